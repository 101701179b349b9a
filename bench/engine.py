"""Benchmark of the embedded engine, side by side in one run.

1. Throughput: the embedded engine over HTTP at concurrency 1, 16 and 64 against transformers
   ``generate`` with static batches, same model, prompts and output lengths, alternating rounds
   (best round counts). ``--trees OLD,NEW`` compares two source trees under one machine load.
2. Weight push: :meth:`agentrl.learner.weight_push.WeightUpdater.push` in both wire formats
   against raw torch.distributed broadcasts of the same bytes, and the cache flush on the last
   bucket against a separate ``/flush_cache``, interleaved round by round (``bench/weight_push.py``:
   the same to 1-16 receivers).

``--breakdown`` splits each tree's CPU time per scheduler step (decode, prefill, sampling, rest);
``--hf-cb`` runs transformers' continuous batching for comparison. See docs/performance.md.

    python bench/engine.py              # about 2 minutes on a (busy) 2-core CPU
    python bench/engine.py --size 0.5b --device cuda --skip-push   # on a GPU
    git archive main agentrl | tar -x -C /tmp/main-tree   # then, main's engine against this one:
    python bench/engine.py --skip-push --trees /tmp/main-tree,. --rounds 3 --breakdown
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LEVELS = "1:4,16:32,64:96"  # concurrency:requests (two or more waves from 16 up)
SMOKE = {"size": "tiny", "push_size": "", "levels": "1:2,4:4", "rounds": 1, "reps": 1}
SMOKE_HELP = "the same code path on the smallest sizes, in seconds: checks the path, not the numbers"


def parse_levels(text: str) -> dict[int, int]:
    """``"1:4,16:32"`` -> {concurrency: number of requests}."""
    pairs = (item.split(":") for item in text.split(",") if item)
    return {int(conc): int(n) for conc, n in pairs}


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, 500) for _ in range(rng.randint(8, 96))], rng.randint(8, 64)) for _ in range(n)]


def bench_generate(model, reqs, batch: int) -> float:
    import torch

    device = next(model.parameters()).device
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(chunk):  # left padding, as generate wants
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        longest = max(n for _, n in chunk)
        with torch.inference_mode():
            model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=0,
            )
        tokens += sum(n for _, n in chunk)
    return tokens / (time.perf_counter() - t0)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(url: str, reqs, concurrency: int, pid: int | None = None) -> dict:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as http:

        async def one(p, n):
            async with sem:
                r = await http.post(
                    url + "/generate",
                    json={
                        "input_ids": p,
                        "return_logprob": True,
                        "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True},
                    },
                )
                r.raise_for_status()
                return r.json()["meta_info"]["completion_tokens"]

        before = (await http.get(url + "/server_info")).json()
        cpu0, t0 = _cpu_s(pid) if pid else 0.0, time.perf_counter()
        done = await asyncio.gather(*[one(p, n) for p, n in reqs])
        elapsed, cpu = time.perf_counter() - t0, (_cpu_s(pid) - cpu0 if pid else 0.0)
        after = (await http.get(url + "/server_info")).json()
    steps = max(1, after["num_steps"] - before["num_steps"])
    return {
        "tokens_per_s": sum(done) / elapsed,
        "ms_per_step": 1e3 * elapsed / steps,
        "cpu_ms_per_step": 1e3 * cpu / steps,
        "rows_per_step": (after["num_generated_tokens"] - before["num_generated_tokens"]) / steps,
    }


def bench_engine(url: str, reqs, concurrency: int, pid: int | None = None) -> dict:
    """Useful tokens/s over HTTP; the engine's wall and CPU time (``pid``'s, all threads) per scheduler step
    (prefill + decode), and rows per step."""
    return asyncio.run(_drive(url, reqs, concurrency, pid))


def tree_label(tree: str) -> str:
    return Path(tree).resolve().name or tree


def bench_throughput(model, engines: dict, rounds: int, levels: dict[int, int]) -> list[dict]:
    """Every level: ``rounds`` rounds of generate, then each engine in turn (same load for all); best round counts."""
    for e in engines.values():
        bench_engine(e.url, workload(16, seed=99), 16)  # warm-up
    bench_generate(model, workload(4, seed=98), 4)
    rows = []
    for conc, n in levels.items():
        reqs = workload(n, seed=conc)
        gens, engs = [], {tree: [] for tree in engines}
        for _ in range(rounds if conc > 1 else 1):
            gens.append(bench_generate(model, reqs, conc))
            for tree, e in engines.items():
                engs[tree].append(bench_engine(e.url, reqs, conc, e.process.pid))
        best = {tree: max(runs, key=lambda r: r["tokens_per_s"]) for tree, runs in engs.items()}
        rows.append({"concurrency": conc, "requests": n, "generate": max(gens), "engines": best})
        print(
            f"  concurrency {conc:>2}: generate {max(gens):7.0f} tok/s, "
            + ", ".join(
                f"{tree_label(t)} {r['tokens_per_s']:7.0f} tok/s ({r['ms_per_step']:.1f} ms/step, "
                f"{r['cpu_ms_per_step']:.1f} cpu ms/step)"
                for t, r in best.items()
            ),
            flush=True,
        )
    return rows


# Scheduler and runner methods every tree has, timed (thread CPU) by the breakdown worker.
TIMED = {
    "decode forward": ("runner", "decode"),
    "prefill forward": ("runner", "prefill"),
    "sampling": ("runner", "sample"),
    "sampling params": ("runner", "row_params"),
}


def breakdown_worker(tree: str, model_path: str, device: str, threads: int, levels: dict[int, int]) -> dict:
    """In a subprocess: the engine core of ``tree`` (scheduler + runner, no HTTP, no threads) on each
    level's workload; thread CPU time per scheduler step, split into the timed methods and the rest."""
    sys.path.insert(0, tree)
    import torch

    from agentrl.engine import scheduler as scheduler_mod

    try:
        from agentrl.engine import model_runner as runner_mod
        from agentrl.engine.native_api import parse_generate
    except ImportError:  # a tree (--trees) whose modules are engine/runner.py and engine/api.py
        from agentrl.engine.api import parse_generate  # type: ignore[no-redef]

        from agentrl.engine import runner as runner_mod  # type: ignore[no-redef]

    if threads:
        torch.set_num_threads(threads)
    spent: dict[str, int] = {}
    for label, (module, name) in TIMED.items():
        cls = runner_mod.ModelRunner if module == "runner" else scheduler_mod.Scheduler
        original = getattr(cls, name)

        def timed(*a, _f=original, _label=label, **k):
            t0 = time.thread_time_ns()
            try:
                return _f(*a, **k)
            finally:
                spent[_label] = spent.get(_label, 0) + time.thread_time_ns() - t0

        setattr(cls, name, timed)

    def run(sched, reqs, done: list[int]) -> None:
        for p, m in reqs:
            call = parse_generate(
                {
                    "input_ids": p,
                    "return_logprob": True,
                    "sampling_params": {"max_new_tokens": m, "temperature": 1.0, "ignore_eos": True},
                },
                vocab_size=sched.runner.vocab_size,
                context_len=sched.runner.max_context_tokens,
            )
            sched.submit(
                scheduler_mod.Request(call.inputs[0], lambda r, c: c.finish_reason and done.append(len(c.output_ids)))
            )
        sched._drain_inbox()
        while sched.waiting or sched.running:
            sched._step()

    out = {}
    for conc, n in levels.items():
        runner = runner_mod.ModelRunner(model_path, device=device, max_running_requests=conc, max_context_tokens=256)
        sched = scheduler_mod.Scheduler(runner)
        done: list[int] = []

        with torch.inference_mode():
            run(sched, workload(4, seed=98), done)  # warm-up
            spent.clear()
            done.clear()
            steps0, t0 = sched.num_steps, time.thread_time_ns()
            run(sched, workload(n, seed=conc), done)
            total = time.thread_time_ns() - t0
        steps = sched.num_steps - steps0
        parts = {k: v / steps / 1e6 for k, v in spent.items()}
        parts["scheduler and the rest"] = (total - sum(spent.values())) / steps / 1e6
        out[conc] = {
            "tokens_per_cpu_s": sum(done) / (total / 1e9),
            "ms_per_step": total / steps / 1e6,
            "steps": steps,
            "parts": parts,
        }
    return out


