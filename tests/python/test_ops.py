"""Every torch.distributed op on crossbar against gloo's result, for every dtype crossbar
supports, in the same processes (crossbar is the default group, gloo a second group).

Types gloo lacks (float8, uint32/uint64) and ops it lacks (AVG, PREMUL_SUM) are checked
against gloo run on a wider type; bool reductions against uint8 max/min. Values are
small integers, so every reduction is exact in every type and order.
"""

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks

R = dist.ReduceOp

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
]
if hasattr(torch, "uint32"):
    DTYPES += [torch.uint32, torch.uint64]

FLOATS = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}
SIGNED = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int32, torch.int64}


def wide(dtype):
    """The type gloo computes the reference in."""
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.float32
    if dtype in (getattr(torch, "uint32", None), getattr(torch, "uint64", None)):
        return torch.int64
    if dtype == torch.bool:
        return torch.uint8
    return dtype


def make(shape, dtype, rank, salt, op=None):
    g = torch.Generator().manual_seed(rank * 7919 + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    lo, hi = (-2, 3) if dtype in SIGNED else (0, 3)
    if op == R.PRODUCT:
        lo, hi = 1, 3
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def check(got, ref, what):
    assert got.dtype == ref.dtype, what
    if got.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        got, ref = got.float(), ref.float()
    if got.dtype == getattr(torch, "uint32", None) or got.dtype == getattr(torch, "uint64", None):
        got, ref = got.to(torch.int64), ref.to(torch.int64)
    if got.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        torch.testing.assert_close(got, ref, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, ref), f"{what}: crossbar {got} != reference {ref}"


def ref_reduce_op(dtype, op):
    """(op for the reference group, post-processing) with gloo's missing pieces emulated."""
    if dtype == torch.bool:
        return {R.SUM: R.MAX, R.MAX: R.MAX, R.MIN: R.MIN, R.PRODUCT: R.MIN}[op]
    return op


def ops_for(dtype):
    ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX]
    if dtype in FLOATS:
        ops += [R.AVG, "premul"]
    return ops


def gloo_allreduce(t, op, dtype, world, gloo):
    x = t.to(wide(dtype), copy=True)
    if op == R.AVG:
        dist.all_reduce(x, R.SUM, group=gloo)
        x = x / world
    elif op == "premul":
        x = x * 2.0
        dist.all_reduce(x, R.SUM, group=gloo)
    else:
        dist.all_reduce(x, ref_reduce_op(dtype, op), group=gloo)
    return x.to(dtype)


def xb_op(op):
    return dist._make_nccl_premul_sum(2.0) if op == "premul" else op


