// XLA FFI handlers of low-latency mode: dispatch and combine, each a send half
// and a receive half. The send half returns a token (int32 [1], the operation's
// sequence number) that the receive half takes, so XLA orders them and may
// schedule other work in between. Decode, validate, launch; no host sync.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi/common.h"
#include "kernels/low_latency.h"
#include "runtime/registry.h"
#include "runtime/side_stream.h"

namespace deep_ep_jax {
namespace {

using low_latency::DispatchLayout;
using low_latency::Peers;

// This device's view of the buffer's low-latency region.
ffi::Error FindPeers(const char* fn, int64_t buffer_id, int device, int64_t timeout_ns, bool mask_failed,
                     Peers* peers) {
  const DeviceState* state = nullptr;
  DEEP_EP_JAX_RETURN_IF_ERROR(FindBuffer(fn, buffer_id, device, &state));
  if (state->low_latency.local == nullptr) {
    return Invalid(fn, "the buffer has no low-latency region; create it with low_latency_mode=True");
  }
  if (state->device_peers == nullptr || (state->nvshmem && state->device_pes == nullptr)) {
    return ffi::Error::Internal(std::string(fn) + ": the buffer's peer table is missing");
  }
  peers->regions = state->device_peers;
  peers->pes = state->device_pes;
  peers->local = state->low_latency.local;
  peers->rank = state->rank;
  peers->num_ranks = state->num_ranks;
  peers->half_bytes = low_latency::HalfBytes(state->low_latency.num_bytes);
  peers->timeout_ns = uint64_t(timeout_ns);
  peers->mask_failed = mask_failed;
  peers->nvshmem = state->nvshmem;
  peers->send_offset = state->low_latency.num_bytes;  // the send area follows the region
  peers->send_bytes = state->send_bytes;
#ifndef DEEP_EP_JAX_WITH_NVSHMEM
  if (peers->nvshmem) return Invalid(fn, "the buffer spans hosts but the extension was built without NVSHMEM");
#endif
  return ffi::Error::Success();
}

// Across hosts, rows put to other hosts are staged in the send area first.
ffi::Error CheckStage(const char* fn, size_t needed, const Peers& peers) {
  if (peers.nvshmem && needed > peers.send_bytes) {
    return Invalid(fn, "the send area of a buffer across hosts is too small for these shapes: needs " + Str(needed) +
                           " bytes, has " + Str(peers.send_bytes) +
                           "; size the Buffer with cuda_low_latency.low_latency_send_bytes(...)");
  }
  return ffi::Error::Success();
}

// A buffer across hosts runs the NVSHMEM build of the kernels.
const low_latency::Launchers& LaunchersFor(const Peers& peers) {
#ifdef DEEP_EP_JAX_WITH_NVSHMEM
  if (peers.nvshmem) return low_latency::NvshmemLaunchers();
#endif
  return low_latency::NvlinkLaunchers();
}

ffi::Error CheckFits(const char* fn, size_t needed, const Peers& peers) {
  if (needed > peers.half_bytes) {
    return Invalid(fn, "the low-latency region is too small for these shapes: each half needs " + Str(needed) +
                           " bytes, has " + Str(peers.half_bytes) +
                           "; size the Buffer with cuda_low_latency.low_latency_region_bytes(...)");
  }
  return ffi::Error::Success();
}

// Checks shared by both halves of dispatch: shapes the kernels can handle.
ffi::Error CheckDispatchShapes(const char* fn, int64_t num_tokens, int64_t num_topk, int64_t hidden,
                               int64_t num_experts, int64_t max_tokens, int num_ranks, bool fp8) {
  DEEP_EP_JAX_RETURN_IF_ERROR(
      CheckNumExperts(fn, num_experts, num_ranks, low_latency::kMaxExperts, low_latency::kMaxExperts));
  if (hidden < low_latency::kFp8Block || hidden % low_latency::kFp8Block != 0) {
    return Invalid(fn, "hidden (" + Str(hidden) + ") must be a positive multiple of 128");
  }
  if (num_topk < 1 || num_topk > low_latency::kMaxTopk) {
    return Invalid(fn, "top-k (" + Str(num_topk) + ") must be in [1, " + Str(low_latency::kMaxTopk) + "]");
  }
  if (num_tokens > max_tokens || max_tokens < 1 || max_tokens * num_topk > INT32_MAX / 2) {
    return Invalid(
        fn, "tokens (" + Str(num_tokens) + ") must be <= num_max_dispatch_tokens_per_rank (" + Str(max_tokens) + ")");
  }
  // A receiver counts the (token, k) pairs of every source in int.
  if (int64_t(num_ranks) * max_tokens * num_topk > INT32_MAX / 2) {
    return Invalid(fn, "ranks * num_max_dispatch_tokens_per_rank * top-k (" + Str(num_ranks) + " * " + Str(max_tokens) +
                           " * " + Str(num_topk) + ") must be < 2^30 (32-bit row indices)");
  }
  if (low_latency::SharedBytesNeeded(num_ranks, int(num_experts), int(hidden), fp8) > low_latency::kMaxSharedBytes) {
    return Invalid(fn, "num_experts (" + Str(num_experts) + ") and hidden (" + Str(hidden) + ") at " + Str(num_ranks) +
                           " ranks need more shared memory than the kernels use");
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Each half's arguments, decoded and checked; the handlers below launch one
// half, or both in one kernel (the whole operation).

ffi::Error PrepareDispatchSend(const char* fn, int32_t device, const ffi::AnyBuffer& x,
                               const ffi::Buffer<ffi::S32>& topk_idx, int64_t buffer_id, int64_t num_experts,
                               int64_t max_tokens, bool use_fp8, bool round_scale, bool mxfp8, int64_t timeout_ns,
                               bool mask_failed, low_latency::DispatchSendArgs* args) {
  DEEP_EP_JAX_RETURN_IF_ERROR(FindPeers(fn, buffer_id, device, timeout_ns, mask_failed, &args->peers));
  const Dims x_dims = x.dimensions(), idx_dims = topk_idx.dimensions();
  if (x.element_type() != ffi::BF16 || x_dims.size() != 2) return Invalid(fn, "x must be bf16 [T, H]");
  if (idx_dims.size() != 2 || idx_dims[0] != x_dims[0]) return Invalid(fn, "topk_idx must be int32 [T, K]");
  const int64_t num_tokens = x_dims[0], hidden = x_dims[1], num_topk = idx_dims[1];
  const int num_ranks = args->peers.num_ranks;
  DEEP_EP_JAX_RETURN_IF_ERROR(
      CheckDispatchShapes(fn, num_tokens, num_topk, hidden, num_experts, max_tokens, num_ranks, use_fp8));
  args->layout =
      low_latency::MakeDispatchLayout(num_ranks, num_experts / num_ranks, max_tokens, num_topk, hidden, use_fp8);
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckFits(fn, args->layout.bytes, args->peers));
  DEEP_EP_JAX_RETURN_IF_ERROR(
      CheckStage(fn, low_latency::DispatchStageBytes(max_tokens, num_topk, args->layout.row_bytes), args->peers));
  args->x = x.untyped_data();
  args->topk_idx = topk_idx.typed_data();
  args->token = nullptr;
  args->num_tokens = int(num_tokens);
  args->num_topk = int(num_topk);
  args->hidden = int(hidden);
  args->num_experts = int(num_experts);
  args->max_tokens = int(max_tokens);
  if (mxfp8 && !use_fp8) return Invalid(fn, "mxfp8 needs use_fp8");
  args->fp8 = use_fp8;
  args->round_scale = round_scale;
  args->mxfp8 = mxfp8;
  return ffi::Error::Success();
}

ffi::Error PrepareDispatchRecv(const char* fn, int32_t device, ffi::Result<ffi::AnyBuffer>& recv_x,
                               ffi::ResultBuffer<ffi::F32>& recv_scales, ffi::ResultBuffer<ffi::S32>& recv_count,
                               ffi::ResultBuffer<ffi::S32>& recv_src_rank, ffi::ResultBuffer<ffi::S32>& recv_src_token,
                               ffi::ResultBuffer<ffi::S32>& recv_src_topk, int64_t buffer_id, int64_t num_topk,
                               int64_t timeout_ns, bool mask_failed, low_latency::DispatchRecvArgs* args) {
  DEEP_EP_JAX_RETURN_IF_ERROR(FindPeers(fn, buffer_id, device, timeout_ns, mask_failed, &args->peers));
  const int num_ranks = args->peers.num_ranks;
  const Dims dims = recv_x->dimensions();
  const bool fp8 = recv_x->element_type() == ffi::F8E4M3FN;
  if ((!fp8 && recv_x->element_type() != ffi::BF16) || dims.size() != 3 || dims[1] % num_ranks != 0) {
    return Invalid(fn, "recv_x must be float8_e4m3fn or bf16 [E/R, R*M, H]");
  }
  const int64_t num_local = dims[0], rows = dims[1], hidden = dims[2], max_tokens = rows / num_ranks;
  if (fp8 && !IsShape(recv_scales->dimensions(), {num_local, rows, hidden / low_latency::kFp8Block})) {
    return Invalid(fn, "recv_scales must be float32 [E/R, R*M, H/128]");
  }
  if (!IsShape(recv_count->dimensions(), {num_local}) || !IsShape(recv_src_rank->dimensions(), {num_local, rows}) ||
      !IsShape(recv_src_token->dimensions(), {num_local, rows}) ||
      !IsShape(recv_src_topk->dimensions(), {num_local, rows})) {
    return Invalid(fn, "recv_count must be int32 [E/R] and the handle arrays int32 [E/R, R*M]");
  }
  DEEP_EP_JAX_RETURN_IF_ERROR(
      CheckDispatchShapes(fn, 0, num_topk, hidden, num_local * num_ranks, max_tokens, num_ranks, fp8));
  args->layout = low_latency::MakeDispatchLayout(num_ranks, num_local, max_tokens, num_topk, hidden, fp8);
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckFits(fn, args->layout.bytes, args->peers));
  args->token = nullptr;
  args->recv_x = recv_x->untyped_data();
  args->recv_scales = fp8 ? recv_scales->typed_data() : nullptr;
  args->recv_count = recv_count->typed_data();
  args->recv_src_rank = recv_src_rank->typed_data();
  args->recv_src_token = recv_src_token->typed_data();
  args->recv_src_topk = recv_src_topk->typed_data();
  args->num_local_experts = int(num_local);
  args->max_tokens = int(max_tokens);
  args->num_topk = int(num_topk);
  args->hidden = int(hidden);
  args->fp8 = fp8;
  return ffi::Error::Success();
}

ffi::Error PrepareCombineSend(const char* fn, int32_t device, const ffi::AnyBuffer& x,
                              const ffi::Buffer<ffi::S32>& recv_count, const ffi::Buffer<ffi::S32>& recv_src_rank,
                              const ffi::Buffer<ffi::S32>& recv_src_token, const ffi::Buffer<ffi::S32>& recv_src_topk,
                              int64_t buffer_id, int64_t num_topk, int64_t timeout_ns, bool mask_failed,
                              low_latency::CombineSendArgs* args) {
  DEEP_EP_JAX_RETURN_IF_ERROR(FindPeers(fn, buffer_id, device, timeout_ns, mask_failed, &args->peers));
  const int num_ranks = args->peers.num_ranks;
  const Dims dims = x.dimensions();
  if (x.element_type() != ffi::BF16 || dims.size() != 3 || dims[1] % num_ranks != 0) {
    return Invalid(fn, "x must be bf16 [E/R, R*M, H]");
  }
  const int64_t num_local = dims[0], rows = dims[1], hidden = dims[2], max_tokens = rows / num_ranks;
  if (!IsShape(recv_count.dimensions(), {num_local}) || !IsShape(recv_src_rank.dimensions(), {num_local, rows}) ||
      !IsShape(recv_src_token.dimensions(), {num_local, rows}) ||
      !IsShape(recv_src_topk.dimensions(), {num_local, rows})) {
    return Invalid(fn, "the handle must hold recv_count int32 [E/R] and int32 [E/R, R*M] arrays matching x");
  }
  if (hidden < 8 || hidden % 8 != 0) return Invalid(fn, "hidden (" + Str(hidden) + ") must be a multiple of 8");
  if (num_topk < 1 || num_topk > low_latency::kMaxTopk || num_local > low_latency::kMaxExperts) {
    return Invalid(fn, "top-k (" + Str(num_topk) + ") must be in [1, " + Str(low_latency::kMaxTopk) + "] and E/R (" +
                           Str(num_local) + ") <= " + Str(low_latency::kMaxExperts));
  }
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckFits(fn, low_latency::CombineBytes(max_tokens, num_topk, hidden), args->peers));
  DEEP_EP_JAX_RETURN_IF_ERROR(
      CheckStage(fn, low_latency::CombineStageBytes(num_ranks, max_tokens, num_topk, hidden), args->peers));
  args->x = x.untyped_data();
  args->recv_count = recv_count.typed_data();
  args->recv_src_rank = recv_src_rank.typed_data();
  args->recv_src_token = recv_src_token.typed_data();
  args->recv_src_topk = recv_src_topk.typed_data();
  args->token = nullptr;
  args->num_local_experts = int(num_local);
  args->max_tokens = int(max_tokens);
  args->num_topk = int(num_topk);
  args->hidden = int(hidden);
  return ffi::Error::Success();
}

ffi::Error PrepareCombineRecv(const char* fn, int32_t device, const ffi::Buffer<ffi::S32>& topk_idx,
                              const ffi::Buffer<ffi::F32>& topk_weights, ffi::Result<ffi::AnyBuffer>& out,
                              int64_t buffer_id, int64_t num_experts, int64_t timeout_ns, bool mask_failed,
                              low_latency::CombineRecvArgs* args) {
  DEEP_EP_JAX_RETURN_IF_ERROR(FindPeers(fn, buffer_id, device, timeout_ns, mask_failed, &args->peers));
  DEEP_EP_JAX_RETURN_IF_ERROR(
      CheckNumExperts(fn, num_experts, args->peers.num_ranks, low_latency::kMaxExperts, low_latency::kMaxExperts));
  const Dims idx_dims = topk_idx.dimensions(), out_dims = out->dimensions();
  if (idx_dims.size() != 2 || !IsShape(topk_weights.dimensions(), {idx_dims[0], idx_dims[1]})) {
    return Invalid(fn, "topk_idx and topk_weights must be [T, K]");
  }
  if (out->element_type() != ffi::BF16 || out_dims.size() != 2 || out_dims[0] != idx_dims[0] || out_dims[1] % 8 != 0) {
    return Invalid(fn, "the output must be bf16 [T, H] with H a multiple of 8");
  }
  const int64_t num_tokens = idx_dims[0], num_topk = idx_dims[1], hidden = out_dims[1];
  if (num_topk < 1 || num_topk > low_latency::kMaxTopk) {
    return Invalid(fn, "top-k (" + Str(num_topk) + ") must be in [1, " + Str(low_latency::kMaxTopk) + "]");
  }
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckFits(fn, low_latency::CombineBytes(num_tokens, num_topk, hidden), args->peers));
  args->token = nullptr;
  args->topk_idx = topk_idx.typed_data();
  args->topk_weights = topk_weights.typed_data();
  args->out = out->untyped_data();
  args->num_tokens = int(num_tokens);
  args->num_topk = int(num_topk);
  args->hidden = int(hidden);
  args->num_experts = int(num_experts);
  return ffi::Error::Success();
}

