#include "ffi/common.h"

#include <cuda.h>

#include <climits>

namespace deep_ep_jax {

std::string ShapeString(Dims dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

bool IsShape(Dims dims, std::initializer_list<int64_t> want) {
  if (dims.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want) {
    if (dims[i++] != w) return false;
  }
  return true;
}

ffi::Error Invalid(const char* fn, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(fn) + ": " + what);
}

ffi::Error ExpectShape(const char* fn, const char* name, Dims dims, std::initializer_list<int64_t> want) {
  if (IsShape(dims, want)) return ffi::Error::Success();
  std::string expected = "[";
  size_t i = 0;
  for (int64_t w : want) expected += (i++ ? ", " : "") + std::to_string(w);
  return Invalid(fn, std::string(name) + " must have shape " + expected + "], got " + ShapeString(dims));
}

ffi::Error Launched(const char* fn, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(fn) + ": launch failed: " + cudaGetErrorString(err));
}

ffi::Error CheckCallOrder(const char* fn, ffi::Buffer<ffi::S32> order, ffi::Result<ffi::Buffer<ffi::S32>> order_out,
                          CallOrder* call) {
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "order", order.dimensions(), {1}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "order_out", order_out->dimensions(), {1}));
  *call = CallOrder{order.typed_data(), order_out->typed_data()};
  return ffi::Error::Success();
}

ffi::Error FindBuffer(const char* fn, int64_t buffer_id, int device, const DeviceState** state) {
  *state = FindDeviceState(buffer_id, device);
  if (*state != nullptr) return ffi::Error::Success();
  return Invalid(fn, "buffer " + Str(buffer_id) + " does not exist on device " + Str(device) +
                         " (destroyed, or made for other devices); create the Buffer before tracing");
}

ffi::Error CheckLaunchKnobs(const char* fn, int64_t num_sms, int max_blocks, int64_t num_warps, int max_warps,
                            int64_t timeout_ns) {
  if (num_sms < 1 || num_sms > max_blocks) {
    return Invalid(fn, "num_sms must be in [1, " + Str(max_blocks) + "], got " + Str(num_sms));
  }
  if (num_warps < 1 || num_warps > max_warps) {
    return Invalid(fn, "num_warps must be in [1, " + Str(max_warps) + "], got " + Str(num_warps));
  }
  if (timeout_ns <= 0) return Invalid(fn, "timeout_ns must be positive");
  return ffi::Error::Success();
}

ffi::Error CheckNumExperts(const char* fn, int64_t num_experts, int64_t num_ranks, int64_t max_per_rank,
                           int64_t max_total) {
  if (num_experts <= 0 || num_experts % num_ranks != 0) {
    return Invalid(
        fn, "num_experts (" + Str(num_experts) + ") must be a positive multiple of the " + Str(num_ranks) + " ranks");
  }
  if (num_experts / num_ranks > max_per_rank) {
    return Invalid(fn, "at most " + Str(max_per_rank) + " experts per rank, got " + Str(num_experts / num_ranks));
  }
  if (num_experts > max_total) return Invalid(fn, "at most " + Str(max_total) + " experts, got " + Str(num_experts));
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Normal mode.

namespace {

using PointerGetAttribute = CUresult (*)(void* data, CUpointer_attribute attribute, CUdeviceptr ptr);

// The driver's cuPointerGetAttribute, through the runtime (the module links
// no libcuda); null if the driver lacks it.
PointerGetAttribute DriverPointerGetAttribute() {
  static const PointerGetAttribute fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuPointerGetAttribute", &f, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return PointerGetAttribute(nullptr);
    }
    return reinterpret_cast<PointerGetAttribute>(f);
  }();
  return fn;
}

}  // namespace

