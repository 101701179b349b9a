"""Weight push fan-out, side by side in one run: the learner's push against raw broadcasts of the same bytes.

For each number of receivers (1, 2, 4, 8 by default), N receiver processes join a new weight group as an engine
does (``/init_weights_update_group``, then the engine's own ``EngineWeightReceiver`` receives into its
parameters); they serve no model, only SGLang's control routes on a stdlib HTTP server. Over that one gloo
group the trainer alternates, every repetition:

* raw, same tensors: one async broadcast per tensor (what the receivers post: straight into the parameters);
* raw, flat: one broadcast per bucket of persistent flat buffers, one bucket after the other (the floor of
  ``flattened_bucket``);
* push: ``WeightUpdater.push`` of the same tensors, per tensor and ``flattened_bucket``, per bucket size
  (pause, version, begin, the buckets, end, continue).

A raw round runs between two barriers of the group, so it ends when every receiver has every byte, as a push
ends with every engine's answer. Best time of ``--reps`` rounds per row; each ratio is the median over the rounds
of its two times measured side by side (robust to a machine whose load comes and goes). After the timed rounds
a push of fresh values per format is checked byte for byte on every receiver. See docs/performance.md.

    python bench/weight_push.py                        # small (100 MiB, 90 fp32 tensors), 1-8 receivers
    python bench/weight_push.py --receivers 1,2,4,8,16 --reps 5
    python bench/weight_push.py --smoke                # tiny, 1 and 2 receivers, in seconds (--model: no build)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMOKE = {"size": "tiny", "receivers": "1,2", "buckets_mb": "0.25,4", "reps": 1}
SMOKE_HELP = "the same code path on the smallest sizes, in seconds: checks the path, not the numbers"
FORMATS = {"tensors": None, "flat": "flattened_bucket"}  # column label -> WeightUpdater load_format


def model_tensors(size: str, dtype_name: str, seed: int = 0) -> list[tuple[str, Any]]:
    """The parameters a learner pushes for a model of ``size`` (agentrl.models.builder), random values."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.learner.weight_push import without_tied_head
    from agentrl.models.builder import SIZES, build_model_config

    config = build_model_config(size, int(SIZES[size]["vocab_target"]))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    named = without_tied_head(model.named_parameters(), tied=bool(config.tie_word_embeddings))
    return [(n, torch.randn(tuple(p.shape), generator=gen).to(dtype)) for n, p in named]


def folder_tensors(folder: str, dtype_name: str) -> list[tuple[str, Any]]:
    """The tensors of a model folder's safetensors files (a tied head is not stored), in ``dtype_name``."""
    import torch
    from safetensors.torch import load_file

    named = [(n, t) for f in sorted(Path(folder).glob("*.safetensors")) for n, t in load_file(str(f)).items()]
    if not named:
        raise SystemExit(f"no *.safetensors in {folder}")
    return [(n, t.to(getattr(torch, dtype_name))) for n, t in named]