ffi::Error CheckToken(const char* fn, Dims dims) {
  return IsShape(dims, {1}) ? ffi::Error::Success() : Invalid(fn, "the token must be int32 [1]");
}

// ---------------------------------------------------------------------------
// Overlapped halves (Config.low_latency_overlap_sms > 0): runtime/side_stream.h
// holds the policy; this reports its refusals and CUDA failures.

ffi::Error SideStreamError(const char* fn, const SideStreamStatus& status) {
  switch (status.code) {
    case SideStreamStatus::kOk:
      return ffi::Error::Success();
    case SideStreamStatus::kRefused:
      return Invalid(fn, status.message);
    case SideStreamStatus::kCudaError:
      break;
  }
  return ffi::Error::Internal(std::string(fn) + ": " + status.message);
}

// The shared tail of the send halves: the token, then the launch on XLA's
// stream (refused while an overlapped send is pending) or, overlapped, on the
// side stream.
template <bool kOverlapped, typename Args>
ffi::Error LaunchSend(const char* fn, int device, cudaStream_t xla, int64_t buffer_id,
                      ffi::ResultBuffer<ffi::S32>& token, const CallOrder& order, int64_t max_blocks, Args& args,
                      cudaError_t (*launch)(const Args&, int, cudaStream_t)) {
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckToken(fn, token->dimensions()));
  // Overlapped, the send may run after XLA's next calls, which read and
  // write the order state: it takes none (its tag names its kind only).
  args.order = kOverlapped ? CallOrder{nullptr, nullptr} : order;
  cudaStream_t stream;
  DEEP_EP_JAX_RETURN_IF_ERROR(SideStreamError(fn, BeginSend(device, buffer_id, xla, kOverlapped, &stream)));
  args.token = token->typed_data();
  args.max_blocks = int(max_blocks);
  DEEP_EP_JAX_RETURN_IF_ERROR(Launched(fn, launch(args, device, stream)));
  return SideStreamError(fn, EndSend(device, buffer_id, args.token, kOverlapped));
}

}  // namespace

