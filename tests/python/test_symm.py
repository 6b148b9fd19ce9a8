"""crossbar.symm on 2 and 3 spawned ranks: symmetric CPU tensors (zero-filled), peer views
(whole tensors and views into the allocation), signal/wait ping-pong, the heap barrier,
all_gather_into_tensor reading a symmetric input in place, wait timeouts, and typed errors."""

import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks


def expected(rank: int, shape) -> torch.Tensor:
    return (torch.arange(torch.Size(shape).numel(), dtype=torch.float32) + 1000 * rank).view(shape)


def _views_signals_collectives(rank, world):
    import crossbar
    import crossbar.symm as symm

    t = symm.empty((3, 5), dtype=torch.float32)
    assert t.shape == (3, 5) and t.dtype == torch.float32 and t.device.type == "cpu"
    assert symm.is_symmetric(t) and not symm.is_symmetric(torch.zeros(3))
    assert torch.count_nonzero(t).item() == 0  # zero-filled
    t.copy_(expected(rank, (3, 5)))
    symm.barrier()
    for r in range(world):
        v = symm.peer(t, r)
        assert v.shape == t.shape and v.stride() == t.stride()
        assert torch.equal(v, expected(r, (3, 5))), f"rank {rank}: view of rank {r}"
        # A view into the allocation maps to the same elements of the peer's copy.
        assert torch.equal(symm.peer(t[1:, 2:], r), expected(r, (3, 5))[1:, 2:])
        assert torch.equal(symm.peer(t.t(), r), expected(r, (3, 5)).t())
    assert symm.peer(t, rank).data_ptr() == t.data_ptr()
    symm.barrier()  # nobody writes below before everyone has read above

    # Ping-pong between ranks 0 and 1: write into the peer's copy, then signal it.
    for i in range(5):
        if rank == 0:
            symm.peer(t, 1)[0, 0] = 10.0 * i
            symm.signal(t, 1)
            symm.wait_signal(t, 1)
            assert t[0, 0].item() == 10.0 * i + 1, f"round {i}"
        elif rank == 1:
            symm.wait_signal(t, 0)
            assert t[0, 0].item() == 10.0 * i, f"round {i}"
            symm.peer(t, 0)[0, 0] = 10.0 * i + 1
            symm.signal(t, 0)
    symm.barrier()

    # all_gather_into_tensor with a symmetric input: right results, and peers read it in place
    # (64 KiB: above CROSSBAR_EAGER_BYTES, whose eager path has no staging to skip).
    n = 16384
    x = symm.empty(n, dtype=torch.float32)
    x.copy_(torch.arange(n, dtype=torch.float32) + 10 * rank)
    out = torch.empty(n * world)
    before = crossbar._C._symm.direct_reads()
    dist.all_gather_into_tensor(out, x)
    want = torch.cat([torch.arange(n, dtype=torch.float32) + 10 * r for r in range(world)])
    assert torch.equal(out, want)
    assert crossbar._C._symm.direct_reads() > before, "the symmetric input was staged, not read in place"
    # all_to_all_single (equal splits) too: block r of rank s's input lands as block s on rank r.
    blk = 4096
    a = symm.empty(blk * world, dtype=torch.float32)
    a.copy_(torch.arange(blk * world, dtype=torch.float32) + 100000 * rank)
    got = torch.empty(blk * world)
    before = crossbar._C._symm.direct_reads()
    dist.all_to_all_single(got, a)
    want = torch.cat([torch.arange(rank * blk, (rank + 1) * blk, dtype=torch.float32) + 100000 * s
                      for s in range(world)])
    assert torch.equal(got, want)
    assert crossbar._C._symm.direct_reads() > before, "all_to_all_single staged the symmetric input"

    # Nobody signals on channel 2: the wait ends with crossbar's TimeoutError, naming the peer.
    start = time.monotonic()
    with pytest.raises(crossbar.TimeoutError) as e:
        symm.wait_signal(t, (rank + 1) % world, channel=2, timeout=0.2)
    assert time.monotonic() - start < 30
    assert f"rank {(rank + 1) % world}" in str(e.value) and "channel 2" in str(e.value)

    # Typed errors.
    with pytest.raises(crossbar.InvalidArgument, match="not a symmetric tensor"):
        symm.peer(torch.zeros(3), 0)
    with pytest.raises(crossbar.InvalidArgument, match=f"peer {world} is not a rank"):
        symm.peer(t, world)
    with pytest.raises(crossbar.Unsupported, match="CPU or CUDA"):
        symm.empty(4, device="meta")
    if not symm.cuda_available():  # no GPU here, or a build without CUDA symmetric tensors
        with pytest.raises(crossbar.Unsupported, match="allocate on the CPU"):
            symm.empty(4, device="cuda")
        with pytest.raises(crossbar.Unsupported, match="allocate on the CPU"):
            symm.barrier(device="cuda")
    symm.barrier()


