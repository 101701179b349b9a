"""A real retrieval server (``agentrl serve-search``), the search tool and the search_qa env."""

from __future__ import annotations

import itertools
import json
import os
import re
import select
import signal
import subprocess
import sys
import time

import httpx
import pytest
import trio

from agentrl.envs.search_qa import SearchQAEnv, build_world, corpus_path, write_corpus
from agentrl.tools.base import ToolBox, ToolCall
from agentrl.tools.search import SearchTool
from agentrl.tools.search_server import BM25Index, load_corpus, parse_request


def start_server(corpus, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``agentrl serve-search --port 0`` (with ``env`` added to a token-free environment)."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AGENTRL_SEARCH_TOKEN")}, **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl", "serve-search", "--corpus", str(corpus), "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )
    deadline = time.monotonic() + 60
    seen = ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            seen += line
            m = re.search(r"serving search on (http://\S+)", line)
            if m:
                return proc, m.group(1)
        if proc.poll() is not None:
            break
    stop(proc)
    raise AssertionError(f"serve-search did not start: {seen}")


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server():
    proc, url = start_server(corpus_path())
    yield url
    stop(proc)


def test_shipped_corpus_is_the_generated_one(tmp_path):
    path = write_corpus(tmp_path / "corpus.jsonl")
    assert path.read_text() == corpus_path().read_text()
    world = build_world()
    assert len(load_corpus(corpus_path())) == len(world["books"]) + len(world["authors"]) + len(world["cities"])


def test_server_health_and_ranked_retrieval(server):
    health = httpx.get(f"{server}/health", timeout=10).json()
    assert health == {"status": "ok", "num_passages": len(load_corpus(corpus_path()))}
    title, author = next(iter(build_world()["books"].items()))
    response = httpx.post(f"{server}/retrieve", json={"queries": [title, "zzqx unknownword"], "top_k": 2}, timeout=10)
    assert response.status_code == 200
    results = response.json()["results"]
    assert len(results) == 2 and len(results[0]) == 2 and results[1] == []
    best = results[0][0]
    assert best["text"] == f"{title} is a novel written by {author}." and set(best) == {"id", "text", "score"}
    assert results[0][0]["score"] >= results[0][1]["score"] > 0


@pytest.mark.parametrize(
    "body, message",
    [
        ({"queries": "x", "top_k": 0}, "top_k"),
        ({"queries": [1]}, "list of strings"),
        ([1, 2], "JSON object"),
        ({"queries": ["x"], "top_k": True}, "top_k"),
    ],
)
def test_server_rejects_bad_requests(server, body, message):
    response = httpx.post(f"{server}/retrieve", json=body, timeout=10)
    assert response.status_code == 400 and message in response.json()["error"]
    raw = httpx.post(f"{server}/retrieve", content=b"{nope", timeout=10)
    assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]


