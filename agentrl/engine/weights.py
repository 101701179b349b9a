"""Weight updates, the engine's end: :class:`EngineWeightReceiver`.

The protocol is SGLang's (``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/update_weights_from_disk``), so the learner drives real SGLang and the embedded engine alike;
the trainer's end is ``agentrl.learner.weight_push``. Tensors are received straight into the
parameters when dtype and shape agree, or as SGLang's ``flattened_bucket``, into a CPU
:class:`Scratch` kept across buckets; an update is answered after the device has settled.

Invariants: every declared tensor is received, into scratch when its name or shape is wrong, so
the trainer is never left blocked in a broadcast (the HTTP answer reports the problem); with
``--tp-size N`` the N-1 :class:`ShadowRank` s receive every broadcast and drop it.

LoRA adapters: one PEFT adapter is merged into the weights (fp32 product, cast to the engine's
dtype) and a CPU copy of the weights it changed is kept, so an unload restores them exactly; a
full update while an adapter is merged replaces the base and merges the adapter again.
See docs/engine.md.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agentrl.engine.native_api import show
from agentrl.weight_group import destroy_weight_group, init_weight_group, parse_dtype

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- engine side


class Scratch:
    """Receive buffers kept across buckets: on the CPU one uint8 buffer, grown to the largest
    bucket (a fresh one of a bucket's size costs a page fault per 4 KiB on every receive, more than
    the receive itself); on CUDA fresh tensors (the caching allocator reuses its blocks)."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def flat(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        if self.buffer.numel() < nbytes:
            self.buffer = torch.empty(0, dtype=torch.uint8)  # freed before the larger one is allocated
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self.buffer[:nbytes]

    def tensors(self, spec: list[tuple[str, torch.dtype, tuple[int, ...]]], device: torch.device) -> list[torch.Tensor]:
        """One tensor per entry of ``spec``, side by side in one flat buffer (each at a multiple of 64 bytes)."""
        sizes = [-(-math.prod(shape) * dtype.itemsize // 64) * 64 for _, dtype, shape in spec]
        flat = self.flat(sum(sizes), device)
        out, offset = [], 0
        for (_, dtype, shape), size in zip(spec, sizes):
            nbytes = math.prod(shape) * dtype.itemsize
            out.append(flat[offset : offset + nbytes].view(dtype).view(shape))
            offset += size
        return out


def settle(device: torch.device) -> None:
    """Block until the work queued on ``device`` has run (CUDA: NCCL's ``wait()`` only orders the
    stream), so that an answer means the weights are in, and a broken receive fails here."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ShadowRank:
    """A weight-group member that receives every broadcast into scratch and drops it.

    SGLang joins the weight group with one rank per TP rank of an engine (``rank_offset +
    tp_rank``), so an engine started with ``--tp-size N`` joins as N ranks: this one, plus N-1
    shadows. A shadow builds its gloo backend directly (``ProcessGroupGloo`` over the same store
    prefixes ``_new_process_group_helper`` uses), because torch refuses a second process group
    with the same name in one process. A trainer that miscounts the world size then hangs or
    fails exactly as it would against real SGLang."""

    def __init__(
        self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str, timeout_s: float
    ):
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import PrefixStore

        timeout = timedelta(seconds=timeout_s)
        # TCPStore is public torch API, re-exported by torch.distributed without __all__.
        store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            master_address, master_port, world_size, is_master=False, timeout=timeout
        )
        # The prefixes of init_weight_group + _new_process_group_helper for a gloo group ("cpu/").
        store = PrefixStore("cpu/", PrefixStore(f"{group_name}/", PrefixStore(group_name, store)))
        self.rank = rank
        self.backend = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self.scratch = Scratch()

    def receive(self, spec: list[tuple[str, torch.dtype, tuple[int, ...]]], flattened: bool) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        cpu = torch.device("cpu")
        if flattened:
            bufs = [self.scratch.flat(sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in spec), cpu)]
        else:
            bufs = self.scratch.tensors(spec, cpu)
        # Posted at once, as the main rank does (torch's stub of Backend leaves its collectives out).
        works = [self.backend.broadcast([b], opts) for b in bufs]  # pyright: ignore[reportAttributeAccessIssue]
        for w in works:
            w.wait()


def check_group_args(master_port: int, rank_offset: int, world_size: int) -> None:
    """Refuse, with a message naming the field, what would otherwise fail deep inside torch (a
    port that is no port) or wait for minutes to join as a rank outside the world. A world too
    small for the engine's further TP ranks fails as it does in SGLang (the first rank joins)."""
    if not 0 <= master_port <= 65535:
        raise ValueError(f"master_port must be in [0, 65535], got {show(master_port)}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {show(world_size)}")
    if not 0 <= rank_offset < world_size:
        raise ValueError(
            f"rank_offset must be in [0, world_size), got rank_offset {show(rank_offset)} with world_size {world_size}"
        )


def _fits(target: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device) -> bool:
    """Whether a broadcast can land straight in ``target``."""
    return (
        target is not None
        and target.dtype == dtype
        and tuple(target.shape) == shape
        and target.device == device
        and target.is_contiguous()
    )


@dataclass
class MergedAdapter:
    """The adapter merged into the weights: its name and folder, the factors per weight, and the
    weights as they were before (CPU copies)."""

    name: str
    path: str
    deltas: dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # parameter name -> (A, B, scaling)
    originals: dict[str, torch.Tensor] = field(default_factory=dict)


# transformers saves a Qwen2-VL-style model in the original checkpoint layout (``model.layers.*``, ``visual.*``)
# while its modules are ``model.language_model.*`` and ``model.visual.*``
_CHECKPOINT_PREFIXES = (("model.", "model.language_model."), ("visual.", "model.visual."))


def _module_name(name: str, named: dict[str, torch.Tensor]) -> str:
    """The model's name of a checkpoint tensor: itself, or its original-layout name renamed."""
    if name in named:
        return name
    for old, new in _CHECKPOINT_PREFIXES:
        if name.startswith(old) and new + name[len(old) :] in named:
            return new + name[len(old) :]
    return name


class EngineWeightReceiver:
    """Engine end: owns the group; receives and applies updates (called in the scheduler thread).

    It never touches the prefix cache: whether K/V computed under the old weights are dropped
    is the update request's ``flush_cache`` (the server's job, as in SGLang)."""

    def __init__(self, runner, *, tp_size: int = 1):
        self.runner = runner
        self.tp_size = tp_size
        self.group: ProcessGroup | None = None
        self.group_name: str | None = None
        self.backend = "gloo"
        self.shadows: list[ShadowRank] = []
        self._shadow_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.adapter: MergedAdapter | None = None  # the LoRA adapter merged into the weights
        self.adapters_seen: dict[str, str] = {}  # every adapter name loaded so far -> its folder
        self.scratch = Scratch()  # what is not received straight into a parameter (a flattened bucket)

    def init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float = 600.0,
    ) -> None:
        """Join as ranks ``rank_offset .. rank_offset + tp_size - 1`` (SGLang: one rank per TP rank)."""
        check_group_args(master_port, rank_offset, world_size)
        if self.group is not None:
            self.destroy_group()
        if backend == "nccl" and self.runner.device.type != "cuda":
            raise ValueError("backend 'nccl' needs the engine on a CUDA device; use 'gloo' on CPU")
        if self.tp_size == 1:
            self.group = init_weight_group(
                backend, master_address, master_port, world_size, rank_offset, group_name, timeout_s
            )
        else:
            if backend != "gloo":
                raise ValueError(f"--tp-size {self.tp_size} joins extra ranks as gloo shadows; use backend 'gloo'")
            self._join_with_shadows(master_address, master_port, rank_offset, world_size, group_name, timeout_s)
        self.group_name, self.backend = group_name, backend

    def _join_with_shadows(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        timeout_s: float,
    ) -> None:
        """Every rank blocks in the rendezvous until all have arrived, so they join concurrently."""
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.tp_size - 1, thread_name_prefix="weight-shadow")
        joins = [
            pool.submit(ShadowRank, master_address, master_port, rank_offset + k, world_size, group_name, timeout_s)
            for k in range(1, self.tp_size)
        ]
        try:
            group = init_weight_group(
                "gloo", master_address, master_port, world_size, rank_offset, group_name, timeout_s
            )
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
        self._shadow_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=len(shadows), thread_name_prefix="weight-shadow"
        )

    def destroy_group(self) -> None:
        destroy_weight_group(self.group)
        self.group, self.group_name = None, None
        self.scratch = Scratch()
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
            raise ValueError(
                f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) differ in length"
            )
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

        if self.group is None:
            raise ValueError("no weight update group: call /init_weights_update_group first")
        shadows: list[concurrent.futures.Future] = []
        if self.shadows:
            assert self._shadow_pool is not None, "the shadows come with their pool"
            shadows = [self._shadow_pool.submit(s.receive, spec, flattened) for s in self.shadows]
        named = self.runner.named_tensors()
        recv_device = (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        )
        with torch.no_grad():
            if flattened:
                received = self._receive_flat(spec, recv_device)
            else:
                received = self._receive_tensors(spec, named, recv_device)
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
            self._merge_again([name for name, _, _ in spec])
            settle(self.runner.device)  # gloo into a CUDA engine: the copies from the CPU scratch too
        return problems

    def _receive_tensors(self, spec, named: dict, device: torch.device) -> list[tuple[str, torch.Tensor]]:
        """One broadcast per tensor, all posted at once (no round trip per tensor), each straight into
        its parameter when dtype, shape and device agree, else into scratch (returned, to be applied)."""
        import torch.distributed as dist

        targets = [named.get(name) for name, _, _ in spec]
        straight = [_fits(t, dtype, shape, device) for t, (_, dtype, shape) in zip(targets, spec)]
        scratch = iter(self.scratch.tensors([s for s, ok in zip(spec, straight) if not ok], device))
        bufs = [t.data if ok and t is not None else next(scratch) for t, ok in zip(targets, straight)]
        received = [(name, b) for (name, _, _), b, ok in zip(spec, bufs, straight) if not ok]
        works: list = [dist.broadcast(b, src=0, group=self.group, async_op=True) for b in bufs]
        for w in works:
            w.wait()
        return received

    def _receive_flat(self, spec, device: torch.device) -> list[tuple[str, torch.Tensor]]:
        """SGLang's ``flattened_bucket``: the tensors' bytes concatenated in ``names`` order."""
        import torch.distributed as dist

        sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in spec]
        flat = self.scratch.flat(sum(sizes), device)
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
        tensors = {_module_name(n, named): t for n, t in tensors.items()}
        unknown = [n for n in tensors if n not in named]
        if unknown:
            raise ValueError(f"checkpoint has parameters the model lacks: {unknown[:5]}")
        embeddings = self.runner.model.get_input_embeddings()
        tied = (
            self.runner.lm_head is not None
            and "lm_head.weight" in named
            and embeddings is not None
            and named["lm_head.weight"] is embeddings.weight
        )
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
            self._merge_again(list(tensors))

    # -- LoRA adapters (module docstring) ----------------------------------------------------
    def read_adapter(self, name: str, path: str) -> MergedAdapter:
        """Read a PEFT folder and check it against the model; no side effects (any thread)."""
        from agentrl.peft_format import read_adapter

        files = read_adapter(path)
        named = self.runner.named_tensors()
        deltas = {}
        for layer, (a, b) in files.factors.items():
            weight = f"{layer}.weight"
            target = named.get(weight)
            if target is None:
                raise ValueError(f"{path}: the model has no layer {layer!r} (no parameter {weight!r})")
            if (b.shape[0], a.shape[1]) != tuple(target.shape):
                raise ValueError(
                    f"{path}: {layer}: B @ A is {[b.shape[0], a.shape[1]]}, the weight is {list(target.shape)}"
                )
            deltas[weight] = (a.to(target.device, torch.float32), b.to(target.device, torch.float32), files.scaling)
        return MergedAdapter(name, str(path), deltas)

    def load_adapter(self, adapter: MergedAdapter) -> None:
        """Merge ``adapter`` into the weights (scheduler thread); ValueError when one is merged already."""
        if self.adapter is not None:
            if self.adapter.name == adapter.name:
                raise ValueError(f"Failed to load LoRA adapter {adapter.name} because it is already loaded")
            raise ValueError(
                f"the embedded engine serves one LoRA adapter at a time, merged into its weights: "
                f"unload {self.adapter.name!r} first"
            )
        self.adapter = adapter
        self._merge_again(list(adapter.deltas))
        self.adapters_seen[adapter.name] = adapter.path

    def unload_adapter(self, name: str) -> None:
        """Put back the weights the adapter changed (scheduler thread)."""
        if self.adapter is None or self.adapter.name != name:
            loaded = [self.adapter.name] if self.adapter is not None else []
            raise ValueError(f"LoRA with name {name} does not exist. Loaded LoRAs: {loaded}")
        named = self.runner.named_tensors()
        with torch.no_grad():
            for weight, original in self.adapter.originals.items():
                named[weight].data.copy_(original)
        self.adapter = None

    def _merge_again(self, names: list[str]) -> None:
        """The weights ``names`` were just set (an update, or a load): those the adapter covers keep
        them as their originals and get the adapter merged on top."""
        if self.adapter is None:
            return
        named = self.runner.named_tensors()
        with torch.no_grad():
            for weight in names:
                if weight not in self.adapter.deltas:
                    continue
                target = named[weight]
                a, b, scaling = self.adapter.deltas[weight]
                self.adapter.originals[weight] = target.detach().to("cpu", copy=True)
                target.data.copy_((target.float() + scaling * (b @ a)).to(target.dtype))
