// XLA FFI handlers of low-latency mode: dispatch and combine, each a send half
// and a receive half. The send half returns a token (int32 [1], the operation's
// sequence number) that the receive half takes, so XLA orders them and may
// schedule other work in between. Decode, validate, launch; no host sync.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi/bindings.h"
#include "ffi/registration.h"
#include "kernels/low_latency.h"
#include "runtime/registry.h"
#include "runtime/side_stream.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace deep_ep_jax {
namespace {

using low_latency::DispatchLayout;
using low_latency::Peers;

std::string Str(int64_t v) { return std::to_string(v); }

ffi::Error Invalid(const char* fn, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(fn) + ": " + what);
}

// This device's view of the buffer's low-latency region.
ffi::Error FindPeers(const char* fn, int64_t buffer_id, int device, int64_t timeout_ns, Peers* peers) {
  const DeviceState* state = FindDeviceState(buffer_id, device);
  if (state == nullptr) {
    return Invalid(fn, "buffer " + Str(buffer_id) + " does not exist on device " + Str(device) +
                           " (destroyed, or made for other devices)");
  }
  if (state->low_latency.local == nullptr) {
    return Invalid(fn, "the buffer has no low-latency region; create it with low_latency_mode=True");
  }
  for (int r = 0; r < state->num_ranks; ++r) peers->regions[r] = state->low_latency.peers[r];
  peers->rank = state->rank;
  peers->num_ranks = state->num_ranks;
  peers->half_bytes = low_latency::HalfBytes(state->low_latency.num_bytes);
  peers->timeout_ns = uint64_t(timeout_ns);
  peers->nvshmem = state->nvshmem;
  for (int r = 0; r < state->num_ranks; ++r) peers->pes[r] = state->pes[r];
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

ffi::Error Launched(const char* fn, cudaError_t err) {
  if (err != cudaSuccess) return ffi::Error::Internal(std::string(fn) + ": launch failed: " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

bool IsShape(ffi::Span<const int64_t> dims, std::initializer_list<int64_t> want) {
  if (dims.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want) {
    if (dims[i++] != w) return false;
  }
  return true;
}

// Checks shared by both halves of dispatch: shapes the kernels can handle.
ffi::Error CheckDispatchShapes(const char* fn, int64_t num_tokens, int64_t num_topk, int64_t hidden,
                               int64_t num_experts, int64_t max_tokens, int num_ranks, bool fp8) {
  if (num_experts < 1 || num_experts % num_ranks != 0 || num_experts > low_latency::kMaxExperts) {
    return Invalid(fn, "num_experts (" + Str(num_experts) + ") must be a multiple of num_ranks (" + Str(num_ranks) +
                           ") and <= " + Str(low_latency::kMaxExperts));
  }
  if (hidden < low_latency::kFp8Block || hidden % low_latency::kFp8Block != 0) {
    return Invalid(fn, "hidden (" + Str(hidden) + ") must be a positive multiple of 128");
  }
  if (num_topk < 1 || num_topk > low_latency::kMaxTopk) {
    return Invalid(fn, "top-k (" + Str(num_topk) + ") must be in [1, " + Str(low_latency::kMaxTopk) + "]");
  }
  if (num_tokens > max_tokens || max_tokens < 1 || max_tokens * num_topk > INT32_MAX / 2) {
    return Invalid(fn, "tokens (" + Str(num_tokens) + ") must be <= num_max_dispatch_tokens_per_rank (" +
                           Str(max_tokens) + ")");
  }
  if (low_latency::SharedBytesNeeded(int(num_experts), int(hidden), fp8) > low_latency::kMaxSharedBytes) {
    return Invalid(fn, "num_experts (" + Str(num_experts) + ") and hidden (" + Str(hidden) +
                           ") need more shared memory than the kernels use");
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Each half's arguments, decoded and checked; the handlers below launch one
// half, or both in one kernel (the whole operation).

ffi::Error PrepareDispatchSend(const char* fn, int32_t device, const ffi::AnyBuffer& x,
                               const ffi::Buffer<ffi::S32>& topk_idx, int64_t buffer_id, int64_t num_experts,
                               int64_t max_tokens, bool use_fp8, bool round_scale, int64_t timeout_ns,
                               low_latency::DispatchSendArgs* args) {
  if (auto err = FindPeers(fn, buffer_id, device, timeout_ns, &args->peers); err.failure()) return err;
  const auto x_dims = x.dimensions();
  const auto idx_dims = topk_idx.dimensions();
  if (x.element_type() != ffi::BF16 || x_dims.size() != 2) return Invalid(fn, "x must be bf16 [T, H]");
  if (idx_dims.size() != 2 || idx_dims[0] != x_dims[0]) return Invalid(fn, "topk_idx must be int32 [T, K]");
  const int64_t num_tokens = x_dims[0], hidden = x_dims[1], num_topk = idx_dims[1];
  const int num_ranks = args->peers.num_ranks;
  if (auto err = CheckDispatchShapes(fn, num_tokens, num_topk, hidden, num_experts, max_tokens, num_ranks, use_fp8);
      err.failure()) {
    return err;
  }
  args->layout =
      low_latency::MakeDispatchLayout(num_ranks, num_experts / num_ranks, max_tokens, num_topk, hidden, use_fp8);
  if (auto err = CheckFits(fn, args->layout.bytes, args->peers); err.failure()) return err;
  if (auto err = CheckStage(fn, low_latency::DispatchStageBytes(max_tokens, num_topk, args->layout.row_bytes),
                            args->peers);
      err.failure()) {
    return err;
  }
  args->x = x.untyped_data();
  args->topk_idx = topk_idx.typed_data();
  args->token = nullptr;
  args->num_tokens = int(num_tokens);
  args->num_topk = int(num_topk);
  args->hidden = int(hidden);
  args->num_experts = int(num_experts);
  args->max_tokens = int(max_tokens);
  args->fp8 = use_fp8;
  args->round_scale = round_scale;
  return ffi::Error::Success();
}

ffi::Error PrepareDispatchRecv(const char* fn, int32_t device, ffi::Result<ffi::AnyBuffer>& recv_x,
                               ffi::ResultBuffer<ffi::F32>& recv_scales, ffi::ResultBuffer<ffi::S32>& recv_count,
                               ffi::ResultBuffer<ffi::S32>& recv_src_rank, ffi::ResultBuffer<ffi::S32>& recv_src_token,
                               ffi::ResultBuffer<ffi::S32>& recv_src_topk, int64_t buffer_id, int64_t num_topk,
                               int64_t timeout_ns, low_latency::DispatchRecvArgs* args) {
  if (auto err = FindPeers(fn, buffer_id, device, timeout_ns, &args->peers); err.failure()) return err;
  const int num_ranks = args->peers.num_ranks;
  const auto dims = recv_x->dimensions();
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
  if (auto err = CheckDispatchShapes(fn, 0, num_topk, hidden, num_local * num_ranks, max_tokens, num_ranks, fp8);
      err.failure()) {
    return err;
  }
  args->layout = low_latency::MakeDispatchLayout(num_ranks, num_local, max_tokens, num_topk, hidden, fp8);
  if (auto err = CheckFits(fn, args->layout.bytes, args->peers); err.failure()) return err;
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
                              int64_t buffer_id, int64_t num_topk, int64_t timeout_ns,
                              low_latency::CombineSendArgs* args) {
  if (auto err = FindPeers(fn, buffer_id, device, timeout_ns, &args->peers); err.failure()) return err;
  const int num_ranks = args->peers.num_ranks;
  const auto dims = x.dimensions();
  if (x.element_type() != ffi::BF16 || dims.size() != 3 || dims[1] % num_ranks != 0) {
    return Invalid(fn, "x must be bf16 [E/R, R*M, H]");
  }
  const int64_t num_local = dims[0], rows = dims[1], hidden = dims[2], max_tokens = rows / num_ranks;
  if (!IsShape(recv_count.dimensions(), {num_local}) || !IsShape(recv_src_rank.dimensions(), {num_local, rows}) ||
      !IsShape(recv_src_token.dimensions(), {num_local, rows}) || !IsShape(recv_src_topk.dimensions(), {num_local, rows})) {
    return Invalid(fn, "the handle must hold recv_count int32 [E/R] and int32 [E/R, R*M] arrays matching x");
  }
  if (hidden < 8 || hidden % 8 != 0) return Invalid(fn, "hidden (" + Str(hidden) + ") must be a multiple of 8");
  if (num_topk < 1 || num_topk > low_latency::kMaxTopk || num_local > low_latency::kMaxExperts) {
    return Invalid(fn, "top-k (" + Str(num_topk) + ") must be in [1, " + Str(low_latency::kMaxTopk) +
                           "] and E/R (" + Str(num_local) + ") <= " + Str(low_latency::kMaxExperts));
  }
  if (auto err = CheckFits(fn, low_latency::CombineBytes(max_tokens, num_topk, hidden), args->peers); err.failure()) {
    return err;
  }
  if (auto err = CheckStage(fn, low_latency::CombineStageBytes(num_ranks, max_tokens, num_topk, hidden), args->peers);
      err.failure()) {
    return err;
  }
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
                              int64_t buffer_id, int64_t timeout_ns, low_latency::CombineRecvArgs* args) {
  if (auto err = FindPeers(fn, buffer_id, device, timeout_ns, &args->peers); err.failure()) return err;
  const auto idx_dims = topk_idx.dimensions();
  const auto out_dims = out->dimensions();
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
  if (auto err = CheckFits(fn, low_latency::CombineBytes(num_tokens, num_topk, hidden), args->peers); err.failure()) {
    return err;
  }
  args->token = nullptr;
  args->topk_idx = topk_idx.typed_data();
  args->topk_weights = topk_weights.typed_data();
  args->out = out->untyped_data();
  args->num_tokens = int(num_tokens);
  args->num_topk = int(num_topk);
  args->hidden = int(hidden);
  return ffi::Error::Success();
}

ffi::Error CheckToken(const char* fn, ffi::Span<const int64_t> dims) {
  return IsShape(dims, {1}) ? ffi::Error::Success() : Invalid(fn, "the token must be int32 [1]");
}

// ---------------------------------------------------------------------------
// Overlapped halves (Config.low_latency_overlap_sms > 0): runtime/side_stream.h
// holds the policy; these report its refusals and CUDA failures.

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

// The shared tail of the send halves: the token, the pending-send check, then
// the launch on XLA's stream or (overlapped) on the side stream.
template <bool kOverlapped, typename Args>
ffi::Error LaunchSend(const char* fn, int device, cudaStream_t xla, int64_t buffer_id,
                      ffi::ResultBuffer<ffi::S32>& token, int64_t max_blocks, Args& args,
                      cudaError_t (*launch)(const Args&, int, cudaStream_t)) {
  if (auto err = CheckToken(fn, token->dimensions()); err.failure()) return err;
  cudaStream_t stream;
  if (auto err = SideStreamError(fn, BeginSend(device, buffer_id, xla, kOverlapped, &stream)); err.failure()) {
    return err;
  }
  args.token = token->typed_data();
  args.max_blocks = int(max_blocks);
  if (auto err = Launched(fn, launch(args, device, stream)); err.failure()) return err;
  return SideStreamError(fn, EndSend(device, buffer_id, args.token, kOverlapped));
}

// ---------------------------------------------------------------------------
// Handlers. The split halves come twice: on XLA's stream (command-buffer
// compatible) and overlapped (kOverlapped; not, as they fork and join streams).

template <bool kOverlapped>
ffi::Error DispatchSend(cudaStream_t xla, int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                        ffi::ResultBuffer<ffi::S32> token, int64_t buffer_id, int64_t num_experts,
                        int64_t max_tokens, bool use_fp8, bool round_scale, int64_t timeout_ns, int64_t max_blocks) {
  constexpr const char* fn = "low_latency_dispatch_send";
  low_latency::DispatchSendArgs args{};
  if (auto err = PrepareDispatchSend(fn, device, x, topk_idx, buffer_id, num_experts, max_tokens, use_fp8,
                                     round_scale, timeout_ns, &args);
      err.failure()) {
    return err;
  }
  return LaunchSend<kOverlapped>(fn, device, xla, buffer_id, token, max_blocks, args,
                                 LaunchersFor(args.peers).dispatch_send);
}

// keep_alive: an overlapped send's inputs, unused here: XLA keeps them until
// this call, as the send may read them until the join.
template <bool kOverlapped>
ffi::Error DispatchRecv(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> token,
                        ffi::RemainingArgs /*keep_alive*/, ffi::Result<ffi::AnyBuffer> recv_x,
                        ffi::ResultBuffer<ffi::F32> recv_scales, ffi::ResultBuffer<ffi::S32> recv_count,
                        ffi::ResultBuffer<ffi::S32> recv_src_rank, ffi::ResultBuffer<ffi::S32> recv_src_token,
                        ffi::ResultBuffer<ffi::S32> recv_src_topk, int64_t buffer_id, int64_t num_topk,
                        int64_t timeout_ns) {
  constexpr const char* fn = "low_latency_dispatch_recv";
  low_latency::DispatchRecvArgs args{};
  if (auto err = PrepareDispatchRecv(fn, device, recv_x, recv_scales, recv_count, recv_src_rank, recv_src_token,
                                     recv_src_topk, buffer_id, num_topk, timeout_ns, &args);
      err.failure()) {
    return err;
  }
  if (auto err = CheckToken(fn, token.dimensions()); err.failure()) return err;
  args.token = token.typed_data();
  if (auto err = SideStreamError(fn, BeginReceive(device, buffer_id, args.token, stream, kOverlapped));
      err.failure()) {
    return err;
  }
  return Launched(fn, LaunchersFor(args.peers).dispatch_recv(args, device, stream));
}

ffi::Error Dispatch(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> topk_idx,
                    ffi::Result<ffi::AnyBuffer> recv_x, ffi::ResultBuffer<ffi::F32> recv_scales,
                    ffi::ResultBuffer<ffi::S32> recv_count, ffi::ResultBuffer<ffi::S32> recv_src_rank,
                    ffi::ResultBuffer<ffi::S32> recv_src_token, ffi::ResultBuffer<ffi::S32> recv_src_topk,
                    int64_t buffer_id, int64_t num_experts, int64_t max_tokens, bool use_fp8, bool round_scale,
                    int64_t timeout_ns) {
  constexpr const char* fn = "low_latency_dispatch";
  if (auto err = SideStreamError(fn, CheckNoPendingSend(device, buffer_id)); err.failure()) return err;
  low_latency::DispatchSendArgs send{};
  low_latency::DispatchRecvArgs recv{};
  if (auto err = PrepareDispatchSend(fn, device, x, topk_idx, buffer_id, num_experts, max_tokens, use_fp8,
                                     round_scale, timeout_ns, &send);
      err.failure()) {
    return err;
  }
  if (auto err = PrepareDispatchRecv(fn, device, recv_x, recv_scales, recv_count, recv_src_rank, recv_src_token,
                                     recv_src_topk, buffer_id, send.num_topk, timeout_ns, &recv);
      err.failure()) {
    return err;
  }
  if (recv.layout.bytes != send.layout.bytes || recv.fp8 != send.fp8 || recv.max_tokens != send.max_tokens) {
    return Invalid(fn, "the outputs do not match the inputs' shapes");
  }
  return Launched(fn, LaunchersFor(send.peers).dispatch(send, recv, device, stream));
}

template <bool kOverlapped>
ffi::Error CombineSend(cudaStream_t xla, int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> recv_count,
                       ffi::Buffer<ffi::S32> recv_src_rank, ffi::Buffer<ffi::S32> recv_src_token,
                       ffi::Buffer<ffi::S32> recv_src_topk, ffi::ResultBuffer<ffi::S32> token, int64_t buffer_id,
                       int64_t num_topk, int64_t timeout_ns, int64_t max_blocks) {
  constexpr const char* fn = "low_latency_combine_send";
  low_latency::CombineSendArgs args{};
  if (auto err = PrepareCombineSend(fn, device, x, recv_count, recv_src_rank, recv_src_token, recv_src_topk,
                                    buffer_id, num_topk, timeout_ns, &args);
      err.failure()) {
    return err;
  }
  return LaunchSend<kOverlapped>(fn, device, xla, buffer_id, token, max_blocks, args,
                                 LaunchersFor(args.peers).combine_send);
}

template <bool kOverlapped>
ffi::Error CombineRecv(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> token, ffi::Buffer<ffi::S32> topk_idx,
                       ffi::Buffer<ffi::F32> topk_weights, ffi::RemainingArgs /*keep_alive, as DispatchRecv*/,
                       ffi::Result<ffi::AnyBuffer> out, int64_t buffer_id, int64_t timeout_ns) {
  constexpr const char* fn = "low_latency_combine_recv";
  low_latency::CombineRecvArgs args{};
  if (auto err = PrepareCombineRecv(fn, device, topk_idx, topk_weights, out, buffer_id, timeout_ns, &args);
      err.failure()) {
    return err;
  }
  if (auto err = CheckToken(fn, token.dimensions()); err.failure()) return err;
  args.token = token.typed_data();
  if (auto err = SideStreamError(fn, BeginReceive(device, buffer_id, args.token, stream, kOverlapped));
      err.failure()) {
    return err;
  }
  return Launched(fn, LaunchersFor(args.peers).combine_recv(args, device, stream));
}

ffi::Error Combine(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> recv_count,
                   ffi::Buffer<ffi::S32> recv_src_rank, ffi::Buffer<ffi::S32> recv_src_token,
                   ffi::Buffer<ffi::S32> recv_src_topk, ffi::Buffer<ffi::S32> topk_idx,
                   ffi::Buffer<ffi::F32> topk_weights, ffi::Result<ffi::AnyBuffer> out, int64_t buffer_id,
                   int64_t timeout_ns) {
  constexpr const char* fn = "low_latency_combine";
  if (auto err = SideStreamError(fn, CheckNoPendingSend(device, buffer_id)); err.failure()) return err;
  low_latency::CombineSendArgs send{};
  low_latency::CombineRecvArgs recv{};
  const auto idx_dims = topk_idx.dimensions();
  const int64_t num_topk = idx_dims.size() == 2 ? idx_dims[1] : 0;
  if (auto err = PrepareCombineSend(fn, device, x, recv_count, recv_src_rank, recv_src_token, recv_src_topk,
                                    buffer_id, num_topk, timeout_ns, &send);
      err.failure()) {
    return err;
  }
  if (auto err = PrepareCombineRecv(fn, device, topk_idx, topk_weights, out, buffer_id, timeout_ns, &recv);
      err.failure()) {
    return err;
  }
  if (recv.hidden != send.hidden || recv.num_tokens > send.max_tokens) {
    return Invalid(fn, "the output must be bf16 [T, H] with T <= M and H of x");
  }
  return Launched(fn, LaunchersFor(send.peers).combine(send, recv, device, stream));
}

}  // namespace

// Arguments, results and attributes of each half; a whole operation binds
// its send half's arguments then its receive half's.
#define DEEP_EP_JAX_DISPATCH_SEND_ARGS \
  .Arg<ffi::AnyBuffer>()        /* x */ \
  .Arg<ffi::Buffer<ffi::S32>>() /* topk_idx */
#define DEEP_EP_JAX_DISPATCH_SEND_ATTRS \
  .Attr<int64_t>("buffer_id")           \
  .Attr<int64_t>("num_experts")         \
  .Attr<int64_t>("max_tokens")          \
  .Attr<bool>("use_fp8")                \
  .Attr<bool>("round_scale")            \
  .Attr<int64_t>("timeout_ns")
#define DEEP_EP_JAX_DISPATCH_RECV_RETS                                   \
  .Ret<ffi::AnyBuffer>()        /* recv_x */                             \
  .Ret<ffi::Buffer<ffi::F32>>() /* recv_scales ([1] unused when bf16) */ \
  .Ret<ffi::Buffer<ffi::S32>>() /* recv_count */                         \
  .Ret<ffi::Buffer<ffi::S32>>() /* recv_src_rank */                      \
  .Ret<ffi::Buffer<ffi::S32>>() /* recv_src_token */                     \
  .Ret<ffi::Buffer<ffi::S32>>() /* recv_src_topk */
#define DEEP_EP_JAX_COMBINE_SEND_ARGS                 \
  .Arg<ffi::AnyBuffer>()        /* x */              \
  .Arg<ffi::Buffer<ffi::S32>>() /* recv_count */     \
  .Arg<ffi::Buffer<ffi::S32>>() /* recv_src_rank */  \
  .Arg<ffi::Buffer<ffi::S32>>() /* recv_src_token */ \
  .Arg<ffi::Buffer<ffi::S32>>() /* recv_src_topk */
#define DEEP_EP_JAX_COMBINE_RECV_ARGS \
  .Arg<ffi::Buffer<ffi::S32>>() /* topk_idx */ \
  .Arg<ffi::Buffer<ffi::F32>>() /* topk_weights */

// The split halves' bindings, for both flavours.
#define DEEP_EP_JAX_DISPATCH_SEND_BINDING                                                \
  ffi::Ffi::Bind() DEEP_EP_JAX_STREAM_AND_DEVICE DEEP_EP_JAX_DISPATCH_SEND_ARGS            \
      .Ret<ffi::Buffer<ffi::S32>>() /* token */                                          \
      DEEP_EP_JAX_DISPATCH_SEND_ATTRS.Attr<int64_t>("max_blocks")
#define DEEP_EP_JAX_DISPATCH_RECV_BINDING                                                \
  ffi::Ffi::Bind() DEEP_EP_JAX_STREAM_AND_DEVICE.Arg<ffi::Buffer<ffi::S32>>() /* token */ \
      .RemainingArgs() /* keep_alive */                                                  \
      DEEP_EP_JAX_DISPATCH_RECV_RETS                                                     \
      .Attr<int64_t>("buffer_id")                                                        \
      .Attr<int64_t>("num_topk")                                                         \
      .Attr<int64_t>("timeout_ns")
#define DEEP_EP_JAX_COMBINE_SEND_BINDING                                       \
  ffi::Ffi::Bind() DEEP_EP_JAX_STREAM_AND_DEVICE DEEP_EP_JAX_COMBINE_SEND_ARGS   \
      .Ret<ffi::Buffer<ffi::S32>>() /* token */                                \
      .Attr<int64_t>("buffer_id")                                              \
      .Attr<int64_t>("num_topk")                                               \
      .Attr<int64_t>("timeout_ns")                                             \
      .Attr<int64_t>("max_blocks")
#define DEEP_EP_JAX_COMBINE_RECV_BINDING                                                 \
  ffi::Ffi::Bind() DEEP_EP_JAX_STREAM_AND_DEVICE.Arg<ffi::Buffer<ffi::S32>>() /* token */ \
      DEEP_EP_JAX_COMBINE_RECV_ARGS                                                      \
      .RemainingArgs() /* keep_alive */                                                  \
      .Ret<ffi::AnyBuffer>() /* out */                                                   \
      .Attr<int64_t>("buffer_id")                                                        \
      .Attr<int64_t>("timeout_ns")

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchSendHandler, DispatchSend<false>, DEEP_EP_JAX_DISPATCH_SEND_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchRecvHandler, DispatchRecv<false>, DEEP_EP_JAX_DISPATCH_RECV_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineSendHandler, CombineSend<false>, DEEP_EP_JAX_COMBINE_SEND_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineRecvHandler, CombineRecv<false>, DEEP_EP_JAX_COMBINE_RECV_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchSendOverlappedHandler, DispatchSend<true>,
                              DEEP_EP_JAX_DISPATCH_SEND_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchRecvOverlappedHandler, DispatchRecv<true>,
                              DEEP_EP_JAX_DISPATCH_RECV_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineSendOverlappedHandler, CombineSend<true>,
                              DEEP_EP_JAX_COMBINE_SEND_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineRecvOverlappedHandler, CombineRecv<true>,
                              DEEP_EP_JAX_COMBINE_RECV_BINDING);

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyDispatchHandler, Dispatch,
                              ffi::Ffi::Bind() DEEP_EP_JAX_STREAM_AND_DEVICE DEEP_EP_JAX_DISPATCH_SEND_ARGS
                                  DEEP_EP_JAX_DISPATCH_RECV_RETS DEEP_EP_JAX_DISPATCH_SEND_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(LowLatencyCombineHandler, Combine,
                              ffi::Ffi::Bind() DEEP_EP_JAX_STREAM_AND_DEVICE DEEP_EP_JAX_COMBINE_SEND_ARGS
                                  DEEP_EP_JAX_COMBINE_RECV_ARGS
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Attr<int64_t>("buffer_id")
                                  .Attr<int64_t>("timeout_ns"),
                              {ffi::Traits::kCmdBufferCompatible});

DEEP_EP_JAX_REGISTER_FFI_TARGET("deep_ep_jax_low_latency_dispatch_send", LowLatencyDispatchSendHandler);
DEEP_EP_JAX_REGISTER_FFI_TARGET("deep_ep_jax_low_latency_dispatch_recv", LowLatencyDispatchRecvHandler);
DEEP_EP_JAX_REGISTER_FFI_TARGET("deep_ep_jax_low_latency_dispatch", LowLatencyDispatchHandler);
DEEP_EP_JAX_REGISTER_FFI_TARGET("deep_ep_jax_low_latency_combine_send", LowLatencyCombineSendHandler);
DEEP_EP_JAX_REGISTER_FFI_TARGET("deep_ep_jax_low_latency_combine_recv", LowLatencyCombineRecvHandler);
DEEP_EP_JAX_REGISTER_FFI_TARGET("deep_ep_jax_low_latency_combine", LowLatencyCombineHandler);
DEEP_EP_JAX_REGISTER_FFI_TARGET("deep_ep_jax_low_latency_dispatch_send_overlapped",
                                LowLatencyDispatchSendOverlappedHandler);
DEEP_EP_JAX_REGISTER_FFI_TARGET("deep_ep_jax_low_latency_dispatch_recv_overlapped",
                                LowLatencyDispatchRecvOverlappedHandler);
DEEP_EP_JAX_REGISTER_FFI_TARGET("deep_ep_jax_low_latency_combine_send_overlapped",
                                LowLatencyCombineSendOverlappedHandler);
DEEP_EP_JAX_REGISTER_FFI_TARGET("deep_ep_jax_low_latency_combine_recv_overlapped",
                                LowLatencyCombineRecvOverlappedHandler);

}  // namespace deep_ep_jax