def digest(named) -> str:
    """A hash of the names and bytes of ``named``."""
    import torch

    h = hashlib.blake2b(digest_size=16)
    for name, t in named:
        h.update(name.encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------ receiver (a process)


class Receiver:
    """An engine's weight end without a model: parameters of the given shapes, the engine's receiver."""

    def __init__(self, spec: list[tuple[str, list[int], str]]):
        import torch

        from agentrl.engine.weights import EngineWeightReceiver

        self.params = {n: torch.zeros(shape, dtype=getattr(torch, dt)) for n, shape, dt in spec}
        self.device = torch.device("cpu")
        self.lm_head = None
        self.weights = EngineWeightReceiver(self)
        self.version = "default"
        self.raw_flat = torch.empty(0, dtype=torch.uint8)
        self.lock = threading.Lock()  # one control operation at a time, as the engine's scheduler thread

    def named_tensors(self) -> dict:
        return self.params

    def handle(self, path: str, body: dict) -> dict:
        with self.lock:
            return getattr(self, "route_" + path.strip("/").replace("/", "_"))(body)

    def route_model_info(self, body: dict) -> dict:
        return {"weight_version": self.version}

    def route_server_info(self, body: dict) -> dict:
        return {"tp_size": 1, "dp_size": 1}

    def route_health(self, body: dict) -> dict:
        return {}

    def _ok(self, body: dict) -> dict:
        return {"success": True, "message": ""}

    route_pause_generation = route_continue_generation = route_begin_weight_update = _ok
    route_end_weight_update = route_flush_cache = _ok

    def route_update_weight_version(self, body: dict) -> dict:
        self.version = body["new_version"]
        return self._ok(body)

    def route_init_weights_update_group(self, body: dict) -> dict:
        keys = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend")
        self.weights.init_group(**{k: body[k] for k in keys}, timeout_s=120.0)
        return self._ok(body)

    def route_destroy_weights_update_group(self, body: dict) -> dict:
        self.weights.destroy_group()
        return self._ok(body)

    def route_update_weights_from_distributed(self, body: dict) -> dict:
        spec = self.weights.check_spec(body["names"], body["dtypes"], body["shapes"])
        problems = self.weights.receive(spec, flattened=body.get("load_format") == "flattened_bucket")
        if problems:
            return {"success": False, "message": "; ".join(problems)}
        if body.get("weight_version") is not None:
            self.version = body["weight_version"]
        return self._ok(body)

    def route__bench_raw(self, body: dict) -> dict:
        """A raw round over the weight group, between two barriers (see :func:`raw_round`)."""
        import torch
        import torch.distributed as dist

        group = self.weights.group
        if body["mode"] == "flat" and self.raw_flat.numel() < sum(body["sizes"]):
            self.raw_flat = torch.empty(sum(body["sizes"]), dtype=torch.uint8)
        dist.barrier(group=group)
        if body["mode"] == "flat":
            bufs, offset = [], 0
            for size in body["sizes"]:
                bufs.append(self.raw_flat[offset : offset + size])
                offset += size
        else:
            bufs = list(self.params.values())
        for w in [dist.broadcast(b, src=0, group=group, async_op=True) for b in bufs]:
            w.wait()
        dist.barrier(group=group)
        return self._ok(body)

    def route__bench_digest(self, body: dict) -> dict:
        return {"digest": digest(self.params.items())}


def serve(port: int, spec_path: str) -> None:
    import torch

    torch.set_num_threads(1)  # as bench/engine.py's engines (--num-threads 1)
    receiver = Receiver(json.loads(Path(spec_path).read_text()))

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn
        disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms wait for a delayed ACK

        def _answer(self, body: dict) -> None:
            try:
                out, status = receiver.handle(self.path, body), 200
            except Exception as e:
                out, status = {"success": False, "message": f"{type(e).__name__}: {e}"}, 400
            data = json.dumps(out).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._answer({})

        def do_POST(self) -> None:
            self._answer(json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}"))

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.serve_forever()


# ------------------------------------------------------------------------------ trainer side


class Receivers:
    """N receiver processes on free ports; stopped (by pid) on exit."""

    def __init__(self, n: int, spec_path: Path):
        from agentrl.net import free_port

        env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}
        self.ports = [free_port() for _ in range(n)]
        self.procs = [
            subprocess.Popen([sys.executable, __file__, "--serve", str(p), "--spec", str(spec_path)], env=env)
            for p in self.ports
        ]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]

    def __enter__(self) -> Receivers:
        import httpx

        deadline = time.monotonic() + 300
        for url, proc in zip(self.urls, self.procs):
            while True:  # external processes: polling with a bound
                if proc.poll() is not None:
                    raise RuntimeError(f"receiver {url} exited with {proc.returncode}")
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"receiver {url} did not start")
                time.sleep(0.1)
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def raw_round(updater, bufs: list, mode: str, sizes: list[int]) -> float:
    """Broadcast ``bufs`` over the updater's group to every member, timed between two barriers: all
    posted at once (``tensors``), or one at a time (``flat``: one bucket after the other, as a push)."""
    import torch.distributed as dist

    futures = updater._fire(updater.members, "/_bench/raw", lambda i: {"mode": mode, "sizes": sizes})
    dist.barrier(group=updater.group)
    t0 = time.perf_counter()
    if mode == "flat":
        for b in bufs:
            dist.broadcast(b, src=0, group=updater.group)
    else:
        for w in [dist.broadcast(b, src=0, group=updater.group, async_op=True) for b in bufs]:
            w.wait()
    dist.barrier(group=updater.group)
    elapsed = time.perf_counter() - t0
    updater._collect(futures)
    return elapsed


def bucket_sizes(named, bucket_bytes: int) -> list[int]:
    from agentrl.learner.weight_push import plan_buckets

    return [sum(t.numel() * t.element_size() for _, t in b) for b in plan_buckets(named, bucket_bytes)]


def bench_fanout(urls: list[str], named, buckets_mb: list[float], reps: int) -> dict:
    """For one group of receivers, each round's times (s): ``raw tensors`` and, per bucket size,
    ``raw flat``, ``push tensors``, ``push flat``; and whether a push of fresh values arrived exactly."""
    import torch

    from agentrl.learner.weight_push import WeightUpdater

    tensors = [t for _, t in named]
    total = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.zeros(total, dtype=torch.uint8)
    rounds: list[dict[str, float]] = []
    with WeightUpdater(urls, backend="gloo", group_name="fanout", timeout_s=120.0) as updater:
        updater.connect()
        version = 0
        for rep in range(reps + 1):  # the first round warms every path up and is not counted
            timed: dict[str, float] = {"raw tensors": raw_round(updater, tensors, "tensors", [])}
            for mb in buckets_mb:
                updater.bucket_bytes = int(mb * 2**20)
                sizes = bucket_sizes(named, updater.bucket_bytes)
                views = [flat[sum(sizes[:i]) : sum(sizes[: i + 1])] for i in range(len(sizes))]
                timed[f"raw flat {mb:g}"] = raw_round(updater, views, "flat", sizes)
                for label, load_format in FORMATS.items():
                    updater.load_format = load_format
                    version += 1
                    timed[f"push {label} {mb:g}"] = updater.push(named, version)["total_s"]
            if rep:
                rounds.append(timed)
        exact = {}
        for i, (label, load_format) in enumerate(FORMATS.items()):
            fresh = [
                (n, torch.randn(t.shape, generator=torch.Generator().manual_seed(i + 1)).to(t.dtype)) for n, t in named
            ]
            updater.load_format, version = load_format, version + 1
            updater.bucket_bytes = int(min(buckets_mb) * 2**20)
            updater.push(fresh, version)
            want = digest(fresh)
            exact[label] = all(d["digest"] == want for d in updater._all("/_bench/digest"))
    return {"rounds": rounds, "exact": exact}