def bench_breakdown(
    model_path: Path, trees: list[str], device: str, threads: int, rounds: int, levels: str = LEVELS
) -> dict:
    """Each tree's core in its own process, trees alternating, ``rounds`` times; the round with the
    least CPU per step counts."""
    import json

    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for _ in range(rounds):
        for tree in trees:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--breakdown-worker",
                    tree,
                    "--model",
                    str(model_path),
                    "--device",
                    device,
                    "--threads",
                    str(threads),
                    "--levels",
                    levels,
                ],
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONSAFEPATH": "1"},
                check=True,
            )
            runs[tree].append(json.loads(out.stdout.splitlines()[-1]))
    return {
        tree: {conc: min((r[conc] for r in rs), key=lambda x: x["ms_per_step"]) for conc in rs[0]}
        for tree, rs in runs.items()
    }


def print_breakdown(result: dict, trees: list[str]) -> None:
    print("\nengine core in process (scheduler + runner, no HTTP), same workload: thread CPU ms per scheduler step")
    labels = [*TIMED, "scheduler and the rest"]
    print(
        f"{'concurrency':>11} {'tree':>14} {'steps':>5} "
        + " ".join(f"{lab[:15]:>15}" for lab in labels)
        + f" {'total':>7} {'tok/CPU-s':>9}"
    )
    for conc in result[trees[0]]:
        for tree in trees:
            r = result[tree][conc]
            print(
                f"{conc:>11} {tree_label(tree)[:14]:>14} {r['steps']:>5} "
                + " ".join(f"{r['parts'].get(lab, 0.0):>15.3f}" for lab in labels)
                + f" {r['ms_per_step']:>7.2f} {r['tokens_per_cpu_s']:>9.0f}"
            )
        if len(trees) == 2:
            old, new = (result[t][conc] for t in trees)
            print(
                f"{'':>11} {'new/old':>14} {'':>5} "
                + " ".join(
                    f"{old['parts'].get(lab, 0.0) / max(new['parts'].get(lab, 0.0), 1e-9):>14.2f}x" for lab in labels
                )
                + f" {old['ms_per_step'] / new['ms_per_step']:>6.2f}x {new['tokens_per_cpu_s'] / old['tokens_per_cpu_s']:>8.2f}x"
            )


