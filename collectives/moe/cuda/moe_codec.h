// MoE payload codecs on the GPU: quantize / dequantize rows of device memory with the same
// per-block math as the host (collectives/quant.h), so a row encoded on the GPU decodes on
// the CPU (and back) to identical bytes. Building block of the CUDA dispatch/combine path:
// the sender quantizes its tokens once into wire rows, the receiver dequantizes them.
//
// All pointers are device memory (or managed / host-registered memory the device can
// read); launches are asynchronous in `stream`. Rows are strided, so a row's payload and
// scales can sit inside a larger wire record (stride = record size).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "collectives/dtype.h"
#include "collectives/quant.h"

namespace crossbar::moe::cuda {

struct RowLayout {
  size_t hidden = 0;
  size_t payload_stride = 0;  // bytes between consecutive rows' payloads
  size_t scale_stride = 0;    // bytes between consecutive rows' scales (4-aligned for kFp8Block128)
  size_t global_scale_stride = sizeof(float);  // bytes between dequantizeRows' per-row global scales
};

// payload/scales of row i <- x[src_rows ? src_rows[i] : i] (x: [*, hidden] of `dtype`,
// kBFloat16 or kFloat32). global_scale: nvfp4's per-tensor scale (ignored otherwise).
// InvalidArgument for a bad dtype or codec (kBFloat16 codec: use a copy).
void quantizeRows(PayloadCodec codec, DataType dtype, const void* x, const int32_t* src_rows, size_t rows,
                  const RowLayout& layout, uint8_t* payload, uint8_t* scales, float global_scale,
                  cudaStream_t stream);

// The same with nvfp4's per-tensor scale read from device memory (stream-ordered: computed
// by an earlier kernel, e.g. tensorAmax + nvfp4GlobalScale).
void quantizeRows(PayloadCodec codec, DataType dtype, const void* x, const int32_t* src_rows, size_t rows,
                  const RowLayout& layout, uint8_t* payload, uint8_t* scales, const float* global_scale,
                  cudaStream_t stream);

// out[dst_rows ? dst_rows[i] : i] <- row i dequantized (out: [*, hidden] of `dtype`).
// global_scales: per-row nvfp4 scale (device, row i's at byte i * layout.global_scale_stride,
// e.g. inside wire records) or null for 1.
void dequantizeRows(PayloadCodec codec, DataType dtype, const uint8_t* payload, const uint8_t* scales,
                    const float* global_scales, size_t rows, const RowLayout& layout, void* out,
                    const int32_t* dst_rows, cudaStream_t stream);

// Per-tensor amax statistics of x ([rows, hidden] of dtype) into *out (device), for
// nvfp4GlobalScale: one float amax (finite values) and one int "non-finite seen" flag.
void tensorAmax(DataType dtype, const void* x, size_t rows, size_t hidden, float* amax, int* non_finite,
                cudaStream_t stream);

}  // namespace crossbar::moe::cuda
