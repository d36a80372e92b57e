// XLA FFI handlers of normal-mode dispatch, cached dispatch and combine:
// decode, validate, launch (kernels/intranode.h). Counts stay on the device
// and every call is the same launch sequence, so the handlers are command
// buffer (CUDA graph) compatible.
//
// Row arrays: x is bf16 [T, H] or FP8 e4m3 [T, H]; x_scales is float32
// [T, H / 128] for FP8 and [T, 0] for bf16. Optional top-k weights are passed
// as [rows, 0] when absent. Received outputs mirror the inputs with N rows.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "ffi/bindings.h"
#include "ffi/registration.h"
#include "kernels/intranode.h"
#include "runtime/registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace deep_ep_jax {
namespace {

using intranode::LaunchConfig;
using intranode::kMaxRowArrays;

using Dims = ffi::Span<const int64_t>;

std::string ShapeString(Dims dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

bool SameShape(Dims dims, std::initializer_list<int64_t> want) {
  if (dims.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want) {
    if (dims[i++] != w) return false;
  }
  return true;
}

// Collects the first failed check of a call as an InvalidArgument error.
class Checker {
 public:
  explicit Checker(const char* op) : op_(op) {}

  void Expect(bool ok, const std::string& what) {
    if (!ok && message_.empty()) message_ = std::string(op_) + ": " + what;
  }
  void Shape(const char* name, Dims dims, std::initializer_list<int64_t> want) {
    if (SameShape(dims, want) || !message_.empty()) return;
    std::string expected = "[";
    size_t i = 0;
    for (int64_t w : want) expected += (i++ ? ", " : "") + std::to_string(w);
    message_ = std::string(op_) + ": " + name + " must have shape " + expected + "], got " + ShapeString(dims);
  }
  ffi::Error Result() const {
    return message_.empty() ? ffi::Error::Success() : ffi::Error::InvalidArgument(message_);
  }
  const char* op() const { return op_; }

 private:
  const char* op_;
  std::string message_;
};

// The buffer's state on this device, and the launch knobs, checked.
const DeviceState* FindState(Checker& check, int64_t buffer_id, int32_t device_ordinal) {
  const DeviceState* state = FindDeviceState(buffer_id, device_ordinal);
  check.Expect(state != nullptr, "buffer " + std::to_string(buffer_id) + " has no memory on device " +
                                     std::to_string(device_ordinal) +
                                     " (destroyed, or made for another mesh); create the Buffer before tracing");
  if (state != nullptr) {
    check.Expect(state->normal.local != nullptr, "buffer " + std::to_string(buffer_id) + " has no normal-mode region");
  }
  return state;
}

// Multi-process buffers (state->ipc) are always staged: peers in other
// processes reach only the Buffer's regions, never XLA's buffers.
LaunchConfig MakeConfig(Checker& check, const DeviceState* state, int64_t num_sms, int64_t num_warps,
                        int64_t chunk_tokens, int64_t timeout_ns, int64_t staged) {
  check.Expect(num_sms >= 1 && num_sms <= intranode::kMaxBlocks,
               "num_sms must be in [1, " + std::to_string(intranode::kMaxBlocks) + "], got " + std::to_string(num_sms));
  check.Expect(num_warps >= 1 && num_warps <= intranode::kMaxWarps, "num_warps must be in [1, " +
                                                                          std::to_string(intranode::kMaxWarps) +
                                                                          "], got " + std::to_string(num_warps));
  check.Expect(chunk_tokens >= 1 && chunk_tokens <= INT_MAX, "chunk_tokens must be >= 1, got " + std::to_string(chunk_tokens));
  check.Expect(timeout_ns > 0, "timeout_ns must be positive");
  const bool ipc = state != nullptr && state->ipc;
  return LaunchConfig{int(num_sms), int(num_warps), int(chunk_tokens), uint64_t(timeout_ns), staged != 0 || ipc};
}

// x and x_scales as row arrays: pointers and bytes per row. Returns the hidden size.
int64_t CheckRows(Checker& check, const char* name, const ffi::AnyBuffer& x, const ffi::AnyBuffer& scales,
                  int64_t num_rows, const char* data[kMaxRowArrays], int64_t row_bytes[kMaxRowArrays]) {
  const Dims dims = x.dimensions();
  const bool fp8 = x.element_type() == ffi::DataType::F8E4M3FN;
  check.Expect(fp8 || x.element_type() == ffi::DataType::BF16, std::string(name) + " must be bf16 or float8_e4m3fn");
  check.Expect(dims.size() == 2, std::string(name) + " must be [rows, hidden], got " + ShapeString(dims));
  const int64_t hidden = dims.size() == 2 ? dims[1] : 0;
  check.Shape(name, dims, {num_rows, hidden});
  if (fp8) {
    check.Expect(hidden % 128 == 0, "FP8 hidden must be a multiple of 128, got " + std::to_string(hidden));
  } else {
    check.Expect(hidden % 8 == 0, "bf16 hidden must be a multiple of 8 (16-byte rows), got " + std::to_string(hidden));
  }
  check.Expect(scales.element_type() == ffi::DataType::F32, "x_scales must be float32");
  check.Shape("x_scales", scales.dimensions(), {num_rows, fp8 ? hidden / 128 : 0});
  data[0] = static_cast<const char*>(x.untyped_data());
  row_bytes[0] = hidden * (fp8 ? 1 : 2);
  data[1] = static_cast<const char*>(scales.untyped_data());
  row_bytes[1] = fp8 ? hidden / 128 * int64_t(sizeof(float)) : 0;
  return hidden;
}

// num_chunks: the chunk records per source a dispatch needs, ceil(tokens /
// chunk_tokens); 0 for combine.
void CheckStagedRegion(Checker& check, const DeviceState* state, const LaunchConfig& config, int64_t num_rows,
                       const int64_t row_bytes[kMaxRowArrays], int64_t num_topk, int64_t num_chunks) {
  if (state == nullptr || !config.staged) return;
  const size_t need = intranode::StagedRegionBytes(num_rows, row_bytes, int(num_topk), num_chunks);
  check.Expect(state->normal.num_bytes >= need,
               std::string(state->ipc ? "a multi-process buffer (staged mode)" : "staged mode (DEEP_EP_JAX_STAGED=1)") +
                   " needs a normal region of " + std::to_string(need) +
                   " bytes for this call, the buffer has " + std::to_string(state->normal.num_bytes) +
                   "; create the Buffer with a larger num_nvl_bytes");
}

ffi::Error LaunchError(const char* op, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(op) + ": kernel launch failed: " + cudaGetErrorString(err));
}

// ---------------------------------------------------------------------------

ffi::Error Dispatch(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer x, ffi::AnyBuffer x_scales,
                    ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                    ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_x_scales,
                    ffi::ResultBuffer<ffi::S32> recv_topk_idx, ffi::ResultBuffer<ffi::F32> recv_topk_weights,
                    ffi::ResultBuffer<ffi::PRED> is_token_in_rank, ffi::ResultBuffer<ffi::S32> num_tokens_per_rank,
                    ffi::ResultBuffer<ffi::S32> rank_prefix_matrix, ffi::ResultBuffer<ffi::S32> send_pos,
                    ffi::ResultBuffer<ffi::S32> recv_src_idx, ffi::ResultBuffer<ffi::S32> recv_src_rank,
                    ffi::ResultBuffer<ffi::S32> num_recv_tokens,
                    ffi::ResultBuffer<ffi::S32> num_recv_tokens_per_expert,
                    ffi::ResultBuffer<ffi::S32> num_dropped_tokens, int64_t buffer_id, int64_t num_experts,
                    int64_t num_sms, int64_t num_warps, int64_t chunk_tokens, int64_t timeout_ns, int64_t staged) {
  Checker check("deep_ep_jax_dispatch");
  const DeviceState* state = FindState(check, buffer_id, device_ordinal);
  const LaunchConfig config = MakeConfig(check, state, num_sms, num_warps, chunk_tokens, timeout_ns, staged);
  if (auto err = check.Result(); err.failure()) return err;
  const int64_t num_ranks = state->num_ranks;

  const Dims idx_dims = topk_idx.dimensions();
  check.Expect(idx_dims.size() == 2, "topk_idx must be [tokens, topk], got " + ShapeString(idx_dims));
  if (auto err = check.Result(); err.failure()) return err;
  const int64_t num_tokens = idx_dims[0], num_topk = idx_dims[1];
  const int64_t num_rows = recv_topk_idx->dimensions().size() == 2 ? recv_topk_idx->dimensions()[0] : -1;
  const int64_t experts_per_rank = num_experts / num_ranks;

  intranode::DispatchParams p{};
  const int64_t hidden = CheckRows(check, "x", x, x_scales, num_tokens, p.x, p.row_bytes);
  check.Shape("topk_weights", topk_weights.dimensions(), {num_tokens, num_topk});
  check.Expect(num_experts > 0 && num_experts % num_ranks == 0,
               "num_experts (" + std::to_string(num_experts) + ") must be a positive multiple of the " +
                   std::to_string(num_ranks) + " ranks");
  check.Expect(experts_per_rank <= intranode::kMaxLocalExperts,
               "at most " + std::to_string(intranode::kMaxLocalExperts) + " experts per rank, got " +
                   std::to_string(experts_per_rank));
  check.Expect(num_rows >= 1, "num_worst_tokens must be >= 1");
  check.Expect(num_tokens * num_ranks <= INT_MAX && num_tokens * num_topk <= INT_MAX &&
                   num_rows * num_topk <= INT_MAX,
               "too many tokens for 32-bit row indices");
  check.Expect(recv_x->element_type() == x.element_type(), "recv_x must have x's dtype");
  check.Shape("recv_x", recv_x->dimensions(), {num_rows, hidden});
  check.Shape("recv_x_scales", recv_x_scales->dimensions(), {num_rows, x_scales.dimensions().size() == 2 ? x_scales.dimensions()[1] : 0});
  check.Shape("recv_topk_idx", recv_topk_idx->dimensions(), {num_rows, num_topk});
  check.Shape("recv_topk_weights", recv_topk_weights->dimensions(), {num_rows, num_topk});
  check.Shape("is_token_in_rank", is_token_in_rank->dimensions(), {num_tokens, num_ranks});
  check.Shape("num_tokens_per_rank", num_tokens_per_rank->dimensions(), {num_ranks});
  check.Shape("rank_prefix_matrix", rank_prefix_matrix->dimensions(), {num_ranks, num_ranks});
  check.Shape("send_pos", send_pos->dimensions(), {num_tokens, num_ranks});
  check.Shape("recv_src_idx", recv_src_idx->dimensions(), {num_rows});
  check.Shape("recv_src_rank", recv_src_rank->dimensions(), {num_rows});
  check.Shape("num_recv_tokens", num_recv_tokens->dimensions(), {});
  check.Shape("num_recv_tokens_per_expert", num_recv_tokens_per_expert->dimensions(), {experts_per_rank});
  check.Shape("num_dropped_tokens", num_dropped_tokens->dimensions(), {});
  CheckStagedRegion(check, state, config, num_rows, p.row_bytes, num_topk,
                    intranode::NumChunks(num_tokens, config.chunk_tokens));
  if (auto err = check.Result(); err.failure()) return err;

  p.topk_idx = topk_idx.typed_data();
  p.topk_weights = topk_weights.typed_data();
  p.num_tokens = int(num_tokens);
  p.num_topk = int(num_topk);
  p.num_experts = int(num_experts);
  p.num_worst_tokens = int(num_rows);
  p.is_token_in_rank = is_token_in_rank->typed_data();
  p.num_tokens_per_rank = num_tokens_per_rank->typed_data();
  p.rank_prefix_matrix = rank_prefix_matrix->typed_data();
  p.send_pos = send_pos->typed_data();
  p.recv.rows[0] = static_cast<char*>(recv_x->untyped_data());
  p.recv.rows[1] = static_cast<char*>(recv_x_scales->untyped_data());
  p.recv.topk_idx = recv_topk_idx->typed_data();
  p.recv.topk_weights = recv_topk_weights->typed_data();
  p.recv.src_idx = recv_src_idx->typed_data();
  p.recv_src_rank = recv_src_rank->typed_data();
  p.num_recv_tokens = num_recv_tokens->typed_data();
  p.num_recv_tokens_per_expert = num_recv_tokens_per_expert->typed_data();
  p.num_dropped_tokens = num_dropped_tokens->typed_data();
  return LaunchError(check.op(), intranode::LaunchDispatch(*state, p, config, stream));
}

ffi::Error CachedDispatch(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer x, ffi::AnyBuffer x_scales,
                          ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> send_pos,
                          ffi::Buffer<ffi::S32> num_recv_tokens, ffi::Result<ffi::AnyBuffer> recv_x,
                          ffi::Result<ffi::AnyBuffer> recv_x_scales, ffi::ResultBuffer<ffi::F32> recv_topk_weights,
                          int64_t buffer_id, int64_t num_sms, int64_t num_warps, int64_t chunk_tokens,
                          int64_t timeout_ns, int64_t staged) {
  Checker check("deep_ep_jax_cached_dispatch");
  const DeviceState* state = FindState(check, buffer_id, device_ordinal);
  const LaunchConfig config = MakeConfig(check, state, num_sms, num_warps, chunk_tokens, timeout_ns, staged);
  if (auto err = check.Result(); err.failure()) return err;
  const int64_t num_ranks = state->num_ranks;

  const Dims pos_dims = send_pos.dimensions();
  check.Expect(pos_dims.size() == 2, "send_pos must be [tokens, ranks], got " + ShapeString(pos_dims));
  const Dims w_dims = topk_weights.dimensions();
  check.Expect(w_dims.size() == 2, "topk_weights must be [tokens, topk] (topk 0 when absent)");
  const Dims recv_dims = recv_x->dimensions();
  check.Expect(recv_dims.size() == 2, "recv_x must be [rows, hidden]");
  if (auto err = check.Result(); err.failure()) return err;
  const int64_t num_tokens = pos_dims[0], num_topk = w_dims[1], num_rows = recv_dims[0];

  intranode::CachedDispatchParams p{};
  const int64_t hidden = CheckRows(check, "x", x, x_scales, num_tokens, p.x, p.row_bytes);
  check.Shape("send_pos", pos_dims, {num_tokens, num_ranks});
  check.Shape("topk_weights", w_dims, {num_tokens, num_topk});
  check.Shape("num_recv_tokens", num_recv_tokens.dimensions(), {});
  check.Expect(recv_x->element_type() == x.element_type(), "recv_x must have x's dtype");
  check.Shape("recv_x", recv_dims, {num_rows, hidden});
  check.Shape("recv_x_scales", recv_x_scales->dimensions(), {num_rows, x_scales.dimensions().size() == 2 ? x_scales.dimensions()[1] : 0});
  check.Shape("recv_topk_weights", recv_topk_weights->dimensions(), {num_rows, num_topk});
  check.Expect(num_tokens * num_ranks <= INT_MAX && num_rows * num_topk <= INT_MAX && num_tokens * num_topk <= INT_MAX,
               "too many tokens for 32-bit row indices");
  CheckStagedRegion(check, state, config, num_rows, p.row_bytes, num_topk,
                    intranode::NumChunks(num_tokens, config.chunk_tokens));
  if (auto err = check.Result(); err.failure()) return err;

  p.topk_weights = num_topk > 0 ? topk_weights.typed_data() : nullptr;
  p.send_pos = send_pos.typed_data();
  p.num_recv_tokens = num_recv_tokens.typed_data();
  p.num_tokens = int(num_tokens);
  p.num_topk = int(num_topk);
  p.num_worst_tokens = int(num_rows);
  p.recv.rows[0] = static_cast<char*>(recv_x->untyped_data());
  p.recv.rows[1] = static_cast<char*>(recv_x_scales->untyped_data());
  p.recv.topk_weights = num_topk > 0 ? recv_topk_weights->typed_data() : nullptr;
  return LaunchError(check.op(), intranode::LaunchCachedDispatch(*state, p, config, stream));
}

ffi::Error Combine(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::BF16> x,
                   ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> send_pos,
                   ffi::Buffer<ffi::S32> num_recv_tokens, ffi::Buffer<ffi::S32> rank_prefix_matrix,
                   ffi::ResultBuffer<ffi::BF16> out, ffi::ResultBuffer<ffi::F32> out_weights, int64_t buffer_id,
                   int64_t num_sms, int64_t num_warps, int64_t chunk_tokens, int64_t timeout_ns, int64_t staged) {
  Checker check("deep_ep_jax_combine");
  const DeviceState* state = FindState(check, buffer_id, device_ordinal);
  const LaunchConfig config = MakeConfig(check, state, num_sms, num_warps, chunk_tokens, timeout_ns, staged);
  if (auto err = check.Result(); err.failure()) return err;
  const int64_t num_ranks = state->num_ranks;

  const Dims x_dims = x.dimensions(), pos_dims = send_pos.dimensions(), w_dims = topk_weights.dimensions();
  check.Expect(x_dims.size() == 2, "x must be [rows, hidden], got " + ShapeString(x_dims));
  check.Expect(pos_dims.size() == 2, "send_pos must be [tokens, ranks], got " + ShapeString(pos_dims));
  check.Expect(w_dims.size() == 2, "topk_weights must be [rows, topk] (topk 0 when absent)");
  if (auto err = check.Result(); err.failure()) return err;
  const int64_t num_rows = x_dims[0], hidden = x_dims[1], num_tokens = pos_dims[0], num_topk = w_dims[1];
  check.Expect(hidden % 8 == 0, "bf16 hidden must be a multiple of 8 (16-byte rows), got " + std::to_string(hidden));
  check.Shape("send_pos", pos_dims, {num_tokens, num_ranks});
  check.Shape("topk_weights", w_dims, {num_rows, num_topk});
  check.Shape("num_recv_tokens", num_recv_tokens.dimensions(), {});
  check.Shape("rank_prefix_matrix", rank_prefix_matrix.dimensions(), {num_ranks, num_ranks});
  check.Shape("out", out->dimensions(), {num_tokens, hidden});
  check.Shape("out_weights", out_weights->dimensions(), {num_tokens, num_topk});
  check.Expect(num_tokens * num_ranks <= INT_MAX && num_rows * num_topk <= INT_MAX && num_tokens * num_topk <= INT_MAX,
               "too many tokens for 32-bit row indices");
  const int64_t row_bytes[kMaxRowArrays] = {hidden * 2, 0};
  CheckStagedRegion(check, state, config, num_rows, row_bytes, num_topk, 0);
  if (auto err = check.Result(); err.failure()) return err;

  intranode::CombineParams p{};
  p.x = x.typed_data();
  p.topk_weights = num_topk > 0 ? topk_weights.typed_data() : nullptr;
  p.send_pos = send_pos.typed_data();
  p.num_recv_tokens = num_recv_tokens.typed_data();
  p.rank_prefix_matrix = rank_prefix_matrix.typed_data();
  p.num_tokens = int(num_tokens);
  p.hidden = int(hidden);
  p.num_topk = int(num_topk);
  p.num_worst_tokens = int(num_rows);
  p.out = out->typed_data();
  p.out_weights = num_topk > 0 ? out_weights->typed_data() : nullptr;
  return LaunchError(check.op(), intranode::LaunchCombine(*state, p, config, stream));
}

}  // namespace

