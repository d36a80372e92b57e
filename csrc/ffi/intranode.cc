// XLA FFI handlers of normal-mode dispatch, cached dispatch and combine:
// decode, validate, launch (kernels/intranode.h). Counts stay on the device
// and every call is the same launch sequence, so the handlers are command
// buffer (CUDA graph) compatible.
//
// Row arrays: x is bf16 [T, H] with x_scales [T, 0], or a quantized pair
// (x, x_scales) of config.ROW_FORMATS, moved as bytes. Optional top-k weights are passed
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

using intranode::kMaxRowArrays;
using intranode::LaunchConfig;

// The buffer's state on this device (with a normal region) and the launch
// knobs. Multi-process buffers (state->ipc) are always staged: peers in other
// processes reach only the Buffer's regions, never XLA's buffers.
ffi::Error Prepare(const char* fn, ffi::Buffer<ffi::S32> order, ffi::Result<ffi::Buffer<ffi::S32>> order_out,
                   int64_t buffer_id, int device, int64_t num_sms, int64_t num_warps, int64_t timeout_ns,
                   int64_t count_traffic, int64_t chunk_tokens, int64_t staged, const DeviceState** state,
                   LaunchConfig* config) {
  DEEP_EP_JAX_RETURN_IF_ERROR(FindBuffer(fn, buffer_id, device, state));
  if ((*state)->num_ranks > kMaxNvlinkRanks) {
    return Invalid(fn, "normal mode supports at most " + Str(kMaxNvlinkRanks) +
                           " ranks on one host (one NVLink domain), the buffer has " + Str((*state)->num_ranks) +
                           " (low-latency mode: " + Str(kMaxGroupRanks) + ")");
  }
  if ((*state)->normal.local == nullptr) return Invalid(fn, "buffer " + Str(buffer_id) + " has no normal-mode region");
  if ((*state)->nvshmem && (*state)->num_nodes != 1) {  // several nodes: the internode kernels' buffer
    return Invalid(fn, "buffer " + Str(buffer_id) + " spans " + Str((*state)->num_nodes) + " nodes");
  }
  DEEP_EP_JAX_RETURN_IF_ERROR(
      CheckLaunchKnobs(fn, num_sms, intranode::kMaxBlocks, num_warps, intranode::kMaxWarps, timeout_ns));
  if (chunk_tokens < 1 || chunk_tokens > INT_MAX) {
    return Invalid(fn, "chunk_tokens must be >= 1, got " + Str(chunk_tokens));
  }
  *config =
      LaunchConfig{int(num_sms), int(num_warps), int(chunk_tokens), uint64_t(timeout_ns), staged != 0 || (*state)->ipc};
  config->count_traffic = count_traffic != 0;
  return CheckCallOrder(fn, order, order_out, &config->order);
}

// Staged calls land rows in the normal region: it must hold this call's.
// num_chunks: the chunk records per source a dispatch needs, ceil(tokens /
// chunk_tokens); 0 for combine.
ffi::Error CheckStagedRegion(const char* fn, const DeviceState& state, const LaunchConfig& config, int64_t num_rows,
                             const int64_t row_bytes[kMaxRowArrays], int64_t num_topk, int64_t num_chunks) {
  if (!config.staged) return ffi::Error::Success();
  const size_t need = intranode::StagedRegionBytes(num_rows, row_bytes, int(num_topk), num_chunks, state.num_ranks);
  if (state.normal.num_bytes >= need) return ffi::Error::Success();
  const char* mode = state.ipc ? "a multi-process buffer (staged mode)" : "staged mode (DEEP_EP_JAX_STAGED=1)";
  return Invalid(fn, std::string(mode) + " needs a normal region of " + Str(need) +
                         " bytes for this call, the buffer has " + Str(state.normal.num_bytes) +
                         "; create the Buffer with a larger num_nvl_bytes");
}

}  // namespace

// ---------------------------------------------------------------------------

