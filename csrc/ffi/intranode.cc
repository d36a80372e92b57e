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
#include <string>

#include "ffi/common.h"
#include "kernels/intranode.h"
#include "runtime/registry.h"

namespace deep_ep_jax {
namespace {

using intranode::LaunchConfig;
using intranode::kMaxRowArrays;

// What each target binds (ffi/registration.h), after the shared parts of
// normal mode (ffi/common.h).
#define INTRANODE_LAUNCH_ATTRS(ATTR)    \
  DEEP_EP_JAX_NORMAL_LAUNCH_ATTRS(ATTR) \
  ATTR(int64_t, chunk_tokens)           \
  ATTR(int64_t, staged)
#define INTRANODE_DISPATCH(ARG, REMAINING_ARGS, RET, ATTR) \
  DEEP_EP_JAX_NORMAL_DISPATCH_ARGS(ARG)                    \
  DEEP_EP_JAX_NORMAL_DISPATCH_RETS(RET)                    \
  ATTR(int64_t, buffer_id)                                 \
  ATTR(int64_t, num_experts)                               \
  INTRANODE_LAUNCH_ATTRS(ATTR)
#define INTRANODE_CACHED_DISPATCH(ARG, REMAINING_ARGS, RET, ATTR) \
  DEEP_EP_JAX_NORMAL_CACHED_DISPATCH_ARGS(ARG)                    \
  DEEP_EP_JAX_NORMAL_CACHED_DISPATCH_RETS(RET)                    \
  ATTR(int64_t, buffer_id)                                        \
  INTRANODE_LAUNCH_ATTRS(ATTR)
#define INTRANODE_COMBINE(ARG, REMAINING_ARGS, RET, ATTR) \
  DEEP_EP_JAX_NORMAL_COMBINE_ARGS(ARG)                    \
  ARG(ffi::Buffer<ffi::S32>, rank_prefix_matrix)          \
  DEEP_EP_JAX_NORMAL_COMBINE_RETS(RET)                    \
  ATTR(int64_t, buffer_id)                                \
  INTRANODE_LAUNCH_ATTRS(ATTR)

// The buffer's state on this device (with a normal region) and the launch
// knobs. Multi-process buffers (state->ipc) are always staged: peers in other
// processes reach only the Buffer's regions, never XLA's buffers.
ffi::Error Prepare(const char* fn, int64_t buffer_id, int device, int64_t num_sms, int64_t num_warps,
                   int64_t timeout_ns, int64_t chunk_tokens, int64_t staged, const DeviceState** state,
                   LaunchConfig* config) {
  DEEP_EP_JAX_RETURN_IF_ERROR(FindBuffer(fn, buffer_id, device, state));
  if ((*state)->normal.local == nullptr) return Invalid(fn, "buffer " + Str(buffer_id) + " has no normal-mode region");
  DEEP_EP_JAX_RETURN_IF_ERROR(
      CheckLaunchKnobs(fn, num_sms, intranode::kMaxBlocks, num_warps, intranode::kMaxWarps, timeout_ns));
  if (chunk_tokens < 1 || chunk_tokens > INT_MAX) {
    return Invalid(fn, "chunk_tokens must be >= 1, got " + Str(chunk_tokens));
  }
  *config = LaunchConfig{int(num_sms), int(num_warps), int(chunk_tokens), uint64_t(timeout_ns),
                         staged != 0 || (*state)->ipc};
  return ffi::Error::Success();
}

// x and x_scales as row arrays of num_rows rows: pointers and bytes per row,
// and the hidden size.
ffi::Error CheckRows(const char* fn, const ffi::AnyBuffer& x, const ffi::AnyBuffer& scales, int64_t num_rows,
                     const char* data[kMaxRowArrays], int64_t row_bytes[kMaxRowArrays], int64_t* hidden) {
  const Dims dims = x.dimensions();
  const bool fp8 = x.element_type() == ffi::DataType::F8E4M3FN;
  if (!fp8 && x.element_type() != ffi::DataType::BF16) return Invalid(fn, "x must be bf16 or float8_e4m3fn");
  if (dims.size() != 2) return Invalid(fn, "x must be [rows, hidden], got " + ShapeString(dims));
  *hidden = dims[1];
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "x", dims, {num_rows, *hidden}));
  if (fp8 && *hidden % 128 != 0) return Invalid(fn, "FP8 hidden must be a multiple of 128, got " + Str(*hidden));
  if (!fp8 && *hidden % 8 != 0) {
    return Invalid(fn, "bf16 hidden must be a multiple of 8 (16-byte rows), got " + Str(*hidden));
  }
  if (scales.element_type() != ffi::DataType::F32) return Invalid(fn, "x_scales must be float32");
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "x_scales", scales.dimensions(), {num_rows, fp8 ? *hidden / 128 : 0}));
  data[0] = static_cast<const char*>(x.untyped_data());
  row_bytes[0] = *hidden * (fp8 ? 1 : 2);
  data[1] = static_cast<const char*>(scales.untyped_data());
  row_bytes[1] = fp8 ? *hidden / 128 * int64_t(sizeof(float)) : 0;
  return ffi::Error::Success();
}

