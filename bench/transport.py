"""Throughput of agentrl's trajectory transport against raw pyzmq, side by side in one run.

For each endpoint kind (ipc, tcp) and message size (4 KB, 256 KB) a sender process pushes
messages to a receiver in this process, three ways, interleaved ``--repeats`` times:

* ``raw``: pyzmq PUSH/PULL moving pre-encoded bytes, ``send``/``recv`` in plain loops,
  default options (the baseline);
* ``agentrl``: the same pre-encoded bytes through agentrl's socket layer, ``PushSocket``
  under trio (queue + socket thread) and ``PullSocket`` (socket thread + queue + ``get``):
  what the transport itself costs. Target: >= 0.85 of raw;
* ``+codec``: ``GroupSender``/``GroupReceiver`` with TrajectoryGroup objects, encoding and
  decoding every message: what an actor and the learner see end to end.

This machine is usually shared, so each mode runs ``--repeats`` times, interleaved; the
table shows the best run of each (the capacity when the box was quietest) and, for the
ratios, also the ratio of medians. Each message is a group of one trajectory
(13 bytes per token). The sender runs in a spawned process, as actors do.

    python bench/transport.py [--seconds 1.0] [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentrl.protocol import Trajectory, TrajectoryGroup, decode, encode  # noqa: E402

SIZES = {"4KB": 4 << 10, "256KB": 256 << 10}
WARMUP = 200
MODES = ("raw", "agentrl", "+codec")


def make_group(target_bytes: int) -> TrajectoryGroup:
    """One trajectory whose encoded group is about ``target_bytes``."""
    n = max(1, (target_bytes - 300) // 13)
    rng = np.random.default_rng(0)
    traj = Trajectory(
        tokens=rng.integers(0, 50_000, n),
        loss_mask=rng.integers(0, 2, n),
        behavior_logprobs=-rng.random(n),
        weight_versions=np.full(n, 3),
        reward=1.0,
        reward_components={"correct": 1.0},
        metadata={"env": "bench", "num_turns": 3, "finish_reason": "stop"},
    )
    return TrajectoryGroup(group_id="g", task_id="t", env="bench", trajectories=[traj], actor_id="bench")


# ---------------------------------------------------------------- senders (child processes)


def raw_sender(endpoint: str, size: int, count: int) -> None:
    import zmq

    data = encode(make_group(size))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(endpoint)
    for _ in range(count):
        sock.send(data)
    time.sleep(30)  # the receiver kills this process when it has everything


def agentrl_sender(endpoint: str, size: int, count: int, with_codec: bool) -> None:
    import trio

    from agentrl.transport import GroupSender, PushSocket

    group = make_group(size)
    data = encode(group)

    async def main() -> None:
        if with_codec:
            sender = GroupSender(endpoint)
            for _ in range(count):
                await sender.send(group)
        else:
            sender = PushSocket(endpoint)
            for _ in range(count):
                await sender.send(data)
        await trio.sleep(30)  # linger 0 drops what is queued at close: wait to be killed

    trio.run(main)


# ---------------------------------------------------------------- receivers (this process)


def measure(mode: str, endpoint: str, size: int, count: int) -> float:
    """Messages per second received after a warm-up."""
    if mode == "raw":
        import zmq

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PULL)
        sock.bind(endpoint)
        proc = _start(raw_sender, sock.getsockopt_string(zmq.LAST_ENDPOINT), size, WARMUP + count)
        recv = lambda: sock.recv()  # noqa: E731
        close = lambda: (sock.close(linger=0), ctx.term())  # noqa: E731
    else:
        from agentrl.transport import GroupReceiver, PullSocket

        receiver = GroupReceiver(endpoint) if mode == "+codec" else PullSocket(endpoint)
        proc = _start(agentrl_sender, receiver.endpoint, size, WARMUP + count, mode == "+codec")
        recv = lambda: receiver.get(60)  # noqa: E731
        close = receiver.close
    try:
        for _ in range(WARMUP):
            recv()
        t0 = time.perf_counter()
        for _ in range(count):
            assert recv() is not None
        return count / (time.perf_counter() - t0)
    finally:
        proc.kill()
        proc.join(10)
        close()


def _start(target, *args) -> mp.Process:
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="target length of one measurement")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    tmp = tempfile.mkdtemp(prefix="agentrl-bench-")
    print("best messages/s (MB/s) of --repeats runs; ratio to raw of the best runs [and of the medians]")
    print(
        f"{'endpoint':8} {'size':>6} {'raw':>15} {'agentrl':>15} {'ratio':>12} "
        f"{'+codec':>15} {'ratio':>12} {'codec us/msg':>12}"
    )
    best_ratios = []
    for scheme in ("ipc", "tcp"):
        for label, size in SIZES.items():
            group = make_group(size)
            nbytes = len(encode(group))
            codec_us = 1e6 * min(timeit.repeat(lambda: decode(encode(group)), number=200, repeat=3)) / 200
            probe = 300  # size the run so that one raw measurement takes about --seconds
            count = max(500, int(args.seconds * measure("raw", _endpoint(scheme, tmp, "probe"), size, probe)))
            rates: dict[str, list[float]] = {m: [] for m in MODES}
            for i in range(args.repeats):
                for mode in MODES:
                    rates[mode].append(measure(mode, _endpoint(scheme, tmp, f"{mode}{i}"), size, count))
            best = {m: max(v) for m, v in rates.items()}
            med = {m: statistics.median(v) for m, v in rates.items()}
            best_ratios.append(best["agentrl"] / best["raw"])

            def cell(m: str) -> str:
                return f"{best[m]:7.0f} ({best[m] * nbytes / 1e6:4.0f})"

            def ratio(m: str) -> str:
                return f"{best[m] / best['raw']:.2f} [{med[m] / med['raw']:.2f}]"

            print(
                f"{scheme:8} {label:>6} {cell('raw'):>15} {cell('agentrl'):>15} {ratio('agentrl'):>12} "
                f"{cell('+codec'):>15} {ratio('+codec'):>12} {codec_us:12.1f}",
                flush=True,
            )
    print(f"transport (agentrl/raw, best runs), median of the four cases: {statistics.median(best_ratios):.2f} (target >= 0.85)")


def _endpoint(scheme: str, tmp: str, name: str) -> str:
    return f"ipc://{tmp}/{name}.sock" if scheme == "ipc" else "tcp://127.0.0.1:*"


if __name__ == "__main__":
    main()
