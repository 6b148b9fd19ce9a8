"""A Triton kernel over crossbar.symm.rendezvous's pointer table, the way kernels written for
torch's SymmetricMemory use ``buffer_ptrs_dev``: test_symm_handle.py runs it in Triton's
interpreter on CPU tensors (TRITON_INTERPRET=1 before this module is imported), and
test_symm_cuda.py compiled on CUDA tensors. Importing it needs triton."""

import triton
import triton.language as tl


@triton.jit
def put_kernel(ptrs_dev, rank, value_base):
    # Program p stores value_base + p into element [rank] of rank p's copy: the address of the
    # tensor's first element in p's copy is entry p of the table at ptrs_dev.
    p = tl.program_id(0)
    table = ptrs_dev.to(tl.pointer_type(tl.int64))
    dst = tl.load(table + p).to(tl.pointer_type(tl.float32))
    tl.store(dst + rank, (value_base + p).to(tl.float32))


@triton.jit
def signal_kernel(slot_ptr):
    # Stores the next value of a signal pad counter (this rank is its only writer), with
    # release order at system scope, after the data this rank wrote before it.
    slot = slot_ptr.to(tl.pointer_type(tl.int64))
    tl.atomic_add(slot, 1, sem="release", scope="sys")


@triton.jit
def handle_signal_kernel(handle_dev, to, rank, pads_word, stride_word):
    # Signals rank `to` through a crossbar::cuda::SymmDeviceHandle copied to the GPU, as the
    # struct's outboxSlot(to) does: signal_pads[to] + rank * signal_stride (uint64 words).
    # pads_word / stride_word: where signal_pads (uint64 words) and signal_stride (int32 words)
    # are in the struct (crossbar.symm.DEVICE_HANDLE_LAYOUT).
    words = handle_dev.to(tl.pointer_type(tl.int64))
    pad = tl.load(words + pads_word + to).to(tl.pointer_type(tl.int64))
    stride = tl.load(handle_dev.to(tl.pointer_type(tl.int32)) + stride_word)
    tl.atomic_add(pad + rank * stride, 1, sem="release", scope="sys")