// Staged calls land rows in the normal region: it must hold this call's.
// num_chunks: the chunk records per source a dispatch needs, ceil(tokens /
// chunk_tokens); 0 for combine.
ffi::Error CheckStagedRegion(const char* fn, const DeviceState& state, const LaunchConfig& config, int64_t num_rows,
                             const int64_t row_bytes[kMaxRowArrays], int64_t num_topk, int64_t num_chunks) {
  if (!config.staged) return ffi::Error::Success();
  const size_t need = intranode::StagedRegionBytes(num_rows, row_bytes, int(num_topk), num_chunks);
  if (state.normal.num_bytes >= need) return ffi::Error::Success();
  const char* mode = state.ipc ? "a multi-process buffer (staged mode)" : "staged mode (DEEP_EP_JAX_STAGED=1)";
  return Invalid(fn, std::string(mode) + " needs a normal region of " + Str(need) +
                         " bytes for this call, the buffer has " + Str(state.normal.num_bytes) +
                         "; create the Buffer with a larger num_nvl_bytes");
}

ffi::Error CheckRowIndices(const char* fn, int64_t num_tokens, int64_t num_rows, int64_t num_topk, int64_t num_ranks) {
  if (num_tokens * num_ranks <= INT_MAX && num_tokens * num_topk <= INT_MAX && num_rows * num_topk <= INT_MAX) {
    return ffi::Error::Success();
  }
  return Invalid(fn, "too many tokens for 32-bit row indices");
}

// ---------------------------------------------------------------------------

