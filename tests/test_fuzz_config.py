"""Fuzzing the config border: TOML files and ``-s key=value`` overrides.

Properties: any file and any overrides give either a valid ``AgentRLConfig`` or a ``ConfigError``
whose message names the file and the dotted key at fault, never another exception; and
``dump_toml`` of any valid config loads back to an equal config.
"""

from __future__ import annotations

import datetime
import math
import tomllib
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from agentrl.config import AgentRLConfig, ConfigError, _toml_key, _toml_value, dump_toml, load_config
from agentrl.config_docs import section_class
from tests._fuzz import fuzz, texts

SECTIONS = {
    name: list(section_class(info.annotation).model_fields) for name, info in AgentRLConfig.model_fields.items()
}
DOTTED = [f"{s}.{k}" for s, keys in SECTIONS.items() for k in keys] + [
    "env.kwargs.x",
    "env.kwargs.a.b",
    "envs.0.weight",
]


def same(a, b) -> bool:
    """Equal, with NaN equal to itself and types kept apart (1 is not 1.0, True is not 1)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# ------------------------------------------------------------------------------ strategies

offsets = st.integers(-23 * 60, 23 * 60).map(lambda m: datetime.timezone(datetime.timedelta(minutes=m)))
toml_scalars = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(),
    st.floats(),
    texts,
    st.datetimes(timezones=st.none() | offsets),
    st.dates(),
    st.times(),
)
toml_values = st.recursive(
    toml_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3), max_leaves=8
)
# Near the schema: real section and key names, numbers around the bounds, strings of the Literals.
plausible = st.one_of(
    st.integers(-2, 70_000),
    st.floats(-1, 3),
    st.sampled_from(
        [
            "",
            "tiny",
            "grpo",
            "ppo",
            "gae",
            "rloo",
            "a:B",
            "agentrl.envs.calculator:CalculatorEnv",
            "auto",
            "gloo",
            "token",
            "clamp",
            "none",
            "float32",
            0,
            1,
            2,
            16,
            1024,
            2048,
            1e-4,
            float("nan"),
            float("inf"),
            10**30,
        ]
    ),
)
values = st.one_of(plausible, plausible, toml_values)


@st.composite
def trees(draw) -> dict:
    """A TOML document: real sections with real and made-up keys, made-up sections, scalars at the top."""
    out = {}
    for section in draw(st.lists(st.sampled_from(list(SECTIONS)) | texts, max_size=4, unique=True)):
        keys = st.sampled_from(SECTIONS.get(section) or ["x"]) | texts
        out[section] = draw(st.dictionaries(keys, values, max_size=4) | values)
    return out


def as_toml(tree: dict) -> str:
    return "\n".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in tree.items()) + "\n"


def dotted_paths(tree, prefix: str = "") -> set[str]:
    out = set()
    if isinstance(tree, dict):
        for k, v in tree.items():
            path = f"{prefix}.{k}" if prefix else k
            out |= {path} | dotted_paths(v, path)
    return out


def check_loads_back(cfg: AgentRLConfig, tmp_path: Path) -> None:
    dumped = tmp_path / "dumped.toml"
    dumped.write_text(dump_toml(cfg), encoding="utf-8")
    assert same(load_config(dumped).model_dump(), cfg.model_dump())


# ---------------------------------------------------------------------------------- tests


@fuzz(300)
@given(toml_values, texts)
@example('a\x00b\x7f"\\\n\t\u2028', "")
@example({"a b": 1, "": [1.5, float("nan")], "é": {"x.y": "z"}}, "a.b")
@example(datetime.datetime(1979, 5, 27, 7, 32, tzinfo=datetime.timezone(datetime.timedelta(hours=-7))), "\x7f")
@example(float("-inf"), "=")
def test_toml_values_and_keys_round_trip(value, key):
    assert same(tomllib.loads(f"v = {_toml_value(value)}")["v"], value)
    assert tomllib.loads(f"{_toml_key(key)} = 1") == {key: 1}


@fuzz(150)
@given(trees())
@example({"env": {"kwargs": {"a b": datetime.date(1979, 5, 27), "s": "x\ny", "": {"q": [1, "2"]}}}})
@example({"learner": {"lr": float("nan")}})
@example({"sandbox": {"wall_time_s": float("inf")}})  # was accepted: an infinite time limit
@example({"run": {"seed": 10**30}})
@example({"env": "calculator"})
@example({"engine": {"urls": {"a": 1}}})
@example({"envs": [{"cls": "a:B", "weight": 2.0, "kwargs": {"x": [1]}}, {"cls": "c:D", "name": "d"}]})
@example({"envs": [{"cls": "a:B"}], "env": {"max_turns": 2}})  # both forms: refused
@example({"envs": [{"cls": "a:B", "weight": -1}]})
@example({"envs": [], "env": {"cls": "a:B"}})
def test_any_toml_tree_is_a_config_or_an_error_naming_file_and_key(tmp_path_factory, tree):
    tmp_path = tmp_path_factory.mktemp("cfg")
    path = tmp_path / "run.toml"
    path.write_text(as_toml(tree), encoding="utf-8")
    try:
        cfg = load_config(path)
    except ConfigError as e:
        message = str(e)
        assert str(path) in message
        assert any(p in message for p in dotted_paths(tree)), message
    else:
        check_loads_back(cfg, tmp_path)


override_values = st.one_of(
    plausible.map(_toml_value),
    toml_values.map(_toml_value),
    texts,
    st.sampled_from(
        ["[", "[" * 5000, "9" * 5000, "nan", "-inf", "{a = 1}", "1979-05-27", "\udcff", "'x'", '"unterminated']
    ),
)
overrides = st.lists(
    st.builds("{}={}".format, st.sampled_from(DOTTED) | texts, override_values)
    | texts.map(lambda t: t.replace("=", ""))
    | st.sampled_from(["=", "a=1", ".x=1", "run.=1"]),
    max_size=4,
)


@fuzz(200)
@given(overrides, st.booleans())
@example(["run.seed=" + "9" * 5000], False)  # tomllib's ValueError escaped
@example(["run.seed=" + "[" * 5000], False)  # RecursionError escaped
@example(["env.kwargs.x=1979-05-27"], False)  # valid, but dump_toml could not render a date
@example(['env.kwargs={"a b" = 1, s = "x\\ny"}'], False)  # dumped as invalid TOML
@example(["run.name=\udcff"], False)  # a command-line byte that is not UTF-8: the dump could not be written
@example(["env.kwargs=1", "env.kwargs.x=1"], True)
def test_any_overrides_give_a_config_or_an_error_naming_the_key(tmp_path_factory, items, with_file):
    tmp_path = tmp_path_factory.mktemp("ovr")
    path = None
    if with_file:
        path = tmp_path / "run.toml"
        path.write_text("[learner]\nlr = 1e-4\n[env.kwargs]\nseed = 3\n", encoding="utf-8")
    try:
        cfg = load_config(path, items)
    except ConfigError as e:
        message = str(e)
        keys = {i.split("=", 1)[0] for i in items}
        named = (
            {p for k in keys for p in dotted_paths(_as_tree(k.strip()))}
            | {repr(i) for i in items}
            | {repr(k) for k in keys}
        )
        assert any(k in message for k in named if k), message
    else:
        check_loads_back(cfg, tmp_path)


def _as_tree(key: str) -> dict:
    tree: dict = {}
    node = tree
    for part in key.split("."):
        node = node.setdefault(part, {})
    return tree


@fuzz(100)
@given(
    st.lists(
        texts
        | st.sampled_from(
            [
                "[",
                "]",
                "[[",
                "=",
                '"',
                "\n",
                "[learner]",
                "lr = ",
                "1e-4",
                "{",
                "}",
                "kwargs.",
                "[env.kwargs]",
                "nan",
                "0x10",
                "1979-05-27T07:32:00",
            ]
        ),
        max_size=12,
    ).map("".join)
)
def test_any_text_file_is_a_config_or_a_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("txt") / "run.toml"
    path.write_text(text, encoding="utf-8")
    try:
        load_config(path)
    except ConfigError as e:
        assert str(path) in str(e)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\xff\xfe[learner]\n", r"is not UTF-8 text \(byte 0\)"),
        (b"a = " + b"[" * 100_000, "nested too deeply"),
        (b"[run]\nseed = " + b"9" * 5000, "is not valid TOML"),
        (b"[learner]\nlr = nan\n", "invalid value for 'learner.lr'"),
        (b"[sandbox]\nwall_time_s = inf\n", "invalid value for 'sandbox.wall_time_s'"),
    ],
)
def test_unreadable_files_are_config_errors_naming_the_file(tmp_path, content, message):
    path = tmp_path / "run.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as err:
        load_config(path)
    assert str(path) in str(err.value)


def test_a_folder_is_not_a_config_file(tmp_path):
    with pytest.raises(ConfigError, match=f"cannot read config file {tmp_path}"):
        load_config(tmp_path)
