// XLA FFI handlers of the expert-major rows (kernels/expert_major.h; their
// FP8 transposed gather, kernels/fp8_quant.h): local targets, no Buffer, no peers;
// decode, validate, launch.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "ffi/common.h"
#include "kernels/expert_major.h"
#include "kernels/fp8_quant.h"

namespace deep_ep_jax {

// Each pair's row in the expert-major layout, and the layout's groups.
static ffi::Error ComputeExpertLayout(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> topk_idx,
                                      ffi::ResultBuffer<ffi::S32> group_sizes,
                                      ffi::ResultBuffer<ffi::S32> group_offsets, ffi::ResultBuffer<ffi::S32> pair_row,
                                      ffi::ResultBuffer<ffi::S32> row_pair, ffi::ResultBuffer<ffi::S32> num_dropped,
                                      ffi::ResultBuffer<ffi::S32> pair_counts, int64_t alignment) {
  constexpr const char* fn = "expert_layout";
  const Dims dims = topk_idx.dimensions();
  if (dims.size() != 2) return Invalid(fn, "topk_idx must be [N, K], got " + ShapeString(dims));
  const int64_t num_pairs = dims[0] * dims[1];
  const Dims group_dims = group_sizes->dimensions(), row_dims = row_pair->dimensions();
  if (group_dims.size() != 1 || row_dims.size() != 1) return Invalid(fn, "group_sizes and row_pair must be 1-D");
  const int64_t num_local_experts = group_dims[0], num_rows = row_dims[0];
  if (num_local_experts < 1 || num_local_experts > kMaxLocalExperts) {
    return Invalid(fn, "local experts must be in [1, " + Str(kMaxLocalExperts) + "], got " + Str(num_local_experts));
  }
  if (alignment < 1 || alignment > INT_MAX) {
    return Invalid(fn, "alignment must be in [1, INT_MAX], got " + Str(alignment));
  }
  // Every row index the kernels compute, padding included, fits an int.
  if (num_rows > INT_MAX || num_pairs > INT_MAX || num_pairs + num_local_experts * (alignment - 1) > INT_MAX) {
    return Invalid(fn, "rows, pairs and padding must fit 32-bit row indices");
  }
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "group_offsets", group_offsets->dimensions(), {num_local_experts}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "pair_counts", pair_counts->dimensions(), {num_local_experts}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "pair_row", pair_row->dimensions(), {dims[0], dims[1]}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "num_dropped", num_dropped->dimensions(), {}));
  return Launched(
      fn, LaunchExpertLayout(topk_idx.typed_data(), num_pairs, int(num_local_experts), alignment, int(num_rows),
                             pair_counts->typed_data(), group_sizes->typed_data(), group_offsets->typed_data(),
                             pair_row->typed_data(), row_pair->typed_data(), num_dropped->typed_data(), stream));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(ExpertLayoutHandler, ComputeExpertLayout,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // topk_idx [N, K]: local expert ids
                                  .Ret<ffi::Buffer<ffi::S32>>()  // group_sizes [L]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // group_offsets [L]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // pair_row [N, K]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // row_pair [rows]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // num_dropped []
                                  .Ret<ffi::Buffer<ffi::S32>>()  // pair_counts [L]: scratch
                                  .Attr<int64_t>("alignment"),
                              {ffi::Traits::kCmdBufferCompatible});

