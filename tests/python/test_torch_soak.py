"""Random asynchronous torch.distributed calls on the crossbar backend, completed in
random orders and ways per rank, every result checked against a closed form.

Every rank draws the same calls from a shared seed (collective, dtype, size, op, root,
contiguous or strided tensors, sometimes a ring of batch_isend_irecv) and issues 1-6 of
them before completing them. How it completes them is its own choice (its own seed):
in issue order, reversed or shuffled; each by wait(), by polling is_completed() alone
(the backend's completion thread must finish it), through get_future().wait(), through a
then() callback, or by short wait(timeout) calls until one succeeds. Inputs are small
integers, so every sum, min and max is exact in every dtype and reduction order.

2 and 3 ranks on one node, 4 ranks on two virtual nodes. SOAK_OPS sets the calls per rank
(default 120); SOAK_SEED the shared seed.
"""

import datetime
import os
import random
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks

_OPS = int(os.environ.get("SOAK_OPS", "120"))
_SEED = int(os.environ.get("SOAK_SEED", "19"))
_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.int8,
           torch.uint8]
_OPS_BY_NAME = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# A call polled with is_completed() alone must finish within this (the completion thread
# takes over calls nobody waits for within about a millisecond).
_STALL_S = 60


def _values(seed, rank, n, dtype):
    """Rank `rank`'s input: n small integers (0..2 for unsigned, -2..2 otherwise)."""
    g = torch.Generator().manual_seed(seed * 1000003 + rank)
    lo = 0 if dtype == torch.uint8 else -2
    return torch.randint(lo, 3, (n,), generator=g, dtype=torch.int64).to(dtype)


def _reduce(tensors, op):
    acc = tensors[0].to(torch.float64)
    for t in tensors[1:]:
        t = t.to(torch.float64)
        acc = acc + t if op == "sum" else torch.maximum(acc, t) if op == "max" else torch.minimum(acc, t)
    return acc


def _tensor(values, strided):
    """`values` as a fresh tensor, contiguous or a strided view (every other element)."""
    if not strided:
        return values.clone()
    base = torch.full((2 * values.numel(),), 7, dtype=values.dtype)
    view = base[::2]
    view.copy_(values)
    return view


class _Call:
    """One issued call: its work, the check of its result, and its description."""

    def __init__(self, desc, work, check):
        self.desc, self.work, self.check = desc, work, check


