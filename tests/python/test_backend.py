"""The backend beyond single ops: async work and futures, DDP against gloo, errors,
torchrun, and the package surface (info, exceptions)."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks


def test_import_registers_backend_and_info():
    import crossbar

    assert "crossbar" in dist.Backend.backend_list
    info = crossbar.info()
    for key in ("version", "build_type", "transports", "torch_compiled", "torch_runtime"):
        assert key in info
    assert "shm" in info["transports"]


def test_exceptions_map_to_builtins():
    import crossbar

    cases = [
        ("timeout", crossbar.TimeoutError, TimeoutError),
        ("peer", crossbar.PeerFailure, ConnectionError),
        ("unsupported", crossbar.Unsupported, NotImplementedError),
        ("argument", crossbar.InvalidArgument, ValueError),
        ("usage", crossbar.InvalidUsage, RuntimeError),
    ]
    for kind, cls, builtin in cases:
        with pytest.raises(cls) as e:
            crossbar._C._throw_for_test(kind, f"message {kind}")
        assert isinstance(e.value, builtin) and isinstance(e.value, crossbar.CrossbarError)
        assert f"message {kind}" in str(e.value)
    with pytest.raises(crossbar.PeerFailure) as e:
        crossbar._C._throw_for_test("peer", "x")
    assert e.value.peers == [1] and e.value.code == "PeerFailure"


def _async_and_errors(rank, world):
    import crossbar

    # Several ops in flight at once, completed through futures and then-chains.
    ts = [torch.full((1000,), float(rank + i)) for i in range(4)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    futs = [w.get_future().then(lambda f: f.value()[0] * 2) for w in works]
    total = sum(range(world))
    for i, f in enumerate(futs):
        assert torch.equal(f.wait(), torch.full((1000,), 2.0 * (total + world * i)))
    for w in works:
        assert w.wait() and w.is_completed() and w.is_success()
    # Point to point in flight while a collective runs (a pending recv must not block it).
    if rank == 0:
        got = torch.zeros(8)
        rw = dist.irecv(got, src=1)
        t = torch.ones(4)
        dist.all_reduce(t)
        rw.wait()
        assert torch.equal(got, torch.arange(8.0))
    elif rank == 1:
        t = torch.ones(4)
        dist.all_reduce(t)
        dist.send(torch.arange(8.0), dst=0)
    else:
        dist.all_reduce(torch.ones(4))

    # Clear, typed errors.
    with pytest.raises(crossbar.Unsupported, match="not supported for reductions"):
        dist.all_reduce(torch.ones(3, dtype=torch.int16))
    with pytest.raises(crossbar.Unsupported, match="integer or bool"):
        dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND)
    with pytest.raises(crossbar.Unsupported, match="bool"):
        dist.all_reduce(torch.ones(3, dtype=torch.bool), op=dist.ReduceOp.AVG)
    with pytest.raises(crossbar.InvalidArgument, match="elements"):
        dist.all_gather_into_tensor(torch.empty(3), torch.empty(2))
    # gather/scatter: the root passes one tensor per rank, each of its own tensor's size
    # (checked before anything is sent: only the root makes these calls).
    if rank == 0:
        with pytest.raises(crossbar.InvalidArgument, match=f"one output list of {world} tensors"):
            dist.gather(torch.ones(2), [torch.empty(2)] * (world + 1), dst=0)
        with pytest.raises(crossbar.InvalidArgument, match="output tensors must match the input's size"):
            dist.gather(torch.ones(2), [torch.empty(3)] * world, dst=0)
        with pytest.raises(crossbar.InvalidArgument, match="input tensors must match the output's size"):
            dist.scatter(torch.empty(2), [torch.ones(3)] * world, src=0)
    # Data movement works for dtypes without arithmetic support (moved as bytes).
    t = torch.full((3,), complex(rank, 1), dtype=torch.complex64)
    dist.broadcast(t, src=0)
    assert torch.equal(t, torch.full((3,), complex(0, 1), dtype=torch.complex64))
    t = torch.full((3,), rank, dtype=torch.int16)
    out = [torch.empty(3, dtype=torch.int16) for _ in range(world)]
    dist.all_gather(out, t)
    assert all(torch.equal(o, torch.full((3,), r, dtype=torch.int16)) for r, o in enumerate(out))
    # Complex sums go through torch's view-as-real path onto float.
    t = torch.full((2,), complex(1, rank), dtype=torch.complex64)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), complex(world, total), dtype=torch.complex64))
    # The group still works after rejected calls (they fail before reaching the wire).
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), float(world)))
    if torch.cuda.is_available():
        # A group of plain "crossbar" also takes CUDA tensors (devices=["cpu", "cuda"]).
        whole = dist.new_group(backend="crossbar")
        torch.cuda.set_device(rank % torch.cuda.device_count())
        with pytest.raises(crossbar.Unsupported, match="cpu:crossbar,cuda:nccl"):
            dist.all_reduce(torch.ones(2, device="cuda"), group=whole)


def test_async_futures_and_errors():
    run_ranks(_async_and_errors, 3)


def _background_progress(rank, world):
    import datetime

    # A call nobody waits for still runs: rank 0 issues and leaves its works alone (no wait,
    # no future, no test), the others wait for theirs, which needs rank 0's part. The
    # backend starts it without a hand-off at issue (the issuing thread's wait() usually
    # runs it); its completion thread starts whatever no one waited for.
    gloo = dist.new_group(backend="gloo")
    for n in (16, 1 << 16):  # the eager path and a staged one
        t = torch.full((n,), float(rank + 1))
        w = dist.all_reduce(t, async_op=True)
        if rank != 0:
            assert w.wait(timeout=datetime.timedelta(seconds=30))
        dist.barrier(group=gloo)
        expect = torch.full((n,), float(world * (world + 1) // 2))
        # Contiguous and in place: the tensor is the buffer, so it holds the sum already.
        assert torch.equal(t, expect), f"rank {rank}: {n} elements not reduced in the background"
        assert w.wait() and w.is_completed()
    # A blocking call that finished inside its issue is complete when it returns.
    w = dist.all_reduce(torch.ones(4), async_op=True)
    w.wait()
    assert w.is_completed() and w.is_success()


def test_background_progress():
    run_ranks(_background_progress, 3)


def _train(rank, world, group):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(5):
        x = torch.randn(16, 8, generator=g)
        y = torch.randn(16, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp(rank, world):
    gloo = dist.new_group(backend="gloo")
    with_crossbar = _train(rank, world, None)
    with_gloo = _train(rank, world, gloo)
    for a, b in zip(with_crossbar, with_gloo):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # A communication hook on crossbar's futures (fp16 compression).
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    ddp(torch.randn(4, 8)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for gr in grads:  # every rank holds the same averaged gradient
        ref = gr.clone()
        dist.broadcast(ref, src=0, group=gloo)
        assert torch.equal(gr, ref)


def test_ddp_matches_gloo():
    run_ranks(_ddp, 2)


TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    import crossbar
    dist.init_process_group("crossbar")
    t = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4,), 3.0)), t
    assert dist.get_backend() == "crossbar"
    # One marker file per rank: the ranks share stdout, so printed lines can interleave.
    with open(os.path.join(sys.argv[1], "rank%d.ok" % dist.get_rank()), "w") as f:
        f.write("ok")
    dist.destroy_process_group()
    """
)


def test_torchrun(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(os.environ))
    assert res.returncode == 0, res.stdout + res.stderr
    for rank in (0, 1):
        assert (tmp_path / ("rank%d.ok" % rank)).exists(), res.stdout + res.stderr
