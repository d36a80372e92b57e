// Normal-mode (training / prefill) dispatch and combine for an EP group that
// spans hosts: one process (one NVSHMEM PE) per GPU, R <=
// kMaxInternodeNormalRanks ranks cut into hosts ("nodes") of the same number
// of GPUs, at most kMaxInternodeHostRanks each. docs/internode.md has the design; in short:
//
// dispatch (hierarchical, as DeepEP's): a token crosses the network at most
// once per destination host, to the GPU of that host with the sender's local
// index (the "forwarder"), which copies it over NVLink to the destination
// GPUs of its host. Tokens for the sender's own host go over NVLink directly.
//   1. notify (one block): layout of the local tokens; every rank publishes
//      its per-rank and per-host token counts to every rank (the call's
//      barrier); then every token's final row on every destination is known
//      here (prefix over earlier source ranks + position), so rows land in
//      the contract's order with no sorting.
//   2. send: a warp per token: stages a packet (row, scales, source token,
//      top-k) in the send area and puts it to each remote host's forwarder;
//      the packets' final rows on that host's ranks (staged by notify) follow
//      in one put per host; writes rows for this host's ranks directly.
//   3. forward: waits for the packets from the same-index ranks of the other
//      hosts and copies each to its destination ranks of this host.
//   2+3 pipelined (LaunchConfig::pipeline, the default): one kernel, half its
//      blocks senders (a channel of contiguous tokens each, sent in chunks,
//      a tail per (source host, channel) at the forwarder after each chunk),
//      half forwarders (forward each chunk as its tail arrives).
//   4. finish: waits until every rank of this host is done writing here,
//      counts rows per local expert, and copies the landed rows into XLA's
//      outputs (the landing area is this rank's region: staged).
// combine (reduced per host, as DeepEP's rail-aligned combine): for a token
// of source rank s, on every host holding rows of it, the "forwarder" is the
// rank there with s's local index (the one that forwarded the rows in
// dispatch).
//   1. notify: the barrier; each source stages per host the tokens with rows
//      there (token, mask of that host's ranks holding it), in token order.
//   2. send: every rank stores each received row over NVLink into its
//      source's forwarder on this host, slot [its index][source host][token];
//      the staged (token, mask) lists go to the forwarders, one put per host.
//   3. forward: after its host's ranks are done, the forwarder sums each
//      token's rows in index order (float32 from 0.0), rounds the partial to
//      bf16 and puts it to the source, slot [this host][token] (its own
//      tokens: stored in place).
//   2+3 pipelined (LaunchConfig::pipeline, where the grid fits the device):
//      one kernel, half its blocks row senders (every C-th chunk of the
//      received rows, a row tail per (index, channel) at this host's ranks
//      after each chunk), half forwarders (reduce a list entry once its
//      holders' tails cover its rows, which the entry names).
//   4. receive: the source sums the partials in host order (float32 from
//      0.0), rounds to bf16: the reference backend's order, bit for bit.
//
// Flags live in this rank's Control block and hold the call's sequence
// number, so back-to-back calls and CUDA-graph replays need no resets. Every
// wait times out with a message naming rank, peer and counter.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/call_order.h"
#include "common/limits.h"
#include "common/traffic.h"
#include "runtime/registry.h"

