"""Every bench still runs: ``python bench/X.py --smoke`` (``bash bench/gpu_check.sh --smoke``) takes the bench's
own code path on its smallest sizes and must exit 0 and print its ratio or summary line. A smoke checks the path,
not the numbers (bench/README.md lists each bench's smoke and what it prints).

The benches that would build a model or a tokenizer get the session's tiny model instead (``--model``). A bench
that runs out of time gets SIGTERM (each stops what it started), then its process group SIGKILL.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests._learner_helpers import subprocess_env, tiny_model  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
HELPERS = {"latency_env.py"}  # imported by benches, not one itself
STOP_GRACE_S = 60.0


@dataclass(frozen=True)
class Smoke:
    script: str
    expect: tuple[str, ...]  # regexes the output must match (multi-line)
    args: tuple[str, ...] = ()  # {model} and {tmp} are filled in
    timeout_s: float = 240.0
    slow: bool = False
    env: dict[str, str] = field(default_factory=dict)


SMOKES = [
    Smoke(
        "actors.py",
        (r"ratio framework / bare loop \(median of 1 back-to-back pairs\): \d+\.\d+",),
        ("--model", "{model}"),
    ),
    Smoke(
        "algorithms.py",
        (
            r"recipes checked: grpo, ppo, rloo, gspo, cispo, dr_grpo, reinforce_pp, grpo_icepop",
            r"^\| ppo \| 1 \| [\d.]+% \| [\d.]+% \| [+-]",
        ),
        ("--bench-dir", "{tmp}", "--warm", "{model}", "-s", "model.path={model}"),
        timeout_s=900,
        slow=True,
    ),
    Smoke("agents.py", (r"endpoint\+sdk +[\d.]+ calls/s \( *[\d.]+ of bare\)",), ("--model", "{model}")),
    Smoke(
        "async_vs_sync.py",
        (r"speed ratio async/sync \(trajectories/s\): \d+\.\d+x",),
        ("--model", "{model}"),
        timeout_s=900,
        slow=True,
    ),
    Smoke(
        "chaos.py",
        (r"faults injected 1, survived 1", r"smoke: every fault survived, exact accounting"),
        ("--run-dir", "{tmp}/run", "-s", "model.path={model}"),
        timeout_s=600,
        slow=True,
    ),
    Smoke(
        "chat_turns.py",
        (r"^tiny +2 +[\d.]+ +[\d.]+ +[\d.]+$", r"^qwen3 +2 +[\d.]+ +\(not prefix-stable\)"),
        ("--model", "{model}"),
    ),
    Smoke(
        "engine.py",
        (r"^ +4 +4 +\d+ +\d+ +[\d.]+x", r"engine core in process", r"push / raw, same tensors +[\d.]+x"),
        ("--model", "{model}", "--breakdown"),
        timeout_s=600,
        slow=True,
    ),
    Smoke(
        "learner.py", (r"\[wall\] learner .* ratio learner/bare = \d+\.\d+",), ("--model-path", "{model}"), slow=True
    ),
    Smoke("lora.py", (r"^LoRA r=4 .* 0\.\d{4} ",), ("--model-path", "{model}"), slow=True),
    Smoke(
        "peer_trl.py",
        (r"token identity: prompt \d+ ids, tool response \d+ ids, identical",),
        ("--model", "{model}"),
        timeout_s=600,  # builds the TRL venv when absent (about a minute from the package index)
        slow=True,
    ),
    Smoke("prefix_cache.py", (r"ratio +\d+\.\d+x",), ("--model", "{model}"), timeout_s=600, slow=True),
    Smoke(
        "scale.py",
        (
            r"scale 1x2x4: [\d.]+ groups/s, learner [\d.]+ ms CPU/group, actors [\d.]+ ms CPU/episode, "
            r"delivery p50 [\d.]+ s",
        ),
        ("--model", "{model}"),
        timeout_s=240,
        slow=True,
    ),
    Smoke("sandbox.py", (r"^local +(run +[\d.]+ +[\d.]+ +\d+\.\d+|skipped: )",)),
    Smoke(
        "time_to_skill.py",
        (r"^\| default \| 1 \| [\d.]+% \| [\d.]+% \|",),
        ("--bench-dir", "{tmp}", "--warm", "{model}", "-s", "model.path={model}"),  # agentrl sft is tested elsewhere
        timeout_s=900,
        slow=True,
    ),
    Smoke(
        "tp_shadow.py",
        (r"weight push \(ms\) .* [\d.]+x", r"generation \(tokens/s\) .* [\d.]+x"),
        ("--model", "{model}"),
        timeout_s=600,
        slow=True,
    ),
    Smoke("transport.py", (r"transport/raw, median of the 2 cases: throughput [\d.]+, CPU efficiency [\d.]+",)),
    Smoke(
        "weight_push.py",
        (
            r"push, one broadcast per tensor / raw broadcast of the same tensors, worst row: [\d.]+x",
            r"every receiver holds exactly the pushed bytes \(both formats\): yes",
        ),
        ("--model", "{model}"),
    ),
    Smoke(
        "gpu_check.sh",
        (
            r"\| learner \(tokens/s\) \| [\d,]+ \| [\d.]+x a bare loop \|",
            r"x static `generate` \|",
            r"x a raw broadcast",
        ),
        env={"GPU_CHECK_MODEL": "{model}", "GPU_CHECK_OUT": "{tmp}"},
        timeout_s=900,
        slow=True,
    ),
]


def test_every_bench_has_a_smoke():
    benches = {p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh") and not p.name.startswith("_")}
    assert benches - HELPERS == {s.script for s in SMOKES}


def run_smoke(argv: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str]:
    """Run ``argv`` in a process group of its own; on timeout SIGTERM the group, SIGKILL it after a grace."""
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"{' '.join(argv)} did not finish within {timeout_s:.0f} s; its output ends:\n{out[-4000:]}")
    finally:
        try:  # whatever it left in its group
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def marks(smoke: Smoke) -> list[pytest.MarkDecorator]:
    timeout = pytest.mark.timeout(smoke.timeout_s + STOP_GRACE_S + 30)  # the bench's own timeout fires first
    return [timeout, pytest.mark.slow] if smoke.slow else [timeout]


@pytest.mark.parametrize("smoke", [pytest.param(s, id=s.script, marks=marks(s)) for s in SMOKES])
def test_bench_smoke(smoke: Smoke, tiny_model: Path, tmp_path: Path) -> None:
    fill = {"model": str(tiny_model), "tmp": str(tmp_path)}
    env = subprocess_env() | {k: v.format(**fill) for k, v in smoke.env.items()} | {"PYTHON": sys.executable}
    script = BENCH / smoke.script
    cmd = ["bash", str(script)] if script.suffix == ".sh" else [sys.executable, str(script)]
    argv = [*cmd, "--smoke", *(a.format(**fill) for a in smoke.args)]
    started = time.monotonic()
    code, out = run_smoke(argv, env, smoke.timeout_s)
    took = time.monotonic() - started
    assert code == 0, f"{' '.join(argv)} exited {code} after {took:.0f} s; its output ends:\n{out[-6000:]}"
    for pattern in smoke.expect:
        assert re.search(pattern, out, re.MULTILINE), f"no line matches {pattern!r} in:\n{out[-6000:]}"
