"""Expert-parallel MoE all-to-all on a crossbar process group (two-level: over the network
once per destination node, then inside the node through shared memory).

::

    import crossbar.moe as moe
    buf = moe.Buffer(max_tokens=4096, hidden=7168, topk=8, num_experts=256, payload="fp8")
    scores = router(x)                                   # [tokens, num_experts]
    w, idx = scores.softmax(-1).topk(8)                  # top-k routing
    d = buf.dispatch(x, idx, w)                          # collective
    # d.x [num_recv, hidden]: tokens that have an expert here, by (source rank, token);
    # d.topk_idx: local expert ids (-1: expert elsewhere), d.topk_weights (0 there)
    y = run_experts(d)                                   # [num_recv, hidden]
    out = buf.combine(y, d.handle)                       # [tokens, hidden] float32, collective

DeepEP-style quantized dispatch (DeepSeek-V3 with fp8 expert GEMMs)::

    buf = moe.Buffer(..., payload="fp8")
    codes, scales = moe.quantize(x, "fp8")               # once, outside the hot loop
    d = buf.dispatch((codes, scales), idx, w)            # sent as is: no encode
    recv_codes, recv_scales = d.x_quantized              # no decode, no bf16 copy (d.x is None)

Expert ``e`` lives on rank ``e // (num_experts // world)``. Payloads: ``"native"`` (x's own
bf16/f32, bit exact), ``"fp8"`` (e4m3 + one f32 scale per 128 channels), ``"mxfp8"`` (e4m3 +
E8M0 scale per 32), ``"nvfp4"`` (e2m1 + e4m3 scale per 16 + an f32 per-tensor scale). Every
call is collective over the group, in the same order.

CPU tensors use the host path (default). CUDA tensors: ``Buffer(..., device="cuda")`` (the
current device, or ``"cuda:N"``) runs the CUDA path (collectives/moe/cuda/moe_cuda.h) on
torch's current stream, like NCCL collectives: dispatch/combine return once the work is
queued (a dispatch without a cached handle first waits for topk_idx on the host), results are
allocated by torch's caching allocator and are bit-identical to the CPU path's. The counts
known on the host (recv_per_rank, tokens_per_expert, expert_offsets) stay CPU tensors.
Within a node the ranks' GPUs must map each other's memory (or share one GPU); several nodes
use NCCL (one rank per GPU).
"""

from __future__ import annotations

import dataclasses
import datetime

import torch

from . import _C
from ._group import crossbar_backend

__all__ = ["Buffer", "Dispatched", "Layout", "PAYLOADS", "quantize", "dequantize"]

PAYLOADS = ("native", "bf16", "fp8", "mxfp8", "nvfp4")


@dataclasses.dataclass
class Layout:
    tokens_per_rank: torch.Tensor  # int32 [world]
    tokens_per_node: torch.Tensor  # int32 [nodes]
    tokens_per_expert: torch.Tensor  # int32 [num_experts]
    is_token_in_rank: torch.Tensor  # bool [tokens, world]


@dataclasses.dataclass
class Dispatched:
    x: torch.Tensor | None  # [num_recv, hidden] in the buffer's dtype (dequantized); None: quantized only
    src_rank: torch.Tensor  # int32 [num_recv]
    src_token: torch.Tensor  # int32 [num_recv]
    recv_per_rank: torch.Tensor  # int32 [world]
    topk_idx: torch.Tensor  # int64 [num_recv, topk]: local expert id, -1 elsewhere
    topk_weights: torch.Tensor  # float32 [num_recv, topk]: 0 where topk_idx is -1
    tokens_per_expert: torch.Tensor  # int32 [local experts]
    expert_offsets: torch.Tensor  # int32 [local experts + 1]
    expert_rows: torch.Tensor  # int32: row of x each expert-major row copies
    expert_weights: torch.Tensor  # float32: its weight
    x_expert_major: torch.Tensor | None  # [expert_rows.numel(), hidden]; None with x
    handle: object  # pass to combine() or a cached dispatch()
    metrics: dict
    # return_quantized=True: the wire payload and scales per row, viewed in their torch types
    # where torch has them (fp8: float8_e4m3fn payload, float32 scales; mxfp8: float8_e4m3fn,
    # float8_e8m0fnu; nvfp4: packed uint8 (two e2m1 per byte, low nibble first), float8_e4m3fn).
    q_payload: torch.Tensor | None = None
    q_scales: torch.Tensor | None = None
    q_global_scale: torch.Tensor | None = None  # nvfp4's per-tensor scale of the source rank
    # The same rows in expert-major order (rows of x_expert_major), when the quantized form is returned.
    q_payload_expert_major: torch.Tensor | None = None
    q_scales_expert_major: torch.Tensor | None = None
    # CPU path: the memory x / x_expert_major / q_payload / q_scales view (dispatch(out=...)).
    _memory: object = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def num_recv(self) -> int:
        return self.src_rank.shape[0]

    @property
    def x_quantized(self):
        """The received tokens as DeepEP's fp8 recv_x: (codes, scales), or None when dispatch
        returned only the dequantized x."""
        return None if self.q_payload is None else (self.q_payload, self.q_scales)


