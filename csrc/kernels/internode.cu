// Normal-mode dispatch and combine across hosts (see internode.h for the
// launch sequence, docs/internode.md for the design). Ranks on other hosts are
// reached through NVSHMEM's portable device API (warp puts from the symmetric
// heap, quiet, atomic-set flags), whatever transport NVSHMEM picked at run
// time; ranks of this host through their regions mapped by nvshmem_ptr.
// Compiled with -rdc=true, only in a build with NVSHMEM.
#include <cuda_bf16.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <atomic>
#include <cstddef>
#include <vector>

#include "kernels/device.cuh"
#include "kernels/internode.h"

namespace deep_ep_jax {
namespace internode {
namespace {

constexpr int kNotifyThreads = 1024;
constexpr int kFinishThreads = 1024;
constexpr int kCopyThreads = 512;
// Ranks or hosts one block-wide scan counts at a time (the notify kernel
// scans R ranks and H hosts in pieces of this many, one bit each of a word).
constexpr int kPiece = 32;
constexpr int kMaxRanks = kMaxInternodeNormalRanks;
static_assert(kMaxRanks % kPiece == 0, "shared per-rank arrays hold whole pieces (the scans write 32 totals)");

enum Mode : int { kDispatch = kDispatchCall, kCachedDispatch = kCachedDispatchCall, kCombine = kCombineCall };

__device__ const char* ModeName(int mode) {
  return mode == kDispatch         ? "internode dispatch"
         : mode == kCachedDispatch ? "internode cached_dispatch"
                                   : "internode combine";
}

// The first bytes of every rank's normal region; the flags and the counts
// peers publish follow in the synchronisation area (Layout: records, ready,
// rdma_done, done), sized by the group. Flags hold the sequence number of the
// call that set them; peers write them (stores over NVLink, or NVSHMEM puts
// and atomic sets), this rank only reads them.
struct Control {
  int seq;     // calls so far on this rank (every rank makes the same calls)
  int active;  // 1 while a call runs on this device (EnterCall)
};
static_assert(sizeof(Control) <= kTrafficOffset, "internode Control reaches the traffic counters (common/traffic.h)");

// The EP group as seen from this rank. Per-host arrays by value (a host has
// at most kMaxInternodeHostRanks ranks); per-rank tables in device memory
// (DeviceState::device_pes, device_nodes), which the kernels that need them
// per row copy to shared memory.
struct Group {
  char* host_regions[kMaxInternodeHostRanks];  // regions of this host's ranks, by index on the host, mapped here
  int host_ranks[kMaxInternodeHostRanks];      // their ranks
  const int* pes;                              // [R] PE of each rank
  const int* node_of;                          // [R] host of each rank
  const int* local_of;                         // [R] index of each rank among its host's ranks
  const int* rank_at;                          // [H * G] rank of (host b, index j) at b * G + j
  int rank, num_ranks, num_nodes, ranks_per_node, node, local;
  uint64_t timeout_ns;

  __device__ char* local_region() const { return host_regions[local]; }
  __device__ Control* control() const { return reinterpret_cast<Control*>(local_region()); }
  // A word of this rank's region as the same offset in `region` (a mapped peer's).
  template <typename T>
  __device__ T* In(char* region, const T* mine) const {
    return reinterpret_cast<T*>(region + (reinterpret_cast<const char*>(mine) - local_region()));
  }
};

// Synchronisation area (kernels/internode.h, Layout).
__device__ __forceinline__ int* Record(const Group& g, const Layout& L, int seq, int src) {
  return reinterpret_cast<int*>(g.local_region() + L.records) + (size_t(seq & 1) * L.num_ranks + src) * L.record_ints;
}
__device__ __forceinline__ int* ReadyFlag(const Group& g, const Layout& L, int src) {
  return reinterpret_cast<int*>(g.local_region() + L.ready) + src;
}
__device__ __forceinline__ int* RdmaDoneFlag(const Group& g, const Layout& L, int src_node, int block) {
  return reinterpret_cast<int*>(g.local_region() + L.rdma_done) + size_t(src_node) * kMaxBlocks + block;
}
__device__ __forceinline__ int* DoneFlag(const Group& g, const Layout& L, int src, int block) {
  return reinterpret_cast<int*>(g.local_region() + L.done) + size_t(src) * kMaxBlocks + block;
}

// A flag of a rank's region, after everything this thread wrote or put
// before (callers fence/quiet first): a release store where the region is
// mapped (this host), else an NVSHMEM atomic set.
__device__ __forceinline__ void SignalAt(const Group& g, char* mapped, int pe, const int* mine, int value) {
  if (mapped != nullptr) {
    StoreReleaseSys(g.In(mapped, mine), value);
  } else {
    nvshmem_int_atomic_set(const_cast<int*>(mine), value, pe);
  }
}

// Every rank's host, index and PE in shared memory, for kernels that look up
// any rank per row (combine's send). Ends with __syncthreads.
struct PeerTable {
  int node[kMaxRanks], local[kMaxRanks], pe[kMaxRanks];
};
__device__ void LoadPeerTable(const Group& g, PeerTable& t) {
  for (int r = threadIdx.x; r < g.num_ranks; r += blockDim.x) {
    t.node[r] = g.node_of[r];
    t.local[r] = g.local_of[r];
    t.pe[r] = g.pes[r];
  }
  __syncthreads();
}

// Completes this thread's NVSHMEM operations and makes its stores visible
// system-wide: after it, a flag may announce them.
__device__ __forceinline__ void CompleteWrites() {
  __threadfence_system();
  nvshmem_quiet();
}

// ---------------------------------------------------------------------------
// Step 1: layout, count exchange (the call's barrier), final rows.

struct NotifyArgs {
  int mode;
  int num_blocks;       // of the move kernels: peers wait for each other's blocks by index
  int pipeline;         // 1: dispatch's send and forward run pipelined (peers must agree: the roles of their blocks)
  const int* topk_idx;  // dispatch
  const int* cached_send_pos;  // cached dispatch
  int num_tokens, num_topk, num_experts, num_worst_tokens;
  bool* is_token_in_rank;
  int* num_tokens_per_rank;
  int* rank_prefix_matrix;
  int* send_pos;
  int* node_pos;
  int* num_recv_tokens;
  int* num_dropped_tokens;
  CallOrder order;
  Layout L;
};

// Bit j: token t goes to rank r0 + j (j < kPiece).
__device__ __forceinline__ uint32_t RankBits(const NotifyArgs& a, int num_ranks, int t, int r0) {
  uint32_t bits = 0;
  if (a.mode == kDispatch) {
    const int* topk = a.topk_idx + int64_t(t) * a.num_topk;
    const int experts_per_rank = a.num_experts / num_ranks;
    for (int k = 0; k < a.num_topk; ++k) {
      const int e = topk[k];
      if (e < 0 || e >= a.num_experts) continue;
      const unsigned j = unsigned(e / experts_per_rank - r0);
      if (j < unsigned(kPiece)) bits |= 1u << j;
    }
    return bits;
  }
  const int* pos = a.cached_send_pos + int64_t(t) * num_ranks;
  const int n = min(kPiece, num_ranks - r0);
  for (int j = 0; j < n; ++j) bits |= uint32_t(HandleRow(pos[r0 + j], a.num_worst_tokens) >= 0) << j;
  return bits;
}

// Bit l: token t has a row (a handle row in range) at host_ranks[l], the
// ranks of one host by index (cached dispatch and combine). With `rows`,
// also each rank's row there (-1 where none): a combine list entry's.
__device__ __forceinline__ uint32_t HostRanksHolding(const NotifyArgs& a, int num_ranks, const int* host_ranks, int G,
                                                     int t, int* rows = nullptr) {
  const int* pos = a.cached_send_pos + int64_t(t) * num_ranks;
  uint32_t mask = 0;
  for (int l = 0; l < G; ++l) {
    const int row = HandleRow(pos[host_ranks[l]], a.num_worst_tokens);
    if (rows != nullptr) rows[l] = row;
    mask |= uint32_t(row >= 0) << l;
  }
  return mask;
}

// Bit j: token t goes to a rank of host b0 + j. node_of, rank_at: shared copies of the group's tables.
__device__ __forceinline__ uint32_t NodeBits(const Group& g, const NotifyArgs& a, const int* node_of,
                                             const int* rank_at, int t, int b0) {
  uint32_t bits = 0;
  if (a.mode == kDispatch) {
    const int* topk = a.topk_idx + int64_t(t) * a.num_topk;
    const int experts_per_rank = a.num_experts / g.num_ranks;
    for (int k = 0; k < a.num_topk; ++k) {
      const int e = topk[k];
      if (e < 0 || e >= a.num_experts) continue;
      const unsigned j = unsigned(node_of[e / experts_per_rank] - b0);
      if (j < unsigned(kPiece)) bits |= 1u << j;
    }
    return bits;
  }
  const int n = min(kPiece, g.num_nodes - b0), G = g.ranks_per_node;
  for (int j = 0; j < n; ++j) {
    bits |= uint32_t(HostRanksHolding(a, g.num_ranks, rank_at + (b0 + j) * G, G, t) != 0) << j;
  }
  return bits;
}

// This thread's tokens [begin, end), in pieces of kPiece ranks (or hosts):
// per piece the exclusive offsets of this thread's first token among the
// block's tokens to each (values), and the block's totals (totals + first).
template <typename Bits>
__device__ __forceinline__ void ScanPiece(int begin, int end, int first, int count, Bits bits_of, int (&values)[kPiece],
                                          int* warp_sums, int* totals) {
#pragma unroll
  for (int j = 0; j < kPiece; ++j) values[j] = 0;
  for (int t = begin; t < end; ++t) {
    const uint32_t bits = bits_of(t);
#pragma unroll
    for (int j = 0; j < kPiece; ++j) values[j] += (bits >> j) & 1u;
  }
  BlockExclusiveScan(values, count, warp_sums, totals + first);
  __syncthreads();  // the next scan reuses warp_sums
}

__global__ void __launch_bounds__(kNotifyThreads) NotifyKernel(Group g, NotifyArgs a) {
  __shared__ int warp_sums[kWarpSize * kPiece];
  __shared__ int totals[kMaxRanks], node_totals[kMaxRanks], first_row[kMaxRanks], scratch[kPiece];
  __shared__ int node_of[kMaxRanks], rank_at[kMaxRanks];
  __shared__ int shared_seq, shared_tag;
  const Layout& L = a.L;
  const int R = g.num_ranks, H = g.num_nodes, G = g.ranks_per_node, me = g.rank;
  const bool dispatch = a.mode == kDispatch, combine = a.mode == kCombine;
  Control* control = g.control();
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    node_of[r] = g.node_of[r];
    rank_at[r] = g.rank_at[r];
  }
  __syncthreads();

