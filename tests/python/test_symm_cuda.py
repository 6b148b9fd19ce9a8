"""crossbar.symm on CUDA tensors, 2 ranks sharing GPU 0 (one node: the CUDA symmetric heap):
zero-filled allocation, peer views (whole tensors, slices, transposes, bf16), the stream-ordered
barrier, a signal/wait ping-pong on the current stream, a 16 MiB put into the peer's memory
ordered by a signal with no host synchronization in between, a side stream, a wait whose signal
does not come bounded by synchronize(timeout) (then released), typed errors, and ranks asking
for different device types. The kernel handle (crossbar.symm.rendezvous): pointer tables on the
GPU read back and read by a kernel at buffer_ptrs_dev, torch kernels writing through every rank's
raw address, a view at a storage offset, get_buffer, the SymmDeviceHandle bytes decoded, a
kernel's store into the documented signal slot taken by wait_signal, and (with triton) a Triton
kernel putting through buffer_ptrs_dev and signaling through the pad. Skips without a GPU or
without CUDA symmetric tensors in the build.

    CROSSBAR_BUILD_DIR=build python3 -m pytest -q tests/python/test_symm_cuda.py
"""

import struct

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks


def _cuda_symm_built():
    try:
        import crossbar.symm as symm
    except ImportError:
        return False
    return symm.cuda_available()


pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not _cuda_symm_built(), reason="crossbar built without CUDA symmetric tensors"),
]

SYNC_S = 60  # bound of every host wait on a stream (a missing signal fails, never hangs)


def expected(rank: int, shape, dtype=torch.float32) -> torch.Tensor:
    return (torch.arange(torch.Size(shape).numel(), dtype=torch.float32) + 1000 * rank).view(shape).to(dtype)


def _host(symm, t: torch.Tensor) -> torch.Tensor:
    symm.synchronize(timeout=SYNC_S)  # bounded: the stream may wait on a peer's signal
    return t.cpu()


