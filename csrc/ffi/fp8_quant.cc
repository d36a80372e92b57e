// XLA FFI handlers of the FP8 quantizations (kernels/fp8_quant.h), fp8_quant.py's
// kernels: local targets, no Buffer, no peers; decode, validate, launch.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <string>

#include "ffi/common.h"
#include "kernels/fp8_quant.h"

namespace deep_ep_jax {
namespace {

// x [B, R, C] and row_multipliers [B, R] or [0] (none) of both FP8 targets.
ffi::Error CheckFp8Copies(const char* fn, const Dims& dims, const Dims& multiplier_dims, int64_t col_multiple) {
  if (dims.size() != 3) return Invalid(fn, "x must be [B, R, C], got " + ShapeString(dims));
  if (dims[1] > INT_MAX) return Invalid(fn, "R must be at most INT_MAX, got " + Str(dims[1]));
  if (dims[2] % col_multiple != 0) return Invalid(fn, "C must be a multiple of " + Str(col_multiple));
  if (!IsShape(multiplier_dims, {dims[0], dims[1]}) && !IsShape(multiplier_dims, {0})) {
    return Invalid(fn, "row_multipliers must be [B, R] or [0], got " + ShapeString(multiplier_dims));
  }
  return ffi::Error::Success();
}

const float* OrNull(const ffi::Buffer<ffi::F32>& a) { return a.element_count() == 0 ? nullptr : a.typed_data(); }

}  // namespace

// The two passes of fp8_quant.quantize_rows_and_columns on bf16 x [B, R, C]:
// the amaxes as magnitude bits (kernels/fp8_quant.h), then both copies.
// row_multipliers [B, R], or [0] for none.
static ffi::Error Fp8Amax(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::BF16> x,
                          ffi::Buffer<ffi::F32> row_multipliers, ffi::ResultBuffer<ffi::S32> row_amax,
                          ffi::ResultBuffer<ffi::S32> col_amax_parts, int64_t strip_rows) {
  constexpr const char* fn = "fp8_amax_rows_and_columns";
  const Dims dims = x.dimensions();
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckFp8Copies(fn, dims, row_multipliers.dimensions(), 16));
  if (strip_rows < 1 || strip_rows > kMaxAmaxStripRows) {
    return Invalid(fn, "strip_rows must be in [1, " + Str(kMaxAmaxStripRows) + "], got " + Str(strip_rows));
  }
  const int64_t strips = (dims[1] + strip_rows - 1) / strip_rows;
  const int64_t bands = (dims[2] + kAmaxBandCols - 1) / kAmaxBandCols;
  if (dims[0] * strips * bands > INT_MAX) return Invalid(fn, "B * strips * bands must be at most INT_MAX");
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "row_amax", row_amax->dimensions(), {dims[0], dims[1]}));
  DEEP_EP_JAX_RETURN_IF_ERROR(
      ExpectShape(fn, "col_amax_parts", col_amax_parts->dimensions(), {dims[0], strips, dims[2]}));
  return Launched(fn, LaunchAmaxRowsAndColumns(reinterpret_cast<const __nv_bfloat16*>(x.typed_data()), dims[0],
                                               int(dims[1]), dims[2], OrNull(row_multipliers), int(strip_rows),
                                               row_amax->typed_data(), col_amax_parts->typed_data(), stream));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8AmaxHandler, Fp8Amax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [B, R, C]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // row_multipliers [B, R] or [0]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // row_amax [B, R]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // col_amax_parts [B, strips, C]
                                  .Attr<int64_t>("strip_rows"),
                              {ffi::Traits::kCmdBufferCompatible});