  // Each thread takes a contiguous slice of tokens: thread order is token order.
  const int per_thread = (a.num_tokens + blockDim.x - 1) / blockDim.x;
  const int begin = min(a.num_tokens, int(threadIdx.x) * per_thread);
  const int end = min(a.num_tokens, begin + per_thread);
  int offset[kPiece];
  // Counts: tokens to each rank (dispatch) and to each host (combine: with rows there).
  for (int r0 = 0; dispatch && r0 < R; r0 += kPiece) {
    ScanPiece(
        begin, end, r0, min(kPiece, R - r0), [&](int t) { return RankBits(a, R, t, r0); }, offset, warp_sums, totals);
  }
  for (int b0 = 0; b0 < H; b0 += kPiece) {
    ScanPiece(
        begin, end, b0, min(kPiece, H - b0), [&](int t) { return NodeBits(g, a, node_of, rank_at, t, b0); }, offset,
        warp_sums, node_totals);
  }

  if (threadIdx.x == 0) {
    EnterCall(&control->active, a.mode, me);
    shared_tag = TakeCallTag(a.order, a.mode);
    shared_seq = NextSeq(LoadVolatile(&control->seq));  // wrapping (device.cuh)
    control->seq = shared_seq;
  }
  __syncthreads();
  const int seq = shared_seq, tag = shared_tag;

  // This rank's record (tag, grid, counts), written here, then copied to the
  // same place in every peer's region; then the ready flags.
  int* mine = Record(g, L, seq, me);
  for (int b = threadIdx.x; b < H; b += blockDim.x) mine[kRecordNodeCounts + b] = node_totals[b];
  for (int d = threadIdx.x; dispatch && d < R; d += blockDim.x) {
    mine[RecordRankCounts(R) + d] = totals[d];
    a.num_tokens_per_rank[d] = totals[d];
  }
  if (threadIdx.x == 0) {
    mine[kRecordCalls] = tag;
    mine[kRecordBlocks] = a.num_blocks;
    mine[kRecordPipeline] = a.pipeline;
  }
  __threadfence();
  __syncthreads();
  const int record_ints = dispatch ? int(RecordRankCounts(R)) + R : int(kRecordNodeCounts) + H;
  for (int peer = threadIdx.x; peer < R; peer += blockDim.x) {
    char* mapped = node_of[peer] == g.node ? g.host_regions[g.local_of[peer]] : nullptr;
    const int pe = g.pes[peer];
    if (peer != me) {
      if (mapped != nullptr) {
        int* theirs = g.In(mapped, mine);
        for (int i = 0; i < record_ints; ++i) theirs[i] = mine[i];
      } else {
        nvshmem_putmem(mine, mine, size_t(record_ints) * sizeof(int), pe);
      }
    }
    CompleteWrites();
    SignalAt(g, mapped, pe, ReadyFlag(g, L, me), seq);
  }
  // Every thread publishes before any waits: a thread serving two peers must not wait on one before the other has it.
  for (int peer = threadIdx.x; peer < R; peer += blockDim.x) {
    WaitAtLeast(ReadyFlag(g, L, peer), seq, g.timeout_ns, ModeName(a.mode), "ready flag (counts published)", me, peer,
                -1);
    const int* theirs = Record(g, L, seq, peer);
    CheckPeerCall(tag, LoadVolatile(theirs + kRecordCalls), me, peer);
    CheckPeerLaunch(a.num_blocks, LoadVolatile(theirs + kRecordBlocks), ModeName(a.mode), "blocks (Config.num_sms)", me,
                    peer);
    CheckPeerLaunch(a.pipeline, LoadVolatile(theirs + kRecordPipeline), ModeName(a.mode),
                    "pipelined stages (1 = on; Config.internode_pipeline)", me, peer);
  }
  __syncthreads();

  if (dispatch) {
    for (int d = threadIdx.x; d < R; d += blockDim.x) {  // destination d's column
      int sum = 0;
      for (int s = 0; s < R; ++s) {
        if (s == me) first_row[d] = sum;
        sum += LoadVolatile(Record(g, L, seq, s) + RecordRankCounts(R) + d);
        a.rank_prefix_matrix[s * R + d] = sum;
      }
      if (d == me) {
        const int num_recv = min(sum, a.num_worst_tokens);
        *a.num_recv_tokens = num_recv;
        *a.num_dropped_tokens = sum - num_recv;
      }
    }
    __syncthreads();
  }

