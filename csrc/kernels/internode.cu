// Normal-mode dispatch and combine across hosts (see internode.h for the
// launch sequence, docs/internode.md for the design). Ranks on other hosts are
// reached through NVSHMEM's portable device API (warp puts from the symmetric
// heap, quiet, atomic-set flags), whatever transport NVSHMEM picked at run
// time; ranks of this host through their regions mapped by nvshmem_ptr.
// Compiled with -rdc=true, only in a build with NVSHMEM.
#include <cuda_bf16.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstddef>

#include "kernels/device.cuh"
#include "kernels/internode.h"

namespace deep_ep_jax {
namespace internode {
namespace {

constexpr int kNotifyThreads = 1024;
constexpr int kFinishThreads = 1024;
constexpr int kCopyThreads = 512;

enum Mode : int { kDispatch = kDispatchCall, kCachedDispatch = kCachedDispatchCall, kCombine = kCombineCall };

__device__ const char* ModeName(int mode) {
  return mode == kDispatch ? "internode dispatch" : mode == kCachedDispatch ? "internode cached_dispatch"
                                                                            : "internode combine";
}

// The first bytes of every rank's normal region. Flags hold the sequence
// number of the call that set them; peers write them (stores over NVLink, or
// NVSHMEM puts and atomic sets), this rank only reads them.
struct Control {
  int seq;  // calls so far on this rank (every rank makes the same calls)
  int active;  // 1 while a call runs on this device (EnterCall)
  int pad[30];
  int ready[kMaxInternodeNormalRanks];                    // [src]: src entered this call; its counts below are here
  // [parity of seq][src][...]: a peer may already publish the next call's
  // counts while this rank still reads this call's, never two calls ahead
  // (the next call's barrier needs this rank).
  int counts[2][kMaxInternodeNormalRanks][kMaxInternodeNormalRanks];       // [.][src][dst]: tokens src sends to rank dst (dispatch)
  int node_counts[2][kMaxInternodeNormalRanks][kMaxInternodeNormalRanks];  // [.][src][node]: tokens src sends to host `node`
  int num_blocks[2][kMaxInternodeNormalRanks];              // [.][src]: src's grid of the move kernels (CheckPeerLaunch)
  int calls[2][kMaxInternodeNormalRanks];                   // [.][src]: src's call tag (CheckPeerCall)
  int rdma_done[kMaxInternodeNormalRanks][kMaxBlocks];    // [src][block]: src's packets for this forwarder have landed
  int done[kMaxInternodeNormalRanks][kMaxBlocks];         // [src][block]: src finished writing into this region
};
static_assert(sizeof(Control) <= kControlBytes, "internode Control exceeds the region's control bytes");

// The EP group as seen from this rank.
struct Group {
  char* regions[kMaxInternodeNormalRanks];  // this host's ranks' regions mapped here; null for other hosts
  int pes[kMaxInternodeNormalRanks];
  int node_of[kMaxInternodeNormalRanks];   // host of each rank
  int local_of[kMaxInternodeNormalRanks];  // index of each rank among its host's ranks
  int rank, num_ranks, num_nodes;
  uint64_t timeout_ns;

  __device__ char* local() const { return regions[rank]; }
  __device__ Control* control() const { return reinterpret_cast<Control*>(local()); }
  __device__ bool here(int r) const { return node_of[r] == node_of[rank]; }
  // The rank that forwards this rank's packets on host `node` (same local index).
  __device__ int forwarder(int node) const {
    for (int q = 0; q < num_ranks; ++q) {
      if (node_of[q] == node && local_of[q] == local_of[rank]) return q;
    }
    return -1;
  }
  // Ranks on other hosts whose packets this rank forwards (same local index).
  __device__ bool forwards_for(int r) const { return !here(r) && local_of[r] == local_of[rank]; }

