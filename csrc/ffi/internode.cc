// XLA FFI handlers of normal mode for an EP group across hosts (kernels/
// internode.h): dispatch, cached dispatch (combine's backward) and combine.
// Shapes are checked at trace time (deep_ep_jax/backends/cuda/internode.py)
// and again here, with the checks the one-host handlers make (ffi/common.h),
// then the region's size; then launch. Counts stay on the device and every
// call is the same launch sequence: command-buffer compatible.
// Without NVSHMEM in the build the handlers exist (same targets everywhere)
// and fail with a message.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi/common.h"
#include "kernels/internode.h"
#include "runtime/registry.h"

namespace deep_ep_jax {
namespace {

// The buffer's state on this device (an NVSHMEM buffer with a normal region) and the launch knobs.
ffi::Error Prepare(const char* fn, ffi::Buffer<ffi::S32> order, ffi::Result<ffi::Buffer<ffi::S32>> order_out,
                   int64_t buffer_id, int device, int64_t num_sms, int64_t num_warps, int64_t timeout_ns,
                   int64_t count_traffic, int64_t pipeline, const DeviceState** state,
                   internode::LaunchConfig* config) {
  DEEP_EP_JAX_RETURN_IF_ERROR(FindBuffer(fn, buffer_id, device, state));
  const DeviceState& s = **state;
  if (s.num_ranks > kMaxInternodeNormalRanks) {
    return Invalid(fn, "normal mode supports at most " + Str(kMaxInternodeNormalRanks) +
                           " ranks in all across hosts, the buffer has " + Str(s.num_ranks));
  }
  if (!s.nvshmem || s.normal.local == nullptr || s.device_pes == nullptr || s.device_nodes == nullptr) {
    return Invalid(fn, "the buffer is not an NVSHMEM buffer with a normal region (an EP group across hosts)");
  }
  if (s.num_nodes < 1 || s.num_ranks % s.num_nodes != 0 || s.num_ranks / s.num_nodes > kMaxInternodeHostRanks) {
    return Invalid(fn, "normal mode across hosts needs hosts of equal size, at most " + Str(kMaxInternodeHostRanks) +
                           " ranks each; the buffer has " + Str(s.num_ranks) + " ranks on " + Str(s.num_nodes) +
                           " hosts");
  }
#ifndef DEEP_EP_JAX_WITH_NVSHMEM
  return Invalid(fn, "the extension was built without NVSHMEM");
#endif
  DEEP_EP_JAX_RETURN_IF_ERROR(
      CheckLaunchKnobs(fn, num_sms, internode::kMaxBlocks, num_warps, internode::kMaxWarps, timeout_ns));
  *config = internode::LaunchConfig{int(num_sms), int(num_warps), uint64_t(timeout_ns)};
  config->count_traffic = count_traffic != 0;
  config->pipeline = pipeline != 0;
  return CheckCallOrder(fn, order, order_out, &config->order);
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

size_t DispatchBytes(const DeviceState& state, const internode::DispatchParams& p) {
#ifdef DEEP_EP_JAX_WITH_NVSHMEM
  const internode::Shapes s{p.num_tokens, p.num_worst_tokens, p.num_topk, {p.row_bytes[0], p.row_bytes[1]}};
  return internode::DispatchRegionBytes(s, state.num_ranks, state.num_nodes);
#else
  return 0;
#endif
}

cudaError_t RunDispatch(const DeviceState& state, const internode::DispatchParams& p, const internode::LaunchConfig& c,
                        cudaStream_t stream) {
#ifdef DEEP_EP_JAX_WITH_NVSHMEM
  return internode::LaunchDispatch(state, p, c, stream);
#else
  return cudaErrorNotSupported;
#endif
}

}  // namespace

// ---------------------------------------------------------------------------

static ffi::Error InternodeDispatch(
    cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> order, ffi::AnyBuffer x, ffi::AnyBuffer x_scales,
    ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights, ffi::Result<ffi::AnyBuffer> recv_x,
    ffi::Result<ffi::AnyBuffer> recv_x_scales, ffi::ResultBuffer<ffi::S32> recv_topk_idx,
    ffi::ResultBuffer<ffi::F32> recv_topk_weights, ffi::ResultBuffer<ffi::PRED> is_token_in_rank,
    ffi::ResultBuffer<ffi::S32> num_tokens_per_rank, ffi::ResultBuffer<ffi::S32> rank_prefix_matrix,
    ffi::ResultBuffer<ffi::S32> send_pos, ffi::ResultBuffer<ffi::S32> recv_src_idx,
    ffi::ResultBuffer<ffi::S32> recv_src_rank, ffi::ResultBuffer<ffi::S32> num_recv_tokens,
    ffi::ResultBuffer<ffi::S32> num_recv_tokens_per_expert, ffi::ResultBuffer<ffi::S32> num_dropped_tokens,
    ffi::ResultBuffer<ffi::S32> node_pos, ffi::ResultBuffer<ffi::S32> order_out, int64_t buffer_id, int64_t num_experts,
    int64_t num_sms, int64_t num_warps, int64_t timeout_ns, int64_t count_traffic, int64_t pipeline) {
  constexpr const char* fn = "deep_ep_jax_internode_dispatch";
  const DeviceState* state = nullptr;
  internode::LaunchConfig config{};
  DEEP_EP_JAX_RETURN_IF_ERROR(Prepare(fn, order, order_out, buffer_id, device, num_sms, num_warps, timeout_ns,
                                      count_traffic, pipeline, &state, &config));
  NormalShapes s{};
  RowArrays rows{};
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckDispatch(
      fn, state->num_ranks, num_experts, &s, &rows, x, x_scales, topk_idx, topk_weights, recv_x, recv_x_scales,
      recv_topk_idx, recv_topk_weights, is_token_in_rank, num_tokens_per_rank, rank_prefix_matrix, send_pos,
      recv_src_idx, recv_src_rank, num_recv_tokens, num_recv_tokens_per_expert, num_dropped_tokens));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "node_pos", node_pos->dimensions(), {s.num_tokens, state->num_nodes}));
  internode::DispatchParams p{};
  SetRowArrays(rows, p.x, p.row_bytes);
  p.topk_idx = topk_idx.typed_data();
  p.topk_weights = topk_weights.typed_data();
  p.num_tokens = int(s.num_tokens);
  p.num_topk = int(s.num_topk);
  p.num_experts = int(num_experts);
  p.num_worst_tokens = int(s.num_rows);
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
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckRegion(fn, *state, DispatchBytes(*state, p)));
  return Launched(fn, RunDispatch(*state, p, config, stream));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(InternodeDispatchHandler, InternodeDispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // order: the Buffer's order state (call_order.h)
                                  .Arg<ffi::AnyBuffer>()          // x: bf16 [T, H], or a pair's data (ROW_FORMATS)
                                  .Arg<ffi::AnyBuffer>()          // x_scales: the pair's scales; [T, 0] for bf16
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_idx [T, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_weights [T, K]
                                  .Ret<ffi::AnyBuffer>()          // recv_x [N, H]: x's dtype, N the worst case
                                  .Ret<ffi::AnyBuffer>()          // recv_x_scales
                                  .Ret<ffi::Buffer<ffi::S32>>()   // recv_topk_idx [N, K]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // recv_topk_weights [N, K]
                                  .Ret<ffi::Buffer<ffi::PRED>>()  // is_token_in_rank [T, R]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // num_tokens_per_rank [R]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // rank_prefix_matrix [R, R]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // send_pos [T, R]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // recv_src_idx [N]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // recv_src_rank [N]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // num_recv_tokens []
                                  .Ret<ffi::Buffer<ffi::S32>>()   // num_recv_tokens_per_expert [E / R]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // num_dropped_tokens []
                                  .Ret<ffi::Buffer<ffi::S32>>()   // node_pos [T, hosts]: the kernels' scratch
                                  .Ret<ffi::Buffer<ffi::S32>>()   // order_out: order, aliased
                                  .Attr<int64_t>("buffer_id")
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_sms")  // launch knobs: backends/cuda/common.py's launch_attrs
                                  .Attr<int64_t>("num_warps")
                                  .Attr<int64_t>("timeout_ns")
                                  .Attr<int64_t>("count_traffic")  // 1: count rows and bytes (common/traffic.h)
                                  .Attr<int64_t>("pipeline"),  // 1: the stages pipelined in one kernel (internode.h)
                              {ffi::Traits::kCmdBufferCompatible});

static ffi::Error InternodeCachedDispatch(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> order,
                                          ffi::AnyBuffer x, ffi::AnyBuffer x_scales, ffi::Buffer<ffi::F32> topk_weights,
                                          ffi::Buffer<ffi::S32> send_pos, ffi::Buffer<ffi::S32> num_recv_tokens,
                                          ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_x_scales,
                                          ffi::ResultBuffer<ffi::F32> recv_topk_weights,
                                          ffi::ResultBuffer<ffi::S32> node_pos, ffi::ResultBuffer<ffi::S32> order_out,
                                          int64_t buffer_id, int64_t num_sms, int64_t num_warps, int64_t timeout_ns,
                                          int64_t count_traffic, int64_t pipeline) {
  constexpr const char* fn = "deep_ep_jax_internode_cached_dispatch";
  const DeviceState* state = nullptr;
  internode::LaunchConfig config{};
  DEEP_EP_JAX_RETURN_IF_ERROR(Prepare(fn, order, order_out, buffer_id, device, num_sms, num_warps, timeout_ns,
                                      count_traffic, pipeline, &state, &config));
  NormalShapes s{};
  RowArrays rows{};
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckCachedDispatch(fn, state->num_ranks, &s, &rows, x, x_scales, topk_weights, send_pos,
                                                  num_recv_tokens, recv_x, recv_x_scales, recv_topk_weights));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "node_pos", node_pos->dimensions(), {s.num_tokens, state->num_nodes}));
  internode::DispatchParams p{};
  SetRowArrays(rows, p.x, p.row_bytes);
  const int num_topk = int(s.num_topk);
  p.topk_weights = num_topk > 0 ? topk_weights.typed_data() : nullptr;
  p.cached_send_pos = send_pos.typed_data();
  p.cached_num_recv_tokens = num_recv_tokens.typed_data();
  p.num_tokens = int(s.num_tokens);
  p.num_topk = num_topk;
  p.num_worst_tokens = int(s.num_rows);
  p.node_pos = node_pos->typed_data();
  p.recv_x[0] = static_cast<char*>(recv_x->untyped_data());
  p.recv_x[1] = static_cast<char*>(recv_x_scales->untyped_data());
  p.recv_topk_weights = num_topk > 0 ? recv_topk_weights->typed_data() : nullptr;
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckRegion(fn, *state, DispatchBytes(*state, p)));
  return Launched(fn, RunDispatch(*state, p, config, stream));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(InternodeCachedDispatchHandler, InternodeCachedDispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // order
                                  .Arg<ffi::AnyBuffer>()         // x
                                  .Arg<ffi::AnyBuffer>()         // x_scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // topk_weights [T, K], [T, 0] when absent
                                  .Arg<ffi::Buffer<ffi::S32>>()  // send_pos: the handle's
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_recv_tokens: the handle's
                                  .Ret<ffi::AnyBuffer>()         // recv_x
                                  .Ret<ffi::AnyBuffer>()         // recv_x_scales
                                  .Ret<ffi::Buffer<ffi::F32>>()  // recv_topk_weights
                                  .Ret<ffi::Buffer<ffi::S32>>()  // node_pos: scratch
                                  .Ret<ffi::Buffer<ffi::S32>>()  // order_out
                                  .Attr<int64_t>("buffer_id")
                                  .Attr<int64_t>("num_sms")
                                  .Attr<int64_t>("num_warps")
                                  .Attr<int64_t>("timeout_ns")
                                  .Attr<int64_t>("count_traffic")
                                  .Attr<int64_t>("pipeline"),
                              {ffi::Traits::kCmdBufferCompatible});

