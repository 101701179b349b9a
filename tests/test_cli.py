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


def test_dry_run_prints_the_resolved_config(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text("[learner]\nlr = 1e-3\n[env.kwargs]\nlevel = 2\n")
    rc, text, heavy, _ = run_cli("run", str(config), "--dry-run", "--set", "learner.max_steps=7", "-s", "run.name=dry")
    assert rc == 0 and heavy == []
    printed = tomllib.loads(text)
    assert printed["learner"]["lr"] == 1e-3 and printed["learner"]["max_steps"] == 7
    assert printed["env"]["kwargs"] == {"level": 2} and printed["run"]["name"] == "dry"
    assert set(printed) == {"run", "model", "engine", "actors", "env", "sandbox", "learner", "sft", "eval", "tracking"}
    dumped = tmp_path / "printed.toml"
    dumped.write_text(text)
    assert load_config(dumped) == load_config(config, ["learner.max_steps=7", "run.name=dry"])


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