ffi::Error Dispatch(DEEP_EP_JAX_HANDLER_PARAMS(INTRANODE_DISPATCH)) {
  constexpr const char* fn = "deep_ep_jax_dispatch";
  const DeviceState* state = nullptr;
  LaunchConfig config{};
  DEEP_EP_JAX_RETURN_IF_ERROR(
      Prepare(fn, buffer_id, device, num_sms, num_warps, timeout_ns, chunk_tokens, staged, &state, &config));
  const int64_t num_ranks = state->num_ranks;

  const Dims idx_dims = topk_idx.dimensions();
  if (idx_dims.size() != 2) return Invalid(fn, "topk_idx must be [tokens, topk], got " + ShapeString(idx_dims));
  const int64_t num_tokens = idx_dims[0], num_topk = idx_dims[1];
  const int64_t num_rows = recv_topk_idx->dimensions().size() == 2 ? recv_topk_idx->dimensions()[0] : -1;
  const int64_t experts_per_rank = num_experts / num_ranks;

  intranode::DispatchParams p{};
  int64_t hidden = 0;
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckRows(fn, x, x_scales, num_tokens, p.x, p.row_bytes, &hidden));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "topk_weights", topk_weights.dimensions(), {num_tokens, num_topk}));
  if (num_experts <= 0 || num_experts % num_ranks != 0) {
    return Invalid(fn, "num_experts (" + Str(num_experts) + ") must be a positive multiple of the " + Str(num_ranks) +
                           " ranks");
  }
  if (experts_per_rank > intranode::kMaxLocalExperts) {
    return Invalid(fn, "at most " + Str(intranode::kMaxLocalExperts) + " experts per rank, got " +
                           Str(experts_per_rank));
  }
  if (num_rows < 1) return Invalid(fn, "num_worst_tokens must be >= 1");
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckRowIndices(fn, num_tokens, num_rows, num_topk, num_ranks));
  if (recv_x->element_type() != x.element_type()) return Invalid(fn, "recv_x must have x's dtype");
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "recv_x", recv_x->dimensions(), {num_rows, hidden}));
  DEEP_EP_JAX_RETURN_IF_ERROR(
      ExpectShape(fn, "recv_x_scales", recv_x_scales->dimensions(), {num_rows, x_scales.dimensions()[1]}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "recv_topk_idx", recv_topk_idx->dimensions(), {num_rows, num_topk}));
  DEEP_EP_JAX_RETURN_IF_ERROR(
      ExpectShape(fn, "recv_topk_weights", recv_topk_weights->dimensions(), {num_rows, num_topk}));
  DEEP_EP_JAX_RETURN_IF_ERROR(
      ExpectShape(fn, "is_token_in_rank", is_token_in_rank->dimensions(), {num_tokens, num_ranks}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "num_tokens_per_rank", num_tokens_per_rank->dimensions(), {num_ranks}));
  DEEP_EP_JAX_RETURN_IF_ERROR(
      ExpectShape(fn, "rank_prefix_matrix", rank_prefix_matrix->dimensions(), {num_ranks, num_ranks}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "send_pos", send_pos->dimensions(), {num_tokens, num_ranks}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "recv_src_idx", recv_src_idx->dimensions(), {num_rows}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "recv_src_rank", recv_src_rank->dimensions(), {num_rows}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "num_recv_tokens", num_recv_tokens->dimensions(), {}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "num_recv_tokens_per_expert", num_recv_tokens_per_expert->dimensions(),
                                          {experts_per_rank}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "num_dropped_tokens", num_dropped_tokens->dimensions(), {}));
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckStagedRegion(fn, *state, config, num_rows, p.row_bytes, num_topk,
                                                intranode::NumChunks(num_tokens, config.chunk_tokens)));

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
  return Launched(fn, intranode::LaunchDispatch(*state, p, config, stream));
}

ffi::Error CachedDispatch(DEEP_EP_JAX_HANDLER_PARAMS(INTRANODE_CACHED_DISPATCH)) {
  constexpr const char* fn = "deep_ep_jax_cached_dispatch";
  const DeviceState* state = nullptr;
  LaunchConfig config{};
  DEEP_EP_JAX_RETURN_IF_ERROR(
      Prepare(fn, buffer_id, device, num_sms, num_warps, timeout_ns, chunk_tokens, staged, &state, &config));
  const int64_t num_ranks = state->num_ranks;

  const Dims pos_dims = send_pos.dimensions(), w_dims = topk_weights.dimensions(), recv_dims = recv_x->dimensions();
  if (pos_dims.size() != 2) return Invalid(fn, "send_pos must be [tokens, ranks], got " + ShapeString(pos_dims));
  if (w_dims.size() != 2) return Invalid(fn, "topk_weights must be [tokens, topk] (topk 0 when absent)");
  if (recv_dims.size() != 2) return Invalid(fn, "recv_x must be [rows, hidden]");
  const int64_t num_tokens = pos_dims[0], num_topk = w_dims[1], num_rows = recv_dims[0];

  intranode::CachedDispatchParams p{};
  int64_t hidden = 0;
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckRows(fn, x, x_scales, num_tokens, p.x, p.row_bytes, &hidden));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "send_pos", pos_dims, {num_tokens, num_ranks}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "topk_weights", w_dims, {num_tokens, num_topk}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "num_recv_tokens", num_recv_tokens.dimensions(), {}));
  if (recv_x->element_type() != x.element_type()) return Invalid(fn, "recv_x must have x's dtype");
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "recv_x", recv_dims, {num_rows, hidden}));
  DEEP_EP_JAX_RETURN_IF_ERROR(
      ExpectShape(fn, "recv_x_scales", recv_x_scales->dimensions(), {num_rows, x_scales.dimensions()[1]}));
  DEEP_EP_JAX_RETURN_IF_ERROR(
      ExpectShape(fn, "recv_topk_weights", recv_topk_weights->dimensions(), {num_rows, num_topk}));
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckRowIndices(fn, num_tokens, num_rows, num_topk, num_ranks));
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckStagedRegion(fn, *state, config, num_rows, p.row_bytes, num_topk,
                                                intranode::NumChunks(num_tokens, config.chunk_tokens)));

  p.topk_weights = num_topk > 0 ? topk_weights.typed_data() : nullptr;
  p.send_pos = send_pos.typed_data();
  p.num_recv_tokens = num_recv_tokens.typed_data();
  p.num_tokens = int(num_tokens);
  p.num_topk = int(num_topk);
  p.num_worst_tokens = int(num_rows);
  p.recv.rows[0] = static_cast<char*>(recv_x->untyped_data());
  p.recv.rows[1] = static_cast<char*>(recv_x_scales->untyped_data());
  p.recv.topk_weights = num_topk > 0 ? recv_topk_weights->typed_data() : nullptr;
  return Launched(fn, intranode::LaunchCachedDispatch(*state, p, config, stream));
}