static ffi::Error IntranodeDispatch(
    cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> order, ffi::AnyBuffer x, ffi::AnyBuffer x_scales,
    ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights, ffi::Result<ffi::AnyBuffer> recv_x,
    ffi::Result<ffi::AnyBuffer> recv_x_scales, ffi::ResultBuffer<ffi::S32> recv_topk_idx,
    ffi::ResultBuffer<ffi::F32> recv_topk_weights, ffi::ResultBuffer<ffi::PRED> is_token_in_rank,
    ffi::ResultBuffer<ffi::S32> num_tokens_per_rank, ffi::ResultBuffer<ffi::S32> rank_prefix_matrix,
    ffi::ResultBuffer<ffi::S32> send_pos, ffi::ResultBuffer<ffi::S32> recv_src_idx,
    ffi::ResultBuffer<ffi::S32> recv_src_rank, ffi::ResultBuffer<ffi::S32> num_recv_tokens,
    ffi::ResultBuffer<ffi::S32> num_recv_tokens_per_expert, ffi::ResultBuffer<ffi::S32> num_dropped_tokens,
    ffi::ResultBuffer<ffi::S32> order_out, int64_t buffer_id, int64_t num_experts, int64_t num_sms, int64_t num_warps,
    int64_t timeout_ns, int64_t count_traffic, int64_t chunk_tokens, int64_t staged) {
  constexpr const char* fn = "deep_ep_jax_dispatch";
  const DeviceState* state = nullptr;
  LaunchConfig config{};
  DEEP_EP_JAX_RETURN_IF_ERROR(Prepare(fn, order, order_out, buffer_id, device, num_sms, num_warps, timeout_ns,
                                      count_traffic, chunk_tokens, staged, &state, &config));
  const int64_t num_ranks = state->num_ranks;

  NormalShapes s{};
  RowArrays rows{};
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckDispatch(
      fn, num_ranks, num_experts, &s, &rows, x, x_scales, topk_idx, topk_weights, recv_x, recv_x_scales, recv_topk_idx,
      recv_topk_weights, is_token_in_rank, num_tokens_per_rank, rank_prefix_matrix, send_pos, recv_src_idx,
      recv_src_rank, num_recv_tokens, num_recv_tokens_per_expert, num_dropped_tokens));
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckStagedRegion(fn, *state, config, s.num_rows, rows.row_bytes, s.num_topk,
                                                intranode::NumChunks(s.num_tokens, config.chunk_tokens)));

  intranode::DispatchParams p{};
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
XLA_FFI_DEFINE_HANDLER_SYMBOL(IntranodeDispatchHandler, IntranodeDispatch,
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
                                  .Ret<ffi::Buffer<ffi::S32>>()   // order_out: order, aliased
                                  .Attr<int64_t>("buffer_id")
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_sms")  // launch knobs: backends/cuda/common.py's launch_attrs
                                  .Attr<int64_t>("num_warps")
                                  .Attr<int64_t>("timeout_ns")
                                  .Attr<int64_t>("count_traffic")  // 1: count rows and bytes (common/traffic.h)
                                  .Attr<int64_t>("chunk_tokens")
                                  .Attr<int64_t>("staged"),  // 1: through the normal region (always for IPC buffers)
                              {ffi::Traits::kCmdBufferCompatible});

static ffi::Error IntranodeCachedDispatch(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> order,
                                          ffi::AnyBuffer x, ffi::AnyBuffer x_scales, ffi::Buffer<ffi::F32> topk_weights,
                                          ffi::Buffer<ffi::S32> send_pos, ffi::Buffer<ffi::S32> num_recv_tokens,
                                          ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_x_scales,
                                          ffi::ResultBuffer<ffi::F32> recv_topk_weights,
                                          ffi::ResultBuffer<ffi::S32> order_out, int64_t buffer_id, int64_t num_sms,
                                          int64_t num_warps, int64_t timeout_ns, int64_t count_traffic,
                                          int64_t chunk_tokens, int64_t staged) {
  constexpr const char* fn = "deep_ep_jax_cached_dispatch";
  const DeviceState* state = nullptr;
  LaunchConfig config{};
  DEEP_EP_JAX_RETURN_IF_ERROR(Prepare(fn, order, order_out, buffer_id, device, num_sms, num_warps, timeout_ns,
                                      count_traffic, chunk_tokens, staged, &state, &config));
  const int64_t num_ranks = state->num_ranks;

  NormalShapes s{};
  RowArrays rows{};
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckCachedDispatch(fn, num_ranks, &s, &rows, x, x_scales, topk_weights, send_pos,
                                                  num_recv_tokens, recv_x, recv_x_scales, recv_topk_weights));
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckStagedRegion(fn, *state, config, s.num_rows, rows.row_bytes, s.num_topk,
                                                intranode::NumChunks(s.num_tokens, config.chunk_tokens)));

  intranode::CachedDispatchParams p{};
  SetRowArrays(rows, p.x, p.row_bytes);
  const int64_t num_topk = s.num_topk;
  p.topk_weights = num_topk > 0 ? topk_weights.typed_data() : nullptr;
  p.send_pos = send_pos.typed_data();
  p.num_recv_tokens = num_recv_tokens.typed_data();
  p.num_tokens = int(s.num_tokens);
  p.num_topk = int(num_topk);
  p.num_worst_tokens = int(s.num_rows);
  p.recv.rows[0] = static_cast<char*>(recv_x->untyped_data());
  p.recv.rows[1] = static_cast<char*>(recv_x_scales->untyped_data());
  p.recv.topk_weights = num_topk > 0 ? recv_topk_weights->typed_data() : nullptr;
  return Launched(fn, intranode::LaunchCachedDispatch(*state, p, config, stream));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(IntranodeCachedDispatchHandler, IntranodeCachedDispatch,
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
                                  .Ret<ffi::Buffer<ffi::S32>>()  // order_out
                                  .Attr<int64_t>("buffer_id")
                                  .Attr<int64_t>("num_sms")
                                  .Attr<int64_t>("num_warps")
                                  .Attr<int64_t>("timeout_ns")
                                  .Attr<int64_t>("count_traffic")
                                  .Attr<int64_t>("chunk_tokens")
                                  .Attr<int64_t>("staged"),
                              {ffi::Traits::kCmdBufferCompatible});

