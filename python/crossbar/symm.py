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

CUDA tensors (``empty(..., device="cuda")``; CUDA builds against a CUDA torch, every rank of the
group on one node): GPU memory from a second heap per group and device, mapped by the local
ranks, so ``peer`` returns a CUDA tensor over a peer's memory. ``signal``, ``wait_signal`` and
``barrier(device="cuda")`` are enqueued on torch's current stream (stream memory operations,
no kernel) and return at once, like NCCL calls: ``signal`` lands after the stream's earlier work
(its writes visible to the peer first), and later work on the stream runs after the awaited
signal. The GPU waits without a deadline; ``synchronize(device, timeout)`` bounds it on the host.
"""

from __future__ import annotations

import torch

from . import _C, errors
from ._group import crossbar_backend

__all__ = ["empty", "peer", "signal", "wait_signal", "barrier", "synchronize", "is_symmetric", "cuda_available"]


def cuda_available() -> bool:
    """Whether CUDA symmetric tensors can be used here: this build has them (a CUDA build of
    crossbar against a CUDA torch) and torch sees a GPU."""
    return bool(_C._symm.cuda_available()) and torch.cuda.is_available()


def _seconds(timeout):
    if timeout is not None and hasattr(timeout, "total_seconds"):
        timeout = timeout.total_seconds()
    return None if timeout is None else float(timeout)


def _cuda_index(device, who: str) -> int:
    """-1 for the CPU, else the CUDA device index (``"cuda"``: the current device)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cpu":
        return -1
    if dev.type != "cuda":
        raise errors.Unsupported(f"{who} on {dev}: symmetric tensors are CPU or CUDA tensors")
    if not _C._symm.cuda_available():
        raise errors.Unsupported(
            f"{who} on {dev}: this build has no CUDA symmetric tensors (crossbar built without CUDA, or "
            "against a CPU-only torch); allocate on the CPU (device=None or 'cpu')"
        )
    if not torch.cuda.is_available():
        raise errors.Unsupported(f"{who} on {dev}: torch sees no CUDA device here; allocate on the CPU")
    return dev.index if dev.index is not None else torch.cuda.current_device()


def empty(shape, dtype: torch.dtype = torch.float32, group=None, device=None) -> torch.Tensor:
    """A zero-filled tensor in symmetric memory, on the CPU (default) or a CUDA device
    (``"cuda"``: the current one). Collective over ``group`` (default: the world): every rank
    calls it with the same shape, dtype and device type, in the same order."""
    index = _cuda_index(device, "crossbar.symm.empty")
    shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise errors.InvalidArgument(f"crossbar.symm.empty: negative dimension in shape {shape}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    # Ranks that ask for different shapes, dtypes or device types get InvalidUsage, all of them.
    raw = _C._symm.empty_bytes(crossbar_backend(group, "crossbar.symm"), list(shape), str(dtype), itemsize, index)
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
    rank's earlier writes, so the peer sees them once its ``wait_signal`` returns. CUDA tensors:
    enqueued on the current stream, after the stream's earlier work."""
    _C._symm.signal(t, int(peer), int(channel))


def wait_signal(t: torch.Tensor, peer: int, channel: int = 0, timeout=None) -> None:
    """Waits for the next signal from ``peer`` on ``channel`` of ``t``'s buffer. ``timeout``
    (seconds or timedelta; default the group's timeout): crossbar.TimeoutError when it passes.
    CUDA tensors: the current stream waits (later work on it sees the peer's writes) and the
    call returns at once; no timeout (bound it with ``synchronize``)."""
    _C._symm.wait_signal(t, int(peer), int(channel), _seconds(timeout))


def barrier(group=None, timeout=None, device=None) -> None:
    """Every rank of ``group`` arrives before any leaves; writes to symmetric tensors made before
    it are visible to every rank after it (signals on the group's heap, not a collective).
    ``device="cuda"``: a barrier on the current stream over the group's CUDA heap (ordering the
    streams' work on CUDA symmetric tensors); returns at once, no timeout (see ``synchronize``)."""
    index = _cuda_index(device, "crossbar.symm.barrier")
    _C._symm.barrier(crossbar_backend(group, "crossbar.symm"), _seconds(timeout), index)


def synchronize(device="cuda", timeout=None) -> None:
    """Blocks until the current stream of ``device`` has run what is queued on it now, or raises
    crossbar.TimeoutError after ``timeout`` (default 300 s): a ``wait_signal`` or CUDA
    ``barrier`` on that stream whose peer never signaled (the stream stays blocked)."""
    index = _cuda_index(device, "crossbar.symm.synchronize")
    if index < 0:
        return
    seconds = _seconds(timeout)
    _C._symm.synchronize(index, 300.0 if seconds is None else seconds)