// Memory XLA allocates can be shared: cuMemAlloc (legacy IPC), a
// virtual-memory allocation made exportable (XLA's default), or a memory
// pool (cuda_async). Module memory, where XLA keeps a program's constants,
// is none of these, and peers reading it fail with an illegal address.
ffi::Error CheckPeersCanRead(const char* fn, const char* what, const void* ptr) {
  const PointerGetAttribute get = DriverPointerGetAttribute();
  if (get == nullptr || ptr == nullptr) return ffi::Error::Success();  // nothing to ask: trust it
  const CUdeviceptr p = reinterpret_cast<CUdeviceptr>(ptr);
  int ipc = 0;
  uint64_t handle_types = 0;
  void* pool = nullptr;
  if (get(&ipc, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, p) != CUDA_SUCCESS ||
      get(&handle_types, CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, p) != CUDA_SUCCESS ||
      get(&pool, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, p) != CUDA_SUCCESS) {
    return ffi::Error::Success();  // an older driver: trust it
  }
  if (ipc || handle_types || pool) return ffi::Error::Success();
  return Invalid(fn, std::string(what) +
                         " is a constant of the compiled program (XLA keeps constants in module memory, which the "
                         "other GPUs of a one-process EP group cannot read). Pass it to the jitted function as an "
                         "argument, or compute it from one");
}

namespace {

// Bytes per element of a quantized pair's arrays: the element types of config.ROW_FORMATS
// (NVFP4's float4 data arrives as its packed uint8 bytes); 0 for any other.
int64_t PairElementBytes(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F8E4M3FN:
    case ffi::DataType::F8E8M0FNU:
    case ffi::DataType::U8:
      return 1;
    case ffi::DataType::F32:
      return 4;
    default:
      return 0;
  }
}

// x and x_scales as row arrays of num_rows rows: bf16 x with x_scales [rows, 0], or a quantized
// pair whose bytes move as they are (the Python wrapper checks its format); sets the hidden size
// (x's columns).
ffi::Error CheckRows(const char* fn, const ffi::AnyBuffer& x, const ffi::AnyBuffer& scales, int64_t num_rows,
                     RowArrays* rows, int64_t* hidden) {
  const Dims dims = x.dimensions(), scale_dims = scales.dimensions();
  if (dims.size() != 2) return Invalid(fn, "x must be [rows, hidden], got " + ShapeString(dims));
  *hidden = dims[1];
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "x", dims, {num_rows, *hidden}));
  const int64_t num_scales = scale_dims.size() == 2 ? scale_dims[1] : 0;
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "x_scales", scale_dims, {num_rows, num_scales}));
  int64_t data_bytes = 2, scale_bytes = 0;
  if (num_scales == 0) {
    if (x.element_type() != ffi::DataType::BF16) return Invalid(fn, "x must be bf16 when it has no scales");
    DEEP_EP_JAX_RETURN_IF_ERROR(CheckBf16Hidden(fn, *hidden));
  } else {
    data_bytes = PairElementBytes(x.element_type());
    scale_bytes = PairElementBytes(scales.element_type());
    if (data_bytes == 0 || scale_bytes == 0) {
      return Invalid(fn, "x and x_scales must be a quantized pair of deep_ep_jax.config.ROW_FORMATS");
    }
    if (*hidden * data_bytes % 4 != 0 || num_scales * scale_bytes % 4 != 0) {  // the copies move 4-byte words
      return Invalid(fn, "a quantized pair's rows must be whole 4-byte words, got " + Str(*hidden * data_bytes) +
                             " and " + Str(num_scales * scale_bytes) + " bytes");
    }
  }
  rows->data[0] = static_cast<const char*>(x.untyped_data());
  rows->row_bytes[0] = *hidden * data_bytes;
  rows->data[1] = static_cast<const char*>(scales.untyped_data());
  rows->row_bytes[1] = num_scales * scale_bytes;
  return ffi::Error::Success();
}

