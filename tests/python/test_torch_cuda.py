"""CUDA tensors on the crossbar backend (CudaCollectives, stream-ordered on torch's current
stream): every collective against a float64 reference computed from all ranks' inputs,
non-contiguous tensors, async works and futures, point to point (also from any source,
in stream order; staged through host memory since NCCL refuses two ranks on one GPU),
and a DDP step equal to single-process training on the whole batch.
Two ranks share GPU 0 (the GPU check runs on one GPU). Skips without a GPU or in a
build without crossbar's CUDA path.

    CROSSBAR_BUILD_DIR=build python3 -m pytest -q tests/python/test_torch_cuda.py
"""

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks


def _cuda_path_built():
    try:
        import crossbar
    except ImportError:
        return False
    return bool(crossbar.info().get("cuda_tensors"))


pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not _cuda_path_built(), reason="crossbar built without its CUDA path"),
]

R = dist.ReduceOp
TYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32]
SIZES = [1, 1001]


def make(rank, n, dtype, salt):
    """Small integers: exact in every type and every reduction order."""
    g = torch.Generator().manual_seed(rank * 7919 + salt)
    return torch.randint(-3, 4, (n,), generator=g).to(dtype)


def reference(inputs, op):
    stack = torch.stack([x.double() for x in inputs])
    if op == R.SUM:
        return stack.sum(0)
    if op == R.MAX:
        return stack.max(0).values
    if op == R.MIN:
        return stack.min(0).values
    if op == R.AVG:
        return stack.mean(0)
    raise AssertionError(op)


def same(got, ref, what):
    got = got.cpu().double()
    ref = ref.double()
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    # bf16/f16 averages round once: allow half an ulp of the type.
    torch.testing.assert_close(got, ref, rtol=4e-3, atol=4e-3, msg=lambda m: f"{what}: {m}")


