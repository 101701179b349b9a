"""The weight-update group that both ends of the weight push share (``agentrl.learner.weight_push``
and ``agentrl.engine.weights``).

Created as SGLang creates it (``init_custom_process_group``): a TCPStore hosted by rank 0 (the
trainer), wrapped in ``PrefixStore(group_name)``, as a non-default group, so it coexists with the
learner's FSDP group. Backend ``gloo`` on CPU, ``nccl`` on GPUs. Dtypes travel as names.

Invariant: rank 0 listens on ``master_address`` only. torch's TCPStore would listen on every
interface, exposing a store that accepts any key from anybody, so rank 0 binds its own socket and
hands the descriptor to the store; :func:`bind_store_socket` returns it, so the port is known
before the engines are told. See docs/learner.md.
"""

from __future__ import annotations

import logging
import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup
    from torch.distributed.distributed_c10d import GroupName

log = logging.getLogger(__name__)


def bind_store_socket(address: str, port: int = 0) -> socket.socket:
    """A listening TCP socket on ``address:port`` only (``port`` 0: a free one), for rank 0's store."""
    infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    if not infos:
        raise ValueError(f"cannot resolve the weight group address {address!r}")
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {address}:{port} for the weight group: {e}") from None
    return sock


def init_weight_group(
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = 600.0,
    listen_socket: socket.socket | None = None,
) -> ProcessGroup:
    """Join the weight-update group (rank 0 hosts the store, on ``listen_socket`` when given,
    else on a socket it binds to ``master_address:master_port``). Blocks until every rank is in."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight group backend must be gloo or nccl, got {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        sock = listen_socket if listen_socket is not None else bind_store_socket(master_address, master_port)
        port = sock.getsockname()[1]
        # TCPStore is public torch API, re-exported by torch.distributed without __all__.
        store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            master_address,
            port,
            world_size,
            is_master=True,
            timeout=timeout,
            multi_tenant=True,
            master_listen_fd=sock.detach(),
            use_libuv=True,
        )
    else:
        store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
            master_address, master_port, world_size, is_master=False, timeout=timeout, multi_tenant=True
        )
    store = PrefixStore(group_name, store)
    # GroupName is a NewType of str (only a type): the name is passed as it is.
    pg, _ = _new_process_group_helper(
        world_size, rank, [], backend, store, group_name=cast("GroupName", group_name), timeout=timeout
    )
    assert isinstance(pg, dist.ProcessGroup), "a group made with no rank list holds every rank"
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_weight_group(group: ProcessGroup | None) -> None:
    import torch.distributed as dist

    if group is not None:
        try:
            dist.destroy_process_group(group)
        except Exception as e:  # already gone; nothing else to free
            log.debug("destroy_process_group: %s", e)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: Any) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (use names like 'bfloat16', 'float32')")
    return dtype
