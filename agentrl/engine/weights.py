"""Weight updates, the engine's end: :class:`EngineWeightReceiver` (the trainer's end is
``agentrl.learner.weight_push``; the group both join is ``agentrl.weight_group``).

The protocol is SGLang's (``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/update_weights_from_disk``), so the learner drives real SGLang servers and the embedded
engine alike. The engine joins the trainer's group at ``rank_offset`` (SGLang joins one rank
per TP rank: ``rank_offset + tp_rank``).

**Wire formats** (the trainer chooses, ``bench/engine.py`` measured them): by default one
broadcast per tensor, received straight into the engine's parameters when dtype and shape
agree -- no copy -- and all posted at once as async ops, so there is no per-tensor round trip;
or SGLang's ``load_format = "flattened_bucket"``: the bucket's bytes concatenated in ``names``
order, one uint8 broadcast (a bucket never mixes dtypes, so every view starts at a multiple
of its item size).

The receiver takes every declared tensor even when a name is unknown or a shape disagrees
(into a scratch buffer), so a bad name never leaves the trainer blocked in a broadcast; it
reports the problem in the HTTP answer instead.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from agentrl.weight_group import destroy_weight_group, init_weight_group, parse_dtype

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- engine side


class EngineWeightReceiver:
    """Engine end: owns the group; receives and applies updates (called in the scheduler thread)."""

    def __init__(self, runner):
        self.runner = runner
        self.group = None
        self.group_name: str | None = None
        self.backend = "gloo"

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str, timeout_s: float = 600.0) -> None:
        if self.group is not None:
            self.destroy_group()
        if backend == "nccl" and self.runner.device.type != "cuda":
            raise ValueError("backend 'nccl' needs the engine on a CUDA device; use 'gloo' on CPU")
        self.group = init_weight_group(backend, master_address, master_port, world_size, rank_offset,
                                       group_name, timeout_s)
        self.group_name, self.backend = group_name, backend

    def destroy_group(self) -> None:
        destroy_weight_group(self.group)
        self.group, self.group_name = None, None

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
        ``flattened``), in order; apply them; return the problems found."""
        import torch.distributed as dist

        if self.group is None:
            raise ValueError("no weight update group: call /init_weights_update_group first")
        named = self.runner.named_tensors()
        self.runner.prefix_cache.clear()  # K/V computed under the old weights
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
        self.runner.prefix_cache.clear()  # K/V computed under the old weights
        with torch.no_grad():
            for n, t in tensors.items():
                named[n].data.copy_(t)