def print_rows(results: dict[int, dict], named, buckets_mb: list[float], reps: int) -> None:
    """Best time per row; ratios are medians over the rounds of the two times measured side by side."""
    import statistics

    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    dtype = str(named[0][1].dtype).removeprefix("torch.")
    print(
        f"\nweight push fan-out: {nbytes / 2**20:.1f} MiB in {len(named)} {dtype} tensors, gloo; best of {reps} "
        f"rounds; ratios: median over the rounds of side-by-side pairs; a raw round ends when every receiver has "
        "every byte"
    )
    head = ("receivers", "bucket", "buckets", "raw tensors", "raw flat", "push tensors", "push flat")
    print(f"{head[0]:>9} {head[1]:>10} {head[2]:>7} " + " ".join(f"{h:>12}" for h in head[3:]), end="")
    print(f" {'push/raw':>9} {'flat/raw flat':>13} {'flat/tensors':>12}")
    worst = {"push/raw": 0.0, "flat/tensors": 0.0}
    for n, r in results.items():
        for mb in buckets_mb:
            keys = ("raw tensors", f"raw flat {mb:g}", f"push tensors {mb:g}", f"push flat {mb:g}")
            best = [min(run[k] for run in r["rounds"]) for k in keys]
            pairs = ((keys[2], keys[0]), (keys[3], keys[1]), (keys[3], keys[2]))
            ratios = [statistics.median(run[a] / run[b] for run in r["rounds"]) for a, b in pairs]
            worst["push/raw"] = max(worst["push/raw"], ratios[0])
            worst["flat/tensors"] = max(worst["flat/tensors"], ratios[2])
            count = len(bucket_sizes(named, int(mb * 2**20)))
            print(
                f"{n:>9} {f'{mb:g} MiB':>10} {count:>7} "
                + " ".join(f"{t * 1e3:>9.1f} ms" for t in best)
                + f" {ratios[0]:>8.2f}x {ratios[1]:>12.2f}x {ratios[2]:>11.2f}x"
            )
    exact = all(all(r["exact"].values()) for r in results.values())
    print(f"\npush, one broadcast per tensor / raw broadcast of the same tensors, worst row: {worst['push/raw']:.2f}x")
    print(f"push, flattened_bucket / push, one broadcast per tensor, worst row: {worst['flat/tensors']:.2f}x")
    print(f"every receiver holds exactly the pushed bytes (both formats): {'yes' if exact else 'NO'}")
    print("targets: push/raw <= 1.5x; flattened_bucket / per tensor <= 1.0x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="small", help="model whose parameters are pushed (tiny, small, 0.5b)")
    ap.add_argument("--model", default="", help="push this model folder's tensors instead of --size's (no build)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--receivers", default="1,2,4,8", help="comma-separated numbers of receiving processes")
    ap.add_argument("--buckets-mb", default="16,64,256", help="comma-separated bucket sizes (MiB)")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds (after one warm-up round)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the trainer process")
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    ap.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.spec)
        return
    if args.smoke:  # flags given explicitly still win
        ap.set_defaults(**SMOKE)
        args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwind: the receivers are stopped
    import torch

    torch.set_num_threads(args.threads)
    named = folder_tensors(args.model, args.dtype) if args.model else model_tensors(args.size, args.dtype)
    buckets_mb = [float(x) for x in args.buckets_mb.split(",")]
    with tempfile.TemporaryDirectory(prefix="agentrl-push-bench-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec = [(n, list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in named]
        spec_path.write_text(json.dumps(spec))
        counts = [int(x) for x in args.receivers.split(",")]
        results = {}
        with Receivers(max(counts), spec_path) as receivers:  # the first n join each group
            for n in counts:
                started = time.perf_counter()
                results[n] = bench_fanout(receivers.urls[:n], named, buckets_mb, args.reps)
                print(f"  {n} receiver(s): {time.perf_counter() - started:.0f} s", flush=True)
    print_rows(results, named, buckets_mb, args.reps)


if __name__ == "__main__":
    main()