// ---------------------------------------------------------------------------
// Handlers. The split halves come twice: on XLA's stream (command-buffer
// compatible) and overlapped (kOverlapped; not, as they fork and join
// streams), each pair with one binding. Every target takes its Buffer's order
// state first and returns it last, aliased (common/call_order.h).

template <bool kOverlapped>
static ffi::Error LowLatencyDispatchSend(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> order,
                                         ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                                         ffi::ResultBuffer<ffi::S32> token, ffi::ResultBuffer<ffi::S32> order_out,
                                         int64_t buffer_id, int64_t num_experts, int64_t max_tokens, bool use_fp8,
                                         bool round_scale, bool mxfp8, int64_t timeout_ns, bool mask_failed,
                                         int64_t max_blocks) {
  constexpr const char* fn = "low_latency_dispatch_send";
  low_latency::DispatchSendArgs args{};
  CallOrder call{};
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckCallOrder(fn, order, order_out, &call));
  DEEP_EP_JAX_RETURN_IF_ERROR(PrepareDispatchSend(fn, device, x, topk_idx, buffer_id, num_experts, max_tokens, use_fp8,
                                                  round_scale, mxfp8, timeout_ns, mask_failed, &args));
  return LaunchSend<kOverlapped>(fn, device, stream, buffer_id, token, call, max_blocks, args,
                                 LaunchersFor(args.peers).dispatch_send);
}
static auto DispatchSendBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::Buffer<ffi::S32>>()  // order
      .Arg<ffi::AnyBuffer>()         // x: bf16 [T, H]
      .Arg<ffi::Buffer<ffi::S32>>()  // topk_idx [T, K]
      .Ret<ffi::Buffer<ffi::S32>>()  // token [1]: the receive half takes it
      .Ret<ffi::Buffer<ffi::S32>>()  // order_out
      .Attr<int64_t>("buffer_id")
      .Attr<int64_t>("num_experts")
      .Attr<int64_t>("max_tokens")  // M: num_max_dispatch_tokens_per_rank
      .Attr<bool>("use_fp8")
      .Attr<bool>("round_scale")
      .Attr<bool>("mxfp8")  // with use_fp8: scales per 32 channels, float8_e8m0fnu bytes
      .Attr<int64_t>("timeout_ns")
      .Attr<bool>("mask_failed_ranks")  // Config.mask_failed_ranks
      .Attr<int64_t>("max_blocks");
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchSendHandler, LowLatencyDispatchSend<false>, DispatchSendBinding(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchSendOverlappedHandler, LowLatencyDispatchSend<true>,
                              DispatchSendBinding(), {});

