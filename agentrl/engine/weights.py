"""Weight updates from the trainer to the inference engines: both ends of the protocol.

The protocol is SGLang's (``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/update_weights_from_disk``), so :class:`WeightUpdater` drives real SGLang servers and the
embedded engine alike.

**The group.** Trainer rank 0 and every engine form a separate torch.distributed group
(world size ``1 + engines``; engine ``i`` is rank ``1 + i``), created the way SGLang creates
it: a TCPStore hosted by rank 0 at ``master_address:master_port``, wrapped in
``PrefixStore(group_name)``, then ``_new_process_group_helper`` -- a group that is *not* the
default group, so it coexists with the learner's own FSDP group and with anything else the
engine process does. Backend ``gloo`` on CPU, ``nccl`` on GPUs; the code path is the same.
The trainer joins while its HTTP init calls are in flight (threads): both sides block in the
rendezvous until everybody has arrived, so doing one after the other deadlocks.

**An update** (:meth:`WeightUpdater.push`): pause generation on every engine -> ``begin`` ->
for each bucket of at most ``bucket_bytes`` (one dtype, one wire format): fire the HTTP
``update_weights_from_distributed`` (names, dtypes, shapes) at every engine *without
waiting*, broadcast the tensors in exactly that order (all posted at once as async ops on
both sides, so there is no per-tensor round trip between the processes), then collect the
HTTP answers -> ``end`` -> continue generation
(``end`` and ``continue`` also run when a bucket fails). Pausing first is what avoids the
classic hang (a server that waits for its running requests while the trainer already blocks
in the broadcast).

**Wire format, chosen by measurement** (``bench/engine.py``): by default one broadcast per
tensor, straight from the trainer's memory into the engine's parameters when dtype and shape
agree -- no copy on either side. SGLang's ``load_format = "flattened_bucket"`` (the bucket's
bytes concatenated in ``names`` order, one uint8 broadcast; a bucket never mixes dtypes) is
supported on both ends too, but costs a fresh allocation and a copy of every byte on each
side, more than it saves on CPU (100 MiB: ~400-550 ms against ~100-130 ms). Sending only the
small tensors flattened was measured as well and saved nothing, so it is not done.
Tied embeddings: ``lm_head.weight`` is skipped when it is the same tensor as the embedding.

**The engine side** (:class:`EngineWeightReceiver`) receives every declared tensor even when
a name is unknown or a shape disagrees (into a scratch buffer), so a bad name never leaves
the trainer blocked in a broadcast; it reports the problem in the HTTP answer instead. It
leaves the prefix cache alone (the request's ``flush_cache`` decides, in the server). An engine
started with ``--tp-size N`` joins as N ranks, as SGLang does (one per TP rank): the N-1
:class:`ShadowRank` s receive every broadcast into scratch and drop it.

:meth:`WeightUpdater.push_from_disk` is the fallback: pause, ``/update_weights_from_disk``
on every engine, continue.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from agentrl.engine.launch import free_port

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------- the group


def init_weight_group(backend: str, master_address: str, master_port: int, world_size: int, rank: int,
                      group_name: str, timeout_s: float = 600.0):
    """Join (rank 0: host) a weight-update group that is independent of the default group."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight group backend must be gloo or nccl, got {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=(rank == 0),
                          timeout=timeout, multi_tenant=True)
    store = dist.PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_weight_group(group) -> None:
    import torch.distributed as dist

    if group is not None:
        try:
            dist.destroy_process_group(group)
        except Exception as e:  # already gone; nothing else to free
            log.debug("destroy_process_group: %s", e)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (use names like 'bfloat16', 'float32')")
    return dtype


# --------------------------------------------------------------------------- engine side