def cuda_available() -> bool:
    """True when this build runs crossbar.moe on CUDA tensors (Buffer(device="cuda"))."""
    return bool(getattr(_C._moe, "cuda", False))


def _device_index(device) -> int:
    """-1 for the CPU, else the CUDA device index."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cpu":
        return -1
    if dev.type != "cuda":
        raise ValueError(f"device {dev}: crossbar.moe runs on 'cpu' or 'cuda' tensors")
    if not cuda_available():
        raise RuntimeError(
            "crossbar.moe: this build has no CUDA MoE path (built without CUDA, or against a CPU-only torch); "
            "use device='cpu'"
        )
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _view(t: torch.Tensor, name: str):
    dtype = getattr(torch, name, None)
    return t.view(dtype) if dtype is not None and t.numel() else t


# Per quantized payload: (block size, scale bytes per block, codes' torch dtype name, scales'
# torch dtype name); codes are one byte per value (nvfp4: two values per byte).
_CODECS = {
    "fp8": (128, 4, "float8_e4m3fn", "float32"),
    "mxfp8": (32, 1, "float8_e4m3fn", "float8_e8m0fnu"),
    "nvfp4": (16, 1, "uint8", "float8_e4m3fn"),
}


def _typed(payload: str, codes: torch.Tensor, scales: torch.Tensor):
    """Byte tensors [rows, bytes] of a payload format as the caller sees them."""
    _, _, cname, sname = _CODECS[payload]

    def typed(t, name):  # also when empty: the dtype tells what the tensor holds
        dtype = getattr(torch, name, None)
        return t.view(dtype) if dtype is not None else t

    return typed(codes, cname), typed(scales, sname)


def _as_bytes(t: torch.Tensor, what: str) -> torch.Tensor:
    """A 2-D tensor as bytes per row ([rows, row bytes]), without a copy."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise _usage_error_of("InvalidUsage", f"dispatch: pre-quantized x's {what} must be a 2-D tensor [tokens, ...]")
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _usage_error_of(kind: str, msg: str):
    """crossbar's exception `kind` (e.g. "InvalidUsage") with msg, naming the rank as the C++
    checks do."""
    import crossbar
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        msg = f"rank {dist.get_rank()} crossbar.moe {msg}"
    return getattr(crossbar, kind, RuntimeError)(msg)


def quantize(x: torch.Tensor, payload: str):
    """x [tokens, hidden] (bf16 / f32, CPU) in a payload format's layout, with the codec the
    buffer's encoder uses (bit-identical bytes): (codes, scales) for "fp8" (float8_e4m3fn,
    float32 [tokens, ceil(hidden / 128)]) and "mxfp8" (float8_e4m3fn, float8_e8m0fnu [tokens,
    ceil(hidden / 32)]); (codes, scales, global_scale) for "nvfp4" (packed uint8 [tokens,
    ceil(hidden / 2)], float8_e4m3fn [tokens, ceil(hidden / 16)], float). The input
    Buffer.dispatch takes as a pre-quantized x. Runs on the CPU (a CUDA x is copied to the
    host); for a CUDA Buffer move the results with .to(device)."""
    if payload not in _CODECS:
        raise ValueError(f"payload {payload!r}: one of {tuple(_CODECS)}")
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError("x must be a 2-D bfloat16 or float32 tensor")
    codes, scales, g = _C._moe.quantize(x.cpu().contiguous(), payload)
    codes, scales = _typed(payload, codes, scales)
    return (codes, scales, g) if payload == "nvfp4" else (codes, scales)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, payload: str, dtype: torch.dtype = torch.bfloat16,
               global_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """The inverse of quantize() (the buffer's decoder): [tokens, hidden] of dtype. For nvfp4,
    global_scale is a float or a per-row tensor (Dispatched.q_global_scale)."""
    if payload not in _CODECS:
        raise ValueError(f"payload {payload!r}: one of {tuple(_CODECS)}")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError("dtype: torch.bfloat16 or torch.float32")
    g = global_scale if isinstance(global_scale, torch.Tensor) else torch.full((codes.shape[0],), float(global_scale))
    return _C._moe.dequantize(
        _as_bytes(codes.cpu(), "codes"), _as_bytes(scales.cpu(), "scales"), g.to(torch.float32).cpu().contiguous(),
        payload, "float32" if dtype == torch.float32 else "bfloat16")