@pytest.mark.parametrize("world", [2, 3])
def test_symm_views_signals_collectives(world):
    run_ranks(_views_signals_collectives, world)


def _shape_text(shape) -> str:  # as Python prints a tuple
    return str(tuple(shape))


def _mismatch(rank, world):
    import crossbar
    import crossbar.symm as symm

    ok = symm.empty((2, 2), dtype=torch.int64)  # agreeing allocations work before and after
    assert ok.dtype == torch.int64
    other = 1 if rank == 0 else 0  # the first rank that asks for something else
    # Rank 0 against all others: different byte sizes, then the same byte size with another
    # dtype, then another shape. Every rank raises InvalidUsage naming a rank that differs from
    # it and both requests.
    cases = [
        ((4, 8), torch.float32, (4, 8), torch.float64),
        ((4,), torch.float32, (4,), torch.int32),
        ((2, 8), torch.float32, (4, 4), torch.float32),
    ]
    for shape0, dtype0, shape1, dtype1 in cases:
        mine, theirs = ((shape0, dtype0), (shape1, dtype1)) if rank == 0 else ((shape1, dtype1), (shape0, dtype0))
        with pytest.raises(crossbar.InvalidUsage) as e:
            symm.empty(mine[0], dtype=mine[1])
        msg = str(e.value)
        assert f"rank {other} (host " in msg, msg
        assert f"asked for shape={_shape_text(theirs[0])}, dtype={theirs[1]}" in msg, msg
        assert f"this rank for shape={_shape_text(mine[0])}, dtype={mine[1]}" in msg, msg
        assert "same shape and dtype" in msg, msg
    # The group's heap is still in step: an agreeing allocation works and is symmetric.
    t = symm.empty(4, dtype=torch.int32)
    t.fill_(rank + 1)
    symm.barrier()
    for r in range(world):
        assert torch.equal(symm.peer(t, r), torch.full((4,), r + 1, dtype=torch.int32))
    symm.barrier()


@pytest.mark.parametrize("world", [2, 3])
def test_symm_mismatch_is_invalid_usage_on_every_rank(world):
    run_ranks(_mismatch, world)


def _virtual_nodes(rank, world):
    import crossbar
    import crossbar.symm as symm

    # Two virtual nodes of one rank (a communicator with a topology of its own): no peer views,
    # but signals and the barrier still work (UCX to the other "node").
    g = dist.new_group([0, 1], pg_options=crossbar.Options(ranks_per_node=1, name="symm-virtual"))
    t = symm.empty(8, group=g)
    with pytest.raises(crossbar.InvalidArgument, match=f"rank {1 - rank} \\(host .*\\) is on another node"):
        symm.peer(t, 1 - rank)
    assert torch.equal(symm.peer(t, rank), t)
    symm.signal(t, 1 - rank)
    symm.wait_signal(t, 1 - rank, timeout=60)
    symm.barrier(g)


def test_symm_off_node_peer_is_invalid_argument():
    run_ranks(_virtual_nodes, 2)