static ffi::Error ExpandRows(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer x_scales,
                             ffi::Buffer<ffi::S32> row_pair, ffi::Result<ffi::AnyBuffer> expert_x,
                             ffi::Result<ffi::AnyBuffer> expert_x_scales, int64_t num_topk) {
  constexpr const char* fn = "expand_rows";
  const Dims dims = x.dimensions();
  if (dims.size() != 2) return Invalid(fn, "x must be [N, H], got " + ShapeString(dims));
  const int64_t num_src_rows = dims[0], hidden = dims[1];
  const bool fp8 = x.element_type() == ffi::DataType::F8E4M3FN;
  if (!fp8 && x.element_type() != ffi::DataType::BF16) return Invalid(fn, "x must be bf16 or float8_e4m3fn");
  if (fp8 && hidden % kFp8Block != 0) return Invalid(fn, "FP8 hidden must be a multiple of " + Str(kFp8Block));
  if (!fp8) DEEP_EP_JAX_RETURN_IF_ERROR(CheckBf16Hidden(fn, hidden));
  const int64_t num_scales = fp8 ? hidden / kFp8Block : 0;
  if (x_scales.element_type() != ffi::DataType::F32 || expert_x_scales->element_type() != ffi::DataType::F32) {
    return Invalid(fn, "x_scales and expert_x_scales must be float32");
  }
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "x_scales", x_scales.dimensions(), {num_src_rows, num_scales}));
  const Dims row_dims = row_pair.dimensions();
  if (row_dims.size() != 1 || row_dims[0] > INT_MAX) return Invalid(fn, "row_pair must be [rows] with rows <= INT_MAX");
  const int64_t num_rows = row_dims[0];
  if (num_topk < 1 || num_src_rows * num_topk > INT_MAX) {
    return Invalid(fn, "num_topk must be positive with N * num_topk <= INT_MAX, got " + Str(num_topk));
  }
  if (expert_x->element_type() != x.element_type()) return Invalid(fn, "expert_x must have x's dtype");
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "expert_x", expert_x->dimensions(), {num_rows, hidden}));
  DEEP_EP_JAX_RETURN_IF_ERROR(
      ExpectShape(fn, "expert_x_scales", expert_x_scales->dimensions(), {num_rows, num_scales}));
  ExpandArrays arrays{};
  arrays.src[0] = static_cast<const char*>(x.untyped_data());
  arrays.dst[0] = static_cast<char*>(expert_x->untyped_data());
  arrays.row_bytes[0] = hidden * (fp8 ? 1 : 2);
  arrays.src[1] = static_cast<const char*>(x_scales.untyped_data());
  arrays.dst[1] = static_cast<char*>(expert_x_scales->untyped_data());
  arrays.row_bytes[1] = num_scales * int64_t(sizeof(float));
  return Launched(
      fn, LaunchExpandRows(arrays, row_pair.typed_data(), int(num_rows), int(num_src_rows), int(num_topk), stream));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(ExpandRowsHandler, ExpandRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()         // x: bf16 or FP8 [N, H]
                                  .Arg<ffi::AnyBuffer>()         // x_scales: float32 [N, H / 128], [N, 0] for bf16
                                  .Arg<ffi::Buffer<ffi::S32>>()  // row_pair [rows]
                                  .Ret<ffi::AnyBuffer>()         // expert_x [rows, H]
                                  .Ret<ffi::AnyBuffer>()         // expert_x_scales
                                  .Attr<int64_t>("num_topk"),
                              {ffi::Traits::kCmdBufferCompatible});

