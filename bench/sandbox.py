"""Sandbox start cost: a trivial program per backend, and grading one code-env answer.

For each backend that can run here (``local`` always when bubblewrap is installed,
``docker`` when a daemon answers and the image exists), it times, interleaved round by
round so that both see the same machine load:

* **bare**: ``python3 -I -c pass`` started directly on this machine (the floor: one
  interpreter start);
* **run**: ``sandbox.run("print(1)")`` in one kept sandbox (what every ``python`` tool call
  pays);
* **grade**: ``CodeEnv.reward`` of a correct answer in that sandbox (reset + the hidden tests).

It prints medians in milliseconds and each one's ratio to ``bare``. It uses only the public
interface, so the same script measures any version of agentrl put first on ``PYTHONPATH``:

    PYTHONPATH=/path/to/agentrl python bench/sandbox.py --rounds 20
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import trio

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH, which picks the version measured


def bare_start() -> float:
    start = time.perf_counter()
    subprocess.run(["/usr/bin/python3", "-I", "-c", "pass"], check=True)
    return time.perf_counter() - start


async def measure(backend: str, rounds: int) -> dict[str, list[float]]:
    from agentrl.envs.code import CodeEnv
    from agentrl.tools.sandbox import SandboxSettings, create_sandbox

    settings = SandboxSettings(backend=backend, lifetime_s=600)
    env = CodeEnv(sandbox=settings)
    task = next(t for t in env.tasks("train") if t.data["family"] == "clip")
    answer = env.demonstration(task)
    sandbox = await create_sandbox(settings, slot=7)
    times: dict[str, list[float]] = {"bare": [], "run": [], "grade": []}
    try:
        assert (await sandbox.run("print(1)")).stdout == "1\n"  # warm up
        for _ in range(rounds):
            times["bare"].append(await trio.to_thread.run_sync(bare_start))
            start = time.perf_counter()
            result = await sandbox.run("print(1)")
            times["run"].append(time.perf_counter() - start)
            assert result.stdout == "1\n", result
            start = time.perf_counter()
            reward = await env.reward(task, {"sandbox": sandbox}, answer)
            times["grade"].append(time.perf_counter() - start)
            assert reward == {"tests_passed": 1.0}, reward
    finally:
        await sandbox.close()
        await env.aclose()
    return times


def available(backend: str) -> str | None:
    if backend == "local":
        from agentrl.tools.sandbox.local import bwrap_available

        return bwrap_available()
    from agentrl.tools.sandbox import SandboxSettings
    from agentrl.tools.sandbox.docker import docker_unavailable

    return docker_unavailable(SandboxSettings(backend="docker"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--backends", default="local,docker")
    args = parser.parse_args()
    import agentrl

    print(f"agentrl from {Path(agentrl.__file__).parent}")
    print(f"{'backend':8} {'what':6} {'median ms':>10} {'x bare':>7}")
    for backend in args.backends.split(","):
        reason = available(backend)
        if reason:
            print(f"{backend:8} skipped: {reason}")
            continue
        times = trio.run(measure, backend, args.rounds)
        bare = statistics.median(times["bare"])
        for what, values in times.items():
            median = statistics.median(values)
            print(f"{backend:8} {what:6} {median * 1000:10.1f} {median / bare:7.1f}")


if __name__ == "__main__":
    main()