class Buffer:
    """Expert-parallel buffer: created once per group (collective), sized by max_tokens per rank."""

    def __init__(
        self,
        group=None,
        *,
        max_tokens: int,
        hidden: int,
        topk: int,
        num_experts: int,
        dtype: torch.dtype = torch.bfloat16,
        payload: str = "native",
        return_quantized: bool = False,
        expert_capacity: int = -1,
        chunk_tokens: int = -1,
        combine_wire: torch.dtype = torch.float32,
        timeout: datetime.timedelta | None = None,
        device: torch.device | str | None = None,
    ):
        """chunk_tokens: rows per pipelined network chunk (-1: CROSSBAR_MOE_CHUNK_TOKENS, 0: one).
        combine_wire: type of combine's per-node partial sums on the network (torch.bfloat16
        halves those bytes; each partial is rounded once). expert_capacity: per local expert,
        assignments beyond it are dropped (-1: none). device: where the tokens live: None /
        "cpu" (host path) or "cuda" / "cuda:N" (CUDA path; every tensor passed must be there)."""
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"dtype {dtype}: tokens must be torch.bfloat16 or torch.float32")
        if payload not in PAYLOADS:
            raise ValueError(f"payload {payload!r}: use one of {PAYLOADS}")
        if combine_wire not in (torch.float32, torch.bfloat16):
            raise ValueError(f"combine_wire {combine_wire}: torch.float32 or torch.bfloat16")
        if payload == "bf16" and dtype != torch.bfloat16:
            raise ValueError("payload 'bf16' needs dtype=torch.bfloat16 (use 'native' for float32)")
        self.hidden, self.topk, self.num_experts, self.dtype = hidden, topk, num_experts, dtype
        self.payload = "native" if payload == "bf16" else payload
        cuda_device = _device_index(device)
        self.device = torch.device("cuda", cuda_device) if cuda_device >= 0 else torch.device("cpu")
        self._impl = _C._moe.Buffer(
            crossbar_backend(group, "crossbar.moe"),
            max_tokens,
            hidden,
            topk,
            num_experts,
            "float32" if dtype == torch.float32 else "bfloat16",
            self.payload,
            return_quantized,
            expert_capacity,
            chunk_tokens,
            int(timeout.total_seconds() * 1000) if timeout is not None else 0,
            "bfloat16" if combine_wire == torch.bfloat16 else "float32",
            cuda_device,
        )

    @property
    def num_local_experts(self) -> int:
        return self._impl.num_local_experts

    def layout(self, topk_idx: torch.Tensor, num_experts: int | None = None) -> Layout:
        """Routing statistics of topk_idx [tokens, topk] (-1: no expert), on topk_idx's device.
        Local (computed on the host: a CUDA topk_idx is copied there)."""
        d = self._impl.layout(topk_idx.to(torch.int64).cpu().contiguous(), num_experts or self.num_experts)
        out = (d["tokens_per_rank"], d["tokens_per_node"], d["tokens_per_expert"], d["is_token_in_rank"])
        return Layout(*(t.to(topk_idx.device) for t in out))

    def dispatch(
        self,
        x,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor | None = None,
        handle=None,
        *,
        out: Dispatched | None = None,
        dequantize: bool | None = None,
    ):
        """Sends each token [tokens, hidden] to the ranks of its top-k experts. Collective.

        x: a tensor [tokens, hidden] in the buffer's dtype, or (quantized payloads) already
        quantized, as DeepEP takes it: a tuple (codes, scales) in the buffer's payload layout
        (see quantize(): fp8 float8_e4m3fn + float32 [tokens, ceil(hidden / 128)]; mxfp8
        float8_e4m3fn + float8_e8m0fnu / uint8 [tokens, ceil(hidden / 32)]; nvfp4
        (codes, scales, global_scale)). Those bytes are sent as they are (no encode).
        dequantize: None (default): a tuple x gives DeepEP's fp8 recv_x, only the received
        codes and scales (d.x_quantized / d.q_payload, d.q_scales; d.x is None: no decode, no
        bf16 copy), a tensor x gives d.x (plus q_* with return_quantized). True: d.x (plus q_*
        with return_quantized). False: only the quantized rows. Wrong shapes or dtypes raise
        crossbar.InvalidUsage before any traffic (on every rank that passed them).

        topk_idx: [tokens, topk] integer expert ids (-1: none); topk_weights: [tokens, topk]
        (default 1). handle: from an earlier dispatch with the same topk_idx (skips the layout).
        out: an earlier Dispatched you are done with (torch's out= convention): the new result's
        x, x_expert_major, q_payload and q_scales reuse its memory where it is large enough (a
        fresh x of tens of MB costs page faults on every call, as much as decoding it), so
        out's tensors then hold the new result's bytes (or stale ones). Results are the same
        as without it. CPU path only; CUDA results come from torch's caching allocator, which
        reuses memory already, and ignore it.
        """
        if out is not None and not isinstance(out, Dispatched):
            raise TypeError(f"out must be a Dispatched from an earlier dispatch, not {type(out).__name__}")
        idx = topk_idx.to(torch.int64).contiguous()
        w = topk_weights.to(torch.float32).contiguous() if topk_weights is not None else None
        memory = out._memory if out is not None else None
        pre_quantized = isinstance(x, (tuple, list))
        if dequantize is None:
            output = "quantized" if pre_quantized else "config"
        else:
            output = "config" if dequantize else "quantized"
        if output == "quantized" and self.payload == "native":
            raise _usage_error_of(
                "InvalidUsage", "dispatch: the native payload has no quantized form (create the Buffer with "
                "payload='fp8', 'mxfp8' or 'nvfp4')")
        if pre_quantized:
            if self.payload == "native":
                raise _usage_error_of(
                    "InvalidUsage", "dispatch: a pre-quantized x (codes, scales) needs a Buffer with a quantized "
                    "payload (fp8, mxfp8, nvfp4); this one sends x as is")
            want = 3 if self.payload == "nvfp4" else 2
            if len(x) != want:
                raise _usage_error_of(
                    "InvalidUsage", f"dispatch: a pre-quantized {self.payload} x is a tuple of {want} "
                    f"({'codes, scales, global_scale' if want == 3 else 'codes, scales'}), not {len(x)}")
            codes, scales = x[0], x[1]
            if self.payload == "fp8" and isinstance(scales, torch.Tensor) and scales.dtype != torch.float32:
                raise _usage_error_of(
                    "InvalidUsage", f"dispatch: fp8 scales must be float32 [tokens, ceil(hidden / 128)], not {scales.dtype}")
            if self.payload != "fp8" and isinstance(scales, torch.Tensor) and scales.element_size() != 1:
                raise _usage_error_of(
                    "InvalidUsage", f"dispatch: {self.payload} scales are one byte each, not {scales.dtype}")
            g = float(x[2]) if want == 3 else 1.0
            d = self._impl.dispatch(None, idx, w, handle, memory, _as_bytes(codes, "codes"),
                                    _as_bytes(scales, "scales"), g, output)
        else:
            d = self._impl.dispatch(x.contiguous(), idx, w, handle, memory, output=output)
        names = [f.name for f in dataclasses.fields(Dispatched) if not f.name.startswith("q_")]
        fields = {name: d.get(name) for name in names if not name.startswith("_")}
        out = Dispatched(**fields, _memory=d.get("memory"))
        if "q_payload" in d:
            out.q_payload, out.q_scales = _typed(self.payload, d["q_payload"], d["q_scales"])
            out.q_global_scale = d["q_global_scale"]
            if "q_payload_expert_major" in d:
                out.q_payload_expert_major, out.q_scales_expert_major = _typed(
                    self.payload, d["q_payload_expert_major"], d["q_scales_expert_major"])
        return out

    def combine(self, y: torch.Tensor, handle, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Per source token, the sum of its rows' y [num_recv, hidden] (times weights [num_recv]
        when given), accumulated in float32: [tokens, hidden] float32. Collective."""
        if y.dtype not in (torch.bfloat16, torch.float32):
            y = y.to(torch.float32)
        w = weights.to(torch.float32).contiguous() if weights is not None else None
        out, _ = self._impl.combine(y.contiguous(), handle, w)
        return out

    def combine_expert_major(self, y: torch.Tensor, dispatched: Dispatched, weights: torch.Tensor | None = None):
        """combine() of expert-major outputs [expert_rows.numel(), hidden]: each token's rows
        are summed here (times weights per expert-major row, e.g. dispatched.expert_weights)."""
        if self.device.type == "cuda":
            # Summed by a kernel in the CPU path's order (index_add_ on CUDA adds atomically).
            if y.dtype not in (torch.bfloat16, torch.float32):
                y = y.to(torch.float32)
            w = weights.to(torch.float32).contiguous() if weights is not None else None
            out, _ = self._impl.combine_expert_major(y.contiguous(), dispatched.handle, w)
            return out
        rows = torch.zeros(dispatched.num_recv, self.hidden, dtype=torch.float32)
        yf = y.to(torch.float32)
        if weights is not None:
            yf = yf * weights.to(torch.float32).unsqueeze(1)
        rows.index_add_(0, dispatched.expert_rows.to(torch.int64), yf)
        return self.combine(rows, dispatched.handle)