template <bool kOverlapped>
static ffi::Error LowLatencyDispatchRecv(
    cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> order, ffi::Buffer<ffi::S32> token,
    ffi::RemainingArgs keep_alive, ffi::Result<ffi::AnyBuffer> recv_x, ffi::ResultBuffer<ffi::F32> recv_scales,
    ffi::ResultBuffer<ffi::S32> recv_count, ffi::ResultBuffer<ffi::S32> recv_src_rank,
    ffi::ResultBuffer<ffi::S32> recv_src_token, ffi::ResultBuffer<ffi::S32> recv_src_topk,
    ffi::ResultBuffer<ffi::S32> order_out, int64_t buffer_id, int64_t num_topk, int64_t timeout_ns, bool mask_failed) {
  constexpr const char* fn = "low_latency_dispatch_recv";
  low_latency::DispatchRecvArgs args{};
  DEEP_EP_JAX_RETURN_IF_ERROR(PrepareDispatchRecv(fn, device, recv_x, recv_scales, recv_count, recv_src_rank,
                                                  recv_src_token, recv_src_topk, buffer_id, num_topk, timeout_ns,
                                                  mask_failed, &args));
  CallOrder call{};  // the position passes through: the send took this operation's
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckCallOrder(fn, order, order_out, &call));
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckToken(fn, token.dimensions()));
  args.token = token.typed_data();
  DEEP_EP_JAX_RETURN_IF_ERROR(SideStreamError(fn, BeginReceive(device, buffer_id, args.token, stream, kOverlapped)));
  return Launched(fn, LaunchersFor(args.peers).dispatch_recv(args, device, stream));
}
static auto DispatchRecvBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::Buffer<ffi::S32>>()  // order
      .Arg<ffi::Buffer<ffi::S32>>()  // token: the send half's
      .RemainingArgs()               // keep_alive: an overlapped send's inputs, unused: alive until the join
      .Ret<ffi::AnyBuffer>()         // recv_x: FP8 or bf16 [E / R, R * M, H]
      .Ret<ffi::Buffer<ffi::F32>>()  // recv_scales [E / R, R * M, H / 128]; [1] unused when bf16
      .Ret<ffi::Buffer<ffi::S32>>()  // recv_count [E / R]
      .Ret<ffi::Buffer<ffi::S32>>()  // recv_src_rank [E / R, R * M]
      .Ret<ffi::Buffer<ffi::S32>>()  // recv_src_token [E / R, R * M]
      .Ret<ffi::Buffer<ffi::S32>>()  // recv_src_topk [E / R, R * M]
      .Ret<ffi::Buffer<ffi::S32>>()  // order_out
      .Attr<int64_t>("buffer_id")
      .Attr<int64_t>("num_topk")
      .Attr<int64_t>("timeout_ns")
      .Attr<bool>("mask_failed_ranks");
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchRecvHandler, LowLatencyDispatchRecv<false>, DispatchRecvBinding(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchRecvOverlappedHandler, LowLatencyDispatchRecv<true>,
                              DispatchRecvBinding(), {});

