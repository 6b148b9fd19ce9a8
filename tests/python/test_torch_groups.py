"""Groups on crossbar: new_group as a split of the default group, monitored_barrier, a
group's Options / set_timeout / get_error / abort / shutdown, and bitwise reductions
(BAND/BOR/BXOR)."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks

CPU = torch.device("cpu")
ErrorType = torch._C._distributed_c10d.ErrorType  # what Backend.get_error() returns


def _comm_name(group):
    # describe(): "<communicator name>: rank r/n, ..."; a split is named "<parent>.<seq>".
    d = group._get_backend(CPU).describe()
    return d[: d.index(": rank ")]


def _new_group_split(rank, world):
    import crossbar

    assert dist.group.WORLD.bound_device_id == torch.device("cpu", 0)
    parent = _comm_name(dist.group.WORLD)
    # Unsorted ranks: torch sorts them, the group rank is the position in the sorted list.
    even = dist.new_group([2, 0])
    odd = dist.new_group([3, 1])
    mine = even if rank % 2 == 0 else odd
    other = odd if rank % 2 == 0 else even
    assert other is dist.GroupMember.NON_GROUP_MEMBER
    assert dist.get_rank(mine) == rank // 2 and dist.get_world_size(mine) == 2
    backend = mine._get_backend(CPU)
    assert isinstance(backend, crossbar.ProcessGroupCrossbar)
    # A split of the default group's communicator (its transports), not a fresh one.
    assert _comm_name(mine).startswith(parent + "."), (_comm_name(mine), parent)
    t = torch.full((5,), float(rank))
    dist.all_reduce(t, group=mine)
    assert torch.equal(t, torch.full((5,), float(2 * (rank % 2) + 2)))
    # Point to point and a collective on the new group, in group ranks.
    if dist.get_rank(mine) == 0:
        dist.send(torch.full((2,), float(rank)), group_dst=1, group=mine)
    else:
        r = torch.zeros(2)
        dist.recv(r, group_src=0, group=mine)
        assert torch.equal(r, torch.full((2,), float(rank - 2)))
    # A group of one rank and a group of everyone, then the default group again.
    solo = dist.new_group([3])
    if rank == 3:
        t = torch.ones(1)
        dist.all_reduce(t, group=solo)
        assert t.item() == 1.0
    everyone = dist.new_group(list(range(world)))
    t = torch.ones(3)
    dist.all_reduce(t, group=everyone)
    assert torch.equal(t, torch.full((3,), float(world)))
    assert _comm_name(everyone).startswith(parent + ".")
    # use_local_synchronization: only members call in: a members-only split.
    local = dist.new_group([1, 2], use_local_synchronization=True)
    if rank in (1, 2):
        assert _comm_name(local) == parent + ".[1,2]", _comm_name(local)
        t = torch.full((1,), float(rank))
        dist.all_reduce(t, group=local)
        assert t.item() == 3.0
    else:
        assert local is dist.GroupMember.NON_GROUP_MEMBER
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), float(world)))


def test_new_group_splits_bound_default_group():
    run_ranks(_new_group_split, 4, device_id=torch.device("cpu", 0))


def _members_only_without_binding(rank, world):
    # Without a bound device torch offers no split and calls members only: a members-only
    # split of the default group's communicator (test_torch_local_groups.py has more).
    parent = _comm_name(dist.group.WORLD)
    g = dist.new_group([0, 1])
    assert _comm_name(g) == parent + ".[0,1]", _comm_name(g)
    t = torch.ones(1)
    dist.all_reduce(t, group=g)
    assert t.item() == 2.0


def test_new_group_members_only_without_bound_device():
    run_ranks(_members_only_without_binding, 2)


def _monitored(rank, world):
    import crossbar

    short = datetime.timedelta(seconds=5)
    # Everybody arrives: passes on every rank, on the default group and a subgroup.
    dist.monitored_barrier()
    dist.monitored_barrier(timeout=short, wait_all_ranks=True)
    # Each failing case on its own group: a rank that never calls a group's monitored_barrier
    # is behind on its calls there (reported as InvalidUsage by the next one).
    fail_fast = dist.new_group(list(range(world)))
    fail_all = dist.new_group(list(range(world)))
    # Rank 1 does not arrive: rank 0 names it (it is first in rank order, however slow
    # the others are); the others are not acknowledged.
    if rank != 1:
        with pytest.raises(crossbar.TimeoutError) as e:
            dist.monitored_barrier(group=fail_fast, timeout=short)
        if rank == 0:
            assert "Rank 1 failed to pass monitoredBarrier" in str(e.value), str(e.value)
            assert e.value.peers == [1]
        else:
            assert "rank 0" in str(e.value) and "did not acknowledge" in str(e.value), str(e.value)
    # Ranks 2 and 3 do not arrive: with wait_all_ranks rank 0 names both.
    if rank < 2:
        with pytest.raises(crossbar.TimeoutError) as e:
            dist.monitored_barrier(group=fail_all, timeout=short, wait_all_ranks=True)
        if rank == 0:
            assert "failed to pass monitoredBarrier" in str(e.value), str(e.value)
            assert {2, 3} <= set(e.value.peers) and 0 not in e.value.peers, str(e.value)
    # The default group is unaffected.
    dist.monitored_barrier()
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == float(world)


def test_monitored_barrier_names_missing_ranks():
    run_ranks(_monitored, 4, device_id=torch.device("cpu", 0))


def _monitored_late(rank, world):
    import crossbar

    store = dist.distributed_c10d._get_default_store()
    long = datetime.timedelta(seconds=60)
    # Rank 1 is late: it arrives only after rank 0 gave up (the store says when), so the
    # outcome does not depend on timing.
    if rank == 1:
        store.wait(["rank0-gave-up"])
        with pytest.raises(crossbar.TimeoutError) as e:
            dist.monitored_barrier(timeout=long)
        # Told at once by rank 0's reply waiting for it (not after its own 60 s).
        assert "arrived at monitored_barrier call #0 after rank 0 ended it" in str(e.value), str(e.value)
        assert e.value.peers == [0]
    elif rank == 0:
        with pytest.raises(crossbar.TimeoutError) as e:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=2))
        assert "Rank 1 failed to pass monitoredBarrier" in str(e.value), str(e.value)
        assert e.value.peers == [1]
        store.set("rank0-gave-up", "1")
    else:  # on time: rank 0's "failed" reply ends its wait, naming the late rank
        with pytest.raises(crossbar.TimeoutError) as e:
            dist.monitored_barrier(timeout=long)
        assert "rank 0" in str(e.value) and "did not acknowledge" in str(e.value), str(e.value)
        assert "found rank 1 (host" in str(e.value), str(e.value)
        # gloo's sentence for this case, which torch's test_monitored_barrier_failure_order matches.
        gloo = (
            f"Rank {rank} successfully reached monitoredBarrier, but received errors while waiting for "
            "send/recv from rank 0"
        )
        assert gloo in str(e.value), str(e.value)
        assert e.value.peers == [1]
    # The same group: the late rank's stale report is dropped, the next barriers pass, and
    # collectives work.
    dist.monitored_barrier(timeout=long)
    dist.monitored_barrier(timeout=long, wait_all_ranks=True)
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(world * (world + 1) // 2)))
    dist.monitored_barrier(timeout=long)


@pytest.mark.parametrize("world", [2, 3])
def test_monitored_barrier_after_a_late_rank_same_group_works(world):
    run_ranks(_monitored_late, world)


def _monitored_zero_timeout(rank, world):
    import crossbar

    # torch's test_monitored_barrier_gloo_rank_0_timeout: timeout 0 is a zero timeout (it
    # was taken for "unset", the group's 5 s), and rank 0 names itself: it ran out of time
    # before it checked rank 1, which therefore is not blamed.
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=5))
    if rank == 0:
        with pytest.raises(crossbar.TimeoutError) as e:
            group.monitored_barrier(datetime.timedelta(seconds=0))
        assert "Rank 0 timed out in monitoredBarrier after 0 ms, before it checked rank 1" in str(e.value), str(
            e.value
        )
    dist.barrier()  # rank 1 never called it; both go on
    t = torch.ones(2)
    dist.all_reduce(t, group=group)
    assert torch.equal(t, torch.full((2,), float(world)))


def test_monitored_barrier_zero_timeout_rank0_times_out():
    run_ranks(_monitored_zero_timeout, 2)


def _lifecycle(rank, world):
    import crossbar

    # Options: the communicator's name and timeout come from pg_options.
    opts = crossbar.Options(name="short", timeout=datetime.timedelta(seconds=60))
    g = dist.new_group([0, 1], pg_options=opts)
    backend = g._get_backend(CPU)
    assert _comm_name(g) == "short"
    assert backend.get_error() == ErrorType.SUCCESS
    # set_timeout (the group's Backend::setTimeout): a receive nobody answers fails with
    # crossbar.TimeoutError after the new timeout (not the 60 s above).
    dist.set_timeout(datetime.timedelta(seconds=1), group=g)
    if rank == 0:
        with pytest.raises(crossbar.TimeoutError):
            dist.recv(torch.zeros(1), src=1, group=g)
        # The failure shows in get_error() (what torch's watchdogs poll).
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=30)
        while backend.get_error() == ErrorType.SUCCESS and datetime.datetime.now() < deadline:
            pass
        assert backend.get_error() == ErrorType.TIMEOUT
    dist.barrier()
    # abort(): every rank's group fails fast afterwards, with a typed error naming what to do.
    g.abort()  # ProcessGroup.abort: the group's backends' abort()
    with pytest.raises(crossbar.InvalidUsage, match="shut down or aborted"):
        dist.all_reduce(torch.ones(1), group=g)
    backend.shutdown()  # idempotent after abort
    # shutdown() of another group: collective, the group then refuses work.
    h = dist.new_group([0, 1])
    t = torch.ones(2)
    dist.all_reduce(t, group=h)
    assert torch.equal(t, torch.full((2,), 2.0))
    h._get_backend(CPU).shutdown()
    with pytest.raises(crossbar.InvalidUsage, match="shut down or aborted"):
        dist.broadcast(torch.ones(1), src=0, group=h)
    # The default group is unaffected.
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == float(world)


def test_options_timeout_error_abort_shutdown():
    run_ranks(_lifecycle, 2)


R = dist.ReduceOp
BIT_TYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
if hasattr(torch, "uint32"):
    BIT_TYPES += [torch.uint16, torch.uint32, torch.uint64]


def _values(rank, n, dtype, salt):
    g = torch.Generator().manual_seed(rank * 131 + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    hi = 128 if dtype in (torch.int8,) else 256
    return torch.randint(0, hi, (n,), generator=g).to(dtype)


def _fold(xs, op):
    # Reference in int64 (bool and every integer type fold exactly there).
    acc = xs[0].to(torch.int64)
    for x in xs[1:]:
        x = x.to(torch.int64)
        acc = acc & x if op == R.BAND else acc | x if op == R.BOR else acc ^ x
    return acc.to(xs[0].dtype)


def _same(a, b):
    # Compared in int64: torch has few kernels for uint16/32/64.
    return a.dtype == b.dtype and torch.equal(a.to(torch.int64), b.to(torch.int64))


def _bitwise(rank, world):
    import crossbar

    n = 6
    for i, dtype in enumerate(BIT_TYPES):
        for j, op in enumerate((R.BAND, R.BOR, R.BXOR)):
            what = f"{dtype} {op}"
            salt = 10 * i + j + 100
            mine = _values(rank, n * world, dtype, salt)
            every = [_values(r, n * world, dtype, salt) for r in range(world)]
            ref = _fold(every, op)
            # all_reduce on a non-contiguous view (every other element of a larger tensor).
            base = torch.zeros(2 * n * world, dtype=dtype)
            view = base[::2]
            view.copy_(mine)
            dist.all_reduce(view, op=op)
            assert _same(view, ref), what
            assert _same(base[1::2], torch.zeros(n * world, dtype=dtype)), what
            # reduce to the last rank: others keep their input.
            t = mine.clone()
            dist.reduce(t, dst=world - 1, op=op)
            assert _same(t, ref if rank == world - 1 else mine), what
            # reduce_scatter (tensor and list forms): my chunk of the fold.
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, mine, op=op)
            assert _same(out, ref[rank * n : (rank + 1) * n]), what
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter(out, list(mine.chunk(world)), op=op)
            assert _same(out, ref[rank * n : (rank + 1) * n]), what
    # Coalesced: all_reduce_coalesced and the coalescing manager's reduce_scatter_tensor.
    a = _values(rank, 4, torch.int32, 1)
    b = _values(rank, 3, torch.int32, 2).flip(0)  # torch wants one dtype per coalesced call
    ra = _fold([_values(r, 4, torch.int32, 1) for r in range(world)], R.BXOR)
    rb = _fold([_values(r, 3, torch.int32, 2).flip(0) for r in range(world)], R.BXOR)
    dist.all_reduce_coalesced([a, b], op=R.BXOR)
    assert _same(a, ra) and _same(b, rb)
    ins = [_values(rank, 2 * world, torch.int64, s) for s in (3, 4)]
    refs = [_fold([_values(r, 2 * world, torch.int64, s) for r in range(world)], R.BOR) for s in (3, 4)]
    outs = [torch.empty(2, dtype=torch.int64) for _ in ins]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.reduce_scatter_tensor(o, i, op=R.BOR)
    cm.wait()
    for o, ref in zip(outs, refs):
        assert _same(o, ref[rank * 2 : rank * 2 + 2])
    # Async, through the future.
    t = _values(rank, 5, torch.int16, 9)
    w = dist.all_reduce(t, op=R.BAND, async_op=True)
    got = w.get_future().wait()[0]
    assert _same(got, _fold([_values(r, 5, torch.int16, 9) for r in range(world)], R.BAND))
    # Floating tensors are refused with a clear error, before anything is sent.
    with pytest.raises(crossbar.Unsupported, match="integer or bool"):
        dist.all_reduce(torch.ones(2), op=R.BOR)
    t = torch.ones(2)
    dist.all_reduce(t)
    assert _same(t, torch.full((2,), float(world)))


def _coalesced_forms(rank, world):
    # The coalesced forms the coalescing manager and the list APIs dispatch
    # (allgather_into_tensor_coalesced, reduce_scatter_tensor_coalesced,
    # allgather_coalesced, allreduce_coalesced), on non-contiguous inputs too.
    every = [[torch.arange(6, dtype=torch.float32).reshape(2, 3) * (r + 1) + k for k in range(2)] for r in range(world)]
    mine = [e.t().contiguous().t() if k == 1 else e for k, e in enumerate(every[rank])]  # second: transposed layout
    outs = [torch.empty(world * 2, 3) for _ in mine]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, mine):
            dist.all_gather_into_tensor(o, i)
    cm.wait()
    for k, o in enumerate(outs):
        assert torch.equal(o, torch.cat([every[r][k] for r in range(world)])), k
    big = [torch.arange(world * 4, dtype=torch.float64) * (rank + 1) + k for k in range(2)]
    rs = [torch.empty(4, dtype=torch.float64) for _ in big]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(rs, big):
            dist.reduce_scatter_tensor(o, i)
    cm.wait()
    scale = sum(r + 1 for r in range(world))
    for k, o in enumerate(rs):
        full = torch.arange(world * 4, dtype=torch.float64) * scale + k * world
        assert torch.equal(o, full[rank * 4 : rank * 4 + 4]), k
    lists = [[torch.empty(2, 3) for _ in mine] for _ in range(world)]
    dist.all_gather_coalesced(lists, mine)
    for r in range(world):
        for k in range(2):
            assert torch.equal(lists[r][k], every[r][k]), (r, k)
    ts = [e.clone() for e in mine]
    dist.all_reduce_coalesced(ts, op=R.MAX)
    for k, t in enumerate(ts):
        assert torch.equal(t, every[world - 1][k]), k


def _bitwise_and_coalesced(rank, world):
    _bitwise(rank, world)
    _coalesced_forms(rank, world)


def test_bitwise_reductions_and_coalesced_forms():
    run_ranks(_bitwise_and_coalesced, 3)


def _groups_from_threads(rank, world, port, result_dir):
    import threading
    import time

    import crossbar  # noqa: F401  (registers the backend)

    # A TCPStore (its client runs one request at a time): parked waits of one thread must
    # not hold up another thread's sets (the backend parks them on clones of the store).
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("cpu:crossbar", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        groups = [dist.new_group(list(range(world))) for _ in range(3)]
        errors = []
        n = 1 << 16  # 256 KiB per rank out: the hierarchical algorithm across the virtual nodes

        def drive(i, g):
            try:
                for step in range(3):
                    # Every group's first call splits its communicator (intra- and inter-node).
                    inp = torch.arange(world * n, dtype=torch.float32) + 100 * i + step + rank
                    out = torch.empty(n)
                    dist.reduce_scatter_tensor(out, inp, group=g)
                    base = torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32)
                    want = world * (base + 100 * i + step) + sum(range(world))
                    assert torch.equal(out, want), (i, step)
            except Exception as e:  # reported by the main thread
                errors.append(f"group {i}: {e!r}")

        t0 = time.monotonic()
        threads = [threading.Thread(target=drive, args=(i, g)) for i, g in enumerate(groups)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
            f.write(f"{time.monotonic() - t0:.3f}")
    finally:
        dist.destroy_process_group()


def test_groups_driven_from_threads_at_once_over_a_tcp_store(monkeypatch, tmp_path):
    import socket

    import torch.multiprocessing as mp

    monkeypatch.setenv("CROSSBAR_RANKS_PER_NODE", "2")  # two virtual nodes of two ranks
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_groups_from_threads, args=(4, port, str(tmp_path)), nprocs=4, join=True)
    took = max(float((tmp_path / f"rank{r}").read_text()) for r in range(4))
    print(f"3 groups x 3 reduce_scatters from 3 threads on 4 ranks: {took:.2f} s")