  // Final rows (dispatch), per piece of ranks: the offsets again, then each token's row.
  for (int r0 = 0; dispatch && r0 < R; r0 += kPiece) {
    const int n = min(kPiece, R - r0);
    ScanPiece(begin, end, 0, n, [&](int t) { return RankBits(a, R, t, r0); }, offset, warp_sums, scratch);
    for (int t = begin; t < end; ++t) {
      const uint32_t bits = RankBits(a, R, t, r0);
#pragma unroll
      for (int j = 0; j < kPiece; ++j) {
        if (j < n) {
          const bool in = (bits >> j) & 1u;
          const int row = first_row[r0 + j] + offset[j];
          a.is_token_in_rank[int64_t(t) * R + r0 + j] = in;
          a.send_pos[int64_t(t) * R + r0 + j] = in && row < a.num_worst_tokens ? row : -1;
          offset[j] += in;
        }
      }
    }
  }
  // Positions among the tokens sent to each host. Combine: each such token's
  // entry (token, mask of the host's ranks holding it, its rows there) at its position, staged by
  // host for the send kernel to put to that host's forwarder; this host's
  // list goes straight to where this rank, its own tokens' forwarder, reads it.
  int* combine_send_meta = reinterpret_cast<int*>(g.local_region() + L.combine_send_meta);
  int* combine_recv_meta = reinterpret_cast<int*>(g.local_region() + L.combine_recv_meta);
  for (int b0 = 0; b0 < H; b0 += kPiece) {
    const int n = min(kPiece, H - b0);
    ScanPiece(
        begin, end, 0, n, [&](int t) { return NodeBits(g, a, node_of, rank_at, t, b0); }, offset, warp_sums, scratch);
    for (int t = begin; t < end; ++t) {
      const uint32_t bits = NodeBits(g, a, node_of, rank_at, t, b0);
#pragma unroll
      for (int j = 0; j < kPiece; ++j) {
        if (j < n) {
          const bool in = (bits >> j) & 1u;
          const int b = b0 + j;
          if (!combine) {
            a.node_pos[int64_t(t) * H + b] = in ? offset[j] : -1;
          } else if (in) {
            int* entry = (b == g.node ? combine_recv_meta : combine_send_meta) +
                         (size_t(b) * a.num_tokens + offset[j]) * L.combine_meta_ints;
            entry[kCombineMetaToken] = t;
            entry[kCombineMetaMask] = int(HostRanksHolding(a, R, rank_at + b * G, G, t, entry + kCombineMetaRows));
          }
          offset[j] += in;
        }
      }
    }
  }
  if (combine) return;
  // Each packet's final rows on the ranks of its destination host, staged by
  // host and position for the send kernel to put in one piece per host (this
  // thread's own writes above: plain reads).
  const int* pos_all = dispatch ? a.send_pos : a.cached_send_pos;
  int* send_meta = reinterpret_cast<int*>(g.local_region() + L.send_meta);
  for (int t = begin; t < end; ++t) {
    for (int b = 0; b < H; ++b) {
      const int p = a.node_pos[int64_t(t) * H + b];
      if (b == g.node || p < 0) continue;
      int* rows = send_meta + (size_t(b) * a.num_tokens + p) * G;
      for (int l = 0; l < G; ++l) rows[l] = HandleRow(pos_all[int64_t(t) * R + rank_at[b * G + l]], a.num_worst_tokens);
    }
  }
}

// ---------------------------------------------------------------------------
// Steps 2 and 3: send, forward. Both deliver rows into landing areas of this
// host's ranks with DeliverRow.

struct MoveArgs {
  int mode;
  const char* x[kMaxRowArrays];
  const int* topk_idx;        // dispatch
  const float* topk_weights;  // or null
  const int* send_pos;        // [T, R]
  const int* node_pos;        // [T, num_nodes]
  int experts_per_rank;
  TrafficCounters* traffic;  // this call kind's counters, or null (not counting)
  Layout L;
};

// Token `src_token`'s row lands at `row` of the landing area of rank `dest`,
// this host's rank of index `j`; top-k ids become dest's local ids (-1 and
// weight 0 for experts elsewhere; cached dispatch moves weights as they are).
// `load` reads the source: plain for the caller's inputs, NoAllocateLoad for
// packets that peers put while the kernel runs.
template <typename Load = PlainLoad>
__device__ void DeliverRow(const Group& g, const MoveArgs& a, int j, int dest, int row,
                           const char* const (&rows)[kMaxRowArrays], int src_token, const int* topk,
                           const float* weights, int lane, Load load = {}) {
  const Layout& L = a.L;
  char* base = g.host_regions[j];
#pragma unroll
  for (int i = 0; i < kMaxRowArrays; ++i) {
    if (L.row_bytes[i] == 0) continue;
    StridedCopyBytes<4>(base + L.rows[i] + int64_t(row) * L.row_bytes[i], rows[i], L.row_bytes[i], lane, kWarpSize,
                        load);
  }
  int* idx_out = reinterpret_cast<int*>(base + L.topk_idx) + int64_t(row) * L.num_topk;
  float* w_out = reinterpret_cast<float*>(base + L.topk_weights) + int64_t(row) * L.num_topk;
  for (int k = lane; k < L.num_topk; k += kWarpSize) {
    const float w = weights != nullptr ? __int_as_float(load(reinterpret_cast<const int*>(weights) + k)) : 0.0f;
    if (a.mode == kDispatch) {
      const int e = load(topk + k), local = e - dest * a.experts_per_rank;
      const bool mine = e >= 0 && local >= 0 && local < a.experts_per_rank;
      idx_out[k] = mine ? local : -1;
      w_out[k] = mine ? w : 0.0f;
    } else if (weights != nullptr) {
      w_out[k] = w;
    }
  }
  if (lane == 0 && a.mode == kDispatch) reinterpret_cast<int*>(base + L.src_idx)[row] = src_token;
}

// Token t, by one warp: a packet to each remote host with a destination
// (forwarder_pe: [host] PE of the rank there with this rank's index), rows
// for this host's ranks straight into their landing areas.
__device__ void SendToken(const Group& g, const MoveArgs& a, const int* forwarder_pe, int t, int lane) {
  const Layout& L = a.L;
  const int R = g.num_ranks, H = g.num_nodes, G = g.ranks_per_node;
  const int* pos = a.send_pos + int64_t(t) * R;
  const int* node_pos = a.node_pos + int64_t(t) * H;
  const int* topk = a.topk_idx != nullptr ? a.topk_idx + int64_t(t) * L.num_topk : nullptr;
  const float* weights = a.topk_weights != nullptr ? a.topk_weights + int64_t(t) * L.num_topk : nullptr;
  const char* rows[kMaxRowArrays];
  for (int i = 0; i < kMaxRowArrays; ++i) rows[i] = a.x[i] + int64_t(t) * L.row_bytes[i];

  // Other hosts: one packet, staged once (the source of a put must be in
  // the symmetric heap), put to each host's forwarder (lanes look at 32 hosts at a time).
  bool remote = false;
  for (int b = lane; b < H; b += kWarpSize) remote |= b != g.node && node_pos[b] >= 0;
  if (__any_sync(0xffffffffu, remote)) {
    char* packet = g.local_region() + L.send + int64_t(t) * L.packet_bytes;
#pragma unroll
    for (int i = 0; i < kMaxRowArrays; ++i) {
      if (L.row_bytes[i] > 0) StridedCopyBytes<4>(packet + L.packet_row[i], rows[i], L.row_bytes[i], lane, kWarpSize);
    }
    int* meta = reinterpret_cast<int*>(packet + L.packet_meta);
    if (lane == 0) meta[0] = t;
    for (int k = lane; k < L.num_topk; k += kWarpSize) {
      meta[1 + k] = topk != nullptr ? topk[k] : -1;
      reinterpret_cast<float*>(meta + 1 + L.num_topk)[k] = weights != nullptr ? weights[k] : 0.0f;
    }
    FenceStagedForWarpPut();
    for (int b0 = 0; b0 < H; b0 += kWarpSize) {
      const int b = b0 + lane;
      const int p = b < H && b != g.node ? node_pos[b] : -1;
      const uint32_t put_hosts = __ballot_sync(0xffffffffu, p >= 0);
      if (lane == 0) CountTraffic(a.traffic, true, __popc(put_hosts), L.row_bytes[0] + L.row_bytes[1]);
      for (uint32_t hosts = put_hosts; hosts != 0; hosts &= hosts - 1) {
        const int j = __ffs(hosts) - 1, position = __shfl_sync(0xffffffffu, p, j);
        const size_t slot = L.rdma_recv + (size_t(g.node) * L.num_tokens + position) * L.packet_bytes;
        nvshmemx_putmem_nbi_warp(g.local_region() + slot, packet, L.packet_bytes, forwarder_pe[b0 + j]);
      }
    }
  }
  // This host: straight into the destinations' landing areas.
  int peers = 0;
  for (int j = 0; j < G; ++j) {
    const int r = g.host_ranks[j], row = HandleRow(pos[r], L.num_worst_tokens);
    if (row >= 0) DeliverRow(g, a, j, r, row, rows, t, topk, weights, lane);
    peers += row >= 0 && j != g.local;
  }
  if (lane == 0) CountTraffic(a.traffic, false, peers, L.row_bytes[0] + L.row_bytes[1]);
}

// forwarder_pe[b]: PE of host b's rank with this rank's index. Ends with __syncthreads.
__device__ void LoadForwarderPes(const Group& g, int* forwarder_pe) {
  for (int b = threadIdx.x; b < g.num_nodes; b += blockDim.x) {
    forwarder_pe[b] = g.pes[g.rank_at[b * g.ranks_per_node + g.local]];
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kMaxWarps* kWarpSize) SendKernel(Group g, MoveArgs a) {
  __shared__ int forwarder_pe[kMaxRanks];  // [host]: PE of the rank there with this rank's index
  const Layout& L = a.L;
  const int H = g.num_nodes, G = g.ranks_per_node, me = g.rank;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int num_warps = gridDim.x * (blockDim.x / kWarpSize);
  LoadForwarderPes(g, forwarder_pe);
  Control* control = g.control();
  const int seq = LoadVolatile(&control->seq);
  for (int t = warp; t < L.num_tokens; t += num_warps) SendToken(g, a, forwarder_pe, t, lane);
  // The packets' final rows on each remote host's ranks (staged by the notify
  // kernel), one put per host, after the same flag as the packets.
  const size_t meta_row = size_t(G) * sizeof(int);
  for (int b = warp; b < H; b += num_warps) {
    const int n = b == g.node ? 0 : LoadVolatile(Record(g, L, seq, me) + kRecordNodeCounts + b);
    if (n == 0) continue;
    char* from = g.local_region() + L.send_meta + size_t(b) * L.num_tokens * meta_row;
    char* to = g.local_region() + L.rdma_meta + size_t(g.node) * L.num_tokens * meta_row;
    nvshmemx_putmem_nbi_warp(to, from, size_t(n) * meta_row, forwarder_pe[b]);
  }

  CompleteWrites();
  __syncthreads();
  // Every forwarder of this rank's packets hears from every block, sent or not.
  for (int b = threadIdx.x; b < H; b += blockDim.x) {
    if (b != g.node) nvshmem_int_atomic_set(RdmaDoneFlag(g, L, g.node, blockIdx.x), seq, forwarder_pe[b]);
  }
}

// starts[0..H) hold per-host counts (written by the block before the call);
// after it they are exclusive prefix sums and starts[H] is the total.
__device__ void ExclusiveScanHosts(int* starts, int H) {
  __syncthreads();
  if (threadIdx.x == 0) {
    int total = 0;
    for (int b = 0; b < H; ++b) {
      const int n = starts[b];
      starts[b] = total;
      total += n;
    }
    starts[H] = total;
  }
  __syncthreads();
}
// The host whose entries hold entry i of the scanned starts: the last b with
// starts[b] <= i (hosts without entries share their successor's start).
__device__ int HostOfEntry(const int* starts, int H, int i) {
  int b = 0;
  for (int hi = H - 1; b < hi;) {
    const int mid = (b + hi + 1) / 2;
    if (starts[mid] <= i)
      b = mid;
    else
      hi = mid - 1;
  }
  return b;
}

// The packet at `position` from host src_node, by one warp: to its
// destination ranks of this host. Peers' puts: coherent loads that leave no
// line in L1 (a line may also hold a packet or final rows not landed yet).
__device__ void ForwardPacket(const Group& g, const MoveArgs& a, int src_node, int position, int lane) {
  const Layout& L = a.L;
  const int G = g.ranks_per_node;
  const size_t at = size_t(src_node) * L.num_tokens + position;
  const char* packet = g.local_region() + L.rdma_recv + at * L.packet_bytes;
  const int* final_rows = reinterpret_cast<const int*>(g.local_region() + L.rdma_meta) + at * G;
  const int* meta = reinterpret_cast<const int*>(packet + L.packet_meta);
  const char* rows[kMaxRowArrays];
  for (int k = 0; k < kMaxRowArrays; ++k) rows[k] = packet + L.packet_row[k];
  const int* topk = meta + 1;
  const float* weights = a.topk_weights != nullptr ? reinterpret_cast<const float*>(topk + L.num_topk) : nullptr;
  const int token = LoadNoAllocate(meta);
  int peers = 0;
  for (int j = 0; j < G; ++j) {
    const int row = LoadNoAllocate(final_rows + j);
    if (row >= 0) DeliverRow(g, a, j, g.host_ranks[j], row, rows, token, topk, weights, lane, NoAllocateLoad{});
    peers += row >= 0 && j != g.local;
  }
  if (lane == 0) CountTraffic(a.traffic, false, peers, L.row_bytes[0] + L.row_bytes[1]);
}

__global__ void __launch_bounds__(kMaxWarps* kWarpSize) ForwardKernel(Group g, MoveArgs a) {
  __shared__ int starts[kMaxRanks + 1];  // [source host]: packets from the hosts before it (H + 1 used)
  const Layout& L = a.L;
  const int H = g.num_nodes, G = g.ranks_per_node, me = g.rank;
  Control* control = g.control();
  const int seq = LoadVolatile(&control->seq);
  const int num_blocks = gridDim.x;
  for (int i = threadIdx.x; i < H * num_blocks; i += blockDim.x) {
    const int b = i / num_blocks, block = i % num_blocks;
    if (b != g.node) {
      WaitAtLeast(RdmaDoneFlag(g, L, b, block), seq, g.timeout_ns, ModeName(a.mode), "RDMA packets of a block", me,
                  g.rank_at[b * G + g.local], block);
    }
  }
  // Packets from each host: its sender's count, published in its record.
  for (int b = threadIdx.x; b < H; b += blockDim.x) {
    starts[b] =
        b == g.node ? 0 : LoadVolatile(Record(g, L, seq, g.rank_at[b * G + g.local]) + kRecordNodeCounts + g.node);
  }
  ExclusiveScanHosts(starts, H);

  const int lane = threadIdx.x % kWarpSize;
  const int warp = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int num_warps = gridDim.x * (blockDim.x / kWarpSize);
  const int total = starts[H];
  for (int i = warp; i < total; i += num_warps) {
    const int b = HostOfEntry(starts, H, i);
    ForwardPacket(g, a, b, i - starts[b], lane);
  }
  __threadfence_system();
  __syncthreads();
  for (int j = threadIdx.x; j < G; j += blockDim.x) {
    StoreReleaseSys(g.In(g.host_regions[j], DoneFlag(g, L, me, blockIdx.x)), seq);
  }
}

// ---------------------------------------------------------------------------
// Steps 2 and 3 pipelined (LaunchConfig::pipeline): one kernel whose blocks
// take roles. Sender block c is channel c: tokens [ChannelBegin(c),
// ChannelBegin(c + 1)) in chunks of kPipelineChunkTokens; a channel's
// packets to host b fill the contiguous positions [head, head + count)
// there, so after each chunk it raises a 64-bit tail at each remote
// forwarder, (sequence number << 32) | packets delivered. Forwarder blocks
// poll the tails of their (source host, channel) pairs and forward each
// newly landed packet at once. Rows, landing rows and counters are those of
// the serial kernels: only the time a row moves changes.
//
// Ordering: every thread of a sender block completes its puts of the chunk
// (packets, final rows, and before the first tail the channel's head) with
// nvshmem_quiet, the block meets at __syncthreads, then one thread per
// remote host sets the tail (nvshmemx_signal_op). Quiet, not nvshmem_fence:
// a fence orders only the calling thread's operations per destination, and
// the chunk's puts come from every warp of the block.
//
// Deadlock: a sender waits for nothing (every packet has its own slot, so
// there is no ring to drain); a forwarder waits only for other ranks'
// senders. No block waits for a block of its own rank, so progress needs no
// co-residency of the roles, and with several ranks time-sliced on one GPU a
// spinning forwarder only spends its own rank's slice. Senders take the low
// block indices, so even a grid larger than the GPU (it never is:
// Config.num_sms <= the SM count) starts them first.

__device__ __forceinline__ int ChannelBegin(int num_tokens, int channel, int num_channels) {
  return int(int64_t(num_tokens) * channel / num_channels);
}
__device__ __forceinline__ uint64_t* Tail(const Group& g, const Layout& L, int src_node, int channel) {
  return reinterpret_cast<uint64_t*>(g.local_region() + L.tails) + size_t(src_node) * kMaxBlocks + channel;
}
// (first position, packets in all) of a channel at this forwarder.
__device__ __forceinline__ int* ChannelHead(const Group& g, const Layout& L, int src_node, int channel) {
  return reinterpret_cast<int*>(g.local_region() + L.channel_heads) + (size_t(src_node) * kMaxBlocks + channel) * 2;
}
__device__ __forceinline__ uint64_t TailValue(int seq, int delivered) {
  return (uint64_t(unsigned(seq)) << 32) | unsigned(delivered);
}

// Per remote host: the channel's first position there (head), the packets it
// delivered so far (sent) and those of the current chunk (fresh).
struct SenderState {
  int head[kMaxRanks], sent[kMaxRanks], fresh[kMaxRanks];
};

__device__ void SendChannel(const Group& g, const MoveArgs& a, const int* forwarder_pe, int channel, int num_channels,
                            int seq, SenderState& s) {
  const Layout& L = a.L;
  const int H = g.num_nodes, G = g.ranks_per_node;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, num_warps = blockDim.x / kWarpSize;
  const int begin = ChannelBegin(L.num_tokens, channel, num_channels);
  const int end = ChannelBegin(L.num_tokens, channel + 1, num_channels);
  // The channel's head at each remote forwarder, before any of its tails.
  for (int b = threadIdx.x; b < H; b += blockDim.x) {
    int first = 0, count = 0;
    for (int t = begin; b != g.node && t < end; ++t) {
      const int p = a.node_pos[int64_t(t) * H + b];
      if (p >= 0 && count++ == 0) first = p;
    }
    s.head[b] = first;
    s.sent[b] = 0;
    if (b == g.node) continue;
    int* head = ChannelHead(g, L, g.node, channel);
    nvshmem_int_p(head, first, forwarder_pe[b]);
    nvshmem_int_p(head + 1, count, forwarder_pe[b]);
  }
  const size_t meta_row = size_t(G) * sizeof(int);
  // The first chunk runs even when the channel is empty: its tails tell the forwarders so.
  for (int chunk = begin; chunk == begin || chunk < end; chunk += kPipelineChunkTokens) {
    const int chunk_end = min(end, chunk + kPipelineChunkTokens);
    for (int t = chunk + warp; t < chunk_end; t += num_warps) SendToken(g, a, forwarder_pe, t, lane);
    // The chunk's final rows (staged by the notify kernel), one put per host.
    for (int b = threadIdx.x; b < H; b += blockDim.x) {
      int n = 0;
      for (int t = chunk; b != g.node && t < chunk_end; ++t) n += a.node_pos[int64_t(t) * H + b] >= 0;
      s.fresh[b] = n;
      if (n == 0) continue;
      const size_t position = size_t(s.head[b] + s.sent[b]);
      const char* from = g.local_region() + L.send_meta + (size_t(b) * L.num_tokens + position) * meta_row;
      char* to = g.local_region() + L.rdma_meta + (size_t(g.node) * L.num_tokens + position) * meta_row;
      nvshmem_putmem_nbi(to, from, size_t(n) * meta_row, forwarder_pe[b]);
    }
    CompleteWrites();
    __syncthreads();
    __threadfence_system();  // the signal after what the block's threads completed before the barrier
    for (int b = threadIdx.x; b < H; b += blockDim.x) {
      if (b == g.node || (s.fresh[b] == 0 && chunk != begin)) continue;
      s.sent[b] += s.fresh[b];
      nvshmemx_signal_op(Tail(g, L, g.node, channel), TailValue(seq, s.sent[b]), NVSHMEM_SIGNAL_SET, forwarder_pe[b]);
    }
  }
}

// Per (source host, channel) pair of a forwarder block: the channel's first
// position here, its packets in all (-1 until its head is read), those
// forwarded; and the pairs with newly landed packets, [from, to) each.
struct ForwarderState {
  int head[kMaxRanks], count[kMaxRanks], done[kMaxRanks];
  int work_pair[kMaxRanks], work_from[kMaxRanks], work_to[kMaxRanks];
  int num_work, num_open;
};

// Pair k of forwarder block f of F: (remote host, channel) number f + k * F,
// remote hosts in order, this host skipped.
__device__ __forceinline__ void PairOf(const Group& g, int num_channels, int f, int num_forwarders, int k, int* node,
                                       int* channel) {
  const int i = f + k * num_forwarders, remote = i / num_channels;
  *node = remote < g.node ? remote : remote + 1;
  *channel = i % num_channels;
}

__device__ void ForwardChannels(const Group& g, const MoveArgs& a, int f, int num_forwarders, int num_channels, int seq,
                                ForwarderState& s) {
  const Layout& L = a.L;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, num_warps = blockDim.x / kWarpSize;
  const int total_pairs = (g.num_nodes - 1) * num_channels;
  // At most ceil((H - 1) * channels / forwarders) <= H pairs: forwarders >= channels (PipelineChannels).
  const int num_pairs = f < total_pairs ? (total_pairs - f + num_forwarders - 1) / num_forwarders : 0;
  for (int k = threadIdx.x; k < num_pairs; k += blockDim.x) {
    s.count[k] = -1;
    s.done[k] = 0;
  }
  uint64_t idle_since = GlobalTimerNs();
  for (;;) {
    if (threadIdx.x == 0) s.num_work = s.num_open = 0;
    __syncthreads();
    for (int k = threadIdx.x; k < num_pairs; k += blockDim.x) {
      if (s.count[k] >= 0 && s.done[k] == s.count[k]) continue;
      atomicAdd(&s.num_open, 1);
      int node, channel;
      PairOf(g, num_channels, f, num_forwarders, k, &node, &channel);
      const uint64_t tail = LoadAcquireSys64(Tail(g, L, node, channel));
      if (int(tail >> 32) != seq) continue;  // no chunk of this call yet (senders are never a call ahead)
      if (s.count[k] < 0) {
        const int* head = ChannelHead(g, L, node, channel);
        s.head[k] = LoadVolatile(head);
        s.count[k] = LoadVolatile(head + 1);
      }
      const int delivered = min(int(uint32_t(tail)), s.count[k]);
      if (delivered > s.done[k]) {
        const int w = atomicAdd(&s.num_work, 1);
        s.work_pair[w] = k;
        s.work_from[w] = s.done[k];
        s.work_to[w] = delivered;
        s.done[k] = delivered;
      }
    }
    __syncthreads();
    if (s.num_open == 0) break;
    for (int w = 0; w < s.num_work; ++w) {
      int node, channel;
      PairOf(g, num_channels, f, num_forwarders, s.work_pair[w], &node, &channel);
      const int head = s.head[s.work_pair[w]];
      for (int i = s.work_from[w] + warp; i < s.work_to[w]; i += num_warps) ForwardPacket(g, a, node, head + i, lane);
    }
    if (s.num_work > 0) {
      idle_since = GlobalTimerNs();
    } else if (threadIdx.x == 0 && GlobalTimerNs() - idle_since > g.timeout_ns) {
      for (int k = 0; k < num_pairs; ++k) {
        if (s.count[k] >= 0 && s.done[k] == s.count[k]) continue;
        int node, channel;
        PairOf(g, num_channels, f, num_forwarders, k, &node, &channel);
        printf(
            "deep_ep_jax timeout: %s rank %d waited %.1f s for the RDMA tail of a channel (packets delivered) "
            "from peer %d (channel %d): %d of %d packets of call %d, tail 0x%llx" DEEP_EP_JAX_TRAP_NOTE,
            ModeName(a.mode), g.rank, g.timeout_ns * 1e-9, g.rank_at[node * g.ranks_per_node + g.local], channel,
            s.done[k], s.count[k], seq, static_cast<unsigned long long>(LoadAcquireSys64(Tail(g, L, node, channel))));
        __trap();
      }
    }
    __syncthreads();  // the next round resets the work list
  }
}

__global__ void __launch_bounds__(kMaxWarps* kWarpSize) PipelinedMoveKernel(Group g, MoveArgs a) {
  __shared__ int forwarder_pe[kMaxRanks];  // [host]: PE of the rank there with this rank's index
  __shared__ union {
    SenderState sender;
    ForwarderState forwarder;
  } state;
  const Layout& L = a.L;
  const int G = g.ranks_per_node, me = g.rank;
  LoadForwarderPes(g, forwarder_pe);
  const int seq = LoadVolatile(&g.control()->seq);
  const int num_channels = PipelineChannels(gridDim.x);
  if (int(blockIdx.x) < num_channels) {
    SendChannel(g, a, forwarder_pe, blockIdx.x, num_channels, seq, state.sender);
  } else {
    ForwardChannels(g, a, blockIdx.x - num_channels, gridDim.x - num_channels, num_channels, seq, state.forwarder);
  }
  // Every rank of this host hears from every block (rows it stored there, or none): the finish kernel waits.
  __threadfence_system();
  __syncthreads();
  for (int j = threadIdx.x; j < G; j += blockDim.x) {
    StoreReleaseSys(g.In(g.host_regions[j], DoneFlag(g, L, me, blockIdx.x)), seq);
  }
}

// ---------------------------------------------------------------------------
// Step 4: wait for this host's ranks, count rows per local expert, copy out.

struct FinishArgs {
  int mode, num_blocks;
  const int* num_recv_tokens;
  int experts_per_rank;
  int* num_recv_tokens_per_expert;  // dispatch
  Layout L;
};

__global__ void __launch_bounds__(kFinishThreads) FinishKernel(Group g, FinishArgs a) {
  __shared__ int histogram[kMaxLocalExperts];
  Control* control = g.control();
  const int seq = LoadVolatile(&control->seq);
  for (int i = threadIdx.x; i < g.ranks_per_node * a.num_blocks; i += blockDim.x) {
    const int src = g.host_ranks[i / a.num_blocks], block = i % a.num_blocks;
    WaitAtLeast(DoneFlag(g, a.L, src, block), seq, g.timeout_ns, ModeName(a.mode), "done flag of a block", g.rank, src,
                block);
  }
  __syncthreads();
  if (a.num_recv_tokens_per_expert == nullptr) return;
  // Slots holding each local expert, over the landed rows' top-k ids.
  BlockBincount(reinterpret_cast<const int*>(g.local_region() + a.L.topk_idx), a.num_recv_tokens, a.L.num_topk,
                a.experts_per_rank, histogram, a.num_recv_tokens_per_expert);
}

struct CopyOutArgs {
  const int* num_recv_tokens;
  const int* rank_prefix_matrix;  // dispatch: for recv_src_rank
  char* recv_x[kMaxRowArrays];
  int* recv_topk_idx;
  float* recv_topk_weights;
  int* recv_src_idx;
  int* recv_src_rank;
  Layout L;
};

// Valid rows from the landing area; padding: ids -1, weights 0, sources -1.
__global__ void __launch_bounds__(kCopyThreads) CopyOutKernel(Group g, CopyOutArgs a) {
  __shared__ int ends[kMaxRanks];  // rows from sources <= s end at ends[s] (this rank's column of the prefix matrix)
  const Layout& L = a.L;
  const int R = g.num_ranks;
  if (a.recv_src_rank != nullptr) {
    for (int s = threadIdx.x; s < R; s += blockDim.x) ends[s] = a.rank_prefix_matrix[s * R + g.rank];
  }
  __syncthreads();
  // Cached dispatch reads num_recv_tokens from the user's handle: clipped to the rows.
  const int num_recv = max(0, min(*a.num_recv_tokens, L.num_worst_tokens));
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  const char* base = g.local_region();
  for (int i = 0; i < kMaxRowArrays; ++i) {
    if (a.recv_x[i] == nullptr || L.row_bytes[i] == 0) continue;
    const int64_t bytes = int64_t(num_recv) * L.row_bytes[i];
    const int4* src = reinterpret_cast<const int4*>(base + L.rows[i]);
    int4* dst = reinterpret_cast<int4*>(a.recv_x[i]);
    for (int64_t j = first; j < bytes / 16; j += stride) dst[j] = src[j];
    for (int64_t j = bytes / 16 * 4 + first; j < bytes / 4; j += stride) {
      reinterpret_cast<int*>(a.recv_x[i])[j] = reinterpret_cast<const int*>(base + L.rows[i])[j];
    }
  }
  const int64_t slots = int64_t(L.num_worst_tokens) * L.num_topk, valid_slots = int64_t(num_recv) * L.num_topk;
  const int* idx = reinterpret_cast<const int*>(base + L.topk_idx);
  const float* w = reinterpret_cast<const float*>(base + L.topk_weights);
  for (int64_t j = first; j < slots; j += stride) {
    if (a.recv_topk_idx != nullptr) a.recv_topk_idx[j] = j < valid_slots ? idx[j] : -1;
    if (a.recv_topk_weights != nullptr) a.recv_topk_weights[j] = j < valid_slots ? w[j] : 0.0f;
  }
  const int* src_idx = reinterpret_cast<const int*>(base + L.src_idx);
  for (int64_t j = first; j < L.num_worst_tokens; j += stride) {
    if (a.recv_src_idx != nullptr) a.recv_src_idx[j] = j < num_recv ? src_idx[j] : -1;
    if (a.recv_src_rank != nullptr) {
      int src = -1;
      if (j < num_recv) {  // sources whose rows end at or before row j (ends is non-decreasing)
        int lo = 0, hi = R;
        while (lo < hi) {
          const int mid = (lo + hi) / 2;
          if (ends[mid] <= j)
            lo = mid + 1;
          else
            hi = mid;
        }
        src = lo;
      }
      a.recv_src_rank[j] = src;
    }
  }
}

// ---------------------------------------------------------------------------
// Combine, reduced per host: rows to the forwarder of their source on this
// host (NVLink), one bf16 partial per (token, host) from there to the source,
// which sums the partials in host order.

struct CombineArgs {
  const uint16_t* x;
  const float* topk_weights;
  const int* send_pos;
  const int* num_recv_tokens;
  const int* recv_src_idx;
  const int* recv_src_rank;
  uint16_t* out;
  float* out_weights;
  TrafficCounters* traffic;  // combine's counters, or null (not counting)
  Layout L;
};

// Where combine packets (row, weights) are in a region: the slot [index on
// the host][source host][token] of a row to reduce, and the partial
// [host][token] of a source's token.
__device__ __forceinline__ size_t CombineSlotOffset(const Group& g, const Layout& L, int local, int src_node,
                                                    int token) {
  return L.combine_slots + ((size_t(local) * g.num_nodes + src_node) * L.num_tokens + token) * L.combine_packet_bytes;
}
__device__ __forceinline__ char* CombineSlot(const Group& g, const Layout& L, int local, int src_node, int token) {
  return g.local_region() + CombineSlotOffset(g, L, local, src_node, token);
}
__device__ __forceinline__ size_t CombinePartial(const Layout& L, int node, int token) {
  return L.combine_partials + (size_t(node) * L.num_tokens + token) * L.combine_packet_bytes;
}
// Entry `position` of the list from host src_node, as received here.
__device__ __forceinline__ const int* CombineEntry(const Group& g, const Layout& L, int src_node, int position) {
  return reinterpret_cast<const int*>(g.local_region() + L.combine_recv_meta) +
         (size_t(src_node) * L.num_tokens + position) * L.combine_meta_ints;
}
// Received rows a combine's kernels take on: the handle's count, clipped to the rows.
__device__ __forceinline__ int CombineRows(const CombineArgs& a) {
  return max(0, min(*a.num_recv_tokens, a.L.num_worst_tokens));
}

// Received row i of x (and its top-k weights), by one warp, over NVLink into
// the forwarder of its source: this host's rank with the source's index,
// slot [this rank's index][source host][token]. The handle's arrays come
// from the user: entries naming no rank or token are skipped, never written
// out of bounds.
__device__ __forceinline__ void SendCombineRow(const Group& g, const CombineArgs& a, const PeerTable& peers, int i,
                                               int lane) {
  const Layout& L = a.L;
  const int src = a.recv_src_rank[i], token = a.recv_src_idx[i];
  if (src < 0 || src >= g.num_ranks || token < 0 || token >= L.num_tokens) return;
  const int64_t row_bytes = L.row_bytes[0];
  char* dst = g.host_regions[peers.local[src]] + CombineSlotOffset(g, L, g.local, peers.node[src], token);
  if (lane == 0 && peers.local[src] != g.local) CountTraffic(a.traffic, false, 1, row_bytes);
  StridedCopyBytes<4>(dst, reinterpret_cast<const char*>(a.x) + int64_t(i) * row_bytes, row_bytes, lane, kWarpSize);
  if (a.topk_weights != nullptr) {
    const float* w = a.topk_weights + int64_t(i) * L.num_topk;
    float* w_out = reinterpret_cast<float*>(dst + L.combine_packet_weights);
    for (int k = lane; k < L.num_topk; k += kWarpSize) w_out[k] = w[k];
  }
}

// This rank's lists (staged by the notify kernel) to each remote host's
// forwarder of this rank's tokens, one put per host by warp `warp` of
// `num_warps`; the caller completes them before raising a flag.
__device__ __forceinline__ void PutCombineLists(const Group& g, const Layout& L, int seq, int warp, int num_warps) {
  const size_t entry_bytes = L.combine_meta_ints * sizeof(int);
  for (int b = warp; b < g.num_nodes; b += num_warps) {
    const int n = b == g.node ? 0 : LoadVolatile(Record(g, L, seq, g.rank) + kRecordNodeCounts + b);
    if (n == 0) continue;
    const char* from = g.local_region() + L.combine_send_meta + size_t(b) * L.num_tokens * entry_bytes;
    char* to = g.local_region() + L.combine_recv_meta + size_t(g.node) * L.num_tokens * entry_bytes;
    nvshmemx_putmem_nbi_warp(to, from, size_t(n) * entry_bytes, g.pes[g.rank_at[b * g.ranks_per_node + g.local]]);
  }
}

// The forward's list entries: starts[b] entries come from the hosts before
// b, starts[H] in all (counts from the sources' records). source_pe[b]: PE
// of host b's rank with this rank's index. Ends with __syncthreads.
__device__ void LoadCombineEntries(const Group& g, const Layout& L, int seq, int* starts, int* source_pe) {
  for (int b = threadIdx.x; b < g.num_nodes; b += blockDim.x) {
    const int src = g.rank_at[b * g.ranks_per_node + g.local];
    starts[b] = LoadVolatile(Record(g, L, seq, src) + kRecordNodeCounts + g.node);
    source_pe[b] = g.pes[src];
  }
  ExclusiveScanHosts(starts, g.num_nodes);
}

// List entry i (of host b, HostOfEntry) by one warp: sums the token's rows of
// this host in index order, float32 from +0.0 (ranks without the token
// skipped), rounds the partial to bf16 (weights: float32) and puts it to the
// source, slot [this host][token]; this rank's own tokens keep it here.
// The rows are peers' stores: loads that leave no line in L1.
__device__ void ReduceCombineEntry(const Group& g, const CombineArgs& a, const int* source_pe, int b, const int* entry,
                                   int lane) {
  const Layout& L = a.L;
  const int G = g.ranks_per_node;
  const int token = LoadNoAllocate(entry + kCombineMetaToken);
  const uint32_t holders = uint32_t(LoadNoAllocate(entry + kCombineMetaMask)) & (G >= 32 ? ~0u : (1u << G) - 1);
  if (token < 0 || token >= L.num_tokens) return;  // written by a peer's kernel: in range; never trusted blindly
  // The partial: this rank's own token stays here (slot [this host][token]);
  // another host's is staged in place of index 0's row (each lane reads
  // its vectors of every row before it writes), then put to the source.
  const bool own = b == g.node;
  char* partial = own ? g.local_region() + CombinePartial(L, g.node, token) : CombineSlot(g, L, 0, b, token);
  const int num_vectors = int(L.row_bytes[0] / 16);
  // The reference's order: 0.0, then + row of index 0, 1, ... (ranks without the token skipped).
  for (int v = lane; v < num_vectors; v += kWarpSize) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (uint32_t m = holders; m != 0; m &= m - 1) {
      AddBf16x8(acc, LoadNoAllocate(reinterpret_cast<const int4*>(CombineSlot(g, L, __ffs(m) - 1, b, token)) + v));
    }
    reinterpret_cast<int4*>(partial)[v] = PackBf16x8(acc);
  }
  if (a.out_weights != nullptr) {
    for (int k = lane; k < L.num_topk; k += kWarpSize) {
      float acc = 0.0f;
      for (uint32_t m = holders; m != 0; m &= m - 1) {
        const char* slot = CombineSlot(g, L, __ffs(m) - 1, b, token);
        acc += __int_as_float(LoadNoAllocate(reinterpret_cast<const int*>(slot + L.combine_packet_weights) + k));
      }
      reinterpret_cast<float*>(partial + L.combine_packet_weights)[k] = acc;
    }
  }
  if (!own) {
    if (lane == 0) CountTraffic(a.traffic, true, 1, L.row_bytes[0]);
    FenceStagedForWarpPut();
    nvshmemx_putmem_nbi_warp(g.local_region() + CombinePartial(L, g.node, token), partial, L.combine_packet_bytes,
                             source_pe[b]);
  }
}

// After a block's partials (or none): completes them, then every source of
// this rank's rail on another host hears from the block (the receive waits
// for every block of the grid).
__device__ void SignalPartialsSent(const Group& g, const Layout& L, int seq) {
  CompleteWrites();
  __syncthreads();
  for (int b = threadIdx.x; b < g.num_nodes; b += blockDim.x) {
    const int source_pe = g.pes[g.rank_at[b * g.ranks_per_node + g.local]];
    if (b != g.node) nvshmem_int_atomic_set(DoneFlag(g, L, g.rank, blockIdx.x), seq, source_pe);
  }
}

__global__ void __launch_bounds__(kMaxWarps* kWarpSize) CombineSendKernel(Group g, CombineArgs a) {
  __shared__ PeerTable peers;
  const Layout& L = a.L;
  const int H = g.num_nodes, G = g.ranks_per_node, me = g.rank;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int num_warps = gridDim.x * (blockDim.x / kWarpSize);
  LoadPeerTable(g, peers);
  const int seq = LoadVolatile(&g.control()->seq);
  const int num_recv = CombineRows(a);
  for (int i = warp; i < num_recv; i += num_warps) SendCombineRow(g, a, peers, i, lane);
  PutCombineLists(g, L, seq, warp, num_warps);
  CompleteWrites();
  __syncthreads();
  // Every forwarder of this host hears from every block (rows, sent or not);
  // every remote forwarder of this rank's tokens too (its list).
  for (int j = threadIdx.x; j < G; j += blockDim.x) {
    StoreReleaseSys(g.In(g.host_regions[j], DoneFlag(g, L, me, blockIdx.x)), seq);
  }
  for (int b = threadIdx.x; b < H; b += blockDim.x) {
    const int forwarder_pe = peers.pe[g.rank_at[b * G + g.local]];
    if (b != g.node) nvshmem_int_atomic_set(RdmaDoneFlag(g, L, g.node, blockIdx.x), seq, forwarder_pe);
  }
}

__global__ void __launch_bounds__(kMaxWarps* kWarpSize) CombineForwardKernel(Group g, CombineArgs a) {
  __shared__ int starts[kMaxRanks + 1];  // [source host]: list entries from the hosts before it (H + 1 used)
  __shared__ int source_pe[kMaxRanks];   // [host]: PE of the rank there with this rank's index
  const Layout& L = a.L;
  const int H = g.num_nodes, G = g.ranks_per_node, me = g.rank;
  const int seq = LoadVolatile(&g.control()->seq);
  const int num_blocks = gridDim.x;  // the send kernel's grid too
  // Rows of this host's ranks, and the lists of the same-index ranks of the other hosts.
  for (int i = threadIdx.x; i < G * num_blocks; i += blockDim.x) {
    const int src = g.host_ranks[i / num_blocks], block = i % num_blocks;
    WaitAtLeast(DoneFlag(g, L, src, block), seq, g.timeout_ns, ModeName(kCombine), "rows to reduce of a block", me, src,
                block);
  }
  for (int i = threadIdx.x; i < H * num_blocks; i += blockDim.x) {
    const int b = i / num_blocks, block = i % num_blocks;
    if (b != g.node) {
      WaitAtLeast(RdmaDoneFlag(g, L, b, block), seq, g.timeout_ns, ModeName(kCombine), "token lists of a block", me,
                  g.rank_at[b * G + g.local], block);
    }
  }
  LoadCombineEntries(g, L, seq, starts, source_pe);
  const int lane = threadIdx.x % kWarpSize;
  const int warp = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int num_warps = gridDim.x * (blockDim.x / kWarpSize);
  for (int i = warp; i < starts[H]; i += num_warps) {
    const int b = HostOfEntry(starts, H, i);
    ReduceCombineEntry(g, a, source_pe, b, CombineEntry(g, L, b, i - starts[b]), lane);
  }
  SignalPartialsSent(g, L, seq);
}

// ---------------------------------------------------------------------------
// Combine's send and forward pipelined (LaunchConfig::pipeline): one kernel,
// its first C = PipelineChannels(grid) blocks row senders, the rest
// forwarders; the receive follows as its own kernel.
//
// Row senders: the received rows are cut into chunks of kPipelineChunkTokens
// rows; chunk k is channel k mod C's (k / C)-th. A channel stores each
// chunk's rows as the send kernel does, then raises its row tail at every
// rank of this host: tail [this rank's index][channel] = (call's sequence
// number << 32) | chunks sent, and kChannelFinished once it has no more (so
// a row past this rank's received count, named by an inconsistent handle,
// is waited for no longer than the channel's end). The first forwarder block
// puts this rank's lists to the remote forwarders and sets their list flag.
//
// Forwarders: the list entries of every source host, merged in host order,
// go to the forwarder warps in turn; each warp waits until, for every holder
// l of its entry's token, the tail of (l, channel of the token's row there)
// covers that row's chunk (the row is in the entry), then reduces and puts
// the partial as the serial forward does. Same slots, sums and puts: only
// the time a row is reduced changes.
//
// Ordering: a channel's threads fence their NVLink stores (system scope),
// meet at __syncthreads, then one thread per rank release-stores the tail;
// a forwarder's lane acquires its holder's tail, __syncwarp passes that on
// to the warp, whose loads of the rows leave no line in L1 (a line may also
// hold a neighbouring slot not landed yet).
//
// Progress: senders wait for nothing. A forwarder waits for senders of this
// host's ranks, its own rank's included, so the pipelined kernel needs all
// of its blocks resident at once: it runs only where the grid fits the
// device at the kernel's occupancy (CombinePipelined), else the serial
// kernels do. Senders take the low block indices, which start first.

constexpr uint32_t kChannelFinished = 0x7fffffffu;  // a row tail's count once its channel sent every chunk

__device__ __forceinline__ uint64_t* RowTail(const Group& g, const Layout& L, int index, int channel) {
  return reinterpret_cast<uint64_t*>(g.local_region() + L.tails) + size_t(index) * kMaxBlocks + channel;
}

__device__ void SendRowChannel(const Group& g, const CombineArgs& a, const PeerTable& peers, int channel,
                               int num_channels, int seq) {
  const Layout& L = a.L;
  const int G = g.ranks_per_node;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, num_warps = blockDim.x / kWarpSize;
  const uint64_t* tail = RowTail(g, L, g.local, channel);
  auto raise_tails = [&](uint32_t chunks) {
    __threadfence_system();  // this thread's rows before the tail
    __syncthreads();
    for (int j = threadIdx.x; j < G; j += blockDim.x) {
      StoreReleaseSys64(g.In(g.host_regions[j], tail), TailValue(seq, int(chunks)));
    }
  };
  const int num_recv = CombineRows(a);
  uint32_t sent = 0;
  for (int first = channel * kPipelineChunkTokens; first < num_recv; first += num_channels * kPipelineChunkTokens) {
    const int end = min(num_recv, first + kPipelineChunkTokens);
    for (int i = first + warp; i < end; i += num_warps) SendCombineRow(g, a, peers, i, lane);
    raise_tails(++sent);
  }
  raise_tails(kChannelFinished);
}

// Waits (one warp) until every holder's row of a list entry has landed here: lane l checks holder l.
__device__ void WaitCombineRows(const Group& g, const Layout& L, const int* entry, int num_channels, int seq,
                                int lane) {
  const int G = g.ranks_per_node;
  const uint32_t holders = uint32_t(LoadNoAllocate(entry + kCombineMetaMask));
  bool landed = true;
  int row = -1, channel = 0;
  uint32_t need = 0;
  if (lane < G && ((holders >> lane) & 1u)) {
    row = LoadNoAllocate(entry + kCombineMetaRows + lane);
    const int chunk = row / kPipelineChunkTokens;
    channel = chunk % num_channels;
    need = uint32_t(chunk / num_channels + 1);
    landed = row < 0;  // not a row (a hand-made handle): nothing to wait for
  }
  const uint64_t* tail = landed ? nullptr : RowTail(g, L, lane, channel);
  uint64_t start = 0;
  for (;;) {
    if (!landed) {
      const uint64_t v = LoadAcquireSys64(tail);
      landed = uint32_t(v >> 32) == uint32_t(seq) && uint32_t(v) >= need;
    }
    if (__all_sync(0xffffffffu, landed)) break;
    const uint64_t now = GlobalTimerNs();
    if (start == 0) start = now;
    if (!landed && now - start > g.timeout_ns) {
      printf(
          "deep_ep_jax timeout: %s rank %d waited %.1f s for a row to reduce (row tail) from peer %d "
          "(channel %d): row %d of token %d needs %u chunks of call %d, tail 0x%llx" DEEP_EP_JAX_TRAP_NOTE,
          ModeName(kCombine), g.rank, g.timeout_ns * 1e-9, g.host_ranks[lane], channel, row,
          LoadNoAllocate(entry + kCombineMetaToken), need, seq,
          static_cast<unsigned long long>(LoadAcquireSys64(tail)));
      __trap();
    }
  }
  __syncwarp();  // every lane's acquire before any lane's loads of the rows
}

__device__ void ForwardEntries(const Group& g, const CombineArgs& a, int f, int num_forwarders, int num_channels,
                               int seq, int* starts, int* source_pe) {
  const Layout& L = a.L;
  const int H = g.num_nodes, G = g.ranks_per_node;
  const int lane = threadIdx.x % kWarpSize;
  const int warps_per_block = blockDim.x / kWarpSize;
  const int warp = f * warps_per_block + threadIdx.x / kWarpSize, num_warps = num_forwarders * warps_per_block;
  // The first forwarder block puts this rank's lists to the remote forwarders
  // (a network round trip, kept off the senders' path), then sets their list flag.
  if (f == 0) {
    PutCombineLists(g, L, seq, threadIdx.x / kWarpSize, warps_per_block);
    CompleteWrites();
    __syncthreads();
    for (int b = threadIdx.x; b < H; b += blockDim.x) {
      if (b != g.node) nvshmem_int_atomic_set(RdmaDoneFlag(g, L, g.node, 0), seq, g.pes[g.rank_at[b * G + g.local]]);
    }
  }
  LoadCombineEntries(g, L, seq, starts, source_pe);
  int listed = -1;  // the remote host whose list this warp last waited for (its own host's is in place)
  for (int i = warp; i < starts[H]; i += num_warps) {
    const int b = HostOfEntry(starts, H, i);
    if (b != g.node &&
        b != listed) {  // a remote list: wait for its flag once, lane 0's acquire passed on by __syncwarp
      if (lane == 0) {
        WaitAtLeast(RdmaDoneFlag(g, L, b, 0), seq, g.timeout_ns, ModeName(kCombine), "token list", g.rank,
                    g.rank_at[b * G + g.local], 0);
      }
      __syncwarp();
      listed = b;
    }
    const int* entry = CombineEntry(g, L, b, i - starts[b]);
    WaitCombineRows(g, L, entry, num_channels, seq, lane);
    ReduceCombineEntry(g, a, source_pe, b, entry, lane);
  }
}

__global__ void __launch_bounds__(kMaxWarps* kWarpSize) PipelinedCombineKernel(Group g, CombineArgs a) {
  __shared__ union {
    PeerTable peers;  // senders
    struct {
      int starts[kMaxRanks + 1], source_pe[kMaxRanks];
    } entries;  // forwarders
  } state;
  const int seq = LoadVolatile(&g.control()->seq);
  const int num_channels = PipelineChannels(gridDim.x);
  if (int(blockIdx.x) < num_channels) {
    LoadPeerTable(g, state.peers);
    SendRowChannel(g, a, state.peers, blockIdx.x, num_channels, seq);
  } else {
    ForwardEntries(g, a, blockIdx.x - num_channels, gridDim.x - num_channels, num_channels, seq, state.entries.starts,
                   state.entries.source_pe);
  }
  SignalPartialsSent(g, a.L, seq);
}

__global__ void __launch_bounds__(kMaxWarps* kWarpSize) CombineRecvKernel(Group g, CombineArgs a) {
  // [warp][word]: bit b % 32 of word b / 32 when host b holds the warp's token.
  __shared__ uint32_t token_hosts[kMaxWarps][kMaxRanks / kWarpSize];
  __shared__ int rank_at[kMaxRanks];
  const Layout& L = a.L;
  const int R = g.num_ranks, H = g.num_nodes, G = g.ranks_per_node, me = g.rank;
  Control* control = g.control();
  const int seq = LoadVolatile(&control->seq);
  const int num_blocks = gridDim.x;  // the forward kernel's grid too
  for (int r = threadIdx.x; r < R; r += blockDim.x) rank_at[r] = g.rank_at[r];
  // The partials of the other hosts (this host's: this rank's own forward kernel, earlier on the stream).
  for (int i = threadIdx.x; i < H * num_blocks; i += blockDim.x) {
    const int b = i / num_blocks, block = i % num_blocks;
    if (b != g.node) {
      WaitAtLeast(DoneFlag(g, L, g.rank_at[b * G + g.local], block), seq, g.timeout_ns, ModeName(kCombine),
                  "partial sums of a block", me, g.rank_at[b * G + g.local], block);
    }
  }
  __syncthreads();

  const int lane = threadIdx.x % kWarpSize;
  const int warp = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int num_warps = gridDim.x * (blockDim.x / kWarpSize);
  const int num_vectors = int(L.row_bytes[0] / 16);
  const int num_words = (H + kWarpSize - 1) / kWarpSize;
  uint32_t* holders = token_hosts[threadIdx.x / kWarpSize];
  for (int t = warp; t < L.num_tokens; t += num_warps) {
    const int* pos = a.send_pos + int64_t(t) * R;
    __syncwarp();  // the previous token's words are read
    for (int c = 0; c < num_words; ++c) {
      const int b = c * kWarpSize + lane;
      bool in = false;
      for (int l = 0; b < H && l < G; ++l) in |= HandleRow(pos[rank_at[b * G + l]], L.num_worst_tokens) >= 0;
      const uint32_t word = __ballot_sync(0xffffffffu, in);
      if (lane == 0) holders[c] = word;
    }
    __syncwarp();
    auto partial = [&](int b) { return g.local_region() + CombinePartial(L, b, t); };
    int4* out = reinterpret_cast<int4*>(a.out + int64_t(t) * (L.row_bytes[0] / 2));
    // The reference's order: 0.0, then + partial of host 0, 1, ... (hosts without the token skipped).
    for (int v = lane; v < num_vectors; v += kWarpSize) {
      float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      for (int c = 0; c < num_words; ++c) {
        for (uint32_t word = holders[c]; word != 0; word &= word - 1) {
          AddBf16x8(acc, reinterpret_cast<const int4*>(partial(c * kWarpSize + __ffs(word) - 1))[v]);
        }
      }
      out[v] = PackBf16x8(acc);
    }
    if (a.out_weights == nullptr) continue;
    for (int k = lane; k < L.num_topk; k += kWarpSize) {
      float acc = 0.0f;
      for (int c = 0; c < num_words; ++c) {
        for (uint32_t word = holders[c]; word != 0; word &= word - 1) {
          acc += reinterpret_cast<const float*>(partial(c * kWarpSize + __ffs(word) - 1) + L.combine_packet_weights)[k];
        }
      }
      a.out_weights[int64_t(t) * L.num_topk + k] = acc;
    }
  }
}

// Last of every call: the next call may enter (EnterCall). Its own launch:
// the calls end with kernels of many blocks that read this rank's region.
__global__ void LeaveKernel(Group g) { LeaveCall(&g.control()->active); }

// ---------------------------------------------------------------------------
// Host side.

Group MakeGroup(const DeviceState& state, const LaunchConfig& c) {
  Group g{};
  const int R = state.num_ranks;
  g.pes = state.device_pes;
  g.node_of = state.device_nodes;
  g.local_of = state.device_nodes + R;
  g.rank_at = state.device_nodes + 2 * R;
  g.rank = state.rank;
  g.num_ranks = R;
  g.num_nodes = state.num_nodes;
  g.ranks_per_node = R / state.num_nodes;  // hosts of equal size, at most kMaxInternodeHostRanks (FFI)
  g.node = state.nodes[state.rank];
  int j = 0;
  for (int r = 0; r < R && j < kMaxInternodeHostRanks; ++r) {
    if (state.nodes[r] != g.node) continue;
    if (r == state.rank) g.local = j;
    g.host_regions[j] = state.normal.peers[r];
    g.host_ranks[j++] = r;
  }
  g.timeout_ns = c.timeout_ns;
  return g;
}

// The counters of one call kind in this rank's control block, or null when not counting.
TrafficCounters* TrafficOf(const DeviceState& state, const LaunchConfig& c, int mode) {
  return c.count_traffic ? reinterpret_cast<TrafficCounters*>(state.normal.local + kTrafficOffset) + mode : nullptr;
}

// Whether dispatch runs the pipelined kernel: asked for, and a grid with a sender and a forwarder.
bool Pipelined(const LaunchConfig& c) { return c.pipeline && PipelineChannels(c.num_blocks) >= 1; }

// Whether combine runs its pipelined kernel: as dispatch, and the whole grid
// resident at once (its forwarders wait for its own senders). Peers compare
// the answer in the count exchange, so a GPU that cannot fit the grid stops
// the call with a message instead of hanging its peers.
bool CombinePipelined(const DeviceState& state, const LaunchConfig& c) {
  return Pipelined(c) && CombinePipelineFits(state.device_ordinal, c.num_blocks, c.num_warps);
}

NotifyArgs MakeNotify(int mode, int num_tokens, const LaunchConfig& c, bool pipeline, const Layout& L) {
  NotifyArgs n{};
  n.mode = mode;
  n.order = c.order;
  n.num_blocks = c.num_blocks;
  n.pipeline = pipeline;
  n.num_tokens = num_tokens;
  n.L = L;
  return n;
}

}  // namespace

bool CombinePipelineFits(int device_ordinal, int num_blocks, int num_warps) {
  // Blocks per SM by (device, warps), + 1 (0: not asked yet): every combine launch asks.
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices][kMaxWarps + 1];
  if (device_ordinal < 0 || device_ordinal >= kMaxDevices || num_warps < 1 || num_warps > kMaxWarps) return false;
  std::atomic<int>& cached = cache[device_ordinal][num_warps];
  int per_sm = cached.load(std::memory_order_relaxed) - 1;
  if (per_sm < 0) {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device_ordinal);
    const cudaError_t err =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, PipelinedCombineKernel, num_warps * kWarpSize, 0);
    cudaSetDevice(previous);
    if (err != cudaSuccess) {
      cudaGetLastError();  // clear it: the serial kernels need no such query
      return false;
    }
    cached.store(per_sm + 1, std::memory_order_relaxed);
  }
  return int64_t(per_sm) * DeviceSmCount(device_ordinal) >= num_blocks;
}