// The whole dispatch in one kernel: the send half's arguments, the receive half's results.
static ffi::Error LowLatencyDispatch(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> order, ffi::AnyBuffer x,
                                     ffi::Buffer<ffi::S32> topk_idx, ffi::Result<ffi::AnyBuffer> recv_x,
                                     ffi::ResultBuffer<ffi::F32> recv_scales, ffi::ResultBuffer<ffi::S32> recv_count,
                                     ffi::ResultBuffer<ffi::S32> recv_src_rank,
                                     ffi::ResultBuffer<ffi::S32> recv_src_token,
                                     ffi::ResultBuffer<ffi::S32> recv_src_topk, ffi::ResultBuffer<ffi::S32> order_out,
                                     int64_t buffer_id, int64_t num_experts, int64_t max_tokens, bool use_fp8,
                                     bool round_scale, bool mxfp8, int64_t timeout_ns, bool mask_failed) {
  constexpr const char* fn = "low_latency_dispatch";
  DEEP_EP_JAX_RETURN_IF_ERROR(SideStreamError(fn, CheckNoPendingSend(device, buffer_id)));
  low_latency::DispatchSendArgs send{};
  low_latency::DispatchRecvArgs recv{};
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckCallOrder(fn, order, order_out, &send.order));
  DEEP_EP_JAX_RETURN_IF_ERROR(PrepareDispatchSend(fn, device, x, topk_idx, buffer_id, num_experts, max_tokens, use_fp8,
                                                  round_scale, mxfp8, timeout_ns, mask_failed, &send));
  DEEP_EP_JAX_RETURN_IF_ERROR(PrepareDispatchRecv(fn, device, recv_x, recv_scales, recv_count, recv_src_rank,
                                                  recv_src_token, recv_src_topk, buffer_id, send.num_topk, timeout_ns,
                                                  mask_failed, &recv));
  if (recv.layout.bytes != send.layout.bytes || recv.fp8 != send.fp8 || recv.max_tokens != send.max_tokens) {
    return Invalid(fn, "the outputs do not match the inputs' shapes");
  }
  return Launched(fn, LaunchersFor(send.peers).dispatch(send, recv, device, stream));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchHandler, LowLatencyDispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // order
                                  .Arg<ffi::AnyBuffer>()         // x
                                  .Arg<ffi::Buffer<ffi::S32>>()  // topk_idx
                                  .Ret<ffi::AnyBuffer>()         // recv_x
                                  .Ret<ffi::Buffer<ffi::F32>>()  // recv_scales
                                  .Ret<ffi::Buffer<ffi::S32>>()  // recv_count
                                  .Ret<ffi::Buffer<ffi::S32>>()  // recv_src_rank
                                  .Ret<ffi::Buffer<ffi::S32>>()  // recv_src_token
                                  .Ret<ffi::Buffer<ffi::S32>>()  // recv_src_topk
                                  .Ret<ffi::Buffer<ffi::S32>>()  // order_out
                                  .Attr<int64_t>("buffer_id")
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("max_tokens")
                                  .Attr<bool>("use_fp8")
                                  .Attr<bool>("round_scale")
                                  .Attr<bool>("mxfp8")
                                  .Attr<int64_t>("timeout_ns")
                                  .Attr<bool>("mask_failed_ranks"),
                              {ffi::Traits::kCmdBufferCompatible});

