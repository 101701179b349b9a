"""Sandbox start cost, two versions of agentrl side by side: a trivial run, and grading an answer.

For each backend that runs here (``local`` with bubblewrap, ``docker`` with a daemon and the image)
and each source tree (``--trees OLD,NEW``) it times **run** (``sandbox.run("print(1)")``) and
**grade** (``CodeEnv.reward`` of a correct answer), one worker process per tree per round, and
prints the medians with the ratio NEW / OLD; ``bare`` is ``python3 -I -c pass`` for scale.
See docs/performance.md.

    python bench/sandbox.py --trees /work/main,. --rounds 8 --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOKE = {"rounds": 1, "runs": 1, "trees": f"{ROOT},{ROOT}"}  # this tree against itself: the ratio's path too
SMOKE_HELP = "the same code path on the smallest sizes, in seconds: checks the path, not the numbers"


async def worker(backend: str, runs: int) -> dict[str, list[float]]:
    """In a worker process: time ``runs`` trivial runs and gradings with the agentrl imported."""
    from agentrl.envs.code import CodeEnv
    from agentrl.tools.sandbox import SandboxSettings, create_sandbox

    settings = SandboxSettings(backend=backend, lifetime_s=600)
    env = CodeEnv(sandbox=settings)
    task = next(t for t in env.tasks("train") if t.data["family"] == "clip")
    answer = env.demonstration(task)
    sandbox = await create_sandbox(settings, slot=7)
    times: dict[str, list[float]] = {"run": [], "grade": []}
    try:
        assert (await sandbox.run("print(1)")).stdout == "1\n"  # warm up
        for _ in range(runs):
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


def unavailable(backend: str) -> str | None:
    from agentrl.tools.sandbox import SandboxSettings

    if backend == "local":
        from agentrl.tools.sandbox.local import bwrap_available

        return bwrap_available()
    from agentrl.tools.sandbox.docker import docker_unavailable

    return docker_unavailable(SandboxSettings(backend="docker"))


def bare_start() -> float:
    start = time.perf_counter()
    subprocess.run(["/usr/bin/python3", "-I", "-c", "pass"], check=True)
    return time.perf_counter() - start


def run_worker(tree: str, backend: str, runs: int) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    out = subprocess.run(
        [sys.executable, __file__, "--worker", backend, "--runs", str(runs)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", default=".", help="comma-separated agentrl source trees (OLD,NEW)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--runs", type=int, default=5, help="timed runs per worker and round")
    parser.add_argument("--backends", default="local,docker")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    if args.smoke:  # flags given explicitly still win
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
    if args.worker:
        import trio

        print(json.dumps(trio.run(worker, args.worker, args.runs)))
        return
    trees = args.trees.split(",")
    sys.path.insert(0, str(Path(trees[-1]).resolve()))
    print(
        f"{'backend':8} {'what':6} "
        + " ".join(f"{Path(t).resolve().name[:14]:>14}" for t in trees)
        + ("   new/old" if len(trees) == 2 else "")
        + "   (median ms)"
    )
    for backend in args.backends.split(","):
        reason = unavailable(backend)
        if reason:
            print(f"{backend:8} skipped: {reason}")
            continue
        times = [{"run": [], "grade": []} for _ in trees]  # by position: a tree may be given twice
        bare = []
        for _ in range(args.rounds):
            bare.append(bare_start())
            for i, tree in enumerate(trees):
                for what, values in run_worker(tree, backend, args.runs).items():
                    times[i][what].extend(values)
        for what in ("run", "grade"):
            medians = [statistics.median(t[what]) * 1000 for t in times]
            ratio = f"   {medians[1] / medians[0]:7.2f}" if len(trees) == 2 else ""
            print(f"{backend:8} {what:6} " + " ".join(f"{m:14.1f}" for m in medians) + ratio)
        print(f"{backend:8} {'bare':6} {statistics.median(bare) * 1000:14.1f}")


if __name__ == "__main__":
    main()