def battery(rank, world):
    gloo = dist.new_group(backend="gloo")
    W = world
    for di, dtype in enumerate(DTYPES):
        name = str(dtype)
        # all_reduce / reduce / reduce_scatter for every reduce op
        for oi, op in enumerate(ops_for(dtype)):
            salt = di * 100 + oi
            t = make((5, 3), dtype, rank, salt, op)
            ref = gloo_allreduce(t, op, dtype, W, gloo)
            x = t.clone()
            dist.all_reduce(x, xb_op(op))
            check(x, ref, f"all_reduce {name} {op}")
            # non-contiguous (transposed view)
            xt = t.clone().t()
            dist.all_reduce(xt, xb_op(op))
            check(xt, ref.t(), f"all_reduce non-contiguous {name} {op}")
            # reduce to the last rank
            x = t.clone()
            dist.reduce(x, dst=W - 1, op=xb_op(op))
            check(x, ref if rank == W - 1 else t, f"reduce {name} {op}")
            # reduce_scatter_tensor: rank r gets block r of the reduced (W*2, 3)
            big = make((W * 2, 3), dtype, rank, salt + 50, op)
            bref = gloo_allreduce(big, op, dtype, W, gloo)
            out = torch.empty((2, 3), dtype=dtype)
            dist.reduce_scatter_tensor(out, big.clone(), op=xb_op(op))
            check(out, bref[rank * 2 : rank * 2 + 2], f"reduce_scatter_tensor {name} {op}")
            outs = torch.empty((2, 3), dtype=dtype)
            dist.reduce_scatter(outs, list(big.clone().chunk(W)), op=xb_op(op))
            check(outs, bref[rank * 2 : rank * 2 + 2], f"reduce_scatter {name} {op}")

        # data movement (no arithmetic: dtypes gloo lacks are compared as they are)
        salt = di * 100 + 90
        t = make((4, 3), dtype, rank, salt)
        every = [make((4, 3), dtype, r, salt) for r in range(W)]  # each rank's input, known everywhere
        x = t.clone()
        dist.broadcast(x, src=1 % W)
        check(x, every[1 % W], f"broadcast {name}")
        xt = t.clone().t()
        dist.broadcast(xt, src=0)
        check(xt, every[0].t(), f"broadcast non-contiguous {name}")
        outs = [torch.empty((4, 3), dtype=dtype) for _ in range(W)]
        dist.all_gather(outs, t)
        for r in range(W):
            check(outs[r], every[r], f"all_gather {name} from {r}")
        big = torch.empty((W * 4, 3), dtype=dtype)
        dist.all_gather_into_tensor(big, t)
        check(big, torch.cat(every), f"all_gather_into_tensor {name}")
        gl = [torch.empty((4, 3), dtype=dtype) for _ in range(W)] if rank == 0 else None
        dist.gather(t, gl, dst=0)
        if rank == 0:
            for r in range(W):
                check(gl[r], every[r], f"gather {name} from {r}")
        out = torch.empty((4, 3), dtype=dtype)
        dist.scatter(out, [e.clone() for e in every] if rank == W - 1 else None, src=W - 1)
        check(out, every[rank], f"scatter {name}")
        # all_to_all_single, even: block r of my input goes to rank r
        src = make((W * 2, 3), dtype, rank, salt + 1)
        srcs = [make((W * 2, 3), dtype, r, salt + 1) for r in range(W)]
        out = torch.empty_like(src)
        dist.all_to_all_single(out, src)
        check(out, torch.cat([srcs[r][rank * 2 : rank * 2 + 2] for r in range(W)]), f"all_to_all_single {name}")
        # uneven splits: rank r sends (r + j + 1) rows to rank j
        splits = [[r + j + 1 for j in range(W)] for r in range(W)]
        srcs = [make((sum(splits[r]), 3), dtype, r, salt + 2) for r in range(W)]
        out = torch.empty((sum(splits[r][rank] for r in range(W)), 3), dtype=dtype)
        dist.all_to_all_single(
            out, srcs[rank], output_split_sizes=[splits[r][rank] for r in range(W)], input_split_sizes=splits[rank]
        )
        expect = [srcs[r][sum(splits[r][:rank]) : sum(splits[r][: rank + 1])] for r in range(W)]
        check(out, torch.cat(expect), f"all_to_all_single uneven {name}")
        # all_to_all with lists of different sizes
        ins = [make((rank + j + 1,), dtype, rank, salt + 3 + j) for j in range(W)]
        outs = [torch.empty((r + rank + 1,), dtype=dtype) for r in range(W)]
        dist.all_to_all(outs, ins)
        for r in range(W):
            check(outs[r], make((r + rank + 1,), dtype, r, salt + 3 + rank), f"all_to_all {name} from {r}")
        # send/recv ring and batch_isend_irecv
        nxt, prv = (rank + 1) % W, (rank - 1) % W
        got = torch.empty((4, 3), dtype=dtype)
        if rank % 2 == 0:
            dist.send(t, nxt)
            dist.recv(got, prv)
        else:
            dist.recv(got, prv)
            dist.send(t, nxt)
        check(got, every[prv], f"send/recv {name}")
        got = torch.empty((4, 3), dtype=dtype)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, nxt), dist.P2POp(dist.irecv, got, prv)])
        for q in reqs:
            q.wait()
        check(got, every[prv], f"batch_isend_irecv {name}")
    dist.barrier()

    # coalesced all_reduce (torch's coalescing manager -> allreduce_coalesced)
    from torch.distributed.distributed_c10d import _coalescing_manager

    ts = [make((3,), torch.float32, rank, 7000 + i) for i in range(3)]
    refs = [gloo_allreduce(t, R.SUM, torch.float32, W, gloo) for t in ts]
    with _coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    for t, r in zip(ts, refs):
        check(t, r, "coalesced all_reduce")
    # tensor-valued premul factor
    t = make((4,), torch.float32, rank, 7100)
    ref = gloo_allreduce(t, "premul", torch.float32, W, gloo)
    dist.all_reduce(t, dist._make_nccl_premul_sum(torch.tensor([2.0])))
    check(t, ref, "premul_sum with a tensor factor")
    # a subgroup of crossbar (new_group with the default backend)
    sub = dist.new_group(ranks=[0, 1])
    if rank < 2:
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=sub)
        check(t, torch.full((3,), 3.0), "subgroup all_reduce")
    dist.barrier()


@pytest.mark.parametrize("world", [2, 4])
def test_every_op_matches_gloo(world):
    run_ranks(battery, world)