// Received rows mirror the inputs: x's dtype, num_rows rows.
ffi::Error CheckReceivedRows(const char* fn, const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_scales,
                             ffi::Result<ffi::AnyBuffer>& recv_x, ffi::Result<ffi::AnyBuffer>& recv_x_scales,
                             const NormalShapes& s) {
  if (recv_x->element_type() != x.element_type()) return Invalid(fn, "recv_x must have x's dtype");
  if (recv_x_scales->element_type() != x_scales.element_type()) {
    return Invalid(fn, "recv_x_scales must have x_scales' dtype");
  }
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "recv_x", recv_x->dimensions(), {s.num_rows, s.hidden}));
  return ExpectShape(fn, "recv_x_scales", recv_x_scales->dimensions(), {s.num_rows, x_scales.dimensions()[1]});
}

}  // namespace

ffi::Error CheckBf16Hidden(const char* fn, int64_t hidden) {
  if (hidden % 8 == 0) return ffi::Error::Success();
  return Invalid(fn, "bf16 hidden must be a multiple of 8 (16-byte rows), got " + Str(hidden));
}

ffi::Error CheckRowIndices(const char* fn, const NormalShapes& s, int64_t num_ranks) {
  if (s.num_tokens * num_ranks <= INT_MAX && s.num_tokens * s.num_topk <= INT_MAX &&
      s.num_rows * s.num_topk <= INT_MAX) {
    return ffi::Error::Success();
  }
  return Invalid(fn, "too many tokens for 32-bit row indices");
}

ffi::Error CheckDispatch(const char* fn, int64_t num_ranks, int64_t num_experts, NormalShapes* s, RowArrays* rows,
                         const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_scales, const ffi::Buffer<ffi::S32>& topk_idx,
                         const ffi::Buffer<ffi::F32>& topk_weights, ffi::Result<ffi::AnyBuffer>& recv_x,
                         ffi::Result<ffi::AnyBuffer>& recv_x_scales, ffi::ResultBuffer<ffi::S32>& recv_topk_idx,
                         ffi::ResultBuffer<ffi::F32>& recv_topk_weights, ffi::ResultBuffer<ffi::PRED>& is_token_in_rank,
                         ffi::ResultBuffer<ffi::S32>& num_tokens_per_rank,
                         ffi::ResultBuffer<ffi::S32>& rank_prefix_matrix, ffi::ResultBuffer<ffi::S32>& send_pos,
                         ffi::ResultBuffer<ffi::S32>& recv_src_idx, ffi::ResultBuffer<ffi::S32>& recv_src_rank,
                         ffi::ResultBuffer<ffi::S32>& num_recv_tokens,
                         ffi::ResultBuffer<ffi::S32>& num_recv_tokens_per_expert,
                         ffi::ResultBuffer<ffi::S32>& num_dropped_tokens) {
  const Dims idx_dims = topk_idx.dimensions(), rows_dims = recv_topk_idx->dimensions();
  if (idx_dims.size() != 2) return Invalid(fn, "topk_idx must be [tokens, topk], got " + ShapeString(idx_dims));
  s->num_tokens = idx_dims[0];
  s->num_topk = idx_dims[1];
  s->num_rows = rows_dims.size() == 2 ? rows_dims[0] : -1;
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckRows(fn, x, x_scales, s->num_tokens, rows, &s->hidden));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "topk_weights", topk_weights.dimensions(), {s->num_tokens, s->num_topk}));
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckNumExperts(fn, num_experts, num_ranks, kMaxLocalExperts, INT_MAX));
  if (s->num_rows < 1) return Invalid(fn, "num_worst_tokens must be >= 1");
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckRowIndices(fn, *s, num_ranks));
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckReceivedRows(fn, x, x_scales, recv_x, recv_x_scales, *s));
  const int64_t T = s->num_tokens, N = s->num_rows, K = s->num_topk, R = num_ranks;
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "recv_topk_idx", rows_dims, {N, K}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "recv_topk_weights", recv_topk_weights->dimensions(), {N, K}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "is_token_in_rank", is_token_in_rank->dimensions(), {T, R}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "num_tokens_per_rank", num_tokens_per_rank->dimensions(), {R}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "rank_prefix_matrix", rank_prefix_matrix->dimensions(), {R, R}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "send_pos", send_pos->dimensions(), {T, R}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "recv_src_idx", recv_src_idx->dimensions(), {N}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "recv_src_rank", recv_src_rank->dimensions(), {N}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "num_recv_tokens", num_recv_tokens->dimensions(), {}));
  DEEP_EP_JAX_RETURN_IF_ERROR(
      ExpectShape(fn, "num_recv_tokens_per_expert", num_recv_tokens_per_expert->dimensions(), {num_experts / R}));
  return ExpectShape(fn, "num_dropped_tokens", num_dropped_tokens->dimensions(), {});
}

