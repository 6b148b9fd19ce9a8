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

User kernels (Triton, CUDA, ctypes on the CPU) address every rank's copy through a handle, the
counterpart of ``torch.distributed._symmetric_memory.rendezvous`` (docs/torch-backend.md)::

    h = symm.rendezvous(t)          # local: the exchange happened in empty()
    h.buffer_ptrs[p]                # address of t's first element in rank p's copy (int)
    h.buffer_ptrs_dev               # address of a table of those (CUDA: on t's GPU, uint64)
    h.signal_pad_ptrs[p]            # rank p's signal pad: slot (channel c, sender s) is the
                                    # uint64 counter at + (c * world_size + s) * 16
    h.device_handle(channel)        # CUDA: bytes of cuda::SymmDeviceHandle for a C++ kernel
"""

from __future__ import annotations

import torch

from . import _C, errors
from ._group import crossbar_backend

__all__ = [
    "empty",
    "peer",
    "signal",
    "wait_signal",
    "barrier",
    "synchronize",
    "is_symmetric",
    "cuda_available",
    "rendezvous",
    "SymmHandle",
    "DEVICE_HANDLE_LAYOUT",
]


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


def __getattr__(name: str):
    # DEVICE_HANDLE_LAYOUT: offsets of cuda::SymmDeviceHandle's fields
    # (symmem/cuda/device_handle.h) and its size ("size"), in bytes, as this build lays it out;
    # SymmHandle.device_handle() returns those bytes. Read from _C on use, not at import.
    if name == "DEVICE_HANDLE_LAYOUT":
        return dict(_C._symm.device_handle_layout())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class SymmHandle:
    """What a kernel needs to address every rank's copy of a symmetric tensor: made by
    :func:`rendezvous`, the counterpart of torch's ``_SymmetricMemory`` handle.

    Addresses are of the tensor's first element (its offset into the allocation is kept), in
    this process's mapping of each rank's copy; ``0`` for a rank on another node (not mapped).
    CPU tensors: host addresses (``ctypes``; the tables are int64 CPU tensors). CUDA tensors:
    device addresses on the tensor's GPU (the tables are uint64 tensors on that GPU, built once
    per allocation and offset and kept while the tensor lives).

    Attributes: ``rank``, ``world_size``, ``device`` (the tensor's), ``offset`` (bytes of the
    tensor's first element from the allocation's start), ``buffer_size`` (bytes from
    ``buffer_ptrs[p]`` to the end of the allocation), ``buffer_ptrs`` / ``buffer_ptrs_dev`` /
    ``buffer_ptrs_tensor``, ``signal_pad_ptrs`` / ``signal_pad_ptrs_dev`` /
    ``signal_pad_ptrs_tensor``, ``signal_pad_size`` (bytes of the user channels' slots),
    ``channels``, ``signal_slot_bytes`` (16).

    Signal pad layout (the pads ``signal`` / ``wait_signal`` use): rank p's pad at
    ``signal_pad_ptrs[p]`` holds one 16-byte slot per (channel c, sender s) at byte
    ``(c * world_size + s) * 16``; its first 8 bytes are a uint64 counter that only sender s
    writes and only p waits on. A signal from s to p on c stores the counter's next value
    (previous + 1, release order after the data); ``wait_signal(t, s, c)`` on p consumes one.
    The counters only grow: do not mix raw writes and ``signal`` on one (channel, sender), since
    each keeps its own count. A raw store on the CPU wakes a sleeping ``wait_signal`` within
    its sleep slice (at most 100 ms; crossbar's own signal wakes it at once).
    """

    def __init__(self, t: torch.Tensor, info: dict):
        self._tensor = t  # keeps the allocation (and the cached tables) alive
        self.rank: int = info["rank"]
        self.world_size: int = info["world_size"]
        self.device = t.device
        self.offset: int = info["offset"]
        self.buffer_size: int = info["buffer_size"]
        self.buffer_ptrs: list = list(info["buffer_ptrs"])
        self.signal_pad_ptrs: list = list(info["signal_pad_ptrs"])
        self.buffer_ptrs_tensor: torch.Tensor = info["buffer_ptrs_table"]
        self.signal_pad_ptrs_tensor: torch.Tensor = info["signal_pad_ptrs_table"]
        self.buffer_ptrs_dev: int = self.buffer_ptrs_tensor.data_ptr()
        self.signal_pad_ptrs_dev: int = self.signal_pad_ptrs_tensor.data_ptr()
        self.signal_pad_size: int = info["signal_pad_size"]
        self.channels: int = info["channels"]
        self.signal_slot_bytes: int = info["signal_slot_bytes"]

    def __repr__(self) -> str:
        return (
            f"SymmHandle(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
            f"offset={self.offset}, buffer_size={self.buffer_size})"
        )

    def signal_slot_ptr(self, owner: int, sender: int, channel: int = 0) -> int:
        """Address of the counter that ``sender`` writes for ``channel`` in ``owner``'s pad."""
        for name, r in (("owner", owner), ("sender", sender)):
            if not 0 <= r < self.world_size:
                raise errors.InvalidArgument(
                    f"rank {self.rank}: crossbar.symm.SymmHandle.signal_slot_ptr: {name} {r} is not a rank of the "
                    f"group (size {self.world_size})"
                )
        if not 0 <= channel < self.channels:
            raise errors.InvalidArgument(
                f"rank {self.rank}: crossbar.symm.SymmHandle.signal_slot_ptr: channel {channel} is out of range: "
                f"the buffer has {self.channels} channels (CROSSBAR_SYMMEM_CHANNELS)"
            )
        if self.signal_pad_ptrs[owner] == 0:
            raise errors.InvalidArgument(
                f"rank {self.rank}: crossbar.symm.SymmHandle.signal_slot_ptr: rank {owner} is on another node; "
                "its pad is not mapped here"
            )
        return self.signal_pad_ptrs[owner] + (channel * self.world_size + sender) * self.signal_slot_bytes

    def get_buffer(self, rank: int, sizes, dtype: torch.dtype, storage_offset: int = 0) -> torch.Tensor:
        """A contiguous ``dtype`` tensor of ``sizes`` over ``rank``'s copy, starting
        ``storage_offset`` elements (of ``dtype``) after ``buffer_ptrs[rank]``; it aliases that
        memory and keeps the allocation alive. InvalidArgument past the allocation's end or at
        an address not aligned to ``dtype``."""
        sizes = (sizes,) if isinstance(sizes, int) else [int(d) for d in sizes]
        return _C._symm.get_buffer(self._tensor, int(rank), list(sizes), dtype, int(storage_offset))

    def get_signal_pad(self, rank: int, sizes=None, dtype: torch.dtype = torch.int64, storage_offset: int = 0):
        """A contiguous ``dtype`` tensor over ``rank``'s signal pad (``signal_pad_size`` bytes:
        the user channels' slots), ``sizes`` (default: all of it, 1-D) from element
        ``storage_offset``. With int64 and sizes ``(channels, world_size, 2)``, ``[c, s, 0]`` is
        the counter that rank s writes for channel c. Not a symmetric tensor (``peer`` refuses
        it); it keeps the allocation alive."""
        if sizes is not None:
            sizes = [int(sizes)] if isinstance(sizes, int) else [int(d) for d in sizes]
        return _C._symm.get_signal_pad(self._tensor, int(rank), sizes, dtype, int(storage_offset))

    def barrier(self, channel: int = 0, timeout=None) -> None:
        """Every rank signals every other on ``channel`` of this buffer's pads and waits for
        all (CPU: ``timeout`` as in ``wait_signal``; CUDA: on the current stream, no timeout).
        Use a channel either for barriers or for point-to-point signals."""
        _C._symm.buffer_barrier(self._tensor, int(channel), _seconds(timeout))

    def put_signal(self, dst_rank: int, channel: int = 0) -> None:
        """``crossbar.symm.signal`` on this buffer."""
        signal(self._tensor, dst_rank, channel)

    def wait_signal(self, src_rank: int, channel: int = 0, timeout=None) -> None:
        """``crossbar.symm.wait_signal`` on this buffer."""
        wait_signal(self._tensor, src_rank, channel, timeout)

    def device_handle(self, channel: int = 0) -> bytes:
        """CUDA tensors: the bytes of a ``crossbar::cuda::SymmDeviceHandle``
        (symmem/cuda/device_handle.h; layout in ``DEVICE_HANDLE_LAYOUT``) for ``channel``:
        ``peer_ptrs[r] == buffer_ptrs[r]``, ``signal_pads[r]`` = rank r's slot of sender 0 on
        ``channel`` (slot of sender s at ``+ s * signal_stride`` words, ``signal_stride`` 2),
        ``size == buffer_size``. A C++ extension copies them into the struct and passes it by
        value to its kernel. CPU tensors: InvalidArgument."""
        return _C._symm.device_handle(self._tensor, int(channel))


def rendezvous(t: torch.Tensor, group=None) -> SymmHandle:
    """The handle of symmetric tensor ``t`` (from ``empty``, a view of it, or ``peer``) for user
    kernels: every rank's address of ``t``'s first element, the signal pads, their tables.
    Unlike torch's ``rendezvous`` it is local (no communication: the ranks exchanged their
    mappings in ``empty``), so ranks may call it at different times, or not at all. ``group``:
    when given, it must be the group ``t`` was allocated on (InvalidArgument otherwise)."""
    backend = None if group is None else crossbar_backend(group, "crossbar.symm.rendezvous")
    return SymmHandle(t, _C._symm.handle_info(t, backend))