def _issue(shared, rank, world, n):
    seed = shared.randrange(1 << 30)
    kind = shared.choice(["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                          "all_to_all_single", "broadcast", "reduce", "gather", "scatter", "barrier", "ring"])
    dtype = shared.choice(_DTYPES)
    op = shared.choice(list(_OPS_BY_NAME))
    count = shared.choice([0, 1, 3, 17, 100, 1000, 4099, 20000])
    root = shared.randrange(world)
    strided = shared.random() < 0.3
    desc = f"#{n} {kind} {count} x {dtype} {op} root {root}{' strided' if strided else ''} ({world} ranks)"
    mine = _values(seed, rank, count, dtype)
    inputs = [_values(seed, r, count, dtype) for r in range(world)]

    def expect_equal(got, want, what=""):
        assert torch.equal(got.to(torch.float64), want.to(torch.float64)), f"{desc}{what}: {got} != {want}"

    if kind == "all_reduce":
        t = _tensor(mine, strided)
        work = dist.all_reduce(t, op=_OPS_BY_NAME[op], async_op=True)
        return _Call(desc, work, lambda: expect_equal(t, _reduce(inputs, op)))
    if kind == "all_gather":
        outs = [_tensor(torch.zeros(count, dtype=dtype), strided) for _ in range(world)]
        work = dist.all_gather(outs, _tensor(mine, strided), async_op=True)
        return _Call(desc, work, lambda: [expect_equal(outs[r], inputs[r], f" block {r}") for r in range(world)])
    if kind == "all_gather_into_tensor":
        out = torch.zeros(count * world, dtype=dtype)
        work = dist.all_gather_into_tensor(out, mine.clone(), async_op=True)
        return _Call(desc, work, lambda: expect_equal(out, torch.cat(inputs)))
    if kind == "reduce_scatter_tensor":
        full = [_values(seed, r, count * world, dtype) for r in range(world)]
        out = torch.zeros(count, dtype=dtype)
        work = dist.reduce_scatter_tensor(out, full[rank].clone(), op=_OPS_BY_NAME[op], async_op=True)
        want = _reduce(full, op)[rank * count:(rank + 1) * count]
        return _Call(desc, work, lambda: expect_equal(out, want))
    if kind == "all_to_all_single":
        # Rank s sends (count + s + d) % 4 elements to rank d: uneven splits, some empty.
        def split(s, d):
            return (count + s + d) % 4 if count else 0
        send_splits = [split(rank, d) for d in range(world)]
        recv_splits = [split(s, rank) for s in range(world)]
        src = _values(seed, rank, sum(send_splits), dtype)
        out = torch.zeros(sum(recv_splits), dtype=dtype)
        work = dist.all_to_all_single(out, src, recv_splits, send_splits, async_op=True)

        def check():
            at = 0
            for s in range(world):
                theirs = _values(seed, s, sum(split(s, d) for d in range(world)), dtype)
                off = sum(split(s, d) for d in range(rank))
                expect_equal(out[at:at + recv_splits[s]], theirs[off:off + recv_splits[s]], f" from {s}")
                at += recv_splits[s]
        return _Call(desc, work, check)
    if kind == "broadcast":
        t = _tensor(mine if rank == root else torch.zeros(count, dtype=dtype), strided)
        work = dist.broadcast(t, src=root, async_op=True)
        return _Call(desc, work, lambda: expect_equal(t, inputs[root]))
    if kind == "reduce":
        t = _tensor(mine, strided)
        work = dist.reduce(t, dst=root, op=_OPS_BY_NAME[op], async_op=True)
        return _Call(desc, work, lambda: expect_equal(t, _reduce(inputs, op)) if rank == root else None)
    if kind == "gather":
        outs = [torch.zeros(count, dtype=dtype) for _ in range(world)] if rank == root else None
        work = dist.gather(mine.clone(), outs, dst=root, async_op=True)
        return _Call(desc, work,
                     lambda: [expect_equal(outs[r], inputs[r], f" block {r}") for r in range(world)]
                     if rank == root else None)
    if kind == "scatter":
        ins = [_values(seed, 100 + r, count, dtype) for r in range(world)] if rank == root else None
        out = torch.zeros(count, dtype=dtype)
        work = dist.scatter(out, ins, src=root, async_op=True)
        return _Call(desc, work, lambda: expect_equal(out, _values(seed, 100 + rank, count, dtype)))
    if kind == "barrier":
        return _Call(desc, dist.barrier(async_op=True), lambda: None)
    # ring: send to the next rank, receive from the previous one, as one batch
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    got = torch.zeros(count, dtype=dtype)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine.clone(), nxt),
                                    dist.P2POp(dist.irecv, got, prev)])

    class _All:  # the batch's works as one
        def wait(self, timeout=None):
            for w in works:
                w.wait() if timeout is None else w.wait(timeout=timeout)
            return True

        def is_completed(self):
            return all(w.is_completed() for w in works)

        def get_future(self):
            return torch.futures.collect_all([w.get_future() for w in works])

    return _Call(desc, _All(), lambda: expect_equal(got, inputs[prev]))


def _complete(call, how, own):
    if how == "wait":
        call.work.wait()
    elif how == "poll is_completed":
        until = time.monotonic() + _STALL_S
        while not call.work.is_completed():
            assert time.monotonic() < until, f"{call.desc}: not completed {_STALL_S} s after its issue " \
                                             "while polled with is_completed() (a call nobody waits for)"
            time.sleep(0.0001)
        call.work.wait()  # raises its error, if any
    elif how == "future":
        call.work.get_future().wait()
    elif how == "then":
        ran = []
        call.work.get_future().then(lambda f: ran.append(f.value())).wait()
        assert ran, f"{call.desc}: the then() callback did not run"
    else:  # short waits with a timeout until one succeeds
        until = time.monotonic() + _STALL_S
        while True:
            try:
                call.work.wait(timeout=datetime.timedelta(milliseconds=own.choice([1, 5])))
                break
            except Exception:  # noqa: BLE001  (the wait's timeout)
                assert time.monotonic() < until, f"{call.desc}: short waits never succeeded"
    call.check()


def _soak(rank, world):
    shared = random.Random(_SEED * 31 + world)
    own = random.Random(_SEED * 1009 + rank)
    depth = own.randint(1, 6)
    pending = []
    ways = ["wait", "poll is_completed", "future", "then", "short waits"]

    def complete_all():
        order = list(range(len(pending)))
        style = own.randrange(3)
        if style == 1:
            order.reverse()
        elif style == 2:
            own.shuffle(order)
        for i in order:
            _complete(pending[i], own.choice(ways), own)
        pending.clear()

    for n in range(_OPS):
        pending.append(_issue(shared, rank, world, n))
        if len(pending) >= depth:
            complete_all()
    complete_all()
    print(f"rank {rank}: {_OPS} calls checked (issued {depth} at a time)")


@pytest.mark.parametrize("world,ranks_per_node", [(2, 0), (3, 0), (4, 2)])
def test_random_async_calls_completed_in_random_ways(world, ranks_per_node, monkeypatch):
    if ranks_per_node:  # virtual nodes: UCX between them, hierarchical algorithms
        monkeypatch.setenv("CROSSBAR_RANKS_PER_NODE", str(ranks_per_node))
    run_ranks(_soak, world)