cudaError_t MarkCallRunningForTesting(char* region) {
  const int running = 1;
  return cudaMemcpy(region + offsetof(Control, active), &running, sizeof(running), cudaMemcpyHostToDevice);
}

cudaError_t SetSequenceForTesting(char* region, int num_ranks, int seq) {
  const Control control{seq, 0};
  cudaError_t err = cudaMemcpy(region, &control, sizeof(control), cudaMemcpyHostToDevice);
  // Every flag: ready [R], rdma_done and done [R][kMaxBlocks], tails [R][kMaxBlocks].
  const Layout L = MakeLayout(Shapes{}, num_ranks, 1, true);
  const std::vector<int> flags(size_t(num_ranks) * kMaxBlocks, seq);
  const size_t flag_bytes = flags.size() * sizeof(int);
  if (err == cudaSuccess)
    err = cudaMemcpy(region + L.ready, flags.data(), size_t(num_ranks) * sizeof(int), cudaMemcpyHostToDevice);
  if (err == cudaSuccess) err = cudaMemcpy(region + L.rdma_done, flags.data(), flag_bytes, cudaMemcpyHostToDevice);
  if (err == cudaSuccess) err = cudaMemcpy(region + L.done, flags.data(), flag_bytes, cudaMemcpyHostToDevice);
  // Tails of call seq, so that none reads as the next call's (its number in the high word).
  const std::vector<uint64_t> tails(size_t(num_ranks) * kMaxBlocks, uint64_t(unsigned(seq)) << 32);
  if (err == cudaSuccess) {
    err = cudaMemcpy(region + L.tails, tails.data(), tails.size() * sizeof(uint64_t), cudaMemcpyHostToDevice);
  }
  return err;
}