// Launch knobs every handler of this file takes (cuda_normal.py's _launch_attrs).
#define DEEP_EP_JAX_LAUNCH_ATTRS \
  .Attr<int64_t>("num_sms")      \
  .Attr<int64_t>("num_warps")    \
  .Attr<int64_t>("chunk_tokens") \
  .Attr<int64_t>("timeout_ns")   \
  .Attr<int64_t>("staged")

XLA_FFI_DEFINE_HANDLER_SYMBOL(DispatchHandler, Dispatch,
                              ffi::Ffi::Bind() DEEP_EP_JAX_STREAM_AND_DEVICE DEEP_EP_JAX_NORMAL_DISPATCH_ARGS
                                  DEEP_EP_JAX_NORMAL_DISPATCH_RETS
                                  .Attr<int64_t>("buffer_id")
                                  .Attr<int64_t>("num_experts") DEEP_EP_JAX_LAUNCH_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(CachedDispatchHandler, CachedDispatch,
                              ffi::Ffi::Bind() DEEP_EP_JAX_STREAM_AND_DEVICE DEEP_EP_JAX_NORMAL_CACHED_DISPATCH_ARGS
                                  DEEP_EP_JAX_NORMAL_CACHED_DISPATCH_RETS
                                  .Attr<int64_t>("buffer_id") DEEP_EP_JAX_LAUNCH_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(CombineHandler, Combine,
                              ffi::Ffi::Bind() DEEP_EP_JAX_STREAM_AND_DEVICE DEEP_EP_JAX_NORMAL_COMBINE_ARGS
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rank_prefix_matrix
                                  DEEP_EP_JAX_NORMAL_COMBINE_RETS
                                  .Attr<int64_t>("buffer_id") DEEP_EP_JAX_LAUNCH_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});

DEEP_EP_JAX_REGISTER_FFI_TARGET("deep_ep_jax_dispatch", DispatchHandler);
DEEP_EP_JAX_REGISTER_FFI_TARGET("deep_ep_jax_cached_dispatch", CachedDispatchHandler);
DEEP_EP_JAX_REGISTER_FFI_TARGET("deep_ep_jax_combine", CombineHandler);

}  // namespace deep_ep_jax
