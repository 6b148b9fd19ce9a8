"""Symmetric-memory tensors on a crossbar process group (symmem/symmetric_heap.h).

::

    import crossbar.symm as symm
    t = symm.empty((4, 1024), dtype=torch.float32)   # collective: same shape/dtype, same order
    t.fill_(dist.get_rank())
    symm.barrier()                                  # every rank's writes are visible after it
    left = symm.peer(t, (rank - 1) % world)          # a view of that rank's copy (same node)
    symm.signal(t, peer); symm.wait_signal(t, peer)  # point-to-point flags on the buffer's pads
    dist.all_gather_into_tensor(out, t[0])           # peers read t in place (one node, zero copy)

A symmetric tensor's storage is a ``SymmetricBuffer`` from one heap per crossbar communicator
(made at the group's first ``empty``), over the same communicator the group's collectives use,
so one-node all_gather_into_tensor / all_to_all_single read it in place. Buffers start
zero-filled and live as long as the tensor's storage (or any peer view of it). Errors are
crossbar's typed exceptions (``InvalidUsage`` on every rank when ranks ask for different shapes
or dtypes, ``TimeoutError`` when a wait's deadline passes).

CPU tensors (host memory) only for now: CUDA symmetric tensors raise ``Unsupported``.
"""

from __future__ import annotations

import torch

from . import _C, errors
from ._group import crossbar_backend

__all__ = ["empty", "peer", "signal", "wait_signal", "barrier", "is_symmetric"]


def empty(shape, dtype: torch.dtype = torch.float32, group=None, device=None) -> torch.Tensor:
    """A zero-filled CPU tensor in symmetric memory. Collective over ``group`` (default: the
    world): every rank calls it with the same shape and dtype, in the same order."""
    if device is not None and torch.device(device).type != "cpu":
        raise errors.Unsupported(
            f"crossbar.symm.empty on {device}: symmetric tensors are CPU tensors for now; "
            "allocate on the CPU (device=None or 'cpu')"
        )
    shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise errors.InvalidArgument(f"crossbar.symm.empty: negative dimension in shape {shape}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    # Ranks that ask for different shapes or dtypes get InvalidUsage, all of them.
    raw = _C._symm.empty_bytes(crossbar_backend(group, "crossbar.symm"), list(shape), str(dtype), itemsize)
    return raw.view(dtype).view(shape)


def is_symmetric(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is symmetric memory (from ``empty``, a view of it, or ``peer``)."""
    return bool(_C._symm.is_symmetric(t))


def peer(t: torch.Tensor, rank: int) -> torch.Tensor:
    """A view of ``rank``'s copy of symmetric tensor ``t`` (same shape, dtype, strides and
    offset into the allocation); ``rank`` must be on this node."""
    return _C._symm.peer(t, int(rank))


def signal(t: torch.Tensor, peer: int, channel: int = 0) -> None:
    """Adds a signal to ``peer``'s pad of ``t``'s buffer on ``channel``; it is ordered after this
    rank's earlier writes, so the peer sees them once its ``wait_signal`` returns."""
    _C._symm.signal(t, int(peer), int(channel))


def wait_signal(t: torch.Tensor, peer: int, channel: int = 0, timeout=None) -> None:
    """Waits for the next signal from ``peer`` on ``channel`` of ``t``'s buffer. ``timeout``
    (seconds or timedelta; default the group's timeout): crossbar.TimeoutError when it passes."""
    if timeout is not None and hasattr(timeout, "total_seconds"):
        timeout = timeout.total_seconds()
    _C._symm.wait_signal(t, int(peer), int(channel), None if timeout is None else float(timeout))


def barrier(group=None, timeout=None) -> None:
    """Every rank of ``group`` arrives before any leaves; writes to symmetric tensors made before
    it are visible to every rank after it (signals on the group's heap, not a collective)."""
    if timeout is not None and hasattr(timeout, "total_seconds"):
        timeout = timeout.total_seconds()
    _C._symm.barrier(crossbar_backend(group, "crossbar.symm"), None if timeout is None else float(timeout))
