// Low-latency mode (decode): dispatch and combine, each as a send half and a
// receive half, over the DeviceState.low_latency region.
//
// Region = [control block (kControlBytes)] [half 0] [half 1]. Consecutive
// operations (dispatches and combines share one sequence number) alternate
// halves, so a fast rank's next send never overwrites rows a slow rank still
// reads; a receiver hands a half back to its senders (a "freed" flag) once
// read, so a third operation in flight waits (or times out) instead of
// corrupting data. Every rank must run the same sequence of operations.
//
// Dispatch, in the receiver's half: [counts: R sources x L experts]
// [row infos: R x cap] [rows: R x M], cap = M * K. A source sends each token
// row once to every rank that owns one of its experts, at row (source,
// token); the infos list the source's (token, k) pairs by local expert, then
// by (token, k), and the receiver copies the row out once per pair. Combine,
// in the source's half: row t * K + k holds the expert output for (token t,
// slot k), bf16 [H].
// Python gets these sizes from the _C module (module.cc), never re-derives them.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/limits.h"
#include "runtime/registry.h"

namespace deep_ep_jax {
namespace low_latency {

// This mode's limits (kMaxTopk, kMaxExperts, kMaxSharedBytes) are in this
// namespace in common/limits.h; the shared ones below are declared here as
// well so that low_latency::kFp8Block and the like name them too.
using deep_ep_jax::AlignUp;
using deep_ep_jax::kFp8Block;
using deep_ep_jax::kMxfp8Block;

// Bytes of one dispatched row in a half: FP8 data then its float scales, or bf16.
inline size_t DispatchRowBytes(int64_t hidden, bool fp8) {
  return fp8 ? AlignUp(size_t(hidden) + size_t(hidden / kFp8Block) * 4, kVectorBytes) : size_t(hidden) * 2;
}

// Byte offsets inside one half (all 16-byte aligned), for one call's shapes.
struct DispatchLayout {
  int64_t capacity;      // (token, k) pairs one source can send to one rank: M * K
  int64_t max_tokens;    // token rows one source can send to one rank: M
  size_t counts_offset;  // int [R source][L]: rows per local expert from each source
  size_t infos_offset;   // int [R source][capacity]: t * K + k of each (token, k), by local expert
  size_t rows_offset;    // [R source][max_tokens][row_bytes]: each token once
  size_t row_bytes;
  size_t bytes;  // end of the rows
};

inline DispatchLayout MakeDispatchLayout(int64_t num_ranks, int64_t num_local_experts, int64_t max_tokens,
                                         int64_t num_topk, int64_t hidden, bool fp8) {
  DispatchLayout l;
  l.capacity = max_tokens * num_topk;
  l.max_tokens = max_tokens;
  l.counts_offset = 0;
  l.infos_offset = AlignUp(size_t(num_ranks * num_local_experts) * 4, kVectorBytes);
  l.rows_offset = l.infos_offset + AlignUp(size_t(num_ranks * l.capacity) * 4, kVectorBytes);
  l.row_bytes = DispatchRowBytes(hidden, fp8);
  l.bytes = l.rows_offset + size_t(num_ranks * max_tokens) * l.row_bytes;
  return l;
}

// Bytes of a combine's rows in a half: one bf16 row per (token, k).
inline size_t CombineBytes(int64_t max_tokens, int64_t num_topk, int64_t hidden) {
  return size_t(max_tokens * num_topk) * size_t(hidden) * 2;
}

// Usable bytes of each half of a region of `region_bytes`.
inline size_t HalfBytes(size_t region_bytes) {
  return region_bytes < kControlBytes ? 0 : (region_bytes - kControlBytes) / 2 / kRegionAlign * kRegionAlign;
}

// What every kernel needs about the region and this device's place in it.
// Groups have up to kMaxGroupRanks ranks, so the per-rank tables stay in
// device memory (DeviceState::device_peers, device_pes) and each block copies
// them into its shared memory once (PeerTableBytes, at the start of its
// dynamic shared memory), instead of riding in the kernel arguments.
struct Peers {
  char* const* regions;  // [num_ranks]: low-latency region of each rank, mapped here
  const int* pes;        // [num_ranks]: PE of each rank (NVSHMEM), else null
  char* local;           // this rank's region (regions[rank])
  int rank;
  int num_ranks;
  size_t half_bytes;
  uint64_t timeout_ns;
  // An EP group across hosts (the region is in NVSHMEM's symmetric heap):
  // regions[r] is null for a rank on another host, reached as PE pes[r];
  // rows put to such ranks are staged in this rank's send area first (RDMA
  // reads its source from registered memory), send_bytes at send_offset of
  // the region. Unused (false, 0) over NVLink.
  bool nvshmem;
  size_t send_offset;
  size_t send_bytes;
  // Config.mask_failed_ranks: a peer that does not answer within timeout_ns is
  // masked (the kernels neither send to nor wait for it from then on) instead
  // of the wait trapping.
  bool mask_failed;
};

// Shared memory of a block's copy of the peer tables: region pointers, PEs,
// then which ranks are masked.
constexpr size_t PeerTableBytes(int num_ranks) {
  return AlignUp(size_t(num_ranks) * sizeof(char*), kVectorBytes) +
         2 * AlignUp(size_t(num_ranks) * sizeof(int), kVectorBytes);
}

// Send-area bytes the NVSHMEM kernels stage rows in: M * K slots for a
// dispatch (a token uses one per destination rank, at most K), one per
// (source rank, token, k) for a combine: R * M * K bf16 rows, which grows
// with the group (3.8 GB per GPU at R=256, M=128, K=8, H=7168). Only rows for
// other hosts use their slots; a smaller staging scheme is future work.
inline size_t DispatchStageBytes(int64_t max_tokens, int64_t num_topk, size_t row_bytes) {
  return size_t(max_tokens * num_topk) * row_bytes;
}
inline size_t CombineStageBytes(int64_t num_ranks, int64_t max_tokens, int64_t num_topk, int64_t hidden) {
  return size_t(num_ranks) * CombineBytes(max_tokens, num_topk, hidden);
}

struct DispatchSendArgs {
  Peers peers;
  DispatchLayout layout;
  const void* x;        // bf16 [T, H]
  const int* topk_idx;  // [T, K], -1 or a global expert id
  int* token;           // [1] out: this operation's sequence number (null in a whole dispatch)
  int num_tokens, num_topk, hidden, num_experts, max_tokens;
  bool fp8, round_scale;
  bool mxfp8;       // FP8 with per-32-channel float8_e8m0fnu scales (QuantizeRow)
  int max_blocks;   // split send: at most this many blocks (SMs), 0 for every SM
  CallOrder order;  // null in an overlapped send (common/call_order.h)
};

struct DispatchRecvArgs {
  Peers peers;
  DispatchLayout layout;
  const int* token;    // from the send half (unused in a whole dispatch)
  void* recv_x;        // [L, R*M, H] FP8 or bf16
  float* recv_scales;  // [L, R*M, H/128] (FP8 only)
  int* recv_count;     // [L]
  int* recv_src_rank;  // [L, R*M]
  int* recv_src_token;
  int* recv_src_topk;
  int num_local_experts, max_tokens, num_topk, hidden;
  bool fp8;
};

struct CombineSendArgs {
  Peers peers;
  const void* x;             // bf16 [L, R*M, H]
  const int* recv_count;     // [L]
  const int* recv_src_rank;  // [L, R*M]
  const int* recv_src_token;
  const int* recv_src_topk;
  int* token;  // null in a whole combine
  int num_local_experts, max_tokens, num_topk, hidden;
  int max_blocks;   // split send: at most this many blocks (SMs), 0 for every SM
  CallOrder order;  // null in an overlapped send (common/call_order.h)
};

struct CombineRecvArgs {
  Peers peers;
  const int* token;           // unused in a whole combine
  const int* topk_idx;        // [T, K]
  const float* topk_weights;  // [T, K]
  void* out;                  // bf16 [T, H]
  int num_tokens, num_topk, hidden;
  int num_experts;  // ids outside [0, num_experts) name no expert, as in dispatch
};

// Dynamic shared memory the kernels need (must stay <= kMaxSharedBytes).
size_t SharedBytesNeeded(int num_ranks, int num_experts, int hidden, bool fp8);

// Test hook (_C.set_sequence_for_testing): rewrites `region`'s control block
// as if `seq` calls had run (the sequence number, and every flag that holds
// one), so a test can start just below a wrap. The region's device and every
// peer must be idle. Blocking (cudaMemcpy).
cudaError_t SetSequenceForTesting(char* region, int seq);
// Test hook (_C.mark_call_running_for_testing): marks `region` as if a call
// were running on its device, so the next call stops as overlapping. Blocking.
cudaError_t MarkCallRunningForTesting(char* region);

// The Buffer's mask (low_latency_mask / low_latency_set_mask): 1 for a rank
// this rank neither sends to nor waits for (masked in its own entry, a rank
// sends to and waits for no one). With `set_to` (int32 [num_ranks] on the
// device, else null), the region's mask becomes set_to first; a rank that
// leaves the mask (this rank's own entry counting for all) is taken as having
// freed both halves, as it would have had it not been masked, so the next
// operations wait for it again. Then `mask` (int32 [num_ranks]) receives the
// mask. No operation of the region may run meanwhile (stream order).
cudaError_t LaunchMask(char* region, int rank, int num_ranks, const int* set_to, int* mask, cudaStream_t stream);

// Wait-time counters (Buffer.wait_times()): per receive kind and source rank,
// the nanoseconds this rank's receives waited for that source's rows.
enum WaitKind : int { kDispatchWait = 0, kCombineWait = 1, kWaitKinds = 2 };
// Copies `region`'s counters of ranks [0, num_ranks) to host[kWaitKinds *
// num_ranks] (kind-major), or, with `reset`, zeroes them. Blocking.
cudaError_t CopyWaitTimes(char* region, int num_ranks, unsigned long long* host, bool reset);

// Copies `region`'s mask of ranks [0, num_ranks) (1: masked) to host[num_ranks]. Blocking.
cudaError_t CopyMask(const char* region, int num_ranks, int* host);

// The kernels of one transport. Each only enqueues work on `stream`; no host
// synchronisation. dispatch and combine run both halves in one launch.
struct Launchers {
  cudaError_t (*dispatch_send)(const DispatchSendArgs&, int device_ordinal, cudaStream_t);
  cudaError_t (*dispatch_recv)(const DispatchRecvArgs&, int device_ordinal, cudaStream_t);
  cudaError_t (*dispatch)(const DispatchSendArgs&, const DispatchRecvArgs&, int device_ordinal, cudaStream_t);
  cudaError_t (*combine_send)(const CombineSendArgs&, int device_ordinal, cudaStream_t);
  cudaError_t (*combine_recv)(const CombineRecvArgs&, int device_ordinal, cudaStream_t);
  cudaError_t (*combine)(const CombineSendArgs&, const CombineRecvArgs&, int device_ordinal, cudaStream_t);
};

// Peers through their mapped regions (NVLink).
const Launchers& NvlinkLaunchers();

#ifdef DEEP_EP_JAX_WITH_NVSHMEM
// For a group across hosts (peers.nvshmem): ranks on other hosts through
// NVSHMEM, the others through their mapped regions (low_latency_nvshmem.cu,
// built only with NVSHMEM).
const Launchers& NvshmemLaunchers();
#endif

}  // namespace low_latency
}  // namespace deep_ep_jax
