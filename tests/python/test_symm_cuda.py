"""crossbar.symm on CUDA tensors, 2 ranks sharing GPU 0 (one node: the CUDA symmetric heap):
zero-filled allocation, peer views (whole tensors, slices, transposes, bf16), the stream-ordered
barrier, a signal/wait ping-pong on the current stream, a 16 MiB put into the peer's memory
ordered by a signal with no host synchronization in between, a side stream, a wait whose signal
does not come bounded by synchronize(timeout) (then released), typed errors, and ranks asking
for different device types. Skips without a GPU or without CUDA symmetric tensors in the build.

    CROSSBAR_BUILD_DIR=build python3 -m pytest -q tests/python/test_symm_cuda.py
"""

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