template <bool kOverlapped>
static ffi::Error LowLatencyCombineSend(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> order,
                                        ffi::AnyBuffer x, ffi::Buffer<ffi::S32> recv_count,
                                        ffi::Buffer<ffi::S32> recv_src_rank, ffi::Buffer<ffi::S32> recv_src_token,
                                        ffi::Buffer<ffi::S32> recv_src_topk, ffi::ResultBuffer<ffi::S32> token,
                                        ffi::ResultBuffer<ffi::S32> order_out, int64_t buffer_id, int64_t num_topk,
                                        int64_t timeout_ns, bool mask_failed, int64_t max_blocks) {
  constexpr const char* fn = "low_latency_combine_send";
  low_latency::CombineSendArgs args{};
  CallOrder call{};
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckCallOrder(fn, order, order_out, &call));
  DEEP_EP_JAX_RETURN_IF_ERROR(PrepareCombineSend(fn, device, x, recv_count, recv_src_rank, recv_src_token,
                                                 recv_src_topk, buffer_id, num_topk, timeout_ns, mask_failed, &args));
  return LaunchSend<kOverlapped>(fn, device, stream, buffer_id, token, call, max_blocks, args,
                                 LaunchersFor(args.peers).combine_send);
}
static auto CombineSendBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::Buffer<ffi::S32>>()  // order
      .Arg<ffi::AnyBuffer>()         // x: bf16 expert outputs [E / R, R * M, H]
      .Arg<ffi::Buffer<ffi::S32>>()  // recv_count: the dispatch handle's
      .Arg<ffi::Buffer<ffi::S32>>()  // recv_src_rank: the handle's
      .Arg<ffi::Buffer<ffi::S32>>()  // recv_src_token: the handle's
      .Arg<ffi::Buffer<ffi::S32>>()  // recv_src_topk: the handle's
      .Ret<ffi::Buffer<ffi::S32>>()  // token [1]: the receive half takes it
      .Ret<ffi::Buffer<ffi::S32>>()  // order_out
      .Attr<int64_t>("buffer_id")
      .Attr<int64_t>("num_topk")
      .Attr<int64_t>("timeout_ns")
      .Attr<bool>("mask_failed_ranks")
      .Attr<int64_t>("max_blocks");
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineSendHandler, LowLatencyCombineSend<false>, CombineSendBinding(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineSendOverlappedHandler, LowLatencyCombineSend<true>, CombineSendBinding(),
                              {});