static ffi::Error InternodeCombine(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> order,
                                   ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::F32> topk_weights,
                                   ffi::Buffer<ffi::S32> send_pos, ffi::Buffer<ffi::S32> num_recv_tokens,
                                   ffi::Buffer<ffi::S32> recv_src_idx, ffi::Buffer<ffi::S32> recv_src_rank,
                                   ffi::ResultBuffer<ffi::BF16> out, ffi::ResultBuffer<ffi::F32> out_weights,
                                   ffi::ResultBuffer<ffi::S32> order_out, int64_t buffer_id, int64_t num_sms,
                                   int64_t num_warps, int64_t timeout_ns, int64_t count_traffic, int64_t pipeline) {
  constexpr const char* fn = "deep_ep_jax_internode_combine";
  const DeviceState* state = nullptr;
  internode::LaunchConfig config{};
  DEEP_EP_JAX_RETURN_IF_ERROR(Prepare(fn, order, order_out, buffer_id, device, num_sms, num_warps, timeout_ns,
                                      count_traffic, pipeline, &state, &config));
  NormalShapes s{};
  DEEP_EP_JAX_RETURN_IF_ERROR(
      CheckCombine(fn, state->num_ranks, &s, x, topk_weights, send_pos, num_recv_tokens, out, out_weights));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "recv_src_idx", recv_src_idx.dimensions(), {s.num_rows}));
  DEEP_EP_JAX_RETURN_IF_ERROR(ExpectShape(fn, "recv_src_rank", recv_src_rank.dimensions(), {s.num_rows}));
  internode::CombineParams p{};
  const int num_topk = int(s.num_topk);
  p.x = reinterpret_cast<const uint16_t*>(x.typed_data());
  p.topk_weights = num_topk > 0 ? topk_weights.typed_data() : nullptr;
  p.send_pos = send_pos.typed_data();
  p.num_recv_tokens = num_recv_tokens.typed_data();
  p.recv_src_idx = recv_src_idx.typed_data();
  p.recv_src_rank = recv_src_rank.typed_data();
  p.num_tokens = int(s.num_tokens);
  p.hidden = int(s.hidden);
  p.num_topk = num_topk;
  p.num_worst_tokens = int(s.num_rows);
  p.out = reinterpret_cast<uint16_t*>(out->typed_data());
  p.out_weights = num_topk > 0 ? out_weights->typed_data() : nullptr;