ffi::Error CheckCachedDispatch(const char* fn, int64_t num_ranks, NormalShapes* s, RowArrays* rows,
                               const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_scales,
                               const ffi::Buffer<ffi::F32>& topk_weights, const ffi::Buffer<ffi::S32>& send_pos,
                               const ffi::Buffer<ffi::S32>& num_recv_tokens, ffi::Result<ffi::AnyBuffer>& recv_x,
                               ffi::Result<ffi::AnyBuffer>& recv_x_scales,
                               ffi::ResultBuffer<ffi::F32>& recv_topk_weights) {
  const Dims pos_dims = send_pos.dimensions(), w_dims = topk_weights.dimensions(), recv_dims = recv_x->dimensions();
  if (pos_dims.size() != 2) return Invalid(fn, "send_pos must be [tokens, ranks], got " + ShapeString(pos_dims));
  if (w_dims.size() != 2) return Invalid(fn, "topk_weights must be [tokens, topk] (topk 0 when absent)");
  if (recv_dims.size() != 2) return Invalid(fn, "recv_x must be [rows, hidden]");
  s->num_tokens = pos_dims[0];
  s->num_topk = w_dims[1];
  s->num_rows = recv_dims[0];
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckRows(fn, x, x_scales, s->num_tokens, rows, &s->hidden));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "send_pos", pos_dims, {s->num_tokens, num_ranks}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "topk_weights", w_dims, {s->num_tokens, s->num_topk}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "num_recv_tokens", num_recv_tokens.dimensions(), {}));
  if (s->num_rows < 1) return Invalid(fn, "recv_x must have at least one row");
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckRowIndices(fn, *s, num_ranks));
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckReceivedRows(fn, x, x_scales, recv_x, recv_x_scales, *s));
  return ExpectShape(fn, "recv_topk_weights", recv_topk_weights->dimensions(), {s->num_rows, s->num_topk});
}

ffi::Error CheckCombine(const char* fn, int64_t num_ranks, NormalShapes* s, const ffi::Buffer<ffi::BF16>& x,
                        const ffi::Buffer<ffi::F32>& topk_weights, const ffi::Buffer<ffi::S32>& send_pos,
                        const ffi::Buffer<ffi::S32>& num_recv_tokens, ffi::ResultBuffer<ffi::BF16>& out,
                        ffi::ResultBuffer<ffi::F32>& out_weights) {
  const Dims x_dims = x.dimensions(), pos_dims = send_pos.dimensions(), w_dims = topk_weights.dimensions();
  if (x_dims.size() != 2) return Invalid(fn, "x must be [rows, hidden], got " + ShapeString(x_dims));
  if (pos_dims.size() != 2) return Invalid(fn, "send_pos must be [tokens, ranks], got " + ShapeString(pos_dims));
  if (w_dims.size() != 2) return Invalid(fn, "topk_weights must be [rows, topk] (topk 0 when absent)");
  s->num_rows = x_dims[0];
  s->hidden = x_dims[1];
  s->num_tokens = pos_dims[0];
  s->num_topk = w_dims[1];
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckBf16Hidden(fn, s->hidden));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "send_pos", pos_dims, {s->num_tokens, num_ranks}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "topk_weights", w_dims, {s->num_rows, s->num_topk}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "num_recv_tokens", num_recv_tokens.dimensions(), {}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "out", out->dimensions(), {s->num_tokens, s->hidden}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "out_weights", out_weights->dimensions(), {s->num_tokens, s->num_topk}));
  return CheckRowIndices(fn, *s, num_ranks);
}

}  // namespace deep_ep_jax