template <bool kOverlapped>
static ffi::Error LowLatencyCombineRecv(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> order,
                                        ffi::Buffer<ffi::S32> token, ffi::Buffer<ffi::S32> topk_idx,
                                        ffi::Buffer<ffi::F32> topk_weights, ffi::RemainingArgs keep_alive,
                                        ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::S32> order_out,
                                        int64_t buffer_id, int64_t num_experts, int64_t timeout_ns, bool mask_failed) {
  constexpr const char* fn = "low_latency_combine_recv";
  low_latency::CombineRecvArgs args{};
  DEEP_EP_JAX_RETURN_IF_ERROR(PrepareCombineRecv(fn, device, topk_idx, topk_weights, out, buffer_id, num_experts,
                                                 timeout_ns, mask_failed, &args));
  CallOrder call{};  // the position passes through: the send took this operation's
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckCallOrder(fn, order, order_out, &call));
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckToken(fn, token.dimensions()));
  args.token = token.typed_data();
  DEEP_EP_JAX_RETURN_IF_ERROR(SideStreamError(fn, BeginReceive(device, buffer_id, args.token, stream, kOverlapped)));
  return Launched(fn, LaunchersFor(args.peers).combine_recv(args, device, stream));
}
static auto CombineRecvBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::Buffer<ffi::S32>>()  // order
      .Arg<ffi::Buffer<ffi::S32>>()  // token: the send half's
      .Arg<ffi::Buffer<ffi::S32>>()  // topk_idx [T, K]
      .Arg<ffi::Buffer<ffi::F32>>()  // topk_weights [T, K]
      .RemainingArgs()               // keep_alive: an overlapped send's inputs, unused: alive until the join
      .Ret<ffi::AnyBuffer>()         // out: bf16 [T, H]
      .Ret<ffi::Buffer<ffi::S32>>()  // order_out
      .Attr<int64_t>("buffer_id")
      .Attr<int64_t>("num_experts")
      .Attr<int64_t>("timeout_ns")
      .Attr<bool>("mask_failed_ranks");
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineRecvHandler, LowLatencyCombineRecv<false>, CombineRecvBinding(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineRecvOverlappedHandler, LowLatencyCombineRecv<true>, CombineRecvBinding(),
                              {});