// float8 x is copied (row_multipliers and col_inverse_scales [0]); bf16 x is
// quantized with row_multipliers [rows] and col_inverse_scales [H].
static ffi::Error ExpandRowsTransposed(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                       ffi::Buffer<ffi::S32> row_pair, ffi::Buffer<ffi::F32> row_multipliers,
                                       ffi::Buffer<ffi::F32> col_inverse_scales, ffi::Result<ffi::AnyBuffer> expert_x_t,
                                       int64_t num_topk) {
  constexpr const char* fn = "expand_rows_transposed";
  const Dims dims = x.dimensions(), row_dims = row_pair.dimensions();
  if (dims.size() != 2) return Invalid(fn, "x must be [N, H], got " + ShapeString(dims));
  const int64_t num_src_rows = dims[0], hidden = dims[1];
  const bool quantize = x.element_type() == ffi::DataType::BF16;
  if (!quantize && x.element_type() != ffi::DataType::F8E4M3FN) return Invalid(fn, "x must be float8_e4m3fn or bf16");
  if (expert_x_t->element_type() != ffi::DataType::F8E4M3FN) return Invalid(fn, "expert_x_t must be float8_e4m3fn");
  if (hidden % kFp8Block != 0) return Invalid(fn, "hidden must be a multiple of " + Str(kFp8Block));
  if (row_dims.size() != 1 || row_dims[0] > INT_MAX) return Invalid(fn, "row_pair must be [rows] with rows <= INT_MAX");
  const int64_t num_rows = row_dims[0];
  if (num_topk < 1 || num_src_rows * num_topk > INT_MAX) {
    return Invalid(fn, "num_topk must be positive with N * num_topk <= INT_MAX, got " + Str(num_topk));
  }
  DEEP_EP_JAX_RETURN_IF_ERROR(
      ExpectShape(fn, "row_multipliers", row_multipliers.dimensions(), {quantize ? num_rows : 0}));
  DEEP_EP_JAX_RETURN_IF_ERROR(
      ExpectShape(fn, "col_inverse_scales", col_inverse_scales.dimensions(), {quantize ? hidden : 0}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "expert_x_t", expert_x_t->dimensions(), {hidden, num_rows}));
  TransposedRows rows{};
  rows.src = static_cast<const uint8_t*>(x.untyped_data());
  rows.row_pair = row_pair.typed_data();
  rows.num_rows = int(num_rows);
  rows.num_src_rows = int(num_src_rows);
  rows.num_topk = int(num_topk);
  rows.hidden = hidden;
  rows.batch = 1;
  rows.row_multipliers = row_multipliers.typed_data();
  rows.col_inverse_scales = col_inverse_scales.typed_data();
  rows.dst_t = static_cast<uint8_t*>(expert_x_t->untyped_data());
  return Launched(fn, LaunchTransposedRows(rows, quantize, stream));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(ExpandRowsTransposedHandler, ExpandRowsTransposed,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()         // x: FP8 or bf16 [N, H]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // row_pair [rows]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // row_multipliers
                                  .Arg<ffi::Buffer<ffi::F32>>()  // col_inverse_scales
                                  .Ret<ffi::AnyBuffer>()         // expert_x_t: FP8 [H, rows]
                                  .Attr<int64_t>("num_topk"),
                              {ffi::Traits::kCmdBufferCompatible});

// weights [N, K] for the weighted sum, [N, 0] for the plain one.
static ffi::Error ReduceRows(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::BF16> expert_y,
                             ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> pair_row,
                             ffi::ResultBuffer<ffi::BF16> out) {
  constexpr const char* fn = "reduce_rows";
  const Dims y_dims = expert_y.dimensions(), pair_dims = pair_row.dimensions(), w_dims = weights.dimensions();
  if (y_dims.size() != 2) return Invalid(fn, "expert_y must be [rows, H], got " + ShapeString(y_dims));
  if (pair_dims.size() != 2) return Invalid(fn, "pair_row must be [N, K], got " + ShapeString(pair_dims));
  const int64_t num_rows = y_dims[0], hidden = y_dims[1], num_tokens = pair_dims[0], num_topk = pair_dims[1];
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckBf16Hidden(fn, hidden));
  if (num_rows > INT_MAX || num_tokens * num_topk > INT_MAX) return Invalid(fn, "rows must fit 32-bit indices");
  const bool weighted = IsShape(w_dims, {num_tokens, num_topk});
  if (!weighted && !IsShape(w_dims, {num_tokens, 0})) {
    return Invalid(fn, "weights must be [N, K] or [N, 0], got " + ShapeString(w_dims));
  }
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "out", out->dimensions(), {num_tokens, hidden}));
  return Launched(
      fn, LaunchReduceRows(reinterpret_cast<const __nv_bfloat16*>(expert_y.typed_data()), int(num_rows),
                           weighted ? weights.typed_data() : nullptr, pair_row.typed_data(), int(num_tokens),
                           int(num_topk), int(hidden), reinterpret_cast<__nv_bfloat16*>(out->typed_data()), stream));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(ReduceRowsHandler, ReduceRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()   // expert_y [rows, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // weights
                                  .Arg<ffi::Buffer<ffi::S32>>()    // pair_row [N, K]
                                  .Ret<ffi::Buffer<ffi::BF16>>(),  // out [N, H]
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace deep_ep_jax