namespace deep_ep_jax {
namespace internode {

// The normal-mode limits live in common/limits.h; declared here as well so
// that internode::kMaxBlocks and the like name them too.
using deep_ep_jax::kMaxBlocks;
using deep_ep_jax::kMaxLocalExperts;
using deep_ep_jax::kMaxRowArrays;
using deep_ep_jax::kMaxWarps;

// Launch knobs, the same on every rank.
struct LaunchConfig {
  int num_blocks;
  int num_warps;
  uint64_t timeout_ns;
  CallOrder order;             // this call's place among the Buffer's calls (per call, not a knob)
  bool count_traffic = false;  // add to the traffic counters (common/traffic.h)
  bool pipeline = true;        // send and forward in one kernel, by chunk (else one after the other)
};

// Pipelined send and forward (LaunchConfig::pipeline): one kernel whose
// blocks take roles. Of its num_blocks blocks the first num_blocks /
// kPipelineSenderShare send (one channel each, in chunks of
// kPipelineChunkTokens: dispatch's channel a contiguous range of the tokens,
// combine's every C-th chunk of the received rows), the rest forward. A grid
// of one block runs the serial kernels.
constexpr int kPipelineSenderShare = 2;
constexpr int kPipelineChunkTokens = 16;
// Forwarder blocks >= channels bounds the (source host, channel) pairs a forwarder polls by H.
static_assert(kPipelineSenderShare >= 2, "at least as many forwarder blocks as channels");
constexpr int PipelineChannels(int num_blocks) { return num_blocks / kPipelineSenderShare; }

// Shapes of one call: they fix the region's layout (identical on every rank,
// so peers address each other's regions with this rank's offsets).
struct Shapes {
  int num_tokens;        // T
  int num_worst_tokens;  // N
  int num_topk;          // K (0 when no top-k travels)
  int64_t row_bytes[kMaxRowArrays];
};

// Where things are in a region: the same offsets on every rank (same shapes,
// symmetric heap), so a rank addresses a peer's region with its own offsets.
// After the control bytes (sequence number, running flag) comes the
// synchronisation area, sized by the group only (R ranks), so dispatch's and
// combine's layouts share it; then the call's data.
struct Layout {
  int num_tokens, num_worst_tokens, num_topk;
  int num_ranks, ranks_per_node;  // R, G (every host holds G ranks)
  int64_t row_bytes[kMaxRowArrays];
  // Synchronisation: records [2][R] (parity of seq, source) of record_ints
  // ints: the source's call tag, its move grid, whether it pipelines, its tokens to each host
  // (R slots, hosts <= R), its tokens to each rank (R); ready flags [R];
  // rdma_done flags [R][kMaxBlocks] (source host, block); done flags
  // [R][kMaxBlocks] (source rank, block). Pipelined dispatch: tails
  // [R][kMaxBlocks] (source host, channel) of 64 bits, (call's sequence
  // number << 32) | packets delivered, and channel heads [R][kMaxBlocks] of
  // two ints (first position, packets in all) that precede the first tail.
  size_t records, record_ints, ready, rdma_done, done, tails, channel_heads, sync_end;
  // Dispatch landing area (N rows, in the contract's order).
  size_t rows[kMaxRowArrays], topk_idx, topk_weights, src_idx;
  // Dispatch packets: staged here (T), received from each host (num_nodes * T).
  size_t send, rdma_recv;
  // A packet: rows, then metadata (source token, top-k ids, weights).
  size_t packet_bytes, packet_row[kMaxRowArrays], packet_meta;
  // The final rows of a packet's token on the G ranks of its destination
  // host, [host][position among the tokens to that host][G] ints: staged
  // here by the notify kernel (send_meta, by destination host), put in one
  // piece per host, received from each host (rdma_meta, by source host).
  size_t send_meta, rdma_meta;
  // Combine, packets of (bf16 row, K float weights): slots [index on this
  // host][source host][token] of the rows this rank's host returns to the
  // sources of its rail (G * H = R per token); partials [host][token] of
  // this rank's own tokens; lists [host][position] of entries (token, mask
  // of that host's ranks holding it, its row at each of them: G ints, -1
  // where absent; the pipelined forward waits for those rows), staged here
  // by destination host and received here by source host.
  size_t combine_slots, combine_partials, combine_send_meta, combine_recv_meta;
  size_t combine_packet_bytes, combine_packet_weights, combine_meta_ints;
  size_t end;
};

// Ints of one source's record in the synchronisation area (see Layout):
// call tag, grid, whether the stages are pipelined, counts.
constexpr size_t kRecordCalls = 0, kRecordBlocks = 1, kRecordPipeline = 2, kRecordNodeCounts = 3;
constexpr size_t RecordInts(int num_ranks) { return AlignUp(kRecordNodeCounts + 2 * size_t(num_ranks), 4); }
constexpr size_t RecordRankCounts(int num_ranks) { return kRecordNodeCounts + size_t(num_ranks); }
// A combine list entry (Layout): token, mask, then the rows at the host's G ranks.
constexpr size_t kCombineMetaToken = 0, kCombineMetaMask = 1, kCombineMetaRows = 2;
constexpr size_t CombineMetaInts(int ranks_per_node) { return kCombineMetaRows + size_t(ranks_per_node); }

inline Layout MakeLayout(const Shapes& s, int num_ranks, int num_nodes, bool combine) {
  Layout L{};
  L.num_tokens = s.num_tokens;
  L.num_worst_tokens = s.num_worst_tokens;
  L.num_topk = s.num_topk;
  L.num_ranks = num_ranks;
  L.ranks_per_node = num_nodes > 0 ? num_ranks / num_nodes : 0;
  const size_t T = size_t(s.num_tokens), N = size_t(s.num_worst_tokens), K = size_t(s.num_topk);
  const size_t R = size_t(num_ranks);
  size_t offset = kControlBytes;
  auto take = [&](size_t bytes) {
    const size_t at = offset;
    offset = AlignUp(offset + bytes, kRegionAlign);
    return at;
  };
  L.record_ints = RecordInts(num_ranks);
  L.records = take(2 * R * L.record_ints * sizeof(int));
  L.ready = take(R * sizeof(int));
  L.rdma_done = take(R * kMaxBlocks * sizeof(int));
  L.done = take(R * kMaxBlocks * sizeof(int));
  L.tails = take(R * kMaxBlocks * sizeof(uint64_t));
  L.channel_heads = take(R * kMaxBlocks * 2 * sizeof(int));
  L.sync_end = offset;
  for (int i = 0; i < kMaxRowArrays; ++i) L.row_bytes[i] = s.row_bytes[i];
  if (!combine) {
    for (int i = 0; i < kMaxRowArrays; ++i) L.rows[i] = take(N * size_t(s.row_bytes[i]));
    L.topk_idx = take(N * K * sizeof(int));
    L.topk_weights = take(N * K * sizeof(float));
    L.src_idx = take(N * sizeof(int));
    L.packet_row[0] = 0;
    L.packet_row[1] = AlignUp(size_t(s.row_bytes[0]), kVectorBytes);
    L.packet_meta = L.packet_row[1] + AlignUp(size_t(s.row_bytes[1]), kVectorBytes);
    L.packet_bytes = L.packet_meta + AlignUp(sizeof(int) + (sizeof(int) + sizeof(float)) * K, kVectorBytes);
    L.send = take(T * L.packet_bytes);
    L.rdma_recv = take(size_t(num_nodes) * T * L.packet_bytes);
    // H * T * G = T * R ints each.
    L.send_meta = take(T * R * sizeof(int));
    L.rdma_meta = take(T * R * sizeof(int));
  } else {
    const size_t H = size_t(num_nodes);
    L.combine_packet_weights = AlignUp(size_t(s.row_bytes[0]), kVectorBytes);
    L.combine_packet_bytes = L.combine_packet_weights + AlignUp(K * sizeof(float), kVectorBytes);
    L.combine_slots = take(R * T * L.combine_packet_bytes);  // G * H = R
    L.combine_partials = take(H * T * L.combine_packet_bytes);
    L.combine_meta_ints = CombineMetaInts(L.ranks_per_node);
    L.combine_send_meta = take(H * T * L.combine_meta_ints * sizeof(int));
    L.combine_recv_meta = take(H * T * L.combine_meta_ints * sizeof(int));
  }
  L.end = offset;
  return L;
}

// Bytes of the normal region (control included) that dispatch / cached
// dispatch / combine of these shapes need, for num_ranks ranks on num_nodes
// hosts. Host code, so a build without NVSHMEM knows them too; Python gets
// them from the _C module (module.cc).
inline size_t DispatchRegionBytes(const Shapes& s, int num_ranks, int num_nodes) {
  return MakeLayout(s, num_ranks, num_nodes, false).end;
}
inline size_t CombineRegionBytes(const Shapes& s, int num_ranks, int num_nodes) {
  return MakeLayout(s, num_ranks, num_nodes, true).end;
}
// The control bytes and the synchronisation area (records, flags): the part
// of the region that grows with the group alone, ~ 16 R^2 + 1 KiB R bytes.
inline size_t SyncBytes(int num_ranks) { return MakeLayout(Shapes{}, num_ranks, 1, true).sync_end; }
// Combine's slots at a forwarder, one (row, weights) per (index on its host,
// source host, token): R * T * (2H + 4K) bytes rounded up (any hosts), the
// part of a combine's region that grows with R * T.
inline size_t CombineSlotBytes(const Shapes& s, int num_ranks) {
  const Layout L = MakeLayout(s, num_ranks, 1, true);
  return L.combine_partials - L.combine_slots;
}

struct DispatchParams {
  const char* x[kMaxRowArrays];
  int64_t row_bytes[kMaxRowArrays];
  const int* topk_idx;                // [T, K] global ids (dispatch), null for cached dispatch
  const float* topk_weights;          // [T, K] or null
  const int* cached_send_pos;         // cached dispatch: [T, R] from the handle
  const int* cached_num_recv_tokens;  // cached dispatch: [] from the handle
  int num_tokens, num_topk, num_experts, num_worst_tokens;
  // Token-side outputs (dispatch only; null for cached dispatch).
  bool* is_token_in_rank;    // [T, R]
  int* num_tokens_per_rank;  // [R]
  int* rank_prefix_matrix;   // [R, R] inclusive over source ranks
  int* send_pos;             // [T, R]
  int* node_pos;             // [T, num_nodes] scratch: position among the tokens sent to each host, -1
  // Receive-side outputs, N rows (null where absent).
  char* recv_x[kMaxRowArrays];
  int* recv_topk_idx;
  float* recv_topk_weights;
  int* recv_src_idx;
  int* recv_src_rank;
  int* num_recv_tokens;
  int* num_recv_tokens_per_expert;  // [E / R]
  int* num_dropped_tokens;
};

struct CombineParams {
  const uint16_t* x;           // bf16 [N, H]
  const float* topk_weights;   // [N, K] or null
  const int* send_pos;         // [T, R]
  const int* num_recv_tokens;  // []
  const int* recv_src_idx;     // [N]
  const int* recv_src_rank;    // [N]
  int num_tokens, hidden, num_topk, num_worst_tokens;
  uint16_t* out;       // bf16 [T, H]
  float* out_weights;  // [T, K] or null
};

// Test hook (_C.set_sequence_for_testing): rewrites `region`'s control block
// as if `seq` calls had run (the sequence number, and every flag that holds
// one), so a test can start just below a wrap. The region's device and every
// peer must be idle. Blocking (cudaMemcpy).
cudaError_t SetSequenceForTesting(char* region, int num_ranks, int seq);
// Test hook (_C.mark_call_running_for_testing): marks `region` as if a call
// were running on its device, so the next call stops as overlapping. Blocking.
cudaError_t MarkCallRunningForTesting(char* region);

// Whether combine's pipelined kernel (LaunchConfig::pipeline) can have all
// num_blocks blocks of num_warps warps resident at once on the device, which
// it needs (its forwarders wait for its own senders); else the serial
// kernels run. Also _C.internode_combine_pipeline_fits, for tests.
bool CombinePipelineFits(int device_ordinal, int num_blocks, int num_warps);

// Only enqueue work on `stream` (state.nvshmem with a normal region).
cudaError_t LaunchDispatch(const DeviceState& state, const DispatchParams& p, const LaunchConfig& c,
                           cudaStream_t stream);
cudaError_t LaunchCombine(const DeviceState& state, const CombineParams& p, const LaunchConfig& c, cudaStream_t stream);

}  // namespace internode
}  // namespace deep_ep_jax
