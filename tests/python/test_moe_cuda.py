"""crossbar.moe on CUDA tensors (Buffer(device="cuda"): CudaMoeBuffer on torch's current
stream, results from torch's caching allocator) against the CPU path on the same inputs, bit
for bit: every dispatch output (native bf16 / f32, fp8, mxfp8, nvfp4 with the quantized
payload handed back), a cached dispatch, plain / weighted / expert-major combine, layout.
1 rank, and 2 ranks sharing GPU 0 (one node: the CUDA symmetric heap). Skips without a GPU
or without the CUDA MoE path in the build.

    CROSSBAR_BUILD_DIR=build python3 -m pytest -q tests/python/test_moe_cuda.py
"""

import pytest
import torch

from dist_utils import run_ranks


def _cuda_moe_built():
    try:
        import crossbar.moe as moe
    except ImportError:
        return False
    return moe.cuda_available()


pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not _cuda_moe_built(), reason="crossbar built without its CUDA MoE path"),
]

HIDDEN, TOPK, EPR, MAX_TOKENS = 256, 4, 5, 48  # EPR >= TOPK: one rank holds every expert
# (dtype, payload): every payload format, both token types of the native path.
CASES = [(torch.bfloat16, "native"), (torch.float32, "native"), (torch.bfloat16, "fp8"),
         (torch.bfloat16, "mxfp8"), (torch.float32, "nvfp4")]


def tokens_of(rank: int, world: int) -> int:
    return 0 if world > 1 and rank == 1 else 11 + 13 * rank  # rank 1 sends nothing


def inputs(rank: int, world: int, dtype):
    g = torch.Generator().manual_seed(300 + rank)
    t = tokens_of(rank, world)
    x = (torch.randn(t, HIDDEN, generator=g) * 3).to(dtype)
    w, idx = torch.rand(t, EPR * world, generator=g).softmax(-1).topk(TOPK, dim=-1)
    if t:
        idx[::3, -1] = -1  # "no expert"
    return x, idx, w


def same(cpu: torch.Tensor, got: torch.Tensor, what: str):
    """Bit-identical: same dtype, shape and bytes."""
    assert got.dtype == cpu.dtype and got.shape == cpu.shape, f"{what}: {got.dtype}{tuple(got.shape)} vs {cpu.dtype}{tuple(cpu.shape)}"
    a, b = cpu.contiguous().view(torch.uint8), got.cpu().contiguous().view(torch.uint8)
    assert torch.equal(a, b), f"{what}: CUDA and CPU results differ"


FIELDS = ("x", "src_rank", "src_token", "topk_idx", "topk_weights", "expert_rows", "expert_weights",
          "x_expert_major", "q_payload", "q_scales", "q_global_scale")


def check_case(rank, world, dtype, payload, dev):
    import crossbar
    import crossbar.moe as moe

    kw = dict(max_tokens=MAX_TOKENS, hidden=HIDDEN, topk=TOPK, num_experts=EPR * world, dtype=dtype,
              payload=payload, return_quantized=payload != "native")
    cpu = moe.Buffer(**kw)
    gpu = moe.Buffer(**kw, device=dev)
    assert gpu.device == dev and gpu.num_local_experts == cpu.num_local_experts == EPR
    x, idx, w = inputs(rank, world, dtype)
    xd, idxd, wd = x.to(dev), idx.to(dev), w.to(dev)

    lc, lg = cpu.layout(idx), gpu.layout(idxd)
    for f in ("tokens_per_rank", "tokens_per_node", "tokens_per_expert", "is_token_in_rank"):
        assert getattr(lg, f).device == dev
        same(getattr(lc, f), getattr(lg, f), f"layout.{f}")

    dc = cpu.dispatch(x, idx, w)
    handle = None
    for cached in (False, True):
        dg = gpu.dispatch(xd, idxd, wd, handle=handle)
        handle = dg.handle
        for f in FIELDS:
            a, b = getattr(dc, f), getattr(dg, f)
            if a is None:
                assert b is None, f
                continue
            assert b.device == dev, f"{f} is on {b.device}"
            same(a, b, f"{payload} {dtype} dispatch (cached={cached}).{f}")
        for f in ("recv_per_rank", "tokens_per_expert", "expert_offsets"):  # host-known counts
            assert getattr(dg, f).device.type == "cpu"
            same(getattr(dc, f), getattr(dg, f), f)
        for m in ("inter_node_bytes", "intra_node_bytes", "dropped"):
            assert dg.metrics[m] == dc.metrics[m], m
        assert dg.handle.num_recv == dc.handle.num_recv == dc.num_recv

    # Results own their memory: changing a returned index array leaves the handle alone.
    dg.topk_idx.fill_(7)
    again = gpu.dispatch(xd, idxd, wd, handle=dg.handle)
    same(dc.topk_idx, again.topk_idx, "cached dispatch after changing a result")
    same(dc.topk_weights, again.topk_weights, "cached dispatch after changing a result")

    # Expert outputs: one per received row, and per expert-major row.
    y = dc.x.float() * 1.25 + 0.5
    rw = torch.linspace(0.25, 2.0, dc.num_recv) if dc.num_recv else torch.zeros(0)
    same(cpu.combine(y, dc.handle), gpu.combine(y.to(dev), dg.handle), "combine")
    same(cpu.combine(dc.x, dc.handle, weights=rw), gpu.combine(dg.x, dg.handle, weights=rw.to(dev)),
         "weighted combine")
    ym = dc.x_expert_major.float() * 0.75
    same(cpu.combine_expert_major(ym, dc, dc.expert_weights),
         gpu.combine_expert_major(ym.to(dev), dg, dg.expert_weights), "expert-major combine")

    # On another current stream: the call runs there (results valid after that stream).
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        ds = gpu.dispatch(xd, idxd, wd)
        out = gpu.combine(ds.x, ds.handle)
    torch.cuda.current_stream(dev).wait_stream(side)
    same(cpu.combine(dc.x, dc.handle), out, "combine on a side stream")
    same(dc.x, ds.x, "dispatch on a side stream")

    # Tensors elsewhere than the buffer's device are refused with a typed error (local check,
    # before any traffic, so every rank raises).
    with pytest.raises(crossbar.InvalidArgument):
        gpu.dispatch(x, idx, w)

    # DeepEP-style quantized io (session 8): pre-quantized (codes, scales) in, quantized rows out,
    # and decode only, against the CPU path.
    if payload != "native":
        q = moe.quantize(x, payload)
        qd = tuple(t.to(dev) for t in q[:2]) + tuple(q[2:])
        cq, gq = cpu.dispatch(q, idx, w), gpu.dispatch(qd, idxd, wd)
        assert cq.x is None and gq.x is None
        for f in ("q_payload", "q_scales", "q_global_scale", "q_payload_expert_major", "q_scales_expert_major"):
            same(getattr(cq, f), getattr(gq, f), f"{payload} pre-quantized dispatch.{f}")
        same(dc.q_payload, gq.q_payload, f"{payload} pre-quantized vs encoded codes")
        same(dc.x, gpu.dispatch(qd, idxd, wd, dequantize=True).x, f"{payload} pre-quantized, decoded")
    torch.cuda.synchronize(dev)


def body(rank, world):
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    for dtype, payload in CASES:
        check_case(rank, world, dtype, payload, dev)


@pytest.mark.parametrize("world", [1, 2])
def test_moe_cuda_matches_cpu(world):
    run_ranks(body, world)
