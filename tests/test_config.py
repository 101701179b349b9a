"""Config: every shipped TOML parses, unknown keys are named, overrides, cross-field checks."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest

from agentrl.config import AgentRLConfig, ConfigError, dump_toml, load_config, parse_override

ROOT = Path(__file__).resolve().parents[1]
_NOT_SHIPPED = {".git", ".venv", "runs", "build", "dist", "node_modules", ".pytest_cache", ".hypothesis"}


def shipped_tomls(root: Path = ROOT) -> list[Path]:
    """Every TOML in the repository except pyproject.toml: git's view (tracked, or new and not
    ignored) when this is a git checkout, else a walk that skips virtualenvs and run outputs."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.toml"],
            cwd=root, capture_output=True, text=True, check=True, timeout=30,
        ).stdout  # fmt: skip
        paths = [root / line for line in out.splitlines() if line]
    except (OSError, subprocess.SubprocessError):
        paths = [p for p in root.rglob("*.toml") if not _NOT_SHIPPED & set(p.relative_to(root).parts)]
    return sorted(p for p in paths if p.name != "pyproject.toml" and p.is_file())


def test_every_shipped_toml_parses() -> None:
    paths = shipped_tomls()
    assert all(p.suffix == ".toml" and p.name != "pyproject.toml" for p in paths)
    errors = {}
    for path in paths:
        try:
            load_config(path)
        except ConfigError as e:
            errors[str(path.relative_to(ROOT))] = str(e)
    assert not errors, errors
    examples = sorted((ROOT / "examples").glob("**/*.toml"))
    assert set(examples) <= set(paths), "every example config is among those checked"


def test_shipped_toml_discovery_outside_git(tmp_path) -> None:
    """Without git (an unpacked tarball) the walk finds new examples and skips run outputs."""
    (tmp_path / "examples" / "new").mkdir(parents=True)
    (tmp_path / "examples" / "new" / "config.toml").write_text("[learner]\nlr = 1e-4\n")
    (tmp_path / "runs" / "x").mkdir(parents=True)
    (tmp_path / "runs" / "x" / "config.toml").write_text("[nonsense]\n")
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    assert shipped_tomls(tmp_path) == [tmp_path / "examples" / "new" / "config.toml"]


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_are_valid_and_sectioned() -> None:
    cfg = load_config()
    assert isinstance(cfg, AgentRLConfig)
    assert cfg.tracking.enabled and cfg.tracking.uri == ""
    assert cfg.actors.trajectory_endpoint.startswith("tcp://127.0.0.1:")
    assert cfg.actors.progress_endpoint.startswith("tcp://127.0.0.1:")


@pytest.mark.parametrize(
    "text, key",
    [
        ("[learner]\nlrr = 1e-4\n", "learner.lrr"),
        ("[nonsense]\nx = 1\n", "nonsense"),
        ("[tracking]\nenabled = true\nurl = 'http://x'\n", "tracking.url"),
        ("top_level = 1\n", "top_level"),
    ],
)
def test_unknown_keys_are_named_with_the_file(tmp_path, text, key) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"unknown key '{key}'" in str(err.value)
    assert str(path) in str(err.value)