def _views_signals(rank, world):
    import crossbar
    import crossbar.symm as symm

    torch.cuda.set_device(0)
    store = dist.distributed_c10d._get_default_store()
    other = 1 - rank

    t = symm.empty((3, 5), dtype=torch.float32, device="cuda")
    assert t.device == torch.device("cuda", 0) and t.shape == (3, 5) and t.dtype == torch.float32
    assert symm.is_symmetric(t) and not symm.is_symmetric(torch.zeros(3, device="cuda"))
    assert torch.count_nonzero(_host(symm, t)).item() == 0  # zero-filled
    t.copy_(expected(rank, (3, 5)).cuda())
    symm.barrier(device="cuda")  # on the current stream: later work sees every rank's copy
    for r in range(world):
        v = symm.peer(t, r)
        assert v.device == t.device and v.shape == t.shape and v.stride() == t.stride()
        assert torch.equal(_host(symm, v), expected(r, (3, 5))), f"rank {rank}: view of rank {r}"
        assert torch.equal(_host(symm, symm.peer(t[1:, 2:], r)), expected(r, (3, 5))[1:, 2:])
        assert torch.equal(_host(symm, symm.peer(t.t(), r)), expected(r, (3, 5)).t())
    assert symm.peer(t, rank).data_ptr() == t.data_ptr()
    b = symm.empty(7, dtype=torch.bfloat16, device="cuda")
    b.copy_(expected(rank, (7,), torch.bfloat16).cuda())
    symm.barrier(device="cuda")
    assert torch.equal(_host(symm, symm.peer(b, other)), expected(other, (7,), torch.bfloat16))
    symm.barrier(device="cuda")  # nobody writes below before everyone has read above

    # Ping-pong: write into the peer's copy (a kernel on the current stream), then signal it
    # (after the write, in stream order); the peer's stream waits for the signal.
    for i in range(5):
        if rank == 0:
            symm.peer(t, 1)[0, 0] = 10.0 * i
            symm.signal(t, 1)
            symm.wait_signal(t, 1)
            assert _host(symm, t)[0, 0].item() == 10.0 * i + 1, f"round {i}"
        else:
            symm.wait_signal(t, 0)
            assert _host(symm, t)[0, 0].item() == 10.0 * i, f"round {i}"
            symm.peer(t, 0)[0, 0] = 10.0 * i + 1
            symm.signal(t, 0)
    symm.barrier(device="cuda")

    # 16 MiB put into the peer's memory, signal, and the peer's reduction behind its wait, with
    # no host synchronization between them (stream order only).
    n = 4 << 20
    x = symm.empty(n, dtype=torch.float32, device="cuda")
    out = torch.empty(1, device="cuda")
    if rank == 0:
        src = torch.arange(n, dtype=torch.float32, device="cuda") % 7
        symm.peer(x, 1).copy_(src)
        symm.signal(x, 1, channel=1)
    else:
        symm.wait_signal(x, 0, channel=1)
        torch.sum(x, dim=0, keepdim=True, out=out)
        want = float((torch.arange(n, dtype=torch.float64) % 7).sum())
        assert _host(symm, out).item() == want
    symm.barrier(device="cuda")

    # A side stream: signals and waits go on whichever stream is current.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        t.fill_(rank + 5)
        symm.signal(t, other, channel=3)
        symm.wait_signal(t, other, channel=3)
        got = symm.peer(t, other).clone()
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(_host(symm, got), torch.full((3, 5), float(other + 5)))
    symm.barrier(device="cuda")

    # Rank 0's stream waits on channel 2, which rank 1 signals only after rank 0's bounded
    # synchronize gave up (told through the store): TimeoutError, then the stream goes on.
    if rank == 0:
        symm.wait_signal(t, 1, channel=2)
        with pytest.raises(crossbar.TimeoutError, match="did not finish within"):
            symm.synchronize(timeout=0.5)
        store.set("symm-cuda-timed-out", "1")
        symm.synchronize(timeout=SYNC_S)
    else:
        store.wait(["symm-cuda-timed-out"])
        symm.signal(t, 0, channel=2)
    symm.barrier(device="cuda")

    # Typed errors.
    with pytest.raises(crossbar.InvalidArgument, match="no timeout"):
        symm.wait_signal(t, other, timeout=1)
    with pytest.raises(crossbar.InvalidArgument, match="not a symmetric tensor"):
        symm.peer(torch.zeros(3, device="cuda"), 0)
    with pytest.raises(crossbar.InvalidArgument, match=f"peer {world} is not a rank"):
        symm.peer(t, world)
    # Ranks asking for different device types: InvalidUsage on both, nothing allocated.
    with pytest.raises(crossbar.InvalidUsage) as e:
        symm.empty(4, device="cuda" if rank == 0 else "cpu")
    mine, theirs = ("cuda", "cpu") if rank == 0 else ("cpu", "cuda")
    assert f"rank {other} (host " in str(e.value) and f"device={theirs}" in str(e.value), str(e.value)
    assert f"this rank for shape=(4,), dtype=torch.float32, device={mine}" in str(e.value), str(e.value)
    c = symm.empty(4, device="cuda")  # agreeing again: works
    c.fill_(rank)
    symm.barrier(device="cuda")
    assert torch.equal(_host(symm, symm.peer(c, other)), torch.full((4,), float(other), device="cpu"))
    symm.barrier(device="cuda")
    symm.synchronize(timeout=SYNC_S)  # nothing queued on a buffer when it is released


def test_symm_cuda_views_signals_barrier():
    run_ranks(_views_signals, 2)


class _DeviceMemory:
    """``n`` elements of ``typestr`` at device address ``ptr`` for torch.as_tensor (no copy):
    how a test reaches a raw address from Python with torch kernels only."""

    def __init__(self, ptr: int, n: int, typestr: str):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (n,), "typestr": typestr, "version": 3}


def _at(ptr: int, n: int, typestr: str) -> torch.Tensor:
    return torch.as_tensor(_DeviceMemory(ptr, n, typestr), device="cuda")