def bench_hf_cb(model, reqs) -> float:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gc = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=128, eos_token_id=-1)
    cbc = ContinuousBatchingConfig(return_logprobs=True, max_requests_per_batch=64)
    mgr = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
    mgr.start()
    try:
        rates = []
        for _ in range(2):  # the first pass is warm-up (it is very slow)
            t0 = time.perf_counter()
            for p, n in reqs:
                mgr.add_request(p, max_new_tokens=n)
            got = tokens = 0
            while got < len(reqs):
                r = mgr.get_result(timeout=120)
                if r is None:
                    raise RuntimeError("transformers CB stopped answering")
                if r.is_finished():
                    got, tokens = got + 1, tokens + len(r.generated_tokens)
            rates.append(tokens / (time.perf_counter() - t0))
        return rates[-1]
    finally:
        mgr.stop(block=True)


# ------------------------------------------------------------------------------ weight push


def _raw_receiver(port: int, specs, reps: int) -> None:
    import torch

    from agentrl.weight_group import init_weight_group

    torch.set_num_threads(1)
    import torch.distributed as dist

    group = init_weight_group("gloo", "127.0.0.1", port, 2, 1, "raw_bench")
    bufs = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
    flat = torch.empty(sum(b.numel() * b.element_size() for b in bufs), dtype=torch.uint8)
    sync = torch.zeros(1)
    for _ in range(reps):
        dist.broadcast(sync, src=0, group=group)
        for w in [dist.broadcast(b, src=0, group=group, async_op=True) for b in bufs]:
            w.wait()
        dist.broadcast(sync, src=0, group=group)
        dist.broadcast(flat, src=0, group=group)
    dist.broadcast(sync, src=0, group=group)


def _push_updater():
    from agentrl.learner.weight_push import WeightUpdater

    class BenchUpdater(WeightUpdater):
        """With ``separate_flush``, the alternative to a flush on the last bucket: no bucket flushes,
        then one ``/flush_cache`` call per engine after the last bucket (before end and continue)."""

        separate_flush = False

        def _send_plan(self, plan, version, first, materialize, stats, gathered):
            if not self.separate_flush:
                return super()._send_plan(plan, version, first, materialize, stats, gathered)
            flush, self.flush_cache = self.flush_cache, False
            try:
                super()._send_plan(plan, version, first, materialize, stats, gathered)
            finally:
                self.flush_cache = flush
            t0 = time.perf_counter()
            self._all("/flush_cache")
            stats["flush_call_s"] = time.perf_counter() - t0

    return BenchUpdater