def test_invalid_values_are_named(tmp_path) -> None:
    path = write(tmp_path, "[learner]\nlr = -1.0\n[actors]\ngroup_size = 'many'\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert "invalid value for 'learner.lr'" in msg and "invalid value for 'actors.group_size'" in msg
    assert str(path) in msg


def test_env_kwargs_take_any_keys(tmp_path) -> None:
    cfg = load_config(write(tmp_path, "[env]\ncls = 'my_pkg.env:MyEnv'\n[env.kwargs]\ndifficulty = 3\nname = 'x'\n"))
    assert cfg.env.kwargs == {"difficulty": 3, "name": "x"}


def test_missing_file_and_bad_toml(tmp_path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[learner\nlr = 1\n"))


@pytest.mark.parametrize(
    "item, path, value",
    [
        ("learner.lr=1e-4", ["learner", "lr"], 1e-4),
        ("actors.group_size=4", ["actors", "group_size"], 4),
        ("tracking.enabled=false", ["tracking", "enabled"], False),
        ("engine.urls=['http://a:1', 'http://b:2']", ["engine", "urls"], ["http://a:1", "http://b:2"]),
        ("tracking.uri=http://127.0.0.1:5000", ["tracking", "uri"], "http://127.0.0.1:5000"),  # not TOML: a string
        ("env.kwargs.level = 2", ["env", "kwargs", "level"], 2),
        ("run.name=a=b", ["run", "name"], "a=b"),
    ],
)
def test_parse_override(item, path, value) -> None:
    assert parse_override(item) == (path, value)


@pytest.mark.parametrize("item, match", [("learner.lr", "section.key=value"), ("lr=1", "dotted"), ("a..b=1", "dotted")])
def test_bad_override_forms(item, match) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_override(item)


def test_overrides_apply_over_the_file(tmp_path) -> None:
    path = write(tmp_path, "[learner]\nlr = 1e-3\nmax_steps = 7\n")
    cfg = load_config(path, ["learner.lr=5e-5", "env.kwargs.level=2", "run.name=exp"])
    assert cfg.learner.lr == 5e-5 and cfg.learner.max_steps == 7
    assert cfg.env.kwargs == {"level": 2} and cfg.run.name == "exp"
    with pytest.raises(ConfigError, match=r"unknown key 'learner\.nope' in .*run\.toml \(with overrides\)"):
        load_config(path, ["learner.nope=1"])
    with pytest.raises(ConfigError, match="learner.lr.x"):
        load_config(path, ["learner.lr.x=1"])


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["env.cls=agentrl.envs.calculator.CalculatorEnv"], "module:Class"),
        (["learner.dual_clip=0.5"], "dual_clip"),
        (["learner.algorithm=ppo"], "needs learner.advantage = 'gae'"),
        (["learner.advantage=gae"], "needs a critic"),
        (["actors.group_size=1"], "group_size >= 2"),
        (["env.max_total_tokens=4096", "engine.max_context_tokens=2048"], "exceeds"),
        (["learner.decoupled=true", "learner.tis=token"], "set learner.decoupled = false to use TIS"),
        (["learner.objective=cispo", "learner.ratio_level=sequence"], "ratio_level = 'sequence' .* choose one"),
        (["learner.objective=cispo", "learner.dual_clip=3.0"], "dual_clip bounds PPO's clipped objective"),
        (["learner.behavior_weight_floor=0.5"], "behavior_weight_floor .* needs .*behavior_weight_mode = 'mask'"),
        (
            ["learner.behavior_weight_mode=mask", "learner.behavior_weight_floor=2.5"],
            r"behavior_weight_floor \(2.5\) must be below learner.behavior_weight_cap \(2.0\)",
        ),
        (["learner.sequence_mask_low=1.5"], r"sequence_mask_low \(1.5\) must be in \(0, 1\)"),
        (["learner.sequence_mask_high=0.9"], r"sequence_mask_high \(0.9\) must be above 1"),
        (["learner.overlong_penalty=1.0"], "overlong_penalty_tokens and learner.overlong_penalty turn"),
        (
            ["learner.overlong_penalty=1.0", "learner.overlong_penalty_tokens=4096"],
            r"overlong_penalty_tokens \(4096\) must be below env.max_total_tokens",
        ),
        (["learner.normalization_tokens=512"], "normalization_tokens is the constant of"),
        (["learner.min_lr_ratio=0.5"], "min_lr_ratio shape a decaying learner.lr_schedule"),
        (["learner.advantage=vtrace"], "learner.advantage"),
        (["learner.kl_estimator=k4"], "learner.kl_estimator"),
    ],
)
def test_cross_field_checks(overrides, match) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_the_algorithm_keys_compose_where_the_math_does() -> None:
    """GSPO with the decoupled correction and a sequence mask, IcePop with CISPO, Dr. GRPO with
    REINFORCE++ and k2, DAPO's overlong shaping: each resolves."""
    recipes = [
        ["learner.ratio_level=sequence", "learner.loss_normalization=sequence", "learner.sequence_mask_high=3.0"],
        ["learner.objective=cispo", "learner.behavior_weight_mode=mask", "learner.behavior_weight_floor=0.5"],
        ["learner.loss_normalization=constant", "learner.normalization_tokens=512", "learner.advantage=reinforce_pp"],
        ["learner.kl_coef=0.01", "learner.kl_estimator=k2", "learner.sequence_mask_low=0.5"],
        ["learner.overlong_penalty_tokens=64", "learner.overlong_penalty=1.0", "learner.clip_eps_high=0.28"],
        ["learner.lr_schedule=cosine", "learner.lr_decay_steps=6", "learner.min_lr_ratio=0.5"],
    ]
    for sets in recipes:
        learner = load_config(None, sets).learner
        for item in sets:
            key, value = item.removeprefix("learner.").split("=")
            assert str(getattr(learner, key)) == value, item


def test_cross_field_checks_accept_consistent_settings() -> None:
    cfg = load_config(
        None, ["learner.algorithm=ppo", "learner.advantage=gae", "actors.group_size=1", "learner.dual_clip=3.0"]
    )
    assert cfg.learner.algorithm == "ppo"


def test_dump_toml_round_trips(tmp_path) -> None:
    cfg = load_config(
        None, ["learner.lr=2e-5", "env.kwargs.level=3", "env.kwargs.name='a \"b\"'", "engine.urls=['http://x:1']"]
    )
    text = dump_toml(cfg)
    tomllib.loads(text)  # valid TOML
    again = load_config(write(tmp_path, text))
    assert again == cfg