def _decode_device_handle(symm, raw: bytes) -> dict:
    lay = symm.DEVICE_HANDLE_LAYOUT
    assert len(raw) == lay["size"]
    n = lay["max_local_ranks"]
    return {
        "peer_ptrs": list(struct.unpack_from(f"<{n}Q", raw, lay["peer_ptrs"])),
        "signal_pads": list(struct.unpack_from(f"<{n}Q", raw, lay["signal_pads"])),
        "rank": struct.unpack_from("<i", raw, lay["rank"])[0],
        "local_size": struct.unpack_from("<i", raw, lay["local_size"])[0],
        "size": struct.unpack_from("<Q", raw, lay["size_bytes"])[0],
        "signal_stride": struct.unpack_from("<i", raw, lay["signal_stride"])[0],
    }


def _handle(rank, world):
    import crossbar
    import crossbar.symm as symm

    torch.cuda.set_device(0)
    other = 1 - rank
    t = symm.empty((4, 6), dtype=torch.float32, device="cuda")
    h = symm.rendezvous(t)
    assert (h.rank, h.world_size, h.offset, h.buffer_size) == (rank, world, 0, 4 * 6 * 4)
    assert h.device == t.device and h.signal_pad_size == h.channels * world * 16
    assert h.buffer_ptrs[rank] == t.data_ptr()
    for p in range(world):
        assert h.buffer_ptrs[p] == symm.peer(t, p).data_ptr()
    # The tables: uint64 tensors on the GPU at buffer_ptrs_dev / signal_pad_ptrs_dev, read back
    # and read by a kernel at the raw address.
    for ptrs, table, dev in (
        (h.buffer_ptrs, h.buffer_ptrs_tensor, h.buffer_ptrs_dev),
        (h.signal_pad_ptrs, h.signal_pad_ptrs_tensor, h.signal_pad_ptrs_dev),
    ):
        assert table.dtype == torch.uint64 and table.device == t.device and table.data_ptr() == dev
        assert table.cpu().view(torch.int64).tolist() == ptrs
        assert _at(dev, world, "<i8").clone().cpu().tolist() == ptrs
    again = symm.rendezvous(t)  # cached: the same device tables
    assert (again.buffer_ptrs_dev, again.signal_pad_ptrs_dev) == (h.buffer_ptrs_dev, h.signal_pad_ptrs_dev)

    # Torch kernels writing through the raw addresses: element [0, rank] of every rank's copy.
    t.copy_(expected(rank, (4, 6)).cuda())
    symm.barrier(device="cuda")
    for p in range(world):
        _at(h.buffer_ptrs[p] + 4 * rank, 1, "<f4").fill_(100.0 * rank + p)
    symm.barrier(device="cuda")
    want = expected(rank, (4, 6))
    for r in range(world):
        want[0, r] = 100.0 * r + rank
    assert torch.equal(_host(symm, t), want)

    # A view at a storage offset, get_buffer, and the SymmDeviceHandle bytes.
    v = t[2, 1:]
    hv = symm.rendezvous(v)
    assert hv.offset == 13 * 4 and hv.buffer_size == 11 * 4 and hv.buffer_ptrs[rank] == v.data_ptr()
    assert hv.buffer_ptrs == [p + hv.offset for p in h.buffer_ptrs]
    assert hv.buffer_ptrs_tensor.cpu().view(torch.int64).tolist() == hv.buffer_ptrs
    want_other = expected(other, (4, 6))
    for r in range(world):
        want_other[0, r] = 100.0 * r + other
    row = h.get_buffer(other, (6,), torch.float32, storage_offset=6)
    assert row.device == t.device and row.data_ptr() == h.buffer_ptrs[other] + 24
    assert torch.equal(_host(symm, row), want_other[1])
    assert torch.equal(_host(symm, hv.get_buffer(other, 3, torch.float32, storage_offset=2)), want_other[2, 3:6])
    for handle, channel in ((h, 2), (hv, 0)):
        d = _decode_device_handle(symm, handle.device_handle(channel))
        assert d["peer_ptrs"][:world] == handle.buffer_ptrs
        assert d["signal_pads"][:world] == [handle.signal_slot_ptr(r, 0, channel) for r in range(world)]
        assert (d["rank"], d["local_size"], d["size"], d["signal_stride"]) == (rank, world, handle.buffer_size, 2)
    symm.barrier(device="cuda")

    # A kernel's store into slot (channel 1, sender 0) of rank 1's pad is what its wait_signal
    # takes; crossbar's signal on channel 3 lands in the slot the layout names.
    if rank == 0:
        _at(h.buffer_ptrs[1] + 4 * 18, 1, "<f4").fill_(555.0)  # rank 1's [3, 0]
        _at(h.signal_slot_ptr(1, 0, 1), 1, "<i8").add_(1)  # after it, in stream order
        symm.signal(t, 1, channel=3)
    else:
        symm.wait_signal(t, 0, channel=1)
        assert _host(symm, t)[3, 0].item() == 555.0
    symm.barrier(device="cuda")
    got = _host(symm, _at(h.signal_slot_ptr(rank, other, 3), 1, "<i8").clone()).item()
    assert got == (1 if rank == 1 else 0), f"rank {rank}: counter of rank {other} on channel 3 is {got}"
    pad = h.get_signal_pad(rank, (h.channels, world, 2), torch.int64)  # the same counters, on the GPU
    assert pad.device == t.device and pad.data_ptr() == h.signal_pad_ptrs[rank]
    assert _host(symm, pad)[3, other, 0].item() == got
    if rank == 1:
        symm.wait_signal(t, 0, channel=3)  # consume it

    # The handle's barrier and signals, on the current stream.
    h.barrier(channel=4)
    h.put_signal(other, channel=5)
    h.wait_signal(other, channel=5)
    symm.synchronize(timeout=SYNC_S)
    with pytest.raises(crossbar.InvalidArgument, match="no timeout"):
        h.barrier(channel=4, timeout=1)
    with pytest.raises(crossbar.InvalidArgument, match="channel -1 is out of range"):
        h.device_handle(-1)
    symm.barrier(device="cuda")
    symm.synchronize(timeout=SYNC_S)