def _fill_prefix_cache(url: str) -> None:
    import httpx

    for i in range(4):
        httpx.post(
            url + "/generate",
            timeout=60,
            json={"input_ids": [3 + i] * 64, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}},
        ).raise_for_status()


PUSH_VARIANTS = {  # label -> (load_format, separate_flush)
    "default": (None, False),
    "flattened_bucket": ("flattened_bucket", False),
    "separate_flush": (None, True),
}


def bench_push(small_model: Path, engine, reps: int, dtype=None) -> dict:
    """Interleaved, so that raw and push see the same machine load: every repetition (after one
    warm-up) runs a raw broadcast of the same tensors, a raw flat broadcast, then one push per
    variant, all over one weight group. Best times, and medians of the ratios of side-by-side pairs."""
    import statistics

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from agentrl.net import free_port
    from agentrl.weight_group import destroy_weight_group, init_weight_group

    model = AutoModelForCausalLM.from_pretrained(small_model, dtype=dtype or torch.float32)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    port = free_port()
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_raw_receiver, args=(port, [(tuple(t.shape), t.dtype) for _, t in named], reps + 1))
    proc.start()
    group = init_weight_group("gloo", "127.0.0.1", port, 2, 0, "raw_bench")
    flat = torch.empty(nbytes, dtype=torch.uint8)
    sync = torch.zeros(1)
    rounds: list[dict] = []
    try:
        with _push_updater()([engine.url], backend="gloo", group_name="bench") as updater:
            updater.connect()
            for v in range(reps + 1):
                timed: dict = {}
                dist.broadcast(sync, src=0, group=group)
                t0 = time.perf_counter()
                for w in [dist.broadcast(t, src=0, group=group, async_op=True) for _, t in named]:
                    w.wait()
                timed["raw_tensors_s"] = time.perf_counter() - t0
                dist.broadcast(sync, src=0, group=group)
                t0 = time.perf_counter()
                dist.broadcast(flat, src=0, group=group)
                timed["raw_flat_s"] = time.perf_counter() - t0
                for i, (label, (load_format, separate)) in enumerate(PUSH_VARIANTS.items()):
                    updater.load_format, updater.separate_flush = load_format, separate
                    _fill_prefix_cache(engine.url)
                    timed[label] = updater.push(named, version=len(PUSH_VARIANTS) * v + i + 1)
                if v:  # the first round warms every path up
                    rounds.append(timed)
        dist.broadcast(sync, src=0, group=group)
    finally:
        proc.join(60)
        destroy_weight_group(group)

    def ratio(a: str, b: str) -> float:
        def seconds(r: dict, k: str) -> float:
            return r[k] if isinstance(r[k], float) else r[k]["total_s"]

        return statistics.median(seconds(r, a) / seconds(r, b) for r in rounds)

    return {
        "bytes": nbytes,
        "tensors": len(named),
        "dtype": str(dtype or torch.float32).removeprefix("torch."),
        "model": Path(small_model).name,
        "raw_tensors_s": min(r["raw_tensors_s"] for r in rounds),
        "raw_flat_s": min(r["raw_flat_s"] for r in rounds),
        **{k: min((r[k] for r in rounds), key=lambda p: p["total_s"]) for k in PUSH_VARIANTS},
        "ratios": {
            "push_raw_tensors": ratio("default", "raw_tensors_s"),
            "push_raw_flat": ratio("default", "raw_flat_s"),
            "flattened_per_tensor": ratio("flattened_bucket", "default"),
            "separate_last_bucket": ratio("separate_flush", "default"),
        },
    }