cudaError_t LaunchDispatch(const DeviceState& state, const DispatchParams& p, const LaunchConfig& c,
                           cudaStream_t stream) {
  const bool cached = p.topk_idx == nullptr;
  const int mode = cached ? kCachedDispatch : kDispatch;
  const Group g = MakeGroup(state, c);
  const Shapes shapes{p.num_tokens, p.num_worst_tokens, p.num_topk, {p.row_bytes[0], p.row_bytes[1]}};
  const Layout L = MakeLayout(shapes, state.num_ranks, state.num_nodes, false);
  const int threads = c.num_warps * kWarpSize;
  const int experts_per_rank = cached ? 0 : p.num_experts / state.num_ranks;

  NotifyArgs notify = MakeNotify(mode, p.num_tokens, c, Pipelined(c), L);
  notify.topk_idx = p.topk_idx;
  notify.cached_send_pos = p.cached_send_pos;
  notify.num_topk = p.num_topk;
  notify.num_experts = p.num_experts;
  notify.num_worst_tokens = p.num_worst_tokens;
  notify.is_token_in_rank = p.is_token_in_rank;
  notify.num_tokens_per_rank = p.num_tokens_per_rank;
  notify.rank_prefix_matrix = p.rank_prefix_matrix;
  notify.send_pos = p.send_pos;
  notify.node_pos = p.node_pos;
  notify.num_recv_tokens = p.num_recv_tokens;
  notify.num_dropped_tokens = p.num_dropped_tokens;
  NotifyKernel<<<1, kNotifyThreads, 0, stream>>>(g, notify);

  MoveArgs move{};
  move.mode = mode;
  for (int i = 0; i < kMaxRowArrays; ++i) move.x[i] = p.x[i];
  move.topk_idx = p.topk_idx;
  move.topk_weights = p.topk_weights;
  move.send_pos = cached ? p.cached_send_pos : p.send_pos;
  move.node_pos = p.node_pos;
  move.experts_per_rank = experts_per_rank;
  move.traffic = TrafficOf(state, c, mode);
  move.L = L;
  if (Pipelined(c)) {
    PipelinedMoveKernel<<<c.num_blocks, threads, 0, stream>>>(g, move);
  } else {
    SendKernel<<<c.num_blocks, threads, 0, stream>>>(g, move);
    ForwardKernel<<<c.num_blocks, threads, 0, stream>>>(g, move);
  }

  const int* num_recv = cached ? p.cached_num_recv_tokens : p.num_recv_tokens;
  FinishArgs finish{mode, c.num_blocks, num_recv, experts_per_rank, cached ? nullptr : p.num_recv_tokens_per_expert, L};
  FinishKernel<<<1, kFinishThreads, 0, stream>>>(g, finish);

  CopyOutArgs copy{};
  copy.num_recv_tokens = num_recv;
  copy.rank_prefix_matrix = p.rank_prefix_matrix;
  for (int i = 0; i < kMaxRowArrays; ++i) copy.recv_x[i] = p.recv_x[i];
  copy.recv_topk_idx = p.recv_topk_idx;
  copy.recv_topk_weights = p.recv_topk_weights;
  copy.recv_src_idx = p.recv_src_idx;
  copy.recv_src_rank = p.recv_src_rank;
  copy.L = L;
  // Nothing of this call overlaps the copy: it takes every SM.
  CopyOutKernel<<<DeviceSmCount(state.device_ordinal), kCopyThreads, 0, stream>>>(g, copy);
  LeaveKernel<<<1, 1, 0, stream>>>(g);
  return cudaGetLastError();
}

