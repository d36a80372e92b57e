// XLA FFI handlers of normal mode for an EP group across hosts (kernels/
// internode.h): dispatch, cached dispatch (combine's backward) and combine.
// Shapes are checked at trace time (deep_ep_jax/backends/cuda_internode.py);
// here: the buffer, the region's size, then launch. Counts stay on the device
// and every call is the same launch sequence: command-buffer compatible.
// Without NVSHMEM in the build the handlers exist (same targets everywhere)
// and fail with a message.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi/bindings.h"
#include "ffi/registration.h"
#include "kernels/internode.h"
#include "runtime/registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace deep_ep_jax {
namespace {

using internode::kMaxRowArrays;

std::string Str(int64_t v) { return std::to_string(v); }

ffi::Error Invalid(const char* fn, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(fn) + ": " + what);
}

// The buffer's state on this device (an NVSHMEM buffer with a normal region) and the launch knobs.
ffi::Error Prepare(const char* fn, int64_t buffer_id, int device, int64_t num_sms, int64_t num_warps,
                   int64_t timeout_ns, const DeviceState** state, internode::LaunchConfig* config) {
  *state = FindDeviceState(buffer_id, device);
  if (*state == nullptr) {
    return Invalid(fn, "buffer " + Str(buffer_id) + " does not exist on device " + Str(device) +
                           " (destroyed, or made for other devices)");
  }
  if (!(*state)->nvshmem || (*state)->normal.local == nullptr) {
    return Invalid(fn, "the buffer is not an NVSHMEM buffer with a normal region (an EP group across hosts)");
  }
#ifndef DEEP_EP_JAX_WITH_NVSHMEM
  return Invalid(fn, "the extension was built without NVSHMEM");
#endif
  if (num_sms < 1 || num_sms > internode::kMaxBlocks || num_warps < 1 || num_warps > internode::kMaxWarps ||
      timeout_ns <= 0) {
    return Invalid(fn, "num_sms must be in [1, " + Str(internode::kMaxBlocks) + "], num_warps in [1, " +
                           Str(internode::kMaxWarps) + "], timeout_ns > 0");
  }
  *config = internode::LaunchConfig{int(num_sms), int(num_warps), uint64_t(timeout_ns)};
  return ffi::Error::Success();
}

ffi::Error CheckRegion(const char* fn, const DeviceState& state, size_t needed) {
  if (needed > state.normal.num_bytes) {
    return Invalid(fn, "the normal region of a buffer across hosts is too small for these shapes: needs " +
                           Str(needed) + " bytes, has " + Str(state.normal.num_bytes) +
                           "; create the Buffer with num_nvl_bytes >= cuda_internode.internode_region_bytes(...) "
                           "(or matching hidden=/num_max_tokens hints)");
  }
  return ffi::Error::Success();
}