def test_symm_cuda_handle_pointers_pads_device_handle():
    run_ranks(_handle, 2)


def _triton(rank, world):
    import crossbar.symm as symm

    from symm_triton import handle_signal_kernel, put_kernel, signal_kernel

    torch.cuda.set_device(0)
    t = symm.empty(8, dtype=torch.float32, device="cuda")
    h = symm.rendezvous(t)
    symm.barrier(device="cuda")
    put_kernel[(world,)](h.buffer_ptrs_dev, rank, 100.0 * rank)  # on the current stream
    symm.barrier(device="cuda")
    assert _host(symm, t)[:world].tolist() == [100.0 * r + rank for r in range(world)]
    # Data, then the kernel's signal (release, system scope); the peer's stream waits for it.
    other = 1 - rank
    symm.barrier(device="cuda")
    if rank == 0:
        put_kernel[(world,)](h.buffer_ptrs_dev, 4, 7.0)  # element [4] of every copy
        signal_kernel[(1,)](h.signal_slot_ptr(1, 0, 1))
    else:
        symm.wait_signal(t, other, channel=1)
        assert _host(symm, t)[4].item() == 8.0  # 7 + its rank
    symm.barrier(device="cuda")

    # The SymmDeviceHandle bytes on the GPU, used by kernels: its peer_ptrs (the struct's first
    # words) as the put table, and its signal_pads / signal_stride to signal the peer (channel 6).
    lay = symm.DEVICE_HANDLE_LAYOUT
    dh = torch.frombuffer(bytearray(h.device_handle(6)), dtype=torch.uint8).cuda()
    assert lay["peer_ptrs"] == 0
    put_kernel[(world,)](dh.data_ptr(), 5 + rank, 20.0 * rank)  # element [5 + rank] of every copy
    handle_signal_kernel[(1,)](dh.data_ptr(), other, rank, lay["signal_pads"] // 8, lay["signal_stride"] // 4)
    symm.wait_signal(t, other, channel=6)  # the peer's kernel signal, after its put
    got = _host(symm, t)[5 : 5 + world].tolist()
    assert got == [20.0 * r + rank for r in range(world)], f"rank {rank}: {got}"
    symm.barrier(device="cuda")
    symm.synchronize(timeout=SYNC_S)


def test_symm_cuda_handle_triton_kernel():
    pytest.importorskip("triton")
    run_ranks(_triton, 2)
