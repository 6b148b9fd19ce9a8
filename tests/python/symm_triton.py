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