#ifdef DEEP_EP_JAX_WITH_NVSHMEM
  const internode::Shapes shapes{p.num_tokens, p.num_worst_tokens, p.num_topk, {int64_t(p.hidden) * 2, 0}};
  const size_t needed = internode::CombineRegionBytes(shapes, state->num_ranks, state->num_nodes);
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckRegion(fn, *state, needed));
  return Launched(fn, internode::LaunchCombine(*state, p, config, stream));
#else
  (void)p;
  return Launched(fn, cudaErrorNotSupported);
#endif
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(InternodeCombineHandler, InternodeCombine,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // order
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x: the expert outputs [N, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_weights [N, K], [N, 0] when absent
                                  .Arg<ffi::Buffer<ffi::S32>>()   // send_pos: the handle's
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_recv_tokens: the handle's
                                  .Arg<ffi::Buffer<ffi::S32>>()   // recv_src_idx: the handle's
                                  .Arg<ffi::Buffer<ffi::S32>>()   // recv_src_rank: the handle's
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // out [T, H]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out_weights [T, K]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // order_out
                                  .Attr<int64_t>("buffer_id")
                                  .Attr<int64_t>("num_sms")
                                  .Attr<int64_t>("num_warps")
                                  .Attr<int64_t>("timeout_ns")
                                  .Attr<int64_t>("count_traffic")
                                  .Attr<int64_t>("pipeline"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace deep_ep_jax