static ffi::Error Fp8RowsAndColumns(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::BF16> x,
                                    ffi::Buffer<ffi::F32> row_multipliers, ffi::Buffer<ffi::F32> row_inverse_scales,
                                    ffi::Buffer<ffi::F32> col_inverse_scales, ffi::Result<ffi::AnyBuffer> rows,
                                    ffi::Result<ffi::AnyBuffer> cols) {
  constexpr const char* fn = "fp8_rows_and_columns";
  const Dims dims = x.dimensions();
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckFp8Copies(fn, dims, row_multipliers.dimensions(), kFp8Block));
  const int64_t batch = dims[0], num_rows = dims[1], hidden = dims[2];
  DEEP_EP_JAX_RETURN_IF_ERROR(
      ExpectShape(fn, "row_inverse_scales", row_inverse_scales.dimensions(), {batch, num_rows}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "col_inverse_scales", col_inverse_scales.dimensions(), {batch, hidden}));
  if (rows->element_type() != ffi::DataType::F8E4M3FN || cols->element_type() != ffi::DataType::F8E4M3FN) {
    return Invalid(fn, "rows and cols must be float8_e4m3fn");
  }
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "rows", rows->dimensions(), {batch, num_rows, hidden}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "cols", cols->dimensions(), {batch, hidden, num_rows}));
  TransposedRows copy{};
  copy.src = static_cast<const uint8_t*>(x.untyped_data());
  copy.num_rows = copy.num_src_rows = int(num_rows);
  copy.num_topk = 1;
  copy.hidden = hidden;
  copy.batch = batch;
  copy.row_multipliers = OrNull(row_multipliers);
  copy.col_inverse_scales = col_inverse_scales.typed_data();
  copy.row_inverse_scales = row_inverse_scales.typed_data();
  copy.dst_rows = static_cast<uint8_t*>(rows->untyped_data());
  copy.dst_t = static_cast<uint8_t*>(cols->untyped_data());
  return Launched(fn, LaunchTransposedRows(copy, true, stream));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8RowsAndColumnsHandler, Fp8RowsAndColumns,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [B, R, C]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // row_multipliers [B, R] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // row_inverse_scales [B, R]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // col_inverse_scales [B, C]
                                  .Ret<ffi::AnyBuffer>()          // rows: FP8 [B, R, C]
                                  .Ret<ffi::AnyBuffer>(),         // cols: FP8 [B, C, R]
                              {ffi::Traits::kCmdBufferCompatible});

// fp8_quant.quantize_rows of bf16 x [..., C] (swiglu: of silu(g) * u of x
// [..., 2C] = [g, u]) into data float8 [..., C] and scales [...].
static ffi::Error Fp8QuantizeRows(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::BF16> x,
                                  ffi::Result<ffi::AnyBuffer> data, ffi::ResultBuffer<ffi::F32> scales, bool swiglu) {
  constexpr const char* fn = "fp8_quantize_rows";
  const Dims dims = x.dimensions();
  if (dims.size() < 1) return Invalid(fn, "x needs a row axis");
  const int64_t cols = swiglu ? dims.back() / 2 : dims.back();
  if (cols % 8 != 0 || (swiglu && dims.back() % 2 != 0)) {
    return Invalid(fn, std::string("C must be a multiple of 8") + (swiglu ? " (x's last axis 2C)" : "") + ", got " +
                           ShapeString(dims));
  }
  const int64_t num_rows = cols == 0 ? 0 : x.element_count() / dims.back();
  if (data->element_type() != ffi::DataType::F8E4M3FN) return Invalid(fn, "data must be float8_e4m3fn");
  if (int64_t(data->element_count()) != num_rows * cols || int64_t(scales->element_count()) != num_rows) {
    return Invalid(
        fn, "data must hold the rows' " + Str(num_rows * cols) + " values, scales their " + Str(num_rows) + " scales");
  }
  return Launched(fn, LaunchQuantizeRows(reinterpret_cast<const __nv_bfloat16*>(x.typed_data()), num_rows, cols, swiglu,
                                         static_cast<uint8_t*>(data->untyped_data()), scales->typed_data(), stream));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8QuantizeRowsHandler, Fp8QuantizeRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x [..., C], or [..., 2C] with swiglu
                                  .Ret<ffi::AnyBuffer>()          // data: FP8 [..., C]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // scales [...]
                                  .Attr<bool>("swiglu"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace deep_ep_jax