def print_push(r: dict, reps: int) -> None:
    mb, ratios = r["bytes"] / 2**20, r["ratios"]
    print(
        f"\nweight push: {mb:.0f} MiB in {r['tensors']} {r['dtype']} tensors ({r['model']}); best of {reps} rounds, "
        "ratios: median over the rounds of side-by-side pairs"
    )
    print(f"  {'raw broadcast, one flat buffer':<44} {r['raw_flat_s'] * 1e3:8.1f} ms")
    print(f"  {'raw broadcast, same tensors (async)':<44} {r['raw_tensors_s'] * 1e3:8.1f} ms")
    for key, label in (
        ("default", "push, one broadcast per tensor (default)"),
        ("flattened_bucket", "push, flattened_bucket"),
    ):
        p = r[key]
        print(
            f"  {label:<44} {p['total_s'] * 1e3:8.1f} ms  ({p['num_buckets']} buckets; pause "
            f"{p['pause_s'] * 1e3:.1f}, gather {p['gather_s'] * 1e3:.1f}, broadcast {p['broadcast_s'] * 1e3:.1f}, "
            f"continue {p['continue_s'] * 1e3:.1f})"
        )
    print(f"  {'push / raw, same tensors':<44} {ratios['push_raw_tensors']:8.2f}x")
    print(f"  {'push / raw, one flat buffer':<44} {ratios['push_raw_flat']:8.2f}x")
    print(f"  {'push, flattened_bucket / per tensor':<44} {ratios['flattened_per_tensor']:8.2f}x")
    p, q = r["default"], r["separate_flush"]
    print(f"\ncache flush (prefix cache filled before each push), best of {reps}")
    print(f"  {'flush_cache on the last bucket (default)':<44} {p['total_s'] * 1e3:8.1f} ms")
    print(
        f"  {'separate /flush_cache call':<44} {q['total_s'] * 1e3:8.1f} ms  "
        f"(the call itself {q['flush_call_s'] * 1e3:.1f} ms)"
    )
    print(f"  {'separate / last bucket':<44} {ratios['separate_last_bucket']:8.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="model folder (default: build one of --size in a temp dir)")
    ap.add_argument("--size", default="tiny", help="size to build when --model is not given (tiny, small, 0.5b)")
    ap.add_argument("--device", default="cpu", help="device of generate and of the engine (cpu, cuda)")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads for generate and for the engine (0: torch's default)"
    )
    ap.add_argument("--reps", type=int, default=3, help="rounds of weight pushes and raw broadcasts after a warm-up")
    ap.add_argument("--skip-push", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument(
        "--trees",
        default="",
        help="comma-separated agentrl source trees whose engines run side by side "
        "(OLD,NEW: each level alternates between them; default: this tree)",
    )
    ap.add_argument("--rounds", type=int, default=2, help="rounds per level from concurrency 16 up (best counts)")
    ap.add_argument("--hf-cb", action="store_true", help="also measure transformers' continuous batching")
    ap.add_argument(
        "--push-model", default="", help="model pushed in the weight-push part (default: build --push-size)"
    )
    ap.add_argument("--push-size", default="small", help="size built for the weight push ('': push the served model)")
    ap.add_argument("--levels", default=LEVELS, help="concurrency:requests of each throughput level")
    ap.add_argument(
        "--push-dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the pushed weights"
    )
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the engine core's pieces per step, in process, for each tree (no HTTP)",
    )
    ap.add_argument("--breakdown-worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--json", default="", help="also write the results to this file (bench/gpu_check.sh's table)")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    args = ap.parse_args()
    if args.smoke:  # flags given explicitly still win
        ap.set_defaults(**SMOKE)
        args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwind: the finally blocks stop what was started
    levels = parse_levels(args.levels)
    if args.breakdown_worker:
        import json

        print(json.dumps(breakdown_worker(args.breakdown_worker, args.model, args.device, args.threads, levels)))
        return

    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.engine.launch import EngineProcess, wait_ready
    from agentrl.models.builder import init_model
    from agentrl.net import free_port

    if args.threads:  # 0: torch's default (the engine reads --num-threads 0 the same way)
        torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="agentrl-bench-"))
    model_path = Path(args.model) if args.model else init_model(tmp / args.size, args.size)
    small_path = None
    if not args.skip_push:
        small_path = Path(args.push_model) if args.push_model else model_path
        if not args.push_model and args.push_size:
            small_path = init_model(tmp / f"push-{args.push_size}", args.push_size)
    print(f"model {model_path} on {args.device}, {args.threads} torch thread(s) on each side", flush=True)
    flags = ["--num-threads", str(args.threads), "--device", args.device]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")] if args.trees else [str(ROOT)]
    # All servers load at once; the idle ones cost nothing while another is measured. PYTHONSAFEPATH: `python -m`
    # would otherwise put the working directory before PYTHONPATH, and every engine would run this tree.
    engines = (
        {}
        if args.skip_throughput
        else {
            tree: EngineProcess(
                str(model_path),
                free_port(),
                extra=flags,
                log_path=tmp / f"engine{i}.log",
                env={**os.environ, "PYTHONPATH": tree, "PYTHONSAFEPATH": "1"},
            ).start(wait_s=0)
            for i, tree in enumerate(trees)
        }
    )
    push_engine = None
    if args.smoke and small_path == model_path and len(engines) == 1:  # one engine process fewer
        push_engine = next(iter(engines.values()))
    elif not args.skip_push:
        push_engine = EngineProcess(str(small_path), free_port(), extra=flags[:2], log_path=tmp / "push_engine.log")
        push_engine.start(wait_s=0)
    rows, breakdown = [], None
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(args.device).eval()
        for e in {*engines.values(), push_engine} - {None}:
            wait_ready(e.url, 300, process=e.process)
        if engines:
            rows = bench_throughput(model, engines, args.rounds, levels)
            for e in engines.values():
                if e is not push_engine:
                    e.stop()
        breakdown = (
            bench_breakdown(model_path, trees, args.device, args.threads, args.rounds, args.levels)
            if args.breakdown
            else None
        )
        if args.hf_cb and rows:
            top = max(levels)
            cb = bench_hf_cb(model, workload(levels[top], seed=top))
        push = (
            None
            if push_engine is None
            else bench_push(small_path, push_engine, args.reps, getattr(torch, args.push_dtype))
        )
    finally:
        for e in [*engines.values(), push_engine]:
            if e is not None:
                e.stop()

    if rows:
        print(
            "\nthroughput (useful tokens/s; ragged prompts of 8-96 tokens, outputs of 8-64 tokens; "
            "wall and engine-CPU ms per scheduler step, rows per step)"
        )
        labels = [tree_label(t) for t in trees]
        print(
            f"{'concurrency':>11} {'requests':>8} {'generate':>9} "
            + " ".join(f"{lab[:12]:>12} {'/generate':>9} {'ms/step':>7} {'cpu ms':>6} {'rows':>5}" for lab in labels)
            + (f" {'new/old':>8}" if len(trees) == 2 else "")
        )
        for r in rows:
            engs = [r["engines"][t] for t in trees]
            line = f"{r['concurrency']:>11} {r['requests']:>8} {r['generate']:>9.0f} " + " ".join(
                f"{e['tokens_per_s']:>12.0f} {e['tokens_per_s'] / r['generate']:>8.2f}x {e['ms_per_step']:>7.1f} "
                f"{e['cpu_ms_per_step']:>6.1f} {e['rows_per_step']:>5.1f}"
                for e in engs
            )
            if len(trees) == 2:
                line += f" {engs[1]['tokens_per_s'] / engs[0]['tokens_per_s']:>7.2f}x"
            print(line)

    if breakdown is not None:
        print_breakdown(breakdown, trees)

    if args.hf_cb and rows:
        eng64 = rows[-1]["engines"][trees[-1]]["tokens_per_s"]
        print(
            f"\ntransformers continuous batching at concurrency {rows[-1]['concurrency']}: {cb:.0f} tok/s "
            f"(embedded engine {eng64:.0f} tok/s, {eng64 / cb:.2f}x)"
        )

    if push is not None:
        print_push(push, args.reps)
    print("\ntargets: engine/generate >= 1.0x at 16 and 64; push/raw <= 1.5x; flattened_bucket / per tensor <= 1.0x")
    if args.json:
        import json

        result = {
            "model": Path(model_path).name,
            "device": args.device,
            "throughput": [
                {
                    "concurrency": r["concurrency"],
                    "requests": r["requests"],
                    "generate_tokens_per_s": r["generate"],
                    "engine_tokens_per_s": r["engines"][trees[-1]]["tokens_per_s"],
                    "engines": {tree_label(t): e for t, e in r["engines"].items()},
                }
                for r in rows
            ],
            "push": push,
        }
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
