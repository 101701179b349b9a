"""Throughput of agentrl's trajectory transport against raw pyzmq, side by side in one run.

For ipc and tcp and messages of 4 KB and 256 KB, a sender process pushes to a receiver here, in
modes interleaved ``--repeats`` times: ``raw`` pyzmq; ``agentrl``, the same bytes through
``PushSocket``/``PullSocket`` with raw's high-water mark (target >= 0.85 of raw); ``defaults``, with
agentrl's queue bounds; ``+codec``, ``GroupSender``/``GroupReceiver`` encoding every group.

Prints throughput (best run and ratio of medians) and CPU time per message of both processes (the
steadier measure on a shared machine), ``codec only``, and what the learner adds per new group for
exactly-once delivery (ledger check and journal append). See docs/performance.md.

    python bench/transport.py [--seconds 1.0] [--repeats 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentrl.protocol import Trajectory, TrajectoryGroup, decode, encode

SIZES = {"4KB": 4 << 10, "256KB": 256 << 10}
WARMUP = 200
MODES = ("raw", "agentrl", "defaults", "+codec")
RAW_HWM = 1000  # ZMQ's default high-water mark, which the raw baseline runs with
SMOKE = {"repeats": 1, "sizes": ["4KB"], "count": 100}
SMOKE_HELP = "the same code path on the smallest sizes, in seconds: checks the path, not the numbers"


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
    return TrajectoryGroup(
        group_id="g",
        task_id="t",
        env="bench",
        trajectories=[traj],
        actor_id="bench",
        session="0123456789ab",
        seq=123_456,
    )


# ---------------------------------------------------------------- senders (child processes)
#
# Each sender reports the CPU time its whole process (all threads, ZMQ's I/O thread
# included) spent from its first send until the receiver had everything.


def raw_sender(endpoint: str, size: int, count: int, done, result) -> None:
    import zmq

    data = encode(make_group(size))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(endpoint)
    cpu0 = time.process_time()
    for _ in range(count):
        sock.send(data)
    done.wait(120)
    result.put(time.process_time() - cpu0)
    time.sleep(60)  # killed by the receiver


def agentrl_sender(endpoint: str, size: int, count: int, done, result, mode: str) -> None:
    import trio

    from agentrl.transport import GroupSender, PushSocket

    group = make_group(size)
    data = encode(group)

    async def main() -> None:
        if mode == "+codec":
            sender, item = GroupSender(endpoint), group
        else:
            sender, item = PushSocket(endpoint, max_queued=RAW_HWM if mode == "agentrl" else 16), data
        cpu0 = time.process_time()
        for _ in range(count):
            await sender.send(item)
        await trio.to_thread.run_sync(done.wait, 120)
        result.put(time.process_time() - cpu0)
        await trio.sleep(60)  # linger 0 would drop what is queued: wait to be killed

    trio.run(main)


# ---------------------------------------------------------------- receivers (this process)


def measure(mode: str, endpoint: str, size: int, count: int) -> tuple[float, float]:
    """(messages per second after a warm-up, CPU microseconds per message of both processes)."""
    ctx = mp.get_context("spawn")
    done, result = ctx.Event(), ctx.Queue()
    total = WARMUP + count
    if mode == "raw":
        import zmq

        zctx = zmq.Context()
        sock = zctx.socket(zmq.PULL)
        sock.bind(endpoint)
        args = (sock.getsockopt_string(zmq.LAST_ENDPOINT), size, total, done, result)
        proc = ctx.Process(target=raw_sender, args=args, daemon=True)
        recv = lambda: sock.recv()  # noqa: E731
        close = lambda: (sock.close(linger=0), zctx.term())  # noqa: E731
    else:
        from agentrl.transport import GroupReceiver, PullSocket

        if mode == "+codec":
            receiver = GroupReceiver(endpoint)
        else:
            receiver = PullSocket(endpoint, max_queued=RAW_HWM if mode == "agentrl" else 64)
        args = (receiver.endpoint, size, total, done, result, mode)
        proc = ctx.Process(target=agentrl_sender, args=args, daemon=True)
        recv = lambda: receiver.get(60)  # noqa: E731
        close = receiver.close
    proc.start()
    try:
        cpu0 = time.process_time()
        for _ in range(WARMUP):
            assert recv() is not None
        t0 = time.perf_counter()
        for _ in range(count):
            assert recv() is not None
        rate = count / (time.perf_counter() - t0)
        cpu = time.process_time() - cpu0
        done.set()
        cpu += result.get(timeout=60)
        return rate, 1e6 * cpu / total
    finally:
        proc.kill()
        proc.join(10)
        close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="target length of one measurement")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES), help="message sizes")
    parser.add_argument("--count", type=int, default=0, help="messages per measurement (0: about --seconds' worth)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = parser.parse_args()
    if args.smoke:  # flags given explicitly still win
        parser.set_defaults(**SMOKE)
        args = parser.parse_args()
    sizes = {label: SIZES[label] for label in args.sizes}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run atexit: the sender processes go too

    tmp = tempfile.mkdtemp(prefix="agentrl-bench-")
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    rows = []
    for scheme in ("ipc", "tcp"):
        for label, size in sizes.items():
            group = make_group(size)
            nbytes = len(encode(group))
            codec = timeit.Timer(lambda g=group: decode(encode(g)), timer=time.process_time)
            codec_us = 1e6 * min(codec.repeat(number=200, repeat=3)) / 200  # CPU time, like the table
            count = args.count or _count_for(args.seconds, _endpoint(scheme, tmp, "probe"), size)
            rate: dict[str, list[float]] = {m: [] for m in MODES}
            cpu: dict[str, list[float]] = {m: [] for m in MODES}
            for i in range(args.repeats):
                for mode in MODES:
                    r, c = measure(mode, _endpoint(scheme, tmp, f"{mode}{i}"), size, count)
                    rate[mode].append(r)
                    cpu[mode].append(c)
            rows.append((scheme, label, nbytes, codec_us, rate, cpu))
            print(f"  measured {scheme} {label}", flush=True)

    print("\nThroughput: best of --repeats runs, messages/s (MB/s); ratios to raw of the best [of the median] runs")
    print(f"{'endpoint':8} {'size':>6} {'raw':>15} {'agentrl':>15} {'ratio':>12} {'defaults':>12} {'+codec':>12}")
    best_ratios = []
    for scheme, label, nbytes, _, rate, _ in rows:
        best = {m: max(v) for m, v in rate.items()}
        med = {m: statistics.median(v) for m, v in rate.items()}
        best_ratios.append(best["agentrl"] / best["raw"])
        cell = {m: f"{best[m]:7.0f} ({best[m] * nbytes / 1e6:4.0f})" for m in MODES}
        ratio = {m: f"{best[m] / best['raw']:.2f} [{med[m] / med['raw']:.2f}]" for m in MODES}
        print(
            f"{scheme:8} {label:>6} {cell['raw']:>15} {cell['agentrl']:>15} {ratio['agentrl']:>12} "
            f"{ratio['defaults']:>12} {ratio['+codec']:>12}"
        )
    print("\nCPU per message, sender + receiver processes, median of runs (us); ratio raw/agentrl")
    print(
        f"{'endpoint':8} {'size':>6} {'raw':>8} {'agentrl':>8} {'ratio':>6} {'defaults':>8} {'ratio':>6} "
        f"{'+codec':>8} {'ratio':>6} {'codec only':>10}"
    )
    cpu_ratios = []
    for scheme, label, _, codec_us, _, cpu in rows:
        med = {m: statistics.median(v) for m, v in cpu.items()}
        cpu_ratios.append(med["raw"] / med["agentrl"])
        print(
            f"{scheme:8} {label:>6} {med['raw']:8.1f} {med['agentrl']:8.1f} {med['raw'] / med['agentrl']:6.2f} "
            f"{med['defaults']:8.1f} {med['raw'] / med['defaults']:6.2f} "
            f"{med['+codec']:8.1f} {med['raw'] / med['+codec']:6.2f} {codec_us:10.1f}"
        )
    learner = ", ".join(f"{label} {_ledger_and_journal_us(make_group(size), tmp):.1f}" for label, size in sizes.items())
    print(f"\nThe learner's ledger + journal per new group (CPU us): {learner}")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    print(
        f"transport/raw, median of the {len(rows)} cases: throughput {statistics.median(best_ratios):.2f}, "
        f"CPU efficiency {statistics.median(cpu_ratios):.2f} (target >= 0.85)"
    )


def _ledger_and_journal_us(group: TrajectoryGroup, tmp: str) -> float:
    """CPU microseconds the learner spends per new group on its ledger and journal."""
    from agentrl.learner.journal import Journal
    from agentrl.transport.delivery import Ledger

    best = float("inf")
    for attempt in range(3):
        ledger, journal = Ledger(), Journal(Path(tmp) / "journal", f"bench{attempt}")
        cpu0 = time.process_time()
        for seq in range(200):
            group.seq = seq
            if group not in ledger:
                journal.append(encode(group))
                ledger.record(group)
            if seq % 100 == 99:
                journal.sync()
        best = min(best, time.process_time() - cpu0)
        journal.close()
        shutil.rmtree(journal.dir)
    return 1e6 * best / 200


def _count_for(seconds: float, endpoint: str, size: int) -> int:
    """Messages for one raw measurement of about ``seconds`` (probed with 300)."""
    return max(500, int(seconds * measure("raw", endpoint, size, 300)[0]))


def _endpoint(scheme: str, tmp: str, name: str) -> str:
    return f"ipc://{tmp}/{name}.sock" if scheme == "ipc" else "tcp://127.0.0.1:*"


if __name__ == "__main__":
    main()
