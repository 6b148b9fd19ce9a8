// Kernels of the CUDA MoE executor (moe_cuda.cc) besides the payload codecs (moe_codec.h).
// All pointers are device memory (or peer memory mapped on this device); every launch is
// asynchronous in `stream`. Index arrays are int32 device arrays; null means the identity.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "collectives/dtype.h"

namespace crossbar::moe::cuda {

// dst + (dst_idx ? dst_idx[i] : i) * dst_stride <- src + (src_idx ? src_idx[i] : i) * src_stride,
// `width` bytes, for i < rows.
void copyRows(const void* src, size_t src_stride, const int32_t* src_idx, void* dst, size_t dst_stride,
              const int32_t* dst_idx, size_t width, size_t rows, cudaStream_t stream);

// *global_scale <- nvfp4GlobalScale of (amax, non_finite) when nvfp4, else 1.
void setGlobalScale(const float* amax, const int* non_finite, bool nvfp4, float* global_scale,
                    cudaStream_t stream);

// Header and routing of wire record t (records of `row` bytes): RowHeader{rank, t,
// *global_scale, 0}, topk_idx[t], weights[t] (1 when null) at off_topk / off_w.
void packHeaders(uint8_t* records, size_t row, size_t off_topk, size_t off_w, int rank, const float* global_scale,
                 const int64_t* topk_idx, const float* weights, int topk, size_t tokens, cudaStream_t stream);

// Received records (`rows`, stride `row`) of one forwarder: for output row o = out_rows[p],
// out_w[o * topk + j] = out_idx[o * topk + j] >= 0 ? record weight j : 0; q_global_scale[o]
// (when not null) = the record's global scale.
void receiveWeights(const uint8_t* records, size_t row, size_t off_w, const int32_t* out_rows, size_t rows,
                    int topk, const int64_t* out_idx, float* out_w, float* q_global_scale, cudaStream_t stream);

// out[p] = in[idx[p]] (float gather), p < n.
void gatherFloats(const float* in, const int32_t* idx, float* out, size_t n, cudaStream_t stream);

// Combine, step 1: dst[p * hidden + c] = float(y[rows[p] * hidden + c]) * (w ? w[rows[p]] : 1).
void scaleRowsToF32(const void* y, DataType y_type, const float* w, const int32_t* rows, size_t n, size_t hidden,
                    float* dst, cudaStream_t stream);

// Expert-major combine: out[i * hidden + c] = sum over q in [first[i], first[i+1]) in q order
// of float(y[idx[q] * hidden + c]) * (w ? w[idx[q]] : 1), from 0 (f32).
void sumScaledRows(const void* y, DataType y_type, const float* w, const int32_t* first, const int32_t* idx,
                   size_t n, size_t hidden, float* out, cudaStream_t stream);

// Combine, step 2: acc[i * hidden + c] = sum over q in [first[i], first[i+1]) of
// base[offs[q] + c], summed in q order from 0 (f32); rows i >= bf16_from also go to acc16.
void sumRows(const float* base, const int64_t* offs, const int32_t* first, size_t n, size_t hidden, float* acc,
             uint16_t* acc16, size_t bf16_from, cudaStream_t stream);

// Combine, step 3: out[t * hidden + c] = sum over q in [first[t], first[t+1]) in q order of the
// partial src[q]: (node << 32 | i); node == own_node: own_acc row own_start + i (f32), else
// back row node * back_rows + i (f32, or bf16 when back_bf16).
void sumPartials(const int64_t* src, const int32_t* first, size_t tokens, size_t hidden, int own_node,
                 const float* own_acc, size_t own_start, const void* back, bool back_bf16, size_t back_rows,
                 float* out, cudaStream_t stream);

}  // namespace crossbar::moe::cuda
