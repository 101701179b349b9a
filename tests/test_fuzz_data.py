"""Fuzzing the data borders: task files, SFT conversations, the retrieval server's ``/retrieve``.

Properties: a task file (JSONL or JSON) gives tasks or a ValueError naming the file and the
line; an SFT JSONL file gives conversations that the chat template renders and the loss mask
covers, or a ValueError naming the line; any ``/retrieve`` body gives ranked results or a 400
naming the problem, and the server keeps serving.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from agentrl.envs.sources import TaskSource, load_records
from agentrl.jsonl import loads
from agentrl.learner.sft import ROLES, load_jsonl, tokenize_conversation
from agentrl.tools.search_server import MAX_QUERIES, BM25Index, parse_request
from tests._fuzz import finite_values, fuzz, json_values, mostly, nested, texts

BAD_LINES = [b"[" * 100_000, b"9" * 5000, b"\xff\xfe{}", nested(5000).encode(), b'{"a": 1', b"NaN", b"{}{}"]
lines = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(texts, json_values, max_size=3).map(lambda v: json.dumps(v).encode()),
    st.sampled_from(BAD_LINES),
    st.binary(max_size=20).filter(lambda b: b"\n" not in b),
    st.just(b""),
    st.just(b"  "),
)


def _where_named(message: str, path, numbered: bool) -> bool:
    return str(path) in message and (not numbered or f"{path}:" in message)


# ------------------------------------------------------------------------------- task files


@fuzz(200)
@given(st.lists(lines, max_size=5), st.booleans())
@example([b"[" * 100_000], False)  # RecursionError escaped
@example([b'{"id": 1}', b"9" * 5000], False)  # a ValueError without the file or the line
@example([b"\xff\xfe{}"], False)  # UnicodeDecodeError without the file
@example([b'{"id": 1}', b"[1, 2]"], False)  # a list as a task: named only later, without the line
@example([b"[" * 100_000], True)
def test_a_task_file_gives_tasks_or_an_error_naming_file_and_line(tmp_path_factory, content, as_json):
    folder = tmp_path_factory.mktemp("tasks")
    if as_json:
        path = folder / "test.json"
        path.write_bytes(b"[" + b",".join(c for c in content if c.strip()) + b"]")
    else:
        path = folder / "test.jsonl"
        path.write_bytes(b"\n".join(content))
    try:
        records = load_records(path)
    except ValueError as e:
        assert _where_named(str(e), path, numbered=not as_json), str(e)
        return
    assert all(isinstance(r, dict) for r in records)
    if records:
        tasks = list(TaskSource(test=path).tasks("test"))
        assert [t.data for t in tasks] == records and all(isinstance(t.id, str) for t in tasks)


# ----------------------------------------------------------------------------------- SFT

tool_names = st.from_regex(r"[a-z_]{1,10}", fullmatch=True)
arguments = st.dictionaries(texts, finite_values, max_size=3) | texts
good_call = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": tool_names, "arguments": arguments})}
)
tool_call = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": mostly(tool_names), "arguments": mostly(arguments)}),
    }
)
parameters = st.fixed_dictionaries(
    {
        "type": st.just("object"),
        "properties": st.dictionaries(
            tool_names, st.fixed_dictionaries({"type": st.sampled_from(["string", "integer"])}), max_size=2
        ),
    }
)
good_schema = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": tool_names, "description": texts, "parameters": parameters}),
    }
)
tool_schema = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": mostly(tool_names), "description": texts, "parameters": mostly(parameters)}
        ),
    }
)
message = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(ROLES)), "content": mostly(texts | st.none())},
    optional={"tool_calls": mostly(st.lists(mostly(tool_call), max_size=2))},
)
conversation = st.fixed_dictionaries(
    {"messages": mostly(st.lists(mostly(message), min_size=1, max_size=5))},
    optional={"tools": mostly(st.lists(mostly(tool_schema), max_size=2))},
)


def _turn(role: str, **extra) -> st.SearchStrategy:
    return st.fixed_dictionaries({"role": st.just(role), "content": texts, **extra})


# Well-formed conversations (a user turn, then an answer, or a tool call, its result and an answer).
well_formed = st.builds(
    lambda system, turns, tools: {
        "messages": system + [m for turn in turns for m in turn],
        **({"tools": tools} if tools else {}),
    },
    st.lists(_turn("system"), max_size=1),
    st.lists(
        st.tuples(_turn("user"), _turn("assistant"))
        | st.tuples(
            _turn("user"),
            _turn("assistant", tool_calls=st.lists(good_call, min_size=1, max_size=2)),
            _turn("tool"),
            _turn("assistant"),
        ),
        min_size=1,
        max_size=2,
    ),
    st.lists(good_schema, max_size=2),
)


@pytest.fixture(scope="module")
def tokenizer(engine_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(engine_model)


@fuzz(150)
@given(
    st.lists(
        mostly(
            well_formed.map(lambda c: json.dumps(c).encode()),
            conversation.map(lambda c: json.dumps(c).encode()) | lines,
        ),
        min_size=1,
        max_size=3,
    )
)
@example([b'{"messages": [{"role": "user", "content": null}, {"role": "assistant", "content": "x"}]}'])  # TypeError
@example(
    [
        b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", '
        b'"tool_calls": [{"function": {"arguments": {}}}]}]}'
    ]
)  # jinja: a tool call without a name
@example([b'{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "tools": ["x"]}'])
@example([b'{"messages": ["hi"]}'])  # AttributeError
@example([b'{"messages": [{"role": "user", "content": "a"}]}'])  # nothing to learn: named only later, no line
@example([b'{"messages": [{"role": "user", "content": "<|im_end|>"}, {"role": "assistant", "content": "<|im_end|>"}]}'])
def test_sft_data_gives_masked_samples_or_an_error_naming_the_line(tmp_path_factory, tokenizer, content):
    path = tmp_path_factory.mktemp("sft") / "data.jsonl"
    path.write_bytes(b"\n".join(content))
    try:
        conversations = load_jsonl(path)
    except ValueError as e:
        assert _where_named(str(e), path, numbered="holds no conversations" not in str(e)), str(e)
        return
    for messages, tools in conversations:
        try:
            sample = tokenize_conversation(tokenizer, messages, tools)
        except ValueError as e:  # a template that does not render a turn as a prefix of the next
            assert "chat template" in str(e)
            continue
        rendered = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False)
        assert tokenizer.decode(sample.tokens.tolist()) == rendered
        assert sample.loss_mask.sum() > 0


# ------------------------------------------------------------------------------ /retrieve

queries = st.lists(
    mostly(texts, st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1)), max_size=4
)
retrieve_bodies = st.one_of(
    st.fixed_dictionaries({}, optional={"queries": mostly(queries | texts), "top_k": mostly(st.integers(-1, 120))}).map(
        lambda b: json.dumps(b).encode()
    ),
    lines,
    st.just(json.dumps({"queries": ["a"] * (MAX_QUERIES + 1)}).encode()),
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": i, "title": f"T{i}", "text": t}) + "\n"
            for i, t in enumerate(
                ["The Silver Lamp is a novel.", "Ravel Omni wrote it in 1921.", "Rivers run to the sea.", "é 🙂 \u2028"]
            )
        )
    )
    return path


@pytest.fixture(scope="module")
def index(corpus):
    return BM25Index.from_jsonl(corpus)


def check_retrieve(index: BM25Index, raw: bytes) -> tuple[int, dict]:
    """What the server answers, computed in-process: (status, body)."""
    try:
        qs, top_k = parse_request(loads(raw, "the body"))
    except ValueError as e:
        return 400, {"error": str(e)}
    results = index.search(qs, top_k)
    assert len(results) == len(qs) and all(len(r) <= min(top_k, len(index)) for r in results)
    return 200, {"results": results}


@fuzz(200)
@given(retrieve_bodies)
@example(b"[" * 100_000)  # RecursionError: a 500
@example(b'{"queries": ["\\ud800"]}')
def test_any_retrieve_body_gives_results_or_a_400(index, raw):
    status, body = check_retrieve(index, raw)
    if status == 400:
        message = body["error"]
        assert "the body" in message or "queries" in message or "top_k" in message, message


@pytest.fixture(scope="module")
def search_server(corpus):
    from tests.test_search import start_server, stop

    proc, url = start_server(corpus)
    yield url
    stop(proc)


@fuzz(20)
@given(retrieve_bodies)
@example(b"[" * 100_000)
@example(b'{"queries": ["\\ud800"], "top_k": 2}')
def test_retrieve_over_http_answers_as_in_process_and_keeps_serving(index, search_server, raw):
    expected = check_retrieve(index, raw)
    r = httpx.post(f"{search_server}/retrieve", content=raw, timeout=30)
    assert (r.status_code, r.json()) == expected
    ok = httpx.post(f"{search_server}/retrieve", json={"queries": ["Silver Lamp"], "top_k": 1}, timeout=30)
    assert ok.status_code == 200 and ok.json()["results"][0][0]["id"] == "0"


def test_a_secret_file_that_is_not_text_is_a_secret_error(tmp_path, monkeypatch):
    from agentrl.secrets import SecretError, read_secret

    (tmp_path / "key").write_bytes(b"\xff\xfe\x00key")
    monkeypatch.delenv("FUZZ_KEY", raising=False)
    monkeypatch.setenv("FUZZ_KEY_FILE", str(tmp_path / "key"))
    with pytest.raises(SecretError, match="FUZZ_KEY_FILE names .* which is not UTF-8 text"):
        read_secret("FUZZ_KEY")  # was a UnicodeDecodeError, which the commands do not report