class ShadowRank:
    """A weight-group member that receives every broadcast into scratch and drops it.

    SGLang joins the weight group with one rank per TP rank of an engine (``rank_offset +
    tp_rank``), so an engine started with ``--tp-size N`` joins as N ranks: this one, plus N-1
    shadows. A shadow builds its gloo backend directly (``ProcessGroupGloo`` over the same store
    prefixes ``_new_process_group_helper`` uses), because torch refuses a second process group
    with the same name in one process. A trainer that miscounts the world size then hangs or
    fails exactly as it would against real SGLang."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                 timeout_s: float):
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
        # The prefixes of init_weight_group + _new_process_group_helper for a gloo group ("cpu/").
        store = dist.PrefixStore("cpu/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
        self.rank = rank
        self.backend = dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def receive(self, spec: list[tuple[str, torch.dtype, tuple[int, ...]]], flattened: bool) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if flattened:
            bufs = [torch.empty(sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in spec), dtype=torch.uint8)]
        else:
            bufs = [torch.empty(shape, dtype=dtype) for _, dtype, shape in spec]
        works = [self.backend.broadcast([b], opts) for b in bufs]  # posted at once, as the main rank does
        for w in works:
            w.wait()


class EngineWeightReceiver:
    """Engine end: owns the group; receives and applies updates (called in the scheduler thread).

    It never touches the prefix cache: whether K/V computed under the old weights are dropped
    is the update request's ``flush_cache`` (the server's job, as in SGLang)."""

    def __init__(self, runner, *, tp_size: int = 1):
        self.runner = runner
        self.tp_size = tp_size
        self.group = None
        self.group_name: str | None = None
        self.backend = "gloo"
        self.shadows: list[ShadowRank] = []
        self._shadow_pool: concurrent.futures.ThreadPoolExecutor | None = None

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str, timeout_s: float = 600.0) -> None:
        """Join as ranks ``rank_offset .. rank_offset + tp_size - 1`` (SGLang: one rank per TP rank)."""
        if self.group is not None:
            self.destroy_group()
        if backend == "nccl" and self.runner.device.type != "cuda":
            raise ValueError("backend 'nccl' needs the engine on a CUDA device; use 'gloo' on CPU")
        if self.tp_size == 1:
            self.group = init_weight_group(backend, master_address, master_port, world_size, rank_offset,
                                           group_name, timeout_s)
        else:
            if backend != "gloo":
                raise ValueError(f"--tp-size {self.tp_size} joins extra ranks as gloo shadows; use backend 'gloo'")
            self._join_with_shadows(master_address, master_port, rank_offset, world_size, group_name, timeout_s)
        self.group_name, self.backend = group_name, backend

    def _join_with_shadows(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                           group_name: str, timeout_s: float) -> None:
        """Every rank blocks in the rendezvous until all have arrived, so they join concurrently."""
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.tp_size - 1, thread_name_prefix="weight-shadow")
        joins = [pool.submit(ShadowRank, master_address, master_port, rank_offset + k, world_size, group_name,
                             timeout_s) for k in range(1, self.tp_size)]
        try:
            group = init_weight_group("gloo", master_address, master_port, world_size, rank_offset, group_name,
                                      timeout_s)
        except BaseException:
            for f in joins:
                f.cancel()
            pool.shutdown(wait=False)
            raise
        try:
            shadows = [f.result() for f in joins]
        except BaseException:
            destroy_weight_group(group)
            pool.shutdown(wait=False)
            raise
        # One worker per shadow keeps its broadcasts in the order they were declared.
        pool.shutdown(wait=True)
        self.group, self.shadows = group, shadows
        self._shadow_pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(shadows),
                                                                  thread_name_prefix="weight-shadow")

    def destroy_group(self) -> None:
        destroy_weight_group(self.group)
        self.group, self.group_name = None, None
        self.shadows = []  # their gloo backends close with them
        if self._shadow_pool is not None:
            self._shadow_pool.shutdown(wait=False)
            self._shadow_pool = None

    @staticmethod
    def check_spec(names: Any, dtypes: Any, shapes: Any) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """Validate the declared tensors before any broadcast is received."""
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise ValueError("names, dtypes and shapes must be lists")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) differ in length")
        spec = []
        for name, dt, shape in zip(names, dtypes, shapes):
            if not isinstance(name, str):
                raise ValueError(f"names must be strings, got {name!r}")
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"shape of {name!r} must be a list of non-negative integers, got {shape!r}")
            spec.append((name, parse_dtype(dt), tuple(shape)))
        return spec

    def receive(self, spec: list[tuple[str, torch.dtype, tuple[int, ...]]], flattened: bool = False) -> list[str]:
        """Receive the declared tensors (one broadcast each, or one uint8 buffer per bucket when
        ``flattened``), in order, on this rank and every shadow; apply them; return the problems."""
        import torch.distributed as dist

        if self.group is None:
            raise ValueError("no weight update group: call /init_weights_update_group first")
        shadows = [self._shadow_pool.submit(s.receive, spec, flattened) for s in self.shadows] if self.shadows else []
        named = self.runner.named_tensors()
        recv_device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        with torch.no_grad():
            if flattened:
                received = self._receive_flat(spec, recv_device)
            else:
                received, works = [], []
                for name, dtype, shape in spec:  # post every receive at once (async): no round trip per tensor
                    target = named.get(name)
                    direct = (target is not None and target.dtype == dtype and tuple(target.shape) == shape
                              and target.device == recv_device and target.is_contiguous())
                    buf = target.data if direct else torch.empty(shape, dtype=dtype, device=recv_device)
                    works.append(dist.broadcast(buf, src=0, group=self.group, async_op=True))
                    if not direct:
                        received.append((name, buf))
                for w in works:
                    w.wait()
            for f in shadows:  # SGLang answers once every TP rank has its tensors
                f.result()
            problems = []
            for name, buf in received:
                target = named.get(name)
                if target is None:
                    problems.append(f"unknown parameter {name!r}")
                elif tuple(target.shape) != tuple(buf.shape):
                    problems.append(f"{name}: shape {list(buf.shape)} does not match the model's {list(target.shape)}")
                else:
                    target.data.copy_(buf)
        return problems

    def _receive_flat(self, spec, device: torch.device) -> list[tuple[str, torch.Tensor]]:
        """SGLang's ``flattened_bucket``: the tensors' bytes concatenated in ``names`` order."""
        import torch.distributed as dist

        sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in spec]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0, group=self.group)
        out, offset = [], 0
        for (name, dtype, shape), size in zip(spec, sizes):
            chunk = flat[offset : offset + size]
            if offset % dtype.itemsize:
                chunk = chunk.clone()  # a view must start at a multiple of the item size
            out.append((name, chunk.view(dtype).view(shape)))
            offset += size
        return out

    def load_from_disk(self, model_path: str) -> dict[str, torch.Tensor]:
        """Read a checkpoint's tensors (safetensors) and check them against the model; no side effects."""
        from safetensors.torch import load_file

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {model_path}")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        named = self.runner.named_tensors()
        unknown = [n for n in tensors if n not in named]
        if unknown:
            raise ValueError(f"checkpoint has parameters the model lacks: {unknown[:5]}")
        tied = self.runner.lm_head is not None and "lm_head.weight" in named and \
            named["lm_head.weight"] is named.get("model.embed_tokens.weight")
        missing = [n for n in named if n not in tensors and not (tied and n == "lm_head.weight")]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:5]}")
        for n, t in tensors.items():
            if tuple(t.shape) != tuple(named[n].shape):
                raise ValueError(f"{n}: shape {list(t.shape)} does not match the model's {list(named[n].shape)}")
        return tensors

    def apply(self, tensors: dict[str, torch.Tensor]) -> None:
        named = self.runner.named_tensors()
        with torch.no_grad():
            for n, t in tensors.items():
                named[n].data.copy_(t)


