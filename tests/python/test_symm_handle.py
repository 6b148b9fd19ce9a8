"""crossbar.symm.rendezvous on 2 and 3 spawned ranks (CPU tensors): raw writes through every
rank's pointer (ctypes) land in that rank's copy, for a whole tensor and for a view at a storage
offset; the pointer tables behind buffer_ptrs_dev / signal_pad_ptrs_dev hold the same addresses;
get_buffer aliases peers' copies (other dtypes, offsets, range and alignment errors); raw stores
into the documented signal pad slot are what wait_signal consumes, and crossbar's signal lands
in that slot; get_signal_pad shows the same counters and a write through it is a signal; the handle's barrier and signals; errors for non-symmetric tensors, wrong groups,
out-of-range ranks and channels; ranks on another (virtual) node are not mapped."""

import ctypes

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks

WAIT_S = 60  # bound of every wait (a missing signal fails the test, never hangs it)


def expected(rank: int, shape) -> torch.Tensor:
    return (torch.arange(torch.Size(shape).numel(), dtype=torch.float32) + 1000 * rank).view(shape)


def _f32(addr: int) -> ctypes.c_float:
    return ctypes.c_float.from_address(addr)


def _u64(addr: int) -> ctypes.c_uint64:
    return ctypes.c_uint64.from_address(addr)