def test_serve_search_reports_a_bad_corpus(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"title": "no text"}\n')
    out = subprocess.run(
        [sys.executable, "-m", "agentrl", "serve-search", "--corpus", str(bad), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "bad.jsonl:2 must be an object with a string 'text'" in out.stderr


def test_index_ids_titles_and_query_parsing():
    index = BM25Index([{"text": "Paris is in France.", "title": "Paris"}, {"id": "b", "text": "Oslo is in Norway."}])
    hits = index.search(["paris"], top_k=5)[0]
    assert [h["id"] for h in hits] == ["0"]  # only passages sharing a term, with the line number as id
    assert index.search(["Norway"], 1)[0][0]["id"] == "b"
    assert parse_request({"queries": "one"}) == (["one"], 3)
    with pytest.raises(ValueError, match="at most"):
        parse_request({"queries": ["q"] * 1000})


def test_search_tool_over_http_and_in_process_agree(server):
    title = list(build_world()["books"])[5]
    remote = ToolBox([SearchTool(server, top_k=3)])
    local = ToolBox([SearchTool(index=BM25Index(load_corpus(corpus_path())), top_k=3)])
    a = trio.run(remote.execute, ToolCall("search", {"query": title}))
    b = trio.run(local.execute, ToolCall("search", {"query": title}))
    assert not a.is_error and a.content == b.content and a.content.startswith(f"[1] {title} is a novel")
    assert trio.run(local.execute, ToolCall("search", {"query": "qqqzzz"})).content == "No results."
    empty = trio.run(local.execute, ToolCall("search", {"query": "  "}))
    assert empty.is_error and "the query is empty" in empty.content


def test_search_tool_reports_a_dead_server():
    with socket_port() as port:
        box = ToolBox([SearchTool(f"http://127.0.0.1:{port}", request_timeout_s=2)], timeout_s=5)
        result = trio.run(box.execute, ToolCall("search", {"query": "x"}))
    assert result.is_error and "search failed" in result.content


class socket_port:
    """A port that nothing listens on (bound, not listening, while in use)."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.sock.close()


def test_a_guarded_server_refuses_requests_without_its_token(tmp_path, monkeypatch):
    token = "t-" + os.urandom(8).hex()
    (tmp_path / "token").write_text(token + "\n")
    proc, url = start_server(
        corpus_path(), "--token-env", "MY_SEARCH_TOKEN", env={"MY_SEARCH_TOKEN_FILE": str(tmp_path / "token")}
    )
    query = load_corpus(corpus_path())[0]["text"]
    try:
        body = {"queries": [query], "top_k": 1}
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": token},
            {"Authorization": f"Basic {token}"},
            {"Authorization": f"Bearer {token}x"},
        ):
            r = httpx.post(url + "/retrieve", json=body, headers=headers, timeout=10)
            assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"}), headers
        assert httpx.get(url + "/health", timeout=10).status_code == 200  # probes need no token
        ok = httpx.post(url + "/retrieve", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert ok.status_code == 200 and ok.json()["results"][0]

        monkeypatch.delenv("MY_SEARCH_TOKEN", raising=False)
        monkeypatch.delenv("MY_SEARCH_TOKEN_FILE", raising=False)
        without = ToolBox([SearchTool(url, token_env="MY_SEARCH_TOKEN")])
        result = trio.run(without.execute, ToolCall("search", {"query": query}))
        assert result.is_error and "401" in result.content
        monkeypatch.setenv("MY_SEARCH_TOKEN", token)  # the tool sends the token it finds
        env = SearchQAEnv(search_url=url, search_token_env="MY_SEARCH_TOKEN")
        result = trio.run(ToolBox(env.tools()).execute, ToolCall("search", {"query": query}))
        assert not result.is_error and result.content.startswith("[1]")
    finally:
        stop(proc)


def test_search_tool_needs_exactly_one_backend():
    with pytest.raises(ValueError, match="exactly one of url"):
        SearchTool()


# ----------------------------------------------------------------------------- env


def test_env_splits_and_kinds():
    env = SearchQAEnv()
    test = list(env.tasks("test"))
    train = list(itertools.islice(env.tasks("train"), 2000))
    assert 40 < len(test) < 120
    assert not {t.id for t in test} & {t.id for t in train}
    assert {t.data["kind"] for t in test} == {"writer", "birthplace", "author_country"}
    assert all(t.data["hops"] == (2 if t.data["kind"] == "author_country" else 1) for t in test)
    only = SearchQAEnv(kinds=["author_country"])
    assert {t.data["kind"] for t in itertools.islice(only.tasks("train"), 100)} == {"author_country"}
    with pytest.raises(ValueError, match="unknown question kinds"):
        SearchQAEnv(kinds=["weather"])


def test_two_hop_questions_need_two_searches():
    env = SearchQAEnv()
    world = env.world
    task = next(t for t in env.tasks("test") if t.data["kind"] == "author_country")
    title = task.data["queries"][0]
    author = world["books"][title]
    country = task.data["answer"]
    assert country == world["cities"][world["authors"][author]]
    # no passage names both the book and the answer
    assert not any(title in p["text"] and country in p["text"] for p in world["passages"])


def test_demonstrations_replay_against_the_real_server(server):
    """Each demonstration's tool results are what the real search server returns, and it scores 1."""
    env = SearchQAEnv(search_url=server)
    box = ToolBox(env.tools())
    tasks = list(env.tasks("test"))
    picked = [next(t for t in tasks if t.data["kind"] == k) for k in ("writer", "birthplace", "author_country")]
    for task in picked:
        demo = env.demonstration(task)
        for call_msg, tool_msg in zip(demo[2:-1:2], demo[3:-1:2]):
            fn = call_msg["tool_calls"][0]["function"]
            real = trio.run(box.execute, ToolCall(fn["name"], fn["arguments"]))
            assert real.content == tool_msg["content"]
        assert task.data["answer"] in demo[-2]["content"]
        assert trio.run(env.reward, task, {}, demo) == {"correct": 1.0}
        assert len(demo) == 3 + 2 * task.data["hops"]


def test_reward_normalises_the_answer():
    env = SearchQAEnv()
    task = next(env.tasks("test"))
    answer = task.data["answer"]
    score = lambda text: trio.run(  # noqa: E731
        env.reward, task, {}, env.initial_messages(task) + [{"role": "assistant", "content": text}]
    )["correct"]
    assert score(answer) == score(f"The answer is {answer.lower()}.") == score(f"answer: {answer}!") == 1.0
    assert score(f"Maybe {answer} or someone else") == 0.0
    assert score("") == 0.0


def test_demo_records_serialise():
    env = SearchQAEnv()
    from agentrl.envs import demonstrations

    records = list(demonstrations(env, 5))
    assert len(records) == 5 and records[0]["tools"][0]["function"]["name"] == "search"
    json.dumps(records)
