// Table-driven host decode of quantized MoE payload rows (fp8 block-128, MXFP8, NVFP4).
// Same math as collectives/quant.h's dequantizeRow: the element code's value comes from a
// table of the shared decoder (e4m3BitsToFloat / e2m1BitsToFloat), times the same block
// scale, then the same rounding to T, so the bytes are identical (test_moe_host_codec
// checks every code against dequantizeRow), except which NaN a NaN code times a NaN scale
// gives (a product's operand order is the compiler's choice; the GPU gives its canonical NaN). The scalar decoder rebuilds each element's
// float from its bits; the table makes decode a load and a multiply per element.
#pragma once

#include <cstddef>
#include <cstdint>

#include "collectives/float_types.h"
#include "collectives/quant.h"

namespace crossbar::moe {

// codec: kFp8Block128, kMxfp8 or kNvfp4 (others: dequantizeRow). T: float or BFloat16.
template <class T>
void decodeRowHost(PayloadCodec codec, const uint8_t* payload, const void* scales, size_t hidden, T* out,
                   float global_scale);

// Host encode of one row, the bytes of quantizeRow (checked on every bf16 input pattern by
// test_moe_host_codec). fp8 block-128 and MXFP8 round with lane-parallel selects instead of
// the shared per-element branch (a target subnormal rounds with an exact float addition at
// its quantum), so the compiler vectorizes the loop; kNvfp4 uses quantizeRow.
template <class T>
void encodeRowHost(PayloadCodec codec, const T* x, size_t hidden, uint8_t* payload, void* scales,
                   float global_scale);

}  // namespace crossbar::moe