def test_the_two_staleness_settings_must_agree() -> None:
    with pytest.raises(ConfigError, match=r"actors.max_staleness \(0\) and learner.max_staleness \(1\)"):
        load_config(None, ["actors.max_staleness=0"])
    assert load_config(None, ["actors.max_staleness=0", "learner.max_staleness=0"]).learner.max_staleness == 0


def test_the_config_reference_is_complete_and_up_to_date() -> None:
    """docs/config.md is generated from the schema: every key has a meaning written next to it,
    and the file is what `python -m agentrl.config_docs --write` writes now."""
    from agentrl.config_docs import DOC_PATH, reference, section_rows, sections

    undocumented = [key for s, _, cls, _ in sections() for key, _, _, meaning in section_rows(s, cls) if not meaning]
    assert undocumented == [], "add a comment at the end of these keys' lines in agentrl/config.py"
    assert DOC_PATH.read_text() == reference(), "run: python -m agentrl.config_docs --write"


MULTI = """
[[envs]]
cls = "agentrl.envs.calculator:CalculatorEnv"
weight = 3.0
max_turns = 2
[envs.kwargs]
max_ops = 2

[[envs]]
cls = "tests._actors_user_env:AddAgentEnv"
name = "adder"
max_total_tokens = 512
"""


def test_several_envs_and_the_single_env_shorthand(tmp_path) -> None:
    cfg = load_config(write(tmp_path, MULTI))
    assert cfg.env is None and [s.cls.rsplit(":", 1)[1] for s in cfg.env_sections] == ["CalculatorEnv", "AddAgentEnv"]
    assert [s.weight for s in cfg.envs] == [3.0, 1.0] and cfg.envs[0].max_turns == 2 and cfg.envs[1].max_turns == 4
    assert cfg.envs[0].kwargs == {"max_ops": 2} and cfg.envs[1].name == "adder"
    # [env] (or nothing) is one env
    assert load_config().env_sections == [load_config().env] and load_config().envs == []
    # entries are addressed by index on the command line
    cfg = load_config(write(tmp_path, MULTI), ["envs.1.weight=2", "envs.0.kwargs.max_operand=9"])
    assert cfg.envs[1].weight == 2.0 and cfg.envs[0].kwargs == {"max_ops": 2, "max_operand": 9}
    # the resolved config round-trips as TOML with [[envs]]
    text = dump_toml(cfg)
    assert text.count("[[envs]]") == 2 and "\n[env]" not in text
    assert load_config(write(tmp_path, text, "again.toml")) == cfg


@pytest.mark.parametrize(
    "text, overrides, match",
    [
        (MULTI + "\n[env]\ncls = 'a:B'\n", [], r"both \[env\] and \[\[envs\]\]"),
        (MULTI, ["env.max_turns=3"], r"both \[env\] and \[\[envs\]\]"),
        (MULTI, ["envs.2.weight=1"], "envs has 2 entries"),
        (
            MULTI.replace('name = "adder"', 'name = "x"').replace("weight = 3.0", 'weight = 3.0\nname = "x"'),
            [],
            r"names must be unique.*'x'",
        ),
        (MULTI.replace("weight = 3.0", "weight = 0"), [], r"envs\.0\.weight"),
        (
            MULTI.replace("max_total_tokens = 512", "max_total_tokens = 4096"),
            [],
            r"envs\.1\.max_total_tokens \(4096\) exceeds",
        ),
        (MULTI.replace("tests._actors_user_env:AddAgentEnv", "nocolon"), [], r"envs\.1\.cls must be 'module:Class'"),
        (MULTI.replace("max_turns = 2", "max_turn = 2"), [], r"unknown key 'envs\.0\.max_turn'"),
    ],
)
def test_several_envs_are_checked_by_entry(tmp_path, text, overrides, match) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, text), overrides)


def test_env_names_are_unique_once_built(tmp_path) -> None:
    """Two entries of one class without names: the clash is found when the envs are built, and named."""
    from agentrl.envs import make_envs

    twice = '[[envs]]\ncls = "tests._actors_user_env:AddEnv"\n[[envs]]\ncls = "tests._actors_user_env:AddEnv"\n'
    with pytest.raises(
        ValueError, match=r"unique.*'add': tests._actors_user_env:AddEnv, tests._actors_user_env:AddEnv"
    ):
        make_envs(load_config(write(tmp_path, twice)))
    named = twice.replace('AddEnv"\n[[envs]]', 'AddEnv"\nname = "add2"\n[[envs]]', 1)
    assert [env.name for _, env in make_envs(load_config(write(tmp_path, named)))] == ["add2", "add"]