ffi::Error Combine(DEEP_EP_JAX_HANDLER_PARAMS(INTRANODE_COMBINE)) {
  constexpr const char* fn = "deep_ep_jax_combine";
  const DeviceState* state = nullptr;
  LaunchConfig config{};
  DEEP_EP_JAX_RETURN_IF_ERROR(
      Prepare(fn, buffer_id, device, num_sms, num_warps, timeout_ns, chunk_tokens, staged, &state, &config));
  const int64_t num_ranks = state->num_ranks;

  const Dims x_dims = x.dimensions(), pos_dims = send_pos.dimensions(), w_dims = topk_weights.dimensions();
  if (x_dims.size() != 2) return Invalid(fn, "x must be [rows, hidden], got " + ShapeString(x_dims));
  if (pos_dims.size() != 2) return Invalid(fn, "send_pos must be [tokens, ranks], got " + ShapeString(pos_dims));
  if (w_dims.size() != 2) return Invalid(fn, "topk_weights must be [rows, topk] (topk 0 when absent)");
  const int64_t num_rows = x_dims[0], hidden = x_dims[1], num_tokens = pos_dims[0], num_topk = w_dims[1];
  if (hidden % 8 != 0) return Invalid(fn, "bf16 hidden must be a multiple of 8 (16-byte rows), got " + Str(hidden));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "send_pos", pos_dims, {num_tokens, num_ranks}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "topk_weights", w_dims, {num_rows, num_topk}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "num_recv_tokens", num_recv_tokens.dimensions(), {}));
  DEEP_EP_JAX_RETURN_IF_ERROR(
      ExpectShape(fn, "rank_prefix_matrix", rank_prefix_matrix.dimensions(), {num_ranks, num_ranks}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "out", out->dimensions(), {num_tokens, hidden}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "out_weights", out_weights->dimensions(), {num_tokens, num_topk}));
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckRowIndices(fn, num_tokens, num_rows, num_topk, num_ranks));
  const int64_t row_bytes[kMaxRowArrays] = {hidden * 2, 0};
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckStagedRegion(fn, *state, config, num_rows, row_bytes, num_topk, 0));

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
  return Launched(fn, intranode::LaunchCombine(*state, p, config, stream));
}

}  // namespace

DEEP_EP_JAX_FFI_TARGET("deep_ep_jax_dispatch", DispatchHandler, Dispatch, INTRANODE_DISPATCH,
                       {ffi::Traits::kCmdBufferCompatible});
DEEP_EP_JAX_FFI_TARGET("deep_ep_jax_cached_dispatch", CachedDispatchHandler, CachedDispatch, INTRANODE_CACHED_DISPATCH,
                       {ffi::Traits::kCmdBufferCompatible});
DEEP_EP_JAX_FFI_TARGET("deep_ep_jax_combine", CombineHandler, Combine, INTRANODE_COMBINE,
                       {ffi::Traits::kCmdBufferCompatible});

}  // namespace deep_ep_jax