ffi::Error Launched(const char* fn, cudaError_t err) {
  if (err != cudaSuccess) return ffi::Error::Internal(std::string(fn) + ": launch failed: " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// Rows of x and of its scales (0 bytes for bf16).
void RowArrays(const ffi::AnyBuffer& x, const ffi::AnyBuffer& scales, const char* data[kMaxRowArrays],
               int64_t row_bytes[kMaxRowArrays]) {
  const auto dims = x.dimensions();
  const auto scale_dims = scales.dimensions();
  const bool fp8 = x.element_type() == ffi::DataType::F8E4M3FN;
  data[0] = static_cast<const char*>(x.untyped_data());
  row_bytes[0] = dims[1] * (fp8 ? 1 : 2);
  data[1] = static_cast<const char*>(scales.untyped_data());
  row_bytes[1] = scale_dims[1] * int64_t(sizeof(float));
}

size_t DispatchBytes(const DeviceState& state, const internode::DispatchParams& p) {
#ifdef DEEP_EP_JAX_WITH_NVSHMEM
  const internode::Shapes s{p.num_tokens, p.num_worst_tokens, p.num_topk, {p.row_bytes[0], p.row_bytes[1]}};
  return internode::DispatchRegionBytes(s, state.num_ranks, state.num_nodes);
#else
  return 0;
#endif
}

cudaError_t RunDispatch(const DeviceState& state, const internode::DispatchParams& p,
                           const internode::LaunchConfig& c, cudaStream_t stream) {
#ifdef DEEP_EP_JAX_WITH_NVSHMEM
  return internode::LaunchDispatch(state, p, c, stream);
#else
  return cudaErrorNotSupported;
#endif
}

// ---------------------------------------------------------------------------

ffi::Error Dispatch(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer x_scales,
                    ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                    ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_x_scales,
                    ffi::ResultBuffer<ffi::S32> recv_topk_idx, ffi::ResultBuffer<ffi::F32> recv_topk_weights,
                    ffi::ResultBuffer<ffi::PRED> is_token_in_rank, ffi::ResultBuffer<ffi::S32> num_tokens_per_rank,
                    ffi::ResultBuffer<ffi::S32> rank_prefix_matrix, ffi::ResultBuffer<ffi::S32> send_pos,
                    ffi::ResultBuffer<ffi::S32> recv_src_idx, ffi::ResultBuffer<ffi::S32> recv_src_rank,
                    ffi::ResultBuffer<ffi::S32> num_recv_tokens,
                    ffi::ResultBuffer<ffi::S32> num_recv_tokens_per_expert,
                    ffi::ResultBuffer<ffi::S32> num_dropped_tokens, ffi::ResultBuffer<ffi::S32> node_pos,
                    int64_t buffer_id, int64_t num_experts, int64_t num_sms, int64_t num_warps, int64_t timeout_ns) {
  const char* fn = "deep_ep_jax_internode_dispatch";
  const DeviceState* state = nullptr;
  internode::LaunchConfig config{};
  if (auto err = Prepare(fn, buffer_id, device, num_sms, num_warps, timeout_ns, &state, &config); err.failure()) {
    return err;
  }
  internode::DispatchParams p{};
  RowArrays(x, x_scales, p.x, p.row_bytes);
  p.topk_idx = topk_idx.typed_data();
  p.topk_weights = topk_weights.typed_data();
  p.num_tokens = int(topk_idx.dimensions()[0]);
  p.num_topk = int(topk_idx.dimensions()[1]);
  p.num_experts = int(num_experts);
  p.num_worst_tokens = int(recv_src_idx->dimensions()[0]);
  p.is_token_in_rank = is_token_in_rank->typed_data();
  p.num_tokens_per_rank = num_tokens_per_rank->typed_data();
  p.rank_prefix_matrix = rank_prefix_matrix->typed_data();
  p.send_pos = send_pos->typed_data();
  p.node_pos = node_pos->typed_data();
  p.recv_x[0] = static_cast<char*>(recv_x->untyped_data());
  p.recv_x[1] = static_cast<char*>(recv_x_scales->untyped_data());
  p.recv_topk_idx = recv_topk_idx->typed_data();
  p.recv_topk_weights = recv_topk_weights->typed_data();
  p.recv_src_idx = recv_src_idx->typed_data();
  p.recv_src_rank = recv_src_rank->typed_data();
  p.num_recv_tokens = num_recv_tokens->typed_data();
  p.num_recv_tokens_per_expert = num_recv_tokens_per_expert->typed_data();
  p.num_dropped_tokens = num_dropped_tokens->typed_data();
  if (auto err = CheckRegion(fn, *state, DispatchBytes(*state, p)); err.failure()) return err;
  return Launched(fn, RunDispatch(*state, p, config, stream));
}

ffi::Error CachedDispatch(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer x_scales,
                          ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> send_pos,
                          ffi::Buffer<ffi::S32> num_recv_tokens, ffi::Result<ffi::AnyBuffer> recv_x,
                          ffi::Result<ffi::AnyBuffer> recv_x_scales, ffi::ResultBuffer<ffi::F32> recv_topk_weights,
                          ffi::ResultBuffer<ffi::S32> node_pos, int64_t buffer_id, int64_t num_sms, int64_t num_warps,
                          int64_t timeout_ns) {
  const char* fn = "deep_ep_jax_internode_cached_dispatch";
  const DeviceState* state = nullptr;
  internode::LaunchConfig config{};
  if (auto err = Prepare(fn, buffer_id, device, num_sms, num_warps, timeout_ns, &state, &config); err.failure()) {
    return err;
  }
  internode::DispatchParams p{};
  RowArrays(x, x_scales, p.x, p.row_bytes);
  const int num_topk = int(topk_weights.dimensions()[1]);
  p.topk_weights = num_topk > 0 ? topk_weights.typed_data() : nullptr;
  p.cached_send_pos = send_pos.typed_data();
  p.cached_num_recv_tokens = num_recv_tokens.typed_data();
  p.num_tokens = int(send_pos.dimensions()[0]);
  p.num_topk = num_topk;
  p.num_worst_tokens = int(recv_x->dimensions()[0]);
  p.node_pos = node_pos->typed_data();
  p.recv_x[0] = static_cast<char*>(recv_x->untyped_data());
  p.recv_x[1] = static_cast<char*>(recv_x_scales->untyped_data());
  p.recv_topk_weights = num_topk > 0 ? recv_topk_weights->typed_data() : nullptr;
  if (auto err = CheckRegion(fn, *state, DispatchBytes(*state, p)); err.failure()) return err;
  return Launched(fn, RunDispatch(*state, p, config, stream));
}

ffi::Error Combine(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::F32> topk_weights,
                   ffi::Buffer<ffi::S32> send_pos, ffi::Buffer<ffi::S32> num_recv_tokens,
                   ffi::Buffer<ffi::S32> recv_src_idx, ffi::Buffer<ffi::S32> recv_src_rank,
                   ffi::ResultBuffer<ffi::BF16> out, ffi::ResultBuffer<ffi::F32> out_weights, int64_t buffer_id,
                   int64_t num_sms, int64_t num_warps, int64_t timeout_ns) {
  const char* fn = "deep_ep_jax_internode_combine";
  const DeviceState* state = nullptr;
  internode::LaunchConfig config{};
  if (auto err = Prepare(fn, buffer_id, device, num_sms, num_warps, timeout_ns, &state, &config); err.failure()) {
    return err;
  }
  internode::CombineParams p{};
  const int num_topk = int(topk_weights.dimensions()[1]);
  p.x = reinterpret_cast<const uint16_t*>(x.typed_data());
  p.topk_weights = num_topk > 0 ? topk_weights.typed_data() : nullptr;
  p.send_pos = send_pos.typed_data();
  p.num_recv_tokens = num_recv_tokens.typed_data();
  p.recv_src_idx = recv_src_idx.typed_data();
  p.recv_src_rank = recv_src_rank.typed_data();
  p.num_tokens = int(send_pos.dimensions()[0]);
  p.hidden = int(x.dimensions()[1]);
  p.num_topk = num_topk;
  p.num_worst_tokens = int(x.dimensions()[0]);
  p.out = reinterpret_cast<uint16_t*>(out->typed_data());
  p.out_weights = num_topk > 0 ? out_weights->typed_data() : nullptr;
#ifdef DEEP_EP_JAX_WITH_NVSHMEM
  const internode::Shapes s{p.num_tokens, p.num_worst_tokens, p.num_topk, {int64_t(p.hidden) * 2, 0}};
  if (auto err = CheckRegion(fn, *state, internode::CombineRegionBytes(s, state->num_ranks)); err.failure()) return err;
  return Launched(fn, internode::LaunchCombine(*state, p, config, stream));
#else
  (void)p;
  return Launched(fn, cudaErrorNotSupported);
#endif
}

}  // namespace

// Launch knobs every handler of this file takes.
#define DEEP_EP_JAX_LAUNCH_ATTRS \
  .Attr<int64_t>("num_sms")      \
  .Attr<int64_t>("num_warps")    \
  .Attr<int64_t>("timeout_ns")

XLA_FFI_DEFINE_HANDLER_SYMBOL(InternodeDispatchHandler, Dispatch,
                              ffi::Ffi::Bind() DEEP_EP_JAX_STREAM_AND_DEVICE DEEP_EP_JAX_NORMAL_DISPATCH_ARGS
                                  DEEP_EP_JAX_NORMAL_DISPATCH_RETS
                                  .Ret<ffi::Buffer<ffi::S32>>()  // node_pos (scratch)
                                  .Attr<int64_t>("buffer_id")
                                  .Attr<int64_t>("num_experts") DEEP_EP_JAX_LAUNCH_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(InternodeCachedDispatchHandler, CachedDispatch,
                              ffi::Ffi::Bind() DEEP_EP_JAX_STREAM_AND_DEVICE DEEP_EP_JAX_NORMAL_CACHED_DISPATCH_ARGS
                                  DEEP_EP_JAX_NORMAL_CACHED_DISPATCH_RETS
                                  .Ret<ffi::Buffer<ffi::S32>>()  // node_pos (scratch)
                                  .Attr<int64_t>("buffer_id") DEEP_EP_JAX_LAUNCH_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(InternodeCombineHandler, Combine,
                              ffi::Ffi::Bind() DEEP_EP_JAX_STREAM_AND_DEVICE DEEP_EP_JAX_NORMAL_COMBINE_ARGS
                                  .Arg<ffi::Buffer<ffi::S32>>()  // recv_src_idx
                                  .Arg<ffi::Buffer<ffi::S32>>()  // recv_src_rank
                                  DEEP_EP_JAX_NORMAL_COMBINE_RETS
                                  .Attr<int64_t>("buffer_id") DEEP_EP_JAX_LAUNCH_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});

DEEP_EP_JAX_REGISTER_FFI_TARGET("deep_ep_jax_internode_dispatch", InternodeDispatchHandler);
DEEP_EP_JAX_REGISTER_FFI_TARGET("deep_ep_jax_internode_cached_dispatch", InternodeCachedDispatchHandler);
DEEP_EP_JAX_REGISTER_FFI_TARGET("deep_ep_jax_internode_combine", InternodeCombineHandler);

}  // namespace deep_ep_jax
