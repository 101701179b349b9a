"""The ``agentrl`` command in subprocesses: --help stays light, run --dry-run prints the config."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

from agentrl.config import load_config

HEAVY = ("torch", "transformers", "mlflow", "zmq", "trio")


def agentrl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentrl", *args], capture_output=True, text=True, timeout=timeout)


def run_cli(*argv: str) -> tuple[int, str, list[str], str]:
    """Run the CLI's entry point in a fresh interpreter; return its exit code, its output,
    which heavy modules it loaded and its stderr (one interpreter start per check: they cost ~1 s here)."""
    code = (
        "import sys, json\n"
        f"sys.argv = {['agentrl', *argv]!r}\n"
        "from agentrl.cli import main\n"
        "try:\n    main()\n    rc = 0\n"
        "except SystemExit as e:\n    rc = e.code or 0\n"
        f"print('\\n' + json.dumps({{'rc': rc, 'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    body, _, last = out.stdout.rstrip().rpartition("\n")
    report = json.loads(last)
    return report["rc"], body, report["heavy"], out.stderr


def test_help_lists_commands_and_imports_nothing_heavy() -> None:
    rc, text, heavy, _ = run_cli("--help")
    assert rc == 0 and heavy == []
    assert "run" in text and "init-model" in text


ALGORITHM_KEYS = [  # issue 20's keys, as users type them (docs/algorithms.md)
    "learner.objective=cispo",
    "learner.advantage=reinforce_pp",
    "learner.loss_normalization=constant",
    "learner.normalization_tokens=256",
    "learner.kl_estimator=k2",
    "learner.behavior_weight_mode=mask",
    "learner.behavior_weight_floor=0.5",
    "learner.sequence_mask_low=0.25",
    "learner.sequence_mask_high=4.0",
    "learner.overlong_penalty_tokens=64",
    "learner.overlong_penalty=1.0",
]


def test_dry_run_prints_the_resolved_config(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text("[learner]\nlr = 1e-3\n")
    rc, text, heavy, _ = run_cli(
        "run",
        str(config),
        "--dry-run",
        *[a for item in ALGORITHM_KEYS for a in ("-s", item)],
        "--set",
        "learner.max_steps=7",
        "-s",
        "run.name=dry",
        "-s",
        f"model.path={tmp_path / 'no-model-yet'}",
        "-s",
        "model.init_size=small",
        "-s",
        "env.kwargs.min_ops=1",
    )
    # a model to build that is not the tiny one: not built, the check stays light and says how to build it
    assert rc == 0 and "torch" not in heavy and "mlflow" not in heavy
    assert "# env check: ok, but 1 piece(s) not checked" in text and "tools: calculator" in text
    assert f"NOT CHECKED: the first prompt: no model at {tmp_path / 'no-model-yet'} yet" in text
    printed = tomllib.loads(text)
    assert printed["learner"]["lr"] == 1e-3 and printed["learner"]["max_steps"] == 7
    for item in ALGORITHM_KEYS:
        key, value = item.removeprefix("learner.").split("=")
        assert str(printed["learner"][key]) == value, item
    assert printed["env"]["kwargs"] == {"min_ops": 1} and printed["run"]["name"] == "dry"
    assert set(printed) == {
        "run",
        "model",
        "engine",
        "actors",
        "env",
        "sandbox",
        "learner",
        "sft",
        "eval",
        "tracking",
        "judge",
    }
    dumped = tmp_path / "printed.toml"
    dumped.write_text(text)
    assert load_config(dumped) == load_config(
        config,
        [
            *ALGORITHM_KEYS,
            "learner.max_steps=7",
            "run.name=dry",
            "env.kwargs.min_ops=1",
            f"model.path={tmp_path / 'no-model-yet'}",
            "model.init_size=small",
        ],
    )


def test_agentrl_module_entry_point_and_config_errors(tmp_path: Path) -> None:
    """``python -m agentrl``: a config error exits 2 with a message naming key and file."""
    config = tmp_path / "bad.toml"
    config.write_text("[learner]\nlearning_rate = 1e-3\n")
    out = agentrl("run", str(config), "--dry-run")
    assert out.returncode == 2
    assert "unknown key 'learner.learning_rate'" in out.stderr and str(config) in out.stderr
    assert "Traceback" not in out.stderr


def test_init_model_rejects_unknown_size(tmp_path: Path) -> None:
    rc, _, heavy, err = run_cli("init-model", str(tmp_path / "m"), "--size", "huge")
    assert rc == 2 and heavy == [] and "unknown size 'huge'" in err
    assert not (tmp_path / "m").exists()


BROKEN_ENV = """
from agentrl.envs.base import Env, Task
from agentrl.tools.base import tool


class NoDemos(Env):
    def tasks(self, split="train", seed=0):
        yield Task(id="t0", data={})

    def initial_messages(self, task):
        return [{"role": "user", "content": "hello " * 300}]

    async def reward(self, task, state, messages):
        return 0.0


class RaisingTasks(NoDemos):
    def tasks(self, split="train", seed=0):
        raise KeyError("no such split file")
        yield
"""

UNTYPED_TOOL_ENV = """
from agentrl.envs.base import Env
from agentrl.tools.base import tool


@tool
def lookup_factor(from_unit: str, to_unit) -> str:
    return "1"


class Units(Env):
    def tools(self):
        return [lookup_factor]
"""


def test_dry_run_checks_the_env_and_reports_every_problem(tmp_path: Path) -> None:
    """A wrong env.cls, a tool without a type hint, tasks() that raise, a prompt longer than
    env.max_total_tokens, a warm start without demonstrations: each is named, exit status 2."""
    from agentrl.models.builder import init_model

    model = init_model(tmp_path / "tiny", "tiny")
    (tmp_path / "broken_env.py").write_text(BROKEN_ENV)
    (tmp_path / "units_env.py").write_text(UNTYPED_TOOL_ENV)
    base = ["-s", f"model.path={model}"]
    plain = tmp_path / "plain.toml"  # the defaults, with no env kwargs
    plain.write_text("[run]\nname = 'dry'\n")

    def dry(*extra: str, config: Path = plain) -> tuple[int, str]:
        rc, text, _, _ = run_cli("run", str(config), "--dry-run", *base, *extra)
        return rc, text

    rc, text = dry("-s", "env.cls=agentrl.envs.calculator:Calculator")
    assert rc == 2 and "PROBLEM: env.cls = 'agentrl.envs.calculator:Calculator'" in text and "has no attribute" in text
    rc, text = dry("-s", f"env.cls={tmp_path / 'units_env.py'}:Units")
    assert rc == 2 and "lookup_factor: parameter 'to_unit' has no type hint" in text
    rc, text = dry("-s", f"env.cls={tmp_path / 'broken_env.py'}:RaisingTasks", "-s", "sft.enabled=false")
    assert rc == 2 and "PROBLEM: tasks('train'): KeyError" in text and "PROBLEM: tasks('test'): KeyError" in text
    rc, text = dry(
        "-s",
        f"env.cls={tmp_path / 'broken_env.py'}:NoDemos",
        "-s",
        "sft.enabled=true",
        "-s",
        "env.max_total_tokens=512",
    )
    assert rc == 2
    assert "leaves no room for the model within env.max_total_tokens = 512" in text
    assert "sft.enabled = true but the env demonstrates no task" in text
    rc, text = dry(config=Path("examples/calculator/config.toml"))  # the quickstart is fine; its prompt is rendered
    assert rc == 0 and "# env check: ok" in text and "first prompt:" in text