  // An int of rank r's control block: a store over NVLink, or an NVSHMEM put
  // (offsets are the same in every region).
  __device__ void PutInt(int r, const int* mine, int value) const {
    if (here(r)) {
      *reinterpret_cast<int*>(regions[r] + (reinterpret_cast<const char*>(mine) - local())) = value;
    } else {
      nvshmem_int_p(const_cast<int*>(mine), value, pes[r]);
    }
  }
  // A flag of rank r's control block, after everything this thread wrote or
  // put before (callers fence/quiet first).
  __device__ void Signal(int r, const int* mine, int value) const {
    if (here(r)) {
      StoreReleaseSys(reinterpret_cast<int*>(regions[r] + (reinterpret_cast<const char*>(mine) - local())), value);
    } else {
      nvshmem_int_atomic_set(const_cast<int*>(mine), value, pes[r]);
    }
  }
};

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
  int num_blocks;  // of the move kernels: peers wait for each other's blocks by index
  const int* topk_idx;         // dispatch
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
};

__device__ __forceinline__ uint32_t RankMaskOf(const Group& g, const NotifyArgs& a, int t) {
  if (a.mode == kDispatch) {
    return TokenRankMask(a.topk_idx + int64_t(t) * a.num_topk, a.num_topk, a.num_experts, a.num_experts / g.num_ranks);
  }
  uint32_t mask = 0;
  for (int r = 0; r < g.num_ranks; ++r) {
    mask |= uint32_t(HandleRow(a.cached_send_pos[int64_t(t) * g.num_ranks + r], a.num_worst_tokens) >= 0) << r;
  }
  return mask;
}

__device__ __forceinline__ uint32_t NodeMaskOf(const Group& g, uint32_t rank_mask) {
  uint32_t mask = 0;
  for (int r = 0; r < g.num_ranks; ++r) {
    if ((rank_mask >> r) & 1u) mask |= 1u << g.node_of[r];
  }
  return mask;
}

__global__ void __launch_bounds__(kNotifyThreads) NotifyKernel(Group g, NotifyArgs a) {
  __shared__ int warp_sums[kWarpSize * kMaxInternodeNormalRanks];
  __shared__ int totals[kMaxInternodeNormalRanks], node_totals[kMaxInternodeNormalRanks], first_row[kMaxInternodeNormalRanks];
  __shared__ int shared_seq, shared_tag;
  const int R = g.num_ranks, me = g.rank;
  const bool dispatch = a.mode == kDispatch;
  Control* control = g.control();

  // Each thread takes a contiguous slice of tokens: thread order is token order.
  const int per_thread = (a.num_tokens + blockDim.x - 1) / blockDim.x;
  const int begin = min(a.num_tokens, int(threadIdx.x) * per_thread);
  const int end = min(a.num_tokens, begin + per_thread);
  int rank_offset[kMaxInternodeNormalRanks] = {}, node_offset[kMaxInternodeNormalRanks] = {};
  for (int t = begin; t < end; ++t) {
    const uint32_t mask = RankMaskOf(g, a, t), nodes = NodeMaskOf(g, mask);
    for (int r = 0; r < R; ++r) {
      if (dispatch) a.is_token_in_rank[int64_t(t) * R + r] = (mask >> r) & 1u;
      rank_offset[r] += (mask >> r) & 1u;
    }
    for (int b = 0; b < g.num_nodes; ++b) node_offset[b] += (nodes >> b) & 1u;
  }
  BlockExclusiveScan(rank_offset, R, warp_sums, totals);
  __syncthreads();  // the next scan reuses warp_sums
  BlockExclusiveScan(node_offset, g.num_nodes, warp_sums, node_totals);

  if (threadIdx.x == 0) {
    EnterCall(&control->active, a.mode, me);
    shared_tag = TakeCallTag(a.order, a.mode);
    shared_seq = NextSeq(LoadVolatile(&control->seq));  // wrapping (device.cuh)
    control->seq = shared_seq;
  }
  __syncthreads();
  const int seq = shared_seq, tag = shared_tag;
  if (dispatch && int(threadIdx.x) < R) a.num_tokens_per_rank[threadIdx.x] = totals[threadIdx.x];

  // Thread `peer` publishes this rank's counts and grid to peer, then waits for peer's (and checks its grid).
  const int peer = threadIdx.x;
  if (peer < R) {
    if (dispatch) {
      for (int d = 0; d < R; ++d) g.PutInt(peer, &control->counts[seq & 1][me][d], totals[d]);
    }
    for (int b = 0; b < g.num_nodes; ++b) g.PutInt(peer, &control->node_counts[seq & 1][me][b], node_totals[b]);
    g.PutInt(peer, &control->num_blocks[seq & 1][me], a.num_blocks);
    g.PutInt(peer, &control->calls[seq & 1][me], tag);
    CompleteWrites();
    g.Signal(peer, &control->ready[me], seq);
    WaitAtLeast(&control->ready[peer], seq, g.timeout_ns, ModeName(a.mode), "ready flag (counts published)", me,
                peer, -1);
    CheckPeerCall(tag, LoadVolatile(&control->calls[seq & 1][peer]), me, peer);
    CheckPeerLaunch(a.num_blocks, LoadVolatile(&control->num_blocks[seq & 1][peer]), ModeName(a.mode),
                    "blocks (Config.num_sms)", me, peer);
  }
  __syncthreads();
  if (a.mode == kCombine) return;

  if (dispatch) {
    if (int(threadIdx.x) < R) {  // thread d: destination d's column
      const int d = threadIdx.x;
      int sum = 0;
      for (int s = 0; s < R; ++s) {
        if (s == me) first_row[d] = sum;
        sum += LoadVolatile(&control->counts[seq & 1][s][d]);
        a.rank_prefix_matrix[s * R + d] = sum;
        if (d == me && s == R - 1) {
          const int num_recv = min(sum, a.num_worst_tokens);
          *a.num_recv_tokens = num_recv;
          *a.num_dropped_tokens = sum - num_recv;
        }
      }
    }
    __syncthreads();
  }

  // Final rows (dispatch) and positions among the tokens sent to each host.
  for (int t = begin; t < end; ++t) {
    const uint32_t mask = RankMaskOf(g, a, t), nodes = NodeMaskOf(g, mask);
    if (dispatch) {
      for (int r = 0; r < R; ++r) {
        const bool in = (mask >> r) & 1u;
        const int row = first_row[r] + rank_offset[r];
        a.send_pos[int64_t(t) * R + r] = in && row < a.num_worst_tokens ? row : -1;
        rank_offset[r] += in;
      }
    }
    for (int b = 0; b < g.num_nodes; ++b) {
      const bool in = (nodes >> b) & 1u;
      a.node_pos[int64_t(t) * g.num_nodes + b] = in ? node_offset[b] : -1;
      node_offset[b] += in;
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
  Layout L;
};

// Token `src_token`'s row lands at `row` of rank `dest`'s landing area; top-k
// ids become dest's local ids (-1 and weight 0 for experts elsewhere; cached
// dispatch moves weights as they are).
__device__ void DeliverRow(const Group& g, const MoveArgs& a, int dest, int row, const char* const (&rows)[kMaxRowArrays],
                           int src_token, const int* topk, const float* weights, int lane) {
  const Layout& L = a.L;
  char* base = g.regions[dest];
#pragma unroll
  for (int i = 0; i < kMaxRowArrays; ++i) {
    if (L.row_bytes[i] == 0) continue;
    StridedCopyBytes<4>(base + L.rows[i] + int64_t(row) * L.row_bytes[i], rows[i], L.row_bytes[i], lane, kWarpSize);
  }
  int* idx_out = reinterpret_cast<int*>(base + L.topk_idx) + int64_t(row) * L.num_topk;
  float* w_out = reinterpret_cast<float*>(base + L.topk_weights) + int64_t(row) * L.num_topk;
  for (int k = lane; k < L.num_topk; k += kWarpSize) {
    const float w = weights != nullptr ? weights[k] : 0.0f;
    if (a.mode == kDispatch) {
      const int e = topk[k], local = e - dest * a.experts_per_rank;
      const bool mine = e >= 0 && local >= 0 && local < a.experts_per_rank;
      idx_out[k] = mine ? local : -1;
      w_out[k] = mine ? w : 0.0f;
    } else if (weights != nullptr) {
      w_out[k] = w;
    }
  }
  if (lane == 0 && a.mode == kDispatch) reinterpret_cast<int*>(base + L.src_idx)[row] = src_token;
}

__global__ void __launch_bounds__(kMaxWarps * kWarpSize) SendKernel(Group g, MoveArgs a) {
  const Layout& L = a.L;
  const int R = g.num_ranks, me = g.rank;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int num_warps = gridDim.x * (blockDim.x / kWarpSize);
  Control* control = g.control();
  const int seq = LoadVolatile(&control->seq);

  for (int t = warp; t < L.num_tokens; t += num_warps) {
    const int* pos = a.send_pos + int64_t(t) * R;
    const int* node_pos = a.node_pos + int64_t(t) * g.num_nodes;
    const int* topk = a.topk_idx != nullptr ? a.topk_idx + int64_t(t) * L.num_topk : nullptr;
    const float* weights = a.topk_weights != nullptr ? a.topk_weights + int64_t(t) * L.num_topk : nullptr;
    const char* rows[kMaxRowArrays];
    for (int i = 0; i < kMaxRowArrays; ++i) rows[i] = a.x[i] + int64_t(t) * L.row_bytes[i];

    // Other hosts: one packet, staged once (the source of a put must be in
    // the symmetric heap), put to each host's forwarder.
    bool remote = false;
    for (int b = 0; b < g.num_nodes; ++b) remote |= b != g.node_of[me] && node_pos[b] >= 0;
    if (remote) {
      char* packet = g.local() + L.send + int64_t(t) * L.packet_bytes;
#pragma unroll
      for (int i = 0; i < kMaxRowArrays; ++i) {
        if (L.row_bytes[i] > 0) StridedCopyBytes<4>(packet + L.packet_row[i], rows[i], L.row_bytes[i], lane, kWarpSize);
      }
      int* meta = reinterpret_cast<int*>(packet + L.packet_meta);
      if (lane == 0) meta[0] = t;
      if (lane < kMaxInternodeNormalRanks) meta[1 + lane] = lane < R ? HandleRow(pos[lane], L.num_worst_tokens) : -1;
      for (int k = lane; k < L.num_topk; k += kWarpSize) {
        meta[1 + kMaxInternodeNormalRanks + k] = topk != nullptr ? topk[k] : -1;
        reinterpret_cast<float*>(meta + 1 + kMaxInternodeNormalRanks + L.num_topk)[k] = weights != nullptr ? weights[k] : 0.0f;
      }
      FenceStagedForWarpPut();
      for (int b = 0; b < g.num_nodes; ++b) {
        if (b == g.node_of[me] || node_pos[b] < 0) continue;
        const int f = g.forwarder(b);
        const size_t slot = L.rdma_recv + (size_t(g.node_of[me]) * L.num_tokens + node_pos[b]) * L.packet_bytes;
        nvshmemx_putmem_nbi_warp(g.local() + slot, packet, L.packet_bytes, g.pes[f]);
      }
    }
    // This host: straight into the destinations' landing areas.
    for (int r = 0; r < R; ++r) {
      const int row = HandleRow(pos[r], L.num_worst_tokens);
      if (g.here(r) && row >= 0) DeliverRow(g, a, r, row, rows, t, topk, weights, lane);
    }
  }

  CompleteWrites();
  __syncthreads();
  // Every forwarder of this rank's packets hears from every block, sent or not.
  if (int(threadIdx.x) < R && g.forwards_for(threadIdx.x)) g.Signal(threadIdx.x, &control->rdma_done[me][blockIdx.x], seq);
}

__global__ void __launch_bounds__(kMaxWarps * kWarpSize) ForwardKernel(Group g, MoveArgs a) {
  __shared__ int sources[kMaxInternodeNormalRanks], starts[kMaxInternodeNormalRanks + 1];
  const Layout& L = a.L;
  const int R = g.num_ranks, me = g.rank;
  Control* control = g.control();
  const int seq = LoadVolatile(&control->seq);
  const int num_blocks = gridDim.x;
  for (int i = threadIdx.x; i < R * num_blocks; i += blockDim.x) {
    const int src = i / num_blocks, block = i % num_blocks;
    if (g.forwards_for(src)) {
      WaitAtLeast(&control->rdma_done[src][block], seq, g.timeout_ns, ModeName(a.mode), "RDMA packets of a block",
                  me, src, block);
    }
  }
  if (threadIdx.x == 0) {
    int n = 0, total = 0;
    for (int s = 0; s < R; ++s) {
      if (!g.forwards_for(s)) continue;
      sources[n] = s;
      starts[n++] = total;
      total += LoadVolatile(&control->node_counts[seq & 1][s][g.node_of[me]]);
    }
    for (int j = n; j <= kMaxInternodeNormalRanks; ++j) starts[j] = total;
  }
  __syncthreads();

  const int lane = threadIdx.x % kWarpSize;
  const int warp = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int num_warps = gridDim.x * (blockDim.x / kWarpSize);
  const int total = starts[kMaxInternodeNormalRanks];
  for (int i = warp; i < total; i += num_warps) {
    int j = 0;
    while (starts[j + 1] <= i) ++j;
    const int src = sources[j];
    const char* packet = g.local() + L.rdma_recv + (size_t(g.node_of[src]) * L.num_tokens + (i - starts[j])) * L.packet_bytes;
    const int* meta = reinterpret_cast<const int*>(packet + L.packet_meta);
    const char* rows[kMaxRowArrays];
    for (int k = 0; k < kMaxRowArrays; ++k) rows[k] = packet + L.packet_row[k];
    const int* topk = meta + 1 + kMaxInternodeNormalRanks;
    const float* weights = reinterpret_cast<const float*>(topk + L.num_topk);
    const int token = meta[0];
    for (int r = 0; r < R; ++r) {
      const int row = meta[1 + r];
      if (g.here(r) && row >= 0) DeliverRow(g, a, r, row, rows, token, topk, a.topk_weights != nullptr ? weights : nullptr, lane);
    }
  }
  __threadfence_system();
  __syncthreads();
  if (int(threadIdx.x) < R && g.here(threadIdx.x)) g.Signal(threadIdx.x, &control->done[me][blockIdx.x], seq);
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
  for (int i = threadIdx.x; i < g.num_ranks * a.num_blocks; i += blockDim.x) {
    const int src = i / a.num_blocks, block = i % a.num_blocks;
    if (g.here(src)) {
      WaitAtLeast(&control->done[src][block], seq, g.timeout_ns, ModeName(a.mode), "done flag of a block", g.rank,
                  src, block);
    }
  }
  __syncthreads();
  if (a.num_recv_tokens_per_expert == nullptr) return;
  // Slots holding each local expert, over the landed rows' top-k ids.
  BlockBincount(reinterpret_cast<const int*>(g.local() + a.L.topk_idx), a.num_recv_tokens, a.L.num_topk,
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
  const Layout& L = a.L;
  // Cached dispatch reads num_recv_tokens from the user's handle: clipped to the rows.
  const int num_recv = max(0, min(*a.num_recv_tokens, L.num_worst_tokens));
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  const char* base = g.local();
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
      if (j < num_recv) {
        src = 0;
        for (int s = 0; s < g.num_ranks; ++s) src += a.rank_prefix_matrix[s * g.num_ranks + g.rank] <= j;
      }
      a.recv_src_rank[j] = src;
    }
  }
}

// ---------------------------------------------------------------------------
// Combine: push rows back to their sources, sum there in rank order.

struct CombineArgs {
  const uint16_t* x;
  const float* topk_weights;
  const int* send_pos;
  const int* num_recv_tokens;
  const int* recv_src_idx;
  const int* recv_src_rank;
  uint16_t* out;
  float* out_weights;
  Layout L;
};

__global__ void __launch_bounds__(kMaxWarps * kWarpSize) CombineSendKernel(Group g, CombineArgs a) {
  const Layout& L = a.L;
  const int R = g.num_ranks, me = g.rank;
  const int lane = threadIdx.x % kWarpSize;
  const int warp = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int num_warps = gridDim.x * (blockDim.x / kWarpSize);
  Control* control = g.control();
  const int seq = LoadVolatile(&control->seq);
  // The handle's arrays come from the user: rows past x and entries naming
  // no rank or token are skipped, never written out of bounds.
  const int num_recv = min(*a.num_recv_tokens, L.num_worst_tokens);
  const int64_t row_bytes = L.row_bytes[0];

  for (int i = warp; i < num_recv; i += num_warps) {
    const int src = a.recv_src_rank[i], token = a.recv_src_idx[i];
    if (src < 0 || src >= R || token < 0 || token >= L.num_tokens) continue;
    const size_t slot = L.combine_slots + (size_t(me) * L.num_tokens + token) * L.combine_packet_bytes;
    const char* row = reinterpret_cast<const char*>(a.x) + int64_t(i) * row_bytes;
    const float* w = a.topk_weights != nullptr ? a.topk_weights + int64_t(i) * L.num_topk : nullptr;
    // This host: store straight into the source's slot; others: stage, then put.
    char* dst = g.here(src) ? g.regions[src] + slot : g.local() + L.combine_send + int64_t(i) * L.combine_packet_bytes;
    StridedCopyBytes<4>(dst, row, row_bytes, lane, kWarpSize);
    if (w != nullptr) {
      float* w_out = reinterpret_cast<float*>(dst + L.combine_packet_weights);
      for (int k = lane; k < L.num_topk; k += kWarpSize) w_out[k] = w[k];
    }
    if (!g.here(src)) {
      FenceStagedForWarpPut();
      nvshmemx_putmem_nbi_warp(g.local() + slot, dst, L.combine_packet_bytes, g.pes[src]);
    }
  }
  CompleteWrites();
  __syncthreads();
  if (int(threadIdx.x) < R) g.Signal(threadIdx.x, &control->done[me][blockIdx.x], seq);
}

__global__ void __launch_bounds__(kMaxWarps * kWarpSize) CombineRecvKernel(Group g, CombineArgs a) {
  const Layout& L = a.L;
  const int R = g.num_ranks, me = g.rank;
  Control* control = g.control();
  const int seq = LoadVolatile(&control->seq);
  const int num_blocks = gridDim.x;  // the send kernel's grid too
  for (int i = threadIdx.x; i < R * num_blocks; i += blockDim.x) {
    WaitAtLeast(&control->done[i / num_blocks][i % num_blocks], seq, g.timeout_ns, ModeName(kCombine),
                "combined rows of a block", me, i / num_blocks, i % num_blocks);
  }
  __syncthreads();

  const int lane = threadIdx.x % kWarpSize;
  const int warp = blockIdx.x * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
  const int num_warps = gridDim.x * (blockDim.x / kWarpSize);
  const int num_vectors = int(L.row_bytes[0] / 16);
  for (int t = warp; t < L.num_tokens; t += num_warps) {
    const int* pos = a.send_pos + int64_t(t) * R;
    auto slot = [&](int r) {
      return g.local() + L.combine_slots + (size_t(r) * L.num_tokens + t) * L.combine_packet_bytes;
    };
    int4* out = reinterpret_cast<int4*>(a.out + int64_t(t) * (L.row_bytes[0] / 2));
    // The reference's order: 0.0, then + row of rank 0, 1, ... (ranks without the token skipped).
    for (int v = lane; v < num_vectors; v += kWarpSize) {
      float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      for (int r = 0; r < R; ++r) {
        if (HandleRow(pos[r], L.num_worst_tokens) >= 0) AddBf16x8(acc, reinterpret_cast<const int4*>(slot(r))[v]);
      }
      out[v] = PackBf16x8(acc);
    }
    if (a.out_weights == nullptr) continue;
    for (int k = lane; k < L.num_topk; k += kWarpSize) {
      float acc = 0.0f;
      for (int r = 0; r < R; ++r) {
        if (HandleRow(pos[r], L.num_worst_tokens) >= 0) {
          acc += reinterpret_cast<const float*>(slot(r) + L.combine_packet_weights)[k];
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
  int seen[kMaxInternodeNormalRanks] = {};
  for (int r = 0; r < state.num_ranks; ++r) {
    g.regions[r] = state.normal.peers[r];
    g.pes[r] = state.pes[r];
    g.node_of[r] = state.nodes[r];
    g.local_of[r] = seen[state.nodes[r]]++;
  }
  g.rank = state.rank;
  g.num_ranks = state.num_ranks;
  g.num_nodes = state.num_nodes;
  g.timeout_ns = c.timeout_ns;
  return g;
}

NotifyArgs MakeNotify(int mode, int num_tokens, const LaunchConfig& c) {
  NotifyArgs n{};
  n.mode = mode;
  n.order = c.order;
  n.num_blocks = c.num_blocks;
  n.num_tokens = num_tokens;
  return n;
}

}  // namespace



cudaError_t MarkCallRunningForTesting(char* region) {
  const int running = 1;
  return cudaMemcpy(region + offsetof(Control, active), &running, sizeof(running), cudaMemcpyHostToDevice);
}

cudaError_t SetSequenceForTesting(char* region, int seq) {
  Control control;
  cudaError_t err = cudaMemcpy(&control, region, sizeof(control), cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) return err;
  control.seq = seq;
  control.active = 0;
  for (int& flag : control.ready) flag = seq;
  for (auto& flags : control.rdma_done) {
    for (int& flag : flags) flag = seq;
  }
  for (auto& flags : control.done) {
    for (int& flag : flags) flag = seq;
  }
  return cudaMemcpy(region, &control, sizeof(control), cudaMemcpyHostToDevice);
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

  NotifyArgs notify = MakeNotify(mode, p.num_tokens, c);
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
  move.L = L;
  SendKernel<<<c.num_blocks, threads, 0, stream>>>(g, move);
  ForwardKernel<<<c.num_blocks, threads, 0, stream>>>(g, move);

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
  NotifyKernel<<<1, kNotifyThreads, 0, stream>>>(g, MakeNotify(kCombine, 0, c));
  const CombineArgs args{p.x, p.topk_weights, p.send_pos, p.num_recv_tokens, p.recv_src_idx, p.recv_src_rank,
                         p.out, p.out_weights, L};
  const int threads = c.num_warps * kWarpSize;
  CombineSendKernel<<<c.num_blocks, threads, 0, stream>>>(g, args);
  CombineRecvKernel<<<c.num_blocks, threads, 0, stream>>>(g, args);
  LeaveKernel<<<1, 1, 0, stream>>>(g);
  return cudaGetLastError();
}

}  // namespace internode
}  // namespace deep_ep_jax
