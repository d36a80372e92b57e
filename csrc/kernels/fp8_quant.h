// FP8 quantizations (fp8_quant.py's kernels, docs/experts.md): local, no
// peers, no Buffer memory. Every launcher only enqueues work on `stream`.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/limits.h"  // kMaxAmaxStripRows, kAmaxBandCols

namespace deep_ep_jax {

// dst_t [batch, hidden, num_rows]: rows of src [batch, num_src_rows, hidden]
// transposed. Row i is LaunchExpandRows' row (kernels/expert_major.h: token
// row_pair[i] / num_topk, or none), or with row_pair null (batch >= 1) src row
// i. dst_t[b, c, i] = value c of that row, or 0 (the FP8 weight gradient's
// operand, gathered without a row-major copy). src is float8 (copied as
// bytes), or with `quantize` bf16, quantized: fp8(src * row_multipliers[b, i] *
// col_inverse_scales[b, c]), each product rounded, saturated to +-448 (0 where
// the multiplier is 0; row_multipliers null: 1). dst_rows (bf16 src, no
// row_pair; else null): also fp8(src * row_inverse_scales[b, i]) in place
// [batch, num_rows, hidden], from the same read. hidden % 128 == 0.
struct TransposedRows {
  const uint8_t* src;
  const int* row_pair;  // [num_rows], or null
  int num_rows, num_src_rows, num_topk;
  int64_t hidden, batch;
  const float* row_multipliers;     // [batch, num_rows], or null
  const float* col_inverse_scales;  // [batch, hidden]
  const float* row_inverse_scales;  // [batch, num_rows], with dst_rows
  uint8_t* dst_rows;                // [batch, num_rows, hidden], or null
  uint8_t* dst_t;                   // [batch, hidden, num_rows]
};
cudaError_t LaunchTransposedRows(const TransposedRows& rows, bool quantize, cudaStream_t stream);

// The amaxes of x bf16 [batch, num_rows, cols] (cols % 16 == 0), as magnitude
// bits (|v|'s float32 bits, sign cleared: ordered as |v|, NaN above inf):
// row_amax [batch, num_rows] of each row; col_amax_parts [batch, strips, cols]
// of each column of x * row_multipliers ([batch, num_rows], each product
// rounded, 0 where the multiplier is 0; null: x) over each strip of strip_rows
// rows (strips = ceil(num_rows / strip_rows), strip_rows <= kMaxAmaxStripRows).
cudaError_t LaunchAmaxRowsAndColumns(const __nv_bfloat16* x, int64_t batch, int num_rows, int64_t cols,
                                     const float* row_multipliers, int strip_rows, int* row_amax, int* col_amax_parts,
                                     cudaStream_t stream);

// fp8_quant.quantize_rows of bf16 rows, bit for bit: dst float8 [num_rows,
// cols] and scales [num_rows], scale = max(amax, 1e-30) * (1 / 448) (NaN where
// the row holds one), dst = fp8(v * (1 / scale)), 1 / scale correctly rounded.
// The rows are src [num_rows, cols], or with `swiglu` the values bf16(silu(g)
// * u) of src [num_rows, 2 * cols] = [g, u] (XLA's maths: its exp is CUDA's
// expf, its division div.full). cols % 8 == 0.
cudaError_t LaunchQuantizeRows(const __nv_bfloat16* src, int64_t num_rows, int64_t cols, bool swiglu, uint8_t* dst,
                               float* scales, cudaStream_t stream);

}  // namespace deep_ep_jax
