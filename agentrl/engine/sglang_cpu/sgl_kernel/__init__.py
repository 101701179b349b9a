"""A pure-torch stand-in for ``sgl_kernel`` that lets SGLang 0.5.23 run on the CPU (see ../README.md).

Only what SGLang's CPU path calls is implemented. SGLang imports more names at import time (its
speculative-decoding and KV-move ops); any other name is a function that raises
``NotImplementedError`` naming the op and this stand-in when called, so a missing op fails at its
first use instead of computing something wrong.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+agentrl-cpu-stand-in"
_HERE = __file__


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """For request ``i``: ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` takes the next
    ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc`` (requests in order, packed)."""
    starts, ends, rows = start_offset.tolist(), end_offset.tolist(), req_pool_indices.tolist()
    taken = 0
    for row, start, end in zip(rows, starts, ends):
        if not 0 <= start <= end <= pool_len:
            raise ValueError(f"sgl_kernel stand-in: slice [{start}, {end}) is outside a row of {pool_len} tokens")
        n = end - start
        if taken + n > out_cache_loc.numel():
            raise ValueError(f"sgl_kernel stand-in: {out_cache_loc.numel()} cache locations for at least "
                             f"{taken + n} token slots")
        req_to_token[row, start:end] = out_cache_loc[taken:taken + n].to(req_to_token.dtype)
        taken += n


def _not_here(name: str):
    """An op this stand-in does not have: SGLang imports several at import time (speculative decoding,
    KV moves) that its CPU path never calls; calling one raises and names it."""
    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not implemented by agentrl's CPU stand-in ({_HERE}); it "
                                  "implements only what SGLang 0.5.23's CPU path calls. Run SGLang on a GPU for the "
                                  "real kernels.")
    op.__name__ = op.__qualname__ = name
    return op


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _not_here(name)
