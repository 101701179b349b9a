"""Full tensors from FSDP2 shards, bucket by bucket, for the weight push to the engines.

Under FSDP2 every parameter is a ``DTensor`` sharded over the ranks. To push weights, rank 0
needs full tensors under their Hugging Face names. :func:`iter_full_tensors` walks the
parameters in a fixed order, groups them into buckets of about ``bucket_bytes`` (one tensor
larger than the bucket is a bucket of its own), all-gathers one bucket at a time and yields
that bucket's tensors on rank 0 before it gathers the next, holding no reference after
yielding. The memory held on rank 0 is therefore one bucket (plus whatever the consumer
keeps), never the whole model.

Every rank must run the iterator to the end, in lockstep (the all-gathers are collectives);
ranks other than 0 yield nothing. :func:`push_weights` wraps that: rank 0 hands the
iterator to a ``WeightUpdater``-like object (``push(named_tensors, version)``), the other
ranks drain it.

Names are the model's own (``model.layers.0.self_attn.q_proj.weight``); with tied
embeddings ``lm_head.weight`` is not sent (engines tie it themselves), as in SGLang.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol

import torch
import torch.distributed as dist
from torch import nn


class WeightSink(Protocol):
    """What the learner pushes weights into (``agentrl.engine.weights.WeightUpdater``)."""

    def push(self, named_tensors: Any, version: int) -> dict: ...


def _tied(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return bool(getattr(config, "tie_word_embeddings", False))


def named_parameters_for_push(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters to send, in a fixed order, without a tied ``lm_head.weight``."""
    params = list(model.named_parameters())  # deduplicates tied parameters already
    if _tied(model):
        params = [(n, p) for n, p in params if n != "lm_head.weight"]
    return params


def _full(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    data = param.data if isinstance(param, nn.Parameter) else param
    if isinstance(data, DTensor):
        return data.full_tensor()
    return data


def _nbytes(param: torch.Tensor, dtype: torch.dtype | None) -> int:
    itemsize = (dtype or param.dtype).itemsize
    return param.numel() * itemsize  # numel of a DTensor is the global size


def iter_full_tensors(
    model: nn.Module, *, bucket_bytes: int = 64 << 20, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` on rank 0, gathering one bucket at a time (module docstring).

    ``dtype`` casts on the fly (the engines' dtype, e.g. bf16); None keeps the training dtype.
    Must be iterated to the end on every rank.
    """
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    bucket: list[tuple[str, nn.Parameter]] = []
    size = 0

    def flush() -> Iterator[tuple[str, torch.Tensor]]:
        gathered = []
        with torch.no_grad():
            for name, param in bucket:
                full = _full(param)
                if dtype is not None and full.dtype != dtype:
                    full = full.to(dtype)
                gathered.append((name, full.detach()))
        bucket.clear()
        while gathered:
            item = gathered.pop(0)
            if is_main:
                yield item
            del item

    for name, param in named_parameters_for_push(model):
        nbytes = _nbytes(param, dtype)
        if bucket and size + nbytes > bucket_bytes:
            yield from flush()
            size = 0
        bucket.append((name, param))
        size += nbytes
    if bucket:
        yield from flush()


def push_weights(
    model: nn.Module, sink: WeightSink | None, version: int, *, bucket_bytes: int, dtype: torch.dtype | None
) -> dict:
    """Push the model's full weights into ``sink`` from rank 0; other ranks take part in the
    gathers. Returns the sink's timings on rank 0 (``{}`` elsewhere or without a sink)."""
    tensors = iter_full_tensors(model, bucket_bytes=bucket_bytes, dtype=dtype)
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    try:
        if is_main and sink is not None:
            return sink.push(tensors, version) or {}
        return {}
    finally:
        for _ in tensors:  # finish the gathers even if the sink stopped early or raised,
            pass  # so that the other ranks are not left waiting in a collective