def _handle(rank, world):
    import crossbar
    import crossbar.symm as symm

    t = symm.empty((4, 6), dtype=torch.float32)
    h = symm.rendezvous(t)
    assert (h.rank, h.world_size, h.offset, h.buffer_size) == (rank, world, 0, 4 * 6 * 4)
    assert h.device == torch.device("cpu") and h.signal_slot_bytes == 16
    assert h.channels == crossbar._C._symm.channels(t)
    assert h.signal_pad_size == h.channels * world * 16
    assert len(h.buffer_ptrs) == world and len(h.signal_pad_ptrs) == world
    assert h.buffer_ptrs[rank] == t.data_ptr()
    for p in range(world):
        assert h.buffer_ptrs[p] == symm.peer(t, p).data_ptr(), f"rank {rank}: pointer of rank {p}"
    assert len(set(h.buffer_ptrs)) == world and len(set(h.signal_pad_ptrs)) == world
    # The tables: int64 CPU tensors whose addresses are buffer_ptrs_dev / signal_pad_ptrs_dev.
    for ptrs, table, dev in (
        (h.buffer_ptrs, h.buffer_ptrs_tensor, h.buffer_ptrs_dev),
        (h.signal_pad_ptrs, h.signal_pad_ptrs_tensor, h.signal_pad_ptrs_dev),
    ):
        assert table.dtype == torch.int64 and table.device.type == "cpu" and table.data_ptr() == dev
        assert list((ctypes.c_int64 * world).from_address(dev)) == ptrs
    # Built once per allocation and offset: another handle of t (or of a peer view) reuses them.
    again = symm.rendezvous(symm.peer(t, (rank + 1) % world))
    assert again.buffer_ptrs == h.buffer_ptrs and again.rank == rank
    assert (again.buffer_ptrs_dev, again.signal_pad_ptrs_dev) == (h.buffer_ptrs_dev, h.signal_pad_ptrs_dev)

    # Raw writes: rank r stores into element [0, r] of every rank's copy through buffer_ptrs.
    t.copy_(expected(rank, (4, 6)))
    symm.barrier()
    for p in range(world):
        _f32(h.buffer_ptrs[p] + 4 * rank).value = 100.0 * rank + p
    symm.barrier()
    want = expected(rank, (4, 6))
    for r in range(world):
        want[0, r] = 100.0 * r + rank
    assert torch.equal(t, want), f"rank {rank}: {t[0]}"

    # A view at a storage offset: its handle points at the same element of every copy.
    v = t[2, 1:]
    hv = symm.rendezvous(v)
    assert hv.offset == (2 * 6 + 1) * 4 and hv.buffer_size == (24 - 13) * 4
    assert hv.buffer_ptrs[rank] == v.data_ptr()
    assert hv.buffer_ptrs == [p + hv.offset for p in h.buffer_ptrs]
    assert hv.signal_pad_ptrs == h.signal_pad_ptrs  # the pads are the allocation's
    assert list((ctypes.c_int64 * world).from_address(hv.buffer_ptrs_dev)) == hv.buffer_ptrs
    symm.barrier()
    for p in range(world):
        _f32(hv.buffer_ptrs[p] + 4 * rank).value = -1.0 - rank  # element [2, 1 + rank] of rank p
    symm.barrier()
    for r in range(world):
        want[2, 1 + r] = -1.0 - r
    assert torch.equal(t, want), f"rank {rank}: {t[2]}"

    # get_buffer: views of peers' copies, relative to buffer_ptrs[p], in any dtype.
    for p in range(world):
        want_p = expected(p, (4, 6))
        want_p[0, :world] = torch.tensor([100.0 * r + p for r in range(world)])
        want_p[2, 1 : 1 + world] = torch.tensor([-1.0 - r for r in range(world)])
        row = h.get_buffer(p, (6,), torch.float32, storage_offset=6)
        assert row.data_ptr() == h.buffer_ptrs[p] + 24 and row.shape == (6,)
        assert torch.equal(row, want_p[1])
        assert torch.equal(h.get_buffer(p, (4, 6), torch.int32), want_p.view(torch.int32))
        assert torch.equal(hv.get_buffer(p, 3, torch.float32, storage_offset=2), want_p[2, 3:6])
        # It is a symmetric tensor like the others: peer() of it moves to another copy.
        assert symm.is_symmetric(row) and symm.peer(row, rank).data_ptr() == t.data_ptr() + 24
    symm.barrier()
    h.get_buffer((rank + 1) % world, (2,), torch.float32, storage_offset=22).fill_(7.0 + rank)  # last two
    symm.barrier()
    assert t[3, 4:].tolist() == [7.0 + (rank - 1) % world] * 2
    with pytest.raises(crossbar.InvalidArgument, match="need bytes \\[0, 100\\) of the allocation, which has 96"):
        h.get_buffer(0, 25, torch.float32)
    with pytest.raises(crossbar.InvalidArgument, match="byte 52 of the allocation .* not aligned"):
        hv.get_buffer(0, 1, torch.float64)
    with pytest.raises(crossbar.InvalidArgument, match=f"peer {world} is not a rank"):
        h.get_buffer(world, 1, torch.float32)

    # Signal pads: slot (channel c, sender s) of rank p's pad is the counter at
    # signal_pad_ptrs[p] + (c * world + s) * 16. Raw stores on channel 1 are what wait_signal takes.
    for p in range(world):
        for c in (0, 1, h.channels - 1):
            assert h.signal_slot_ptr(p, rank, c) == h.signal_pad_ptrs[p] + (c * world + rank) * 16
    symm.barrier()
    for step in range(3):
        for p in range(world):
            if p == rank:
                continue
            _f32(h.buffer_ptrs[p] + 4 * (18 + rank)).value = 50.0 * step + rank  # row 3 of rank p
            slot = _u64(h.signal_slot_ptr(p, rank, 1))
            slot.value = slot.value + 1  # the next signal (x86: stores stay in order)
        for s in range(world):
            if s == rank:
                continue
            symm.wait_signal(t, s, channel=1, timeout=WAIT_S)
            assert t[3, s].item() == 50.0 * step + s, f"rank {rank} step {step}: data of rank {s}"
        symm.barrier()  # nobody overwrites row 3 before everyone has read it
    # And crossbar's signal on channel 2 lands in the same slot of the receiver's pad.
    for p in range(world):
        if p != rank:
            symm.signal(t, p, channel=2)
    symm.barrier()
    for s in range(world):
        got = _u64(h.signal_slot_ptr(rank, s, 2)).value
        assert got == (0 if s == rank else 1), f"rank {rank}: counter of sender {s} on channel 2 is {got}"

    # The handle's own barrier and signals (channels 3 and 4 of this buffer).
    h.barrier(channel=3, timeout=WAIT_S)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    h.put_signal(nxt, channel=4)
    h.wait_signal(prv, channel=4, timeout=WAIT_S)
    with pytest.raises(crossbar.TimeoutError, match="channel 5"):
        h.wait_signal(prv, channel=5, timeout=0.2)

    # get_signal_pad: the same counters as a tensor ([c, s, 0]: sender s's counter of channel c).
    pad = h.get_signal_pad(rank, (h.channels, world, 2), torch.int64)
    assert pad.data_ptr() == h.signal_pad_ptrs[rank] and not symm.is_symmetric(pad)
    assert pad[1, :, 0].tolist() == [0 if s == rank else 3 for s in range(world)]  # the raw rounds
    assert pad[2, :, 0].tolist() == [0 if s == rank else 1 for s in range(world)]
    assert h.get_signal_pad(rank).numel() == h.signal_pad_size // 8
    h.get_signal_pad(nxt, (h.channels, world, 2), torch.int64)[6, rank, 0] += 1  # a signal to nxt
    h.wait_signal(prv, channel=6, timeout=WAIT_S)
    with pytest.raises(crossbar.InvalidArgument, match=f"of the pad, which has {h.signal_pad_size} bytes"):
        h.get_signal_pad(rank, h.signal_pad_size // 8 + 1)
    with pytest.raises(crossbar.InvalidArgument, match="not a symmetric tensor"):
        symm.peer(pad, rank)

    # Errors.
    with pytest.raises(crossbar.InvalidArgument, match="not a symmetric tensor"):
        symm.rendezvous(torch.zeros(3))
    with pytest.raises(crossbar.InvalidArgument, match="host memory; the SymmDeviceHandle is for CUDA"):
        h.device_handle()
    with pytest.raises(crossbar.InvalidArgument, match=f"channel {h.channels} is out of range"):
        h.barrier(channel=h.channels)
    with pytest.raises(crossbar.InvalidArgument, match="channel -1 is out of range"):
        h.signal_slot_ptr(0, 0, -1)
    assert symm.rendezvous(t, group=dist.group.WORLD).buffer_ptrs == h.buffer_ptrs
    other_group = dist.new_group(list(range(world)))
    with pytest.raises(crossbar.InvalidArgument, match="allocated on another group"):
        symm.rendezvous(t, group=other_group)
    symm.barrier()


@pytest.mark.parametrize("world", [2, 3])
def test_symm_handle_pointers_pads_get_buffer(world):
    run_ranks(_handle, world)


def _virtual_nodes(rank, world):
    import crossbar
    import crossbar.symm as symm

    # One rank per virtual node: the other rank's copy is not mapped here.
    g = dist.new_group([0, 1], pg_options=crossbar.Options(ranks_per_node=1, name="symm-handle-virtual"))
    t = symm.empty(8, group=g)
    h = symm.rendezvous(t, group=g)
    assert h.buffer_ptrs[rank] == t.data_ptr() and h.buffer_ptrs[1 - rank] == 0
    assert h.signal_pad_ptrs[1 - rank] == 0 and h.signal_pad_ptrs[rank] != 0
    with pytest.raises(crossbar.InvalidArgument, match=f"rank {1 - rank} \\(host .*\\) is on another node"):
        h.get_buffer(1 - rank, 8, torch.float32)
    with pytest.raises(crossbar.InvalidArgument, match=f"rank {1 - rank} is on another node"):
        h.signal_slot_ptr(1 - rank, rank, 0)
    h.barrier(timeout=WAIT_S)  # signals still reach the other node (UCX)


def test_symm_handle_off_node_ranks_are_not_mapped():
    run_ranks(_virtual_nodes, 2)


def _triton_interpreted(rank, world):
    import crossbar.symm as symm

    from symm_triton import put_kernel, signal_kernel  # interpreted: TRITON_INTERPRET=1 (set by the test)

    t = symm.empty(8, dtype=torch.float32)
    h = symm.rendezvous(t)
    symm.barrier()
    put_kernel[(world,)](h.buffer_ptrs_dev, rank, 100.0 * rank)
    symm.barrier()
    assert t[:world].tolist() == [100.0 * r + rank for r in range(world)], f"rank {rank}: {t}"
    # A kernel's signal (an atomic add on the slot) is what wait_signal consumes.
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    signal_kernel[(1,)](h.signal_slot_ptr(nxt, rank, 1))
    symm.wait_signal(t, prv, channel=1, timeout=WAIT_S)
    symm.barrier()


def test_symm_handle_triton_kernel_interpreted(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks import symm_triton interpreted
    run_ranks(_triton_interpreted, 2)
