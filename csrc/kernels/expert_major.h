// Expert-major rows (docs/design.md, "Expert-major rows"): a rank's received
// rows regrouped by local expert, and their weighted reduction back. Local:
// no peers, no Buffer memory. Every launcher only enqueues work on `stream`.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/limits.h"  // kMaxLocalExperts, kMaxRowArrays, kMaxAmaxStripRows

namespace deep_ep_jax {

// Pair p = n * K + k of topk_idx int32 [num_pairs = N * K] names local expert
// topk_idx[p] (ids outside [0, num_local_experts) name none). Group e starts at
// offset(e) = sum over e' < e of AlignUp(count(e'), alignment) and holds e's
// pairs in p order; rows from num_rows on are dropped. Writes group_sizes [L]
// (rows of e below num_rows), group_offsets [L] (min(offset(e), num_rows)),
// pair_row [num_pairs] (-1: none or dropped), row_pair [num_rows] (-1: unused)
// and num_dropped [1]; pair_counts [L] is scratch. Deterministic: one block per
// expert places its pairs with block-wide prefix sums, no atomics decide an order.
cudaError_t LaunchExpertLayout(const int* topk_idx, int64_t num_pairs, int num_local_experts, int64_t alignment,
                               int num_rows, int* pair_counts, int* group_sizes, int* group_offsets, int* pair_row,
                               int* row_pair, int* num_dropped, cudaStream_t stream);

// Row i of each dst array = row row_pair[i] / num_topk of the src array, or
// zeros where row_pair[i] is outside [0, num_src_rows * num_topk). Arrays with
// row_bytes 0 are skipped; row_bytes are multiples of 4.
struct ExpandArrays {
  const char* src[kMaxRowArrays];
  char* dst[kMaxRowArrays];
  int64_t row_bytes[kMaxRowArrays];
};
cudaError_t LaunchExpandRows(const ExpandArrays& arrays, const int* row_pair, int num_rows, int num_src_rows,
                             int num_topk, cudaStream_t stream);

// dst_t [batch, hidden, num_rows]: rows of src [batch, num_src_rows, hidden]
// transposed. Row i is LaunchExpandRows' row (token row_pair[i] / num_topk,
// or none), or with row_pair null (batch >= 1) src row i. dst_t[b, c, i] =
// value c of that row, or 0 (the FP8 weight gradient's operand, gathered
// without a row-major copy). src is float8 (copied as bytes), or with
// `quantize` bf16, quantized: fp8(src * row_multipliers[b, i] *
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
                                     const float* row_multipliers, int strip_rows, int* row_amax,
                                     int* col_amax_parts, cudaStream_t stream);

// fp8_quant.quantize_rows of bf16 rows, bit for bit: dst float8 [num_rows,
// cols] and scales [num_rows], scale = max(amax, 1e-30) * (1 / 448) (NaN where
// the row holds one), dst = fp8(v * (1 / scale)), 1 / scale correctly rounded.
// The rows are src [num_rows, cols], or with `swiglu` the values bf16(silu(g)
// * u) of src [num_rows, 2 * cols] = [g, u] (XLA's maths: its exp is CUDA's
// expf, its division div.full). cols % 8 == 0.
cudaError_t LaunchQuantizeRows(const __nv_bfloat16* src, int64_t num_rows, int64_t cols, bool swiglu, uint8_t* dst,
                               float* scales, cudaStream_t stream);

// out[n] = bf16(0 + term(n, 0) + term(n, 1) + ...) in float32 over k with
// pair_row[n, k] in [0, num_rows): term = weight * float32(expert_y row),
// rounded to float32 before the add (no fused multiply-add), or the row
// itself when weights is null. hidden % 8 == 0 (16-byte rows).
cudaError_t LaunchReduceRows(const __nv_bfloat16* expert_y, int num_rows, const float* weights, const int* pair_row,
                             int num_tokens, int num_topk, int hidden, __nv_bfloat16* out, cudaStream_t stream);

}  // namespace deep_ep_jax