// The whole combine in one kernel: the send half's arguments, then the receive half's.
static ffi::Error LowLatencyCombine(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> order, ffi::AnyBuffer x,
                                    ffi::Buffer<ffi::S32> recv_count, ffi::Buffer<ffi::S32> recv_src_rank,
                                    ffi::Buffer<ffi::S32> recv_src_token, ffi::Buffer<ffi::S32> recv_src_topk,
                                    ffi::Buffer<ffi::S32> topk_idx, ffi::Buffer<ffi::F32> topk_weights,
                                    ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::S32> order_out,
                                    int64_t buffer_id, int64_t num_experts, int64_t timeout_ns, bool mask_failed) {
  constexpr const char* fn = "low_latency_combine";
  DEEP_EP_JAX_RETURN_IF_ERROR(SideStreamError(fn, CheckNoPendingSend(device, buffer_id)));
  low_latency::CombineSendArgs send{};
  low_latency::CombineRecvArgs recv{};
  const Dims idx_dims = topk_idx.dimensions();
  const int64_t num_topk = idx_dims.size() == 2 ? idx_dims[1] : 0;
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckCallOrder(fn, order, order_out, &send.order));
  DEEP_EP_JAX_RETURN_IF_ERROR(PrepareCombineSend(fn, device, x, recv_count, recv_src_rank, recv_src_token,
                                                 recv_src_topk, buffer_id, num_topk, timeout_ns, mask_failed, &send));
  DEEP_EP_JAX_RETURN_IF_ERROR(PrepareCombineRecv(fn, device, topk_idx, topk_weights, out, buffer_id, num_experts,
                                                 timeout_ns, mask_failed, &recv));
  if (recv.hidden != send.hidden || recv.num_tokens > send.max_tokens) {
    return Invalid(fn, "the output must be bf16 [T, H] with T <= M and H of x");
  }
  if (num_experts != int64_t(send.num_local_experts) * send.peers.num_ranks) {
    return Invalid(fn, "num_experts (" + Str(num_experts) + ") must be x's experts per rank (" +
                           Str(send.num_local_experts) + ") times the " + Str(send.peers.num_ranks) + " ranks");
  }
  return Launched(fn, LaunchersFor(send.peers).combine(send, recv, device, stream));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineHandler, LowLatencyCombine,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // order
                                  .Arg<ffi::AnyBuffer>()         // x
                                  .Arg<ffi::Buffer<ffi::S32>>()  // recv_count
                                  .Arg<ffi::Buffer<ffi::S32>>()  // recv_src_rank
                                  .Arg<ffi::Buffer<ffi::S32>>()  // recv_src_token
                                  .Arg<ffi::Buffer<ffi::S32>>()  // recv_src_topk
                                  .Arg<ffi::Buffer<ffi::S32>>()  // topk_idx
                                  .Arg<ffi::Buffer<ffi::F32>>()  // topk_weights
                                  .Ret<ffi::AnyBuffer>()         // out
                                  .Ret<ffi::Buffer<ffi::S32>>()  // order_out
                                  .Attr<int64_t>("buffer_id")
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("timeout_ns")
                                  .Attr<bool>("mask_failed_ranks"),
                              {ffi::Traits::kCmdBufferCompatible});

// The Buffer's mask of ranks (low_latency_mask): int32 [R], 1 for a rank this
// rank neither sends to nor waits for; with `set`, first replaced by set_to.
static ffi::Error LowLatencyMask(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> order,
                                 ffi::Buffer<ffi::S32> set_to, ffi::ResultBuffer<ffi::S32> mask,
                                 ffi::ResultBuffer<ffi::S32> order_out, int64_t buffer_id, bool set) {
  constexpr const char* fn = "low_latency_mask";
  DEEP_EP_JAX_RETURN_IF_ERROR(SideStreamError(fn, CheckNoPendingSend(device, buffer_id)));
  CallOrder call{};  // the position passes through: no peer meets this call
  DEEP_EP_JAX_RETURN_IF_ERROR(CheckCallOrder(fn, order, order_out, &call));
  Peers peers{};
  DEEP_EP_JAX_RETURN_IF_ERROR(FindPeers(fn, buffer_id, device, 0, false, &peers));
  if (!IsShape(set_to.dimensions(), {peers.num_ranks}) || !IsShape(mask->dimensions(), {peers.num_ranks})) {
    return Invalid(fn, "the mask must be int32 [" + Str(peers.num_ranks) + "] (one entry per rank)");
  }
  return Launched(fn, low_latency::LaunchMask(peers.local, peers.rank, peers.num_ranks,
                                              set ? set_to.typed_data() : nullptr, mask->typed_data(), stream));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyMaskHandler, LowLatencyMask,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // order
                                  .Arg<ffi::Buffer<ffi::S32>>()  // set_to [R] (read with `set`)
                                  .Ret<ffi::Buffer<ffi::S32>>()  // mask [R]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // order_out
                                  .Attr<int64_t>("buffer_id")
                                  .Attr<bool>("set"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace deep_ep_jax