static ffi::Error IntranodeCombine(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> order,
                                   ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::F32> topk_weights,
                                   ffi::Buffer<ffi::S32> send_pos, ffi::Buffer<ffi::S32> num_recv_tokens,
                                   ffi::Buffer<ffi::S32> rank_prefix_matrix, ffi::ResultBuffer<ffi::BF16> out,
                                   ffi::ResultBuffer<ffi::F32> out_weights, ffi::ResultBuffer<ffi::S32> order_out,
                                   int64_t buffer_id, int64_t num_sms, int64_t num_warps, int64_t timeout_ns,
                                   int64_t count_traffic, int64_t chunk_tokens, int64_t staged) {
  constexpr const char* fn = "deep_ep_jax_combine";
  const DeviceState* state = nullptr;
  LaunchConfig config{};
  DEEP_EP_JAX_RETURN_IF_ERROR(Prepare(fn, order, order_out, buffer_id, device, num_sms, num_warps, timeout_ns,
                                      count_traffic, chunk_tokens, staged, &state, &config));
  const int64_t num_ranks = state->num_ranks;

  NormalShapes s{};
  DEEP_EP_JAX_RETURN_IF_ERROR(
      CheckCombine(fn, num_ranks, &s, x, topk_weights, send_pos, num_recv_tokens, out, out_weights));
  DEEP_EP_JAX_RETURN_IF_ERROR(
      ExpectShape(fn, "rank_prefix_matrix", rank_prefix_matrix.dimensions(), {num_ranks, num_ranks}));
  const int64_t row_bytes[kMaxRowArrays] = {s.hidden * 2, 0};
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckStagedRegion(fn, *state, config, s.num_rows, row_bytes, s.num_topk, 0));
  const int64_t num_topk = s.num_topk;
  if (!config.staged) {  // the peers read x and the weights in place
    DEEP_EP_JAX_RETURN_IF_ERROR(CheckPeersCanRead(fn, "x", x.untyped_data()));
    if (num_topk > 0) DEEP_EP_JAX_RETURN_IF_ERROR(CheckPeersCanRead(fn, "topk_weights", topk_weights.untyped_data()));
  }

  intranode::CombineParams p{};
  p.x = x.typed_data();
  p.topk_weights = num_topk > 0 ? topk_weights.typed_data() : nullptr;
  p.send_pos = send_pos.typed_data();
  p.num_recv_tokens = num_recv_tokens.typed_data();
  p.rank_prefix_matrix = rank_prefix_matrix.typed_data();
  p.num_tokens = int(s.num_tokens);
  p.hidden = int(s.hidden);
  p.num_topk = int(num_topk);
  p.num_worst_tokens = int(s.num_rows);
  p.out = out->typed_data();
  p.out_weights = num_topk > 0 ? out_weights->typed_data() : nullptr;
  return Launched(fn, intranode::LaunchCombine(*state, p, config, stream));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(IntranodeCombineHandler, IntranodeCombine,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // order
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x: the expert outputs [N, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // topk_weights [N, K], [N, 0] when absent
                                  .Arg<ffi::Buffer<ffi::S32>>()   // send_pos: the handle's
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_recv_tokens: the handle's
                                  .Arg<ffi::Buffer<ffi::S32>>()   // rank_prefix_matrix: the handle's
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // out [T, H]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out_weights [T, K]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // order_out
                                  .Attr<int64_t>("buffer_id")
                                  .Attr<int64_t>("num_sms")
                                  .Attr<int64_t>("num_warps")
                                  .Attr<int64_t>("timeout_ns")
                                  .Attr<int64_t>("count_traffic")
                                  .Attr<int64_t>("chunk_tokens")
                                  .Attr<int64_t>("staged"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace deep_ep_jax