def _collectives(rank, world):
    import crossbar

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    salt = 0
    for dtype in TYPES:
        for n in SIZES:
            salt += 1
            ins = [make(r, n, dtype, salt) for r in range(world)]
            ops = [R.SUM, R.MAX, R.MIN] + ([R.AVG] if dtype.is_floating_point else [])
            for op in ops:
                what = f"all_reduce {dtype} n={n} {op}"
                t = ins[rank].to(dev)
                dist.all_reduce(t, op=op)
                same(t, reference(ins, op), what)
                for root in range(world):
                    t = ins[rank].to(dev)
                    dist.reduce(t, dst=root, op=R.SUM)
                    if rank == root:
                        same(t, reference(ins, R.SUM), f"reduce {dtype} n={n} root={root}")
            # broadcast, gathers, scatters
            for root in range(world):
                t = ins[rank].to(dev)
                dist.broadcast(t, src=root)
                same(t, ins[root], f"broadcast {dtype} root={root}")
            outs = [torch.empty(n, dtype=dtype, device=dev) for _ in range(world)]
            dist.all_gather(outs, ins[rank].to(dev))
            for r in range(world):
                same(outs[r], ins[r], f"all_gather {dtype} from {r}")
            flat = torch.empty(world * n, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(flat, ins[rank].to(dev))
            same(flat, torch.cat(ins), f"all_gather_into_tensor {dtype}")
            big = [make(r, world * n, dtype, salt + 100) for r in range(world)]
            out = torch.empty(n, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(out, big[rank].to(dev))
            same(out, reference(big, R.SUM)[rank * n : (rank + 1) * n], f"reduce_scatter_tensor {dtype}")
            out = torch.empty(n, dtype=dtype, device=dev)
            dist.reduce_scatter(out, list(big[rank].to(dev).chunk(world)))
            same(out, reference(big, R.SUM)[rank * n : (rank + 1) * n], f"reduce_scatter {dtype}")
            out = torch.empty(world * n, dtype=dtype, device=dev)
            dist.all_to_all_single(out, big[rank].to(dev))
            expect = torch.cat([big[r][rank * n : (rank + 1) * n] for r in range(world)])
            same(out, expect, f"all_to_all_single {dtype}")
            for root in range(world):
                gl = [torch.empty(n, dtype=dtype, device=dev) for _ in range(world)] if rank == root else None
                dist.gather(ins[rank].to(dev), gather_list=gl, dst=root)
                if rank == root:
                    for r in range(world):
                        same(gl[r], ins[r], f"gather {dtype} root={root} from {r}")
                out = torch.empty(n, dtype=dtype, device=dev)
                sl = [x.to(dev) for x in big[root].chunk(world)] if rank == root else None
                dist.scatter(out, scatter_list=sl, src=root)
                same(out, big[root].chunk(world)[rank], f"scatter {dtype} root={root}")
    # Uneven all-to-all (row splits) and the list form.
    rows_out = [r + 1 for r in range(world)]  # rank r sends r+1 rows to every rank
    send = torch.full((sum([rank + 1] * world), 3), float(rank), device=dev)
    recv = torch.empty((sum(rows_out), 3), device=dev)
    dist.all_to_all_single(recv, send, output_split_sizes=rows_out, input_split_sizes=[rank + 1] * world)
    expect = torch.cat([torch.full((r + 1, 3), float(r)) for r in range(world)])
    same(recv, expect, "all_to_all_single uneven")
    outs = [torch.empty(2, device=dev) for _ in range(world)]
    dist.all_to_all(outs, [torch.full((2,), float(rank * 10 + r), device=dev) for r in range(world)])
    for r in range(world):
        same(outs[r], torch.full((2,), float(r * 10 + rank)), "all_to_all list")
    # Non-contiguous input and output (a column of a matrix).
    m = torch.arange(12.0, device=dev).view(4, 3) * (rank + 1)
    col = m[:, 1]
    dist.all_reduce(col)
    same(m[:, 1], torch.arange(12.0).view(4, 3)[:, 1] * sum(r + 1 for r in range(world)), "non-contiguous")
    same(m[:, 0], torch.arange(12.0).view(4, 3)[:, 0] * (rank + 1), "untouched column")
    # Bitwise reductions (allgather / all-to-all on the stream, then torch's fold there).
    bits = [torch.tensor([0b1100, 0b1010, 0b0110, 0b0001], dtype=torch.int32) << r for r in range(world)]
    for op, fold in ((R.BAND, torch.bitwise_and), (R.BOR, torch.bitwise_or), (R.BXOR, torch.bitwise_xor)):
        ref = bits[0]
        for b in bits[1:]:
            ref = fold(ref, b)
        t = bits[rank].to(dev)
        dist.all_reduce(t, op=op)
        assert torch.equal(t.cpu(), ref), (op, t, ref)
        big = torch.cat([bits[rank]] * world).to(dev)
        out = torch.empty(4, dtype=torch.int32, device=dev)
        dist.reduce_scatter_tensor(out, big, op=op)
        assert torch.equal(out.cpu(), ref), (op, out, ref)
    # Async works: stream ordering, futures, completion.
    ts = [torch.full((1 << 16,), float(rank + i), device=dev) for i in range(4)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    futs = [w.get_future().then(lambda f: f.value()[0] * 2) for w in works]
    total = sum(range(world))
    for i, (w, f) in enumerate(zip(works, futs)):
        w.wait()  # the current stream waits; the host does not
        same(ts[i], torch.full((1 << 16,), float(total + world * i)), f"async {i}")
        same(f.wait(), torch.full((1 << 16,), 2.0 * (total + world * i)), f"future {i}")
    torch.cuda.synchronize()
    for w in works:
        assert w.is_completed()
    dist.barrier()
    # Errors stay typed; any-source receives of CUDA tensors need a tag below 2^26.
    with pytest.raises(crossbar.InvalidArgument, match="any source needs a tag below"):
        dist.recv(torch.zeros(2, device=dev), tag=1 << 26)
    with pytest.raises(crossbar.InvalidArgument, match="same device"):
        dist.all_gather_into_tensor(torch.empty(2 * world), torch.empty(2, device=dev))
    # Point to point: NCCL, or through host memory where NCCL refuses the group (two ranks
    # on one GPU, as here): the data arrives either way.
    if rank == 0:
        dist.send(torch.arange(5.0, device=dev), dst=1)
    elif rank == 1:
        t = torch.zeros(5, device=dev)
        dist.recv(t, src=0)
        same(t, torch.arange(5.0), "send/recv")
    torch.cuda.synchronize()


def test_cuda_collectives_two_ranks_one_gpu():
    run_ranks(_collectives, 2, backend="crossbar")


def _anysource(rank, world):
    import crossbar

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.barrier()
    n = 1 << 20
    if rank == 1:
        for i in range(3):
            dist.send(torch.full((n,), float(10 + i), device=dev), dst=0, tag=4)
    else:
        # Stream order: the add before the receive and the mul after it are queued on
        # the current stream with it; the host does not synchronize in between.
        t = torch.zeros(n, device=dev)
        t.add_(1.0)
        assert dist.recv(t, tag=4) == 1  # no src: the sender is learned on the host
        t.mul_(2.0)
        same(t, torch.full((n,), 20.0), "any-source recv, stream order")
        u = torch.zeros(n, device=dev)
        dist.recv(u, src=1, tag=4)  # by name: takes the sender's next message
        same(u, torch.full((n,), 11.0), "recv by name after any-source")
        w = torch.zeros(n, device=dev)
        work = dist.irecv(w, tag=4)
        work.wait()
        assert work._source_rank() == 1
        same(w, torch.full((n,), 12.0), "irecv from any source")
    torch.cuda.synchronize()
    # Both ranks share GPU 0, which NCCL refuses: point to point went through host memory.
    assert dist.group.WORLD._get_backend(dev)._cuda_p2p_path() == "host-staged"


def test_cuda_recv_any_source():
    run_ranks(_anysource, 2, backend="crossbar")


def _staged_p2p(rank, world):
    """Point to point where NCCL refuses the group (both ranks on GPU 0): staged through
    pinned host memory, ordered on the current stream like NCCL."""
    import crossbar

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    peer = 1 - rank
    # Every dtype moves as bytes; sizes below and above the host path's eager limits.
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.complex64):
        for n in (1, 1000, 1 << 20):
            x = (torch.arange(n) % 7 + 10 * rank).to(dtype).to(dev)
            got = torch.zeros(n, dtype=dtype, device=dev)
            if rank == 0:
                dist.send(x, dst=1, tag=1)
                dist.recv(got, src=1, tag=2)
            else:
                dist.recv(got, src=0, tag=1)
                dist.send(x, dst=0, tag=2)
            expect = (torch.arange(n) % 7 + 10 * peer).to(dtype)
            assert torch.equal(got.cpu(), expect), (dtype, n)
    backend = dist.group.WORLD._get_backend(dev)
    assert backend._cuda_p2p_path() == "host-staged", backend._cuda_p2p_path()
    # Stream order without host synchronization: a kernel writes the tensor right before
    # the send, the receiver's kernels run right before and after the receive.
    n = 1 << 22
    if rank == 0:
        t = torch.zeros(n, device=dev)
        t.add_(3.0)  # queued before the send's device-to-host copy
        dist.send(t, dst=1, tag=3)
        t.fill_(-1.0)  # after the copy: must not reach the receiver
    else:
        r = torch.ones(n, device=dev)
        r.mul_(5.0)  # before the receive: overwritten by it
        dist.recv(r, src=0, tag=3)
        r.add_(1.0)  # after the receive, on the same stream
        same(r, torch.full((n,), 4.0), "stream order")
    # Non-contiguous output (a column), async works, and a batch listing the receive first
    # on both ranks (it must not wait ahead of the sends' copies on the stream).
    m = torch.zeros(6, 4, device=dev)
    col = m[:, 2]
    if rank == 0:
        w = dist.isend(torch.arange(6.0, device=dev) + 100, dst=1, tag=5)
    else:
        w = dist.irecv(col, src=0, tag=5)
    w.wait()
    torch.cuda.synchronize()
    assert w.is_completed()
    if rank == 1:
        same(m[:, 2], torch.arange(6.0) + 100, "non-contiguous recv")
        same(m[:, 1], torch.zeros(6), "untouched column")
    a = torch.zeros(1000, device=dev)
    b = torch.full((1000,), float(rank + 1), device=dev)
    ops = [dist.P2POp(dist.irecv, a, peer, tag=6), dist.P2POp(dist.isend, b, peer, tag=6)]
    for q in dist.batch_isend_irecv(ops):
        q.wait()
    same(a, torch.full((1000,), float(peer + 1)), "batch_isend_irecv, receive first")
    # Empty tensors and a receive from any source.
    e = torch.empty(0, device=dev)
    if rank == 0:
        dist.send(e, dst=1, tag=7)
        dist.send(torch.full((8,), 42.0, device=dev), dst=1, tag=8)
    else:
        dist.recv(e, src=0, tag=7)
        z = torch.zeros(8, device=dev)
        assert dist.recv(z, tag=8) == 0
        same(z, torch.full((8,), 42.0), "any source, staged")
    # A size mismatch is reported (the stream is released, not left blocked).
    if rank == 0:
        dist.send(torch.ones(16, device=dev), dst=1, tag=9)
    else:
        small = torch.zeros(8, device=dev)
        work = dist.irecv(small, src=0, tag=9)
        torch.cuda.synchronize()  # the stream got past the receive
        with pytest.raises(crossbar.CrossbarError, match="sent 64 bytes, expected 32|holds only 32 bytes"):
            work.wait()
    torch.cuda.synchronize()
    dist.barrier()


def test_cuda_p2p_staged_through_host_memory():
    run_ranks(_staged_p2p, 2, backend="crossbar")


def _ddp(rank, world):
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).double()

    def batch(r, step):
        g = torch.Generator().manual_seed(1000 * step + r)
        return torch.randn(16, 8, generator=g, dtype=torch.float64), torch.randn(16, 4, generator=g, dtype=torch.float64)

    ddp = torch.nn.parallel.DistributedDataParallel(model().to(dev), device_ids=[0], bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref = model()  # single process on the whole batch: DDP's averaged gradients equal these
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x.to(dev)), y.to(dev)).backward()
        opt.step()
        xs, ys = zip(*[batch(r, step) for r in range(world)])
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
    for p, q in zip(ddp.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-9, atol=1e-9)


def test_cuda_ddp_matches_single_process():
    run_ranks(_ddp, 2, backend="crossbar")