# -------------------------------------------------------------------------- trainer side


class WeightUpdateError(RuntimeError):
    """An engine refused or failed a weight update; the message names the engine."""


def _buckets(items: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors up to ``bucket_bytes`` per bucket; a bucket holds one dtype (so that a
    flattened bucket's views start at multiples of the item size)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > bucket_bytes or t.dtype != bucket[-1][1].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


class WeightUpdater:
    """Trainer (rank 0) end of the weight-update protocol. Synchronous; not thread-safe."""

    def __init__(self, engine_urls: list[str], *, master_address: str = "127.0.0.1", master_port: int = 0,
                 backend: str = "gloo", group_name: str = "agentrl_weights", bucket_bytes: int = 64 << 20,
                 pause_mode: str = "abort", timeout_s: float = 600.0, load_format: str | None = None):
        import httpx

        if not engine_urls:
            raise ValueError("WeightUpdater needs at least one engine URL")
        if pause_mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_mode must be abort, retract or in_place; got {pause_mode!r}")
        if load_format not in (None, "flattened_bucket"):
            raise ValueError(f"load_format must be None (one broadcast per tensor) or 'flattened_bucket'; got {load_format!r}")
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.master_address, self.master_port = master_address, master_port
        self.backend, self.group_name, self.bucket_bytes = backend, group_name, bucket_bytes
        self.pause_mode, self.timeout_s, self.load_format = pause_mode, timeout_s, load_format
        self.group = None
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0))
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(4, 2 * len(self.engine_urls)),
                                                           thread_name_prefix="weight-http")

    @classmethod
    def from_config(cls, engine, urls: list[str] | None = None, **kwargs: Any) -> "WeightUpdater":
        """From an ``[engine]`` section: backend ``auto`` is nccl when this process sees a GPU, else gloo."""
        backend = engine.weight_group_backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        return cls(list(urls if urls is not None else engine.urls), backend=backend,
                   bucket_bytes=int(engine.weight_bucket_mb * 2**20), **kwargs)

    # -- HTTP helpers ---------------------------------------------------------------------
    def _post(self, url: str, path: str, body: dict | None = None) -> dict:
        resp = self._http.post(f"{url}{path}", json=body or {})
        try:
            data = resp.json()
        except ValueError:
            data = {"message": resp.text}
        if resp.status_code != 200 or data.get("success") is False:
            msg = data.get("message") or (data.get("error") or {}).get("message") or resp.text
            raise WeightUpdateError(f"{url}{path} answered {resp.status_code}: {msg}")
        return data

    def _fire(self, path: str, body_for: Any) -> list[concurrent.futures.Future]:
        """POST to every engine concurrently; ``body_for(i)`` gives engine i's body."""
        return [self._pool.submit(self._post, url, path, body_for(i)) for i, url in enumerate(self.engine_urls)]

    @staticmethod
    def _collect(futures: list[concurrent.futures.Future]) -> list[dict]:
        errors, results = [], []
        for f in futures:
            try:
                results.append(f.result())
            except Exception as e:
                errors.append(str(e))
        if errors:
            raise WeightUpdateError("; ".join(errors))
        return results

    def _all(self, path: str, body: dict | None = None) -> list[dict]:
        return self._collect(self._fire(path, lambda i: body))

    # -- public API -----------------------------------------------------------------------
    def connect(self) -> None:
        """Create the group: trainer is rank 0, engine i joins as rank 1 + i."""
        if self.group is not None:
            return
        port = self.master_port or free_port(self.master_address)
        world = 1 + len(self.engine_urls)
        futures = self._fire("/init_weights_update_group", lambda i: {
            "master_address": self.master_address, "master_port": port, "rank_offset": 1 + i,
            "world_size": world, "group_name": self.group_name, "backend": self.backend,
        })
        try:
            self.group = init_weight_group(self.backend, self.master_address, port, world, 0,
                                           self.group_name, self.timeout_s)
        except Exception:
            for f in futures:
                f.cancel()
            raise
        self._collect(futures)
        self.master_port = port

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> dict:
        """Broadcast new weights to every engine; returns timings (seconds) and sizes.

        ``named_tensors`` may be a generator (e.g. one that gathers FSDP2 shards with
        ``full_tensor()`` as it goes, on every learner rank in step): at most two buckets are
        held at once. Names are Hugging Face parameter names; tensors must be full (not DTensor).
        """
        if self.group is None:
            self.connect()
        t0 = time.perf_counter()
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self._all("/pause_generation", {"mode": self.pause_mode})
        t_paused = time.perf_counter()
        stats = {"bytes": 0, "num_tensors": 0, "num_buckets": 0, "broadcast_s": 0.0}
        try:
            self._all("/begin_weight_update")
            try:
                self._send_all(named_tensors, device, str(version), stats)
            finally:
                self._all("/end_weight_update")
        finally:
            t_updated = time.perf_counter()
            self._all("/continue_generation")
        t1 = time.perf_counter()
        return {"pause_s": t_paused - t0, "update_s": t_updated - t_paused, "continue_s": t1 - t_updated,
                "total_s": t1 - t0, **stats}

    def _send_all(self, named_tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device, version: str,
                  stats: dict) -> None:
        """Stream bucket by bucket; one bucket of look-ahead lets the last one carry ``weight_version``."""
        flattened = self.load_format == "flattened_bucket"
        pending: list[tuple[str, torch.Tensor]] | None = None
        for bucket in _buckets(self._prepare(named_tensors, device), self.bucket_bytes):
            if pending is not None:
                self._push_bucket(pending, flattened, None, stats)
            pending = bucket
        if pending is not None:
            self._push_bucket(pending, flattened, version, stats)

    def _push_bucket(self, bucket: list[tuple[str, torch.Tensor]], flattened: bool, version: str | None,
                     stats: dict) -> None:
        """Fire the HTTP update at every engine, broadcast the bucket in order, collect the answers."""
        import torch.distributed as dist

        body: dict[str, Any] = {
            "names": [n for n, _ in bucket],
            "dtypes": [dtype_name(t.dtype) for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": self.group_name,
            "flush_cache": False,
        }
        if version is not None:
            body["weight_version"] = version
        if flattened:
            body["load_format"] = "flattened_bucket"
        futures = self._fire("/update_weights_from_distributed", lambda i: body)
        t0 = time.perf_counter()
        if flattened:
            flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])
            dist.broadcast(flat, src=0, group=self.group)
        else:
            works = [dist.broadcast(t, src=0, group=self.group, async_op=True) for _, t in bucket]
            for w in works:
                w.wait()
        stats["broadcast_s"] += time.perf_counter() - t0
        stats["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
        stats["num_tensors"] += len(bucket)
        stats["num_buckets"] += 1
        self._collect(futures)

    def _prepare(self, named_tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device):
        seen: dict[int, str] = {}
        for name, t in named_tensors:
            t = t.detach()
            if hasattr(t, "full_tensor"):  # a DTensor: every rank must have gathered it already
                raise TypeError(f"{name} is a DTensor; pass full tensors (e.g. via get_model_state_dict with full_state_dict=True)")
            key = t.data_ptr()
            if name == "lm_head.weight" and key in seen:  # tied to the embedding: SGLang does not want it
                continue
            seen[key] = name
            if t.device != device:
                t = t.to(device)
            yield name, t.contiguous()

    def push_from_disk(self, model_path: str, version: int) -> None:
        """Fallback: every engine loads ``model_path`` (a folder visible to it) between pause and continue."""
        self._all("/pause_generation", {"mode": self.pause_mode})
        try:
            self._all("/update_weights_from_disk", {"model_path": str(model_path), "weight_version": str(version)})
        finally:
            self._all("/continue_generation")

    def close(self) -> None:
        if self.group is not None:
            for f in self._fire("/destroy_weights_update_group", lambda i: {"group_name": self.group_name}):
                try:
                    f.result(timeout=10)
                except Exception as e:  # the engine may be gone already
                    log.debug("destroy_weights_update_group: %s", e)
            destroy_weight_group(self.group)
            self.group = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def __enter__(self) -> "WeightUpdater":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