cudaError_t LaunchCombine(const DeviceState& state, const CombineParams& p, const LaunchConfig& c,
                          cudaStream_t stream) {
  const Group g = MakeGroup(state, c);
  const Shapes shapes{p.num_tokens, p.num_worst_tokens, p.num_topk, {int64_t(p.hidden) * 2, 0}};
  const Layout L = MakeLayout(shapes, state.num_ranks, state.num_nodes, true);
  // Notify: the barrier and this rank's lists per host, from the handle's send_pos.
  const bool pipeline = CombinePipelined(state, c);
  NotifyArgs notify = MakeNotify(kCombine, p.num_tokens, c, pipeline, L);
  notify.cached_send_pos = p.send_pos;
  notify.num_worst_tokens = p.num_worst_tokens;
  NotifyKernel<<<1, kNotifyThreads, 0, stream>>>(g, notify);
  const CombineArgs args{p.x,
                         p.topk_weights,
                         p.send_pos,
                         p.num_recv_tokens,
                         p.recv_src_idx,
                         p.recv_src_rank,
                         p.out,
                         p.out_weights,
                         TrafficOf(state, c, kCombine),
                         L};
  const int threads = c.num_warps * kWarpSize;
  if (pipeline) {
    PipelinedCombineKernel<<<c.num_blocks, threads, 0, stream>>>(g, args);
  } else {
    CombineSendKernel<<<c.num_blocks, threads, 0, stream>>>(g, args);
    CombineForwardKernel<<<c.num_blocks, threads, 0, stream>>>(g, args);
  }
  CombineRecvKernel<<<c.num_blocks, threads, 0, stream>>>(g, args);
  LeaveKernel<<<1, 1, 0, stream>>>(g);
  return cudaGetLastError();
}

}  // namespace internode
}  // namespace deep_ep_jax
