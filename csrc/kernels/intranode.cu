// Normal-mode dispatch and combine over NVLink (see intranode.h for the launch
// sequence). Senders write rows straight into the receivers' buffers with
// 16-byte stores; combine pulls each token's rows from every rank and sums
// them in float32 in rank order, the reference backend's order.
//
// Up to 8 ranks the move kernels keep a token's destinations in registers,
// one unrolled slot per rank (kRanks = 2, 4, 8). Beyond (kRanks = kWide, up to
// kMaxNvlinkRanks) a warp lists each token's destinations in rank order in
// shared memory (at most top-k of them) and moves rows to kWideBatch of them
// at a time; sums still run in rank order, so the bits are the same.
//
// Staged mode: the move kernels have two roles, by block index. Dispatch:
// blocks [0, num_move_blocks) send (as in direct mode), the blocks after them
// copy landed rows from the staging area to XLA's outputs, chunk by chunk, as
// the senders' chunk records arrive. Combine: blocks [0, num_copy_blocks) copy
// XLA's x into the staging area chunk by chunk, raising a ready flag per
// chunk, the blocks after them pull (waiting for the peers' flags). The
// blocks that never wait come first, so they run even if the grid does not
// fit on the device at once; the grid is kept within the SMs anyway.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "kernels/device.cuh"
#include "kernels/intranode.h"

namespace deep_ep_jax {
namespace intranode {
namespace {

constexpr int kNotifyThreads = 1024;  // notify: one block, a slice of tokens per thread
constexpr int kFinishThreads = 1024;  // finish: one block
// Staged dispatch: a chunk record's rows are copied by items of at most this
// many rows (one warp each), so a large chunk_tokens still spreads the copy.
constexpr int kCopyItemRows = 4;
// Move kernels' template argument for groups of more than 8 ranks, and how
// many destinations (or sources) such a kernel serves per pass over a row.
constexpr int kWide = 0;
constexpr int kWideBatch = 8;
// 32-bit words of a bit set over the ranks; also the peers a lane serves
// when the lanes of a warp serve peers lane, lane + 32, ...
constexpr int kRankWords = (kMaxNvlinkRanks + kWarpSize - 1) / kWarpSize;
static_assert(kNotifyThreads >= kMaxNvlinkRanks, "the notify kernel keeps a thread per rank");

// Staged combine: ready flags per source, one per kStagedCopyRows rows of x.
__host__ __device__ __forceinline__ int64_t NumRowFlags(int64_t num_rows) {
  return (num_rows + kStagedCopyRows - 1) / kStagedCopyRows;
}

enum Mode : int { kDispatch = kDispatchCall, kCachedDispatch = kCachedDispatchCall, kCombine = kCombineCall };

__device__ const char* ModeName(int mode) { return CallKindName(mode); }

// The control bytes at the start of every rank's normal region. Peers write
// into it; flags hold the sequence number of the call that set them.
struct Control {
  int seq;                                       // sequence number of the latest call on this device
  int next_chunk;                                // work counter of the move kernel (reset by each call)
  int next_copy;                                 // work counter of the staged copy role (reset by each call)
  int active;                                    // 1 while a call runs on this device (EnterCall)
  int calls[kMaxNvlinkRanks];                    // [src]: src's call tag (CheckPeerCall), published with its ready flag
  int ready[kMaxNvlinkRanks];                    // [src]: src published its counts and buffers here
  int move_blocks[kMaxNvlinkRanks];              // [src]: blocks of src's move kernel in this call (CheckPeerLaunch)
  int done[kMaxNvlinkRanks][kMaxBlocks];         // [src][block]: src's block is done with this rank's memory
  int counts[kMaxNvlinkRanks][kMaxNvlinkRanks];  // [src][dst]: tokens src sends to dst (dispatch)
  RankBuffers buffers[kMaxNvlinkRanks];          // [src]: src's buffers for this call
};
static_assert(sizeof(Control) <= kTrafficOffset, "intranode Control reaches the traffic counters (common/traffic.h)");

// Staged dispatch: what a sender wrote into a receiver's staging area for one
// chunk of its tokens, in the receiver's records [src][chunk]: rows [first,
// first + count) (a source's rows at a destination are consecutive in token
// order; dropped tokens have none, count may be 0). flag = seq once the rows
// and the record are visible to the receiver.
struct ChunkRecord {
  int first, count, flag, unused;
};
static_assert(sizeof(ChunkRecord) == sizeof(int4), "records are cleared as int4");

// Where a call's copy-role synchronisation lives in every rank's normal
// region (the same offsets on every rank: the layout depends only on the
// call's shapes, which all ranks share).
struct StagedSync {
  size_t records;    // ChunkRecord [num_ranks][num_chunks] (dispatch)
  size_t row_flags;  // int [num_ranks][NumRowFlags(num_rows)] (combine): [owner][chunk], raised by the owner
                     // in the puller's region, so pullers poll local memory
  int num_chunks;
};

// The EP group as seen from this device: every rank's normal region.
struct Group {
  char* regions[kMaxNvlinkRanks];
  int rank;
  int num_ranks;
  bool ipc;  // peers in other processes: published buffers are offsets into the regions
};

__device__ __forceinline__ Control* ControlOf(const Group& g, int rank) {
  return reinterpret_cast<Control*>(g.regions[rank]);
}

// Peers in other processes (IPC) cannot use this process's pointers: each rank
// publishes its buffers as offsets into its own normal region (staged mode,
// so they all lie there; null stays null as offsets are >= kControlBytes),
// and readers add the region's address as mapped on their device.
__host__ __device__ __forceinline__ RankBuffers Rebased(RankBuffers b, const char* from, char* to) {
  const uintptr_t shift = reinterpret_cast<uintptr_t>(to) - reinterpret_cast<uintptr_t>(from);  // mod 2^64
  auto move = [shift](auto* p) {
    return p == nullptr ? p : reinterpret_cast<decltype(p)>(reinterpret_cast<uintptr_t>(p) + shift);
  };
  for (int i = 0; i < kMaxRowArrays; ++i) b.rows[i] = move(b.rows[i]);
  b.topk_idx = move(b.topk_idx);
  b.topk_weights = move(b.topk_weights);
  b.src_idx = move(b.src_idx);
  return b;
}

// Rank r's published buffers as addresses valid on this device.
__device__ __forceinline__ RankBuffers LoadPublished(const Group& g, const Control* control, int r) {
  const RankBuffers b = LoadVolatileWords(&control->buffers[r]);
  return g.ipc ? Rebased(b, nullptr, g.regions[r]) : b;
}

// First thing of every call, by one thread: no other call of the Buffer
// running here, the call's tag (*tag), its sequence number (wrapping,
// device.cuh), and fresh work counters for the move kernel.
__device__ __forceinline__ int BeginCall(Control* control, const CallOrder& order, int mode, int rank, int* tag) {
  EnterCall(&control->active, mode, rank);
  *tag = TakeCallTag(order, mode);
  const int seq = NextSeq(LoadVolatile(&control->seq));
  control->seq = seq;
  control->next_chunk = 0;
  control->next_copy = 0;
  return seq;
}

// Staged mode: resets the flags this rank's peers (dispatch) or this rank
// (combine) will raise in this rank's region during the call, before the
// ready flags let the peers in. Their place depends on the call's shapes, so
// it may hold another call's rows or flags; they get PreviousSeq(seq), which
// is before seq whatever its value (0 would read as reached once the
// numbers pass 2^31). The region is free: the previous call's finish saw
// every peer done with it. Every thread of the block, after BeginCall's
// number is shared and before the __syncthreads that precedes PublishAndWait.
struct SyncClear {
  int4* begin;
  int num_vectors;
};

__device__ __forceinline__ void ClearSync(const SyncClear& clear, int seq) {
  if (clear.num_vectors == 0) return;
  const int before = PreviousSeq(seq);
  for (int i = threadIdx.x; i < clear.num_vectors; i += blockDim.x) {
    clear.begin[i] = make_int4(before, before, before, before);
  }
  __threadfence_system();  // before the ready flags, which follow a __syncthreads
}

// Publishes this rank's buffers, its move blocks, its call tag (and, for
// dispatch, its per-destination token counts) into every peer's control
// bytes, then waits for every peer's and checks that the peer is at the same
// call and launched as many move blocks: each finish kernel waits for the
// done flags of the peers' blocks by index. Thread i serves peers i, i +
// blockDim.x, ... (a peer's counts are read by the thread that waited for it).
__device__ void PublishAndWait(const Group& g, int seq, int tag, const RankBuffers& mine, const int* counts,
                               int num_move_blocks, int mode, uint64_t timeout_ns) {
  Control* control = ControlOf(g, g.rank);
  for (int peer = threadIdx.x; peer < g.num_ranks; peer += blockDim.x) {
    Control* remote = ControlOf(g, peer);
    if (counts != nullptr) {
      for (int dst = 0; dst < g.num_ranks; ++dst) remote->counts[g.rank][dst] = counts[dst];
    }
    remote->buffers[g.rank] = mine;
    remote->move_blocks[g.rank] = num_move_blocks;
    remote->calls[g.rank] = tag;
    StoreReleaseSys(&remote->ready[g.rank], seq);  // orders the stores above before the flag
  }
  for (int peer = threadIdx.x; peer < g.num_ranks; peer += blockDim.x) {
    WaitAtLeast(&control->ready[peer], seq, timeout_ns, ModeName(mode), "ready flag (buffers published)", g.rank, peer,
                -1);
    CheckPeerCall(tag, LoadVolatile(&control->calls[peer]), g.rank, peer);
    CheckPeerLaunch(num_move_blocks, LoadVolatile(&control->move_blocks[peer]), ModeName(mode), "move blocks", g.rank,
                    peer);
  }
}

// Once every thread of the block is done with the peers' memory, tells each
// peer. block: the block's index among the move blocks.
__device__ void SignalDone(const Group& g, int seq, int block) {
  __threadfence_system();
  __syncthreads();
  for (int r = threadIdx.x; r < g.num_ranks; r += blockDim.x)
    StoreReleaseSys(&ControlOf(g, r)->done[g.rank][block], seq);
}

// ---------------------------------------------------------------------------
// Dispatch step 1: layout, count exchange, send positions.

struct NotifyArgs {
  const int* topk_idx;
  int num_tokens, num_topk, num_experts, num_worst_tokens;
  bool* is_token_in_rank;
  int* num_tokens_per_rank;
  int* rank_prefix_matrix;
  int* send_pos;
  int* num_recv_tokens;
  int* num_dropped_tokens;
  RankBuffers landing;
  SyncClear clear;  // staged: this rank's chunk records
  int num_move_blocks;
  uint64_t timeout_ns;
  CallOrder order;
};

// Narrow groups (kRanks <= 8): each thread counts a contiguous slice of
// tokens per rank in registers, so thread order is token order; a block scan
// gives each thread its tokens' positions among this rank's tokens per rank.
template <int kRanks>
__device__ __forceinline__ void CountTokensNarrow(const Group& g, const NotifyArgs& a, int (&offset)[kRanks],
                                                  int* totals) {
  static_assert(kRanks <= 32, "TokenRankMask keeps a bit per rank in 32 bits");
  __shared__ int warp_sums[kWarpSize * kRanks];
  const int num_ranks = g.num_ranks, num_topk = a.num_topk;
  const int experts_per_rank = a.num_experts / num_ranks;
  const int per_thread = (a.num_tokens + blockDim.x - 1) / blockDim.x;
  const int begin = min(a.num_tokens, int(threadIdx.x) * per_thread);
  const int end = min(a.num_tokens, begin + per_thread);
  for (int t = begin; t < end; ++t) {
    const uint32_t mask = TokenRankMask(a.topk_idx + int64_t(t) * num_topk, num_topk, a.num_experts, experts_per_rank);
#pragma unroll
    for (int r = 0; r < kRanks; ++r) {
      if (r >= num_ranks) continue;
      const bool in_rank = (mask >> r) & 1u;
      a.is_token_in_rank[int64_t(t) * num_ranks + r] = in_rank;
      offset[r] += in_rank;
    }
  }
  BlockExclusiveScan(offset, num_ranks, warp_sums, totals);
}

// Positions for the narrow groups: offset[r] (this thread's first position at
// r among this rank's tokens) plus the rows r receives from ranks before me.
template <int kRanks>
__device__ __forceinline__ void SendPositionsNarrow(const Group& g, const NotifyArgs& a, int (&offset)[kRanks],
                                                    const int (*counts)[kMaxNvlinkRanks]) {
  const int num_ranks = g.num_ranks, num_topk = a.num_topk;
  const int experts_per_rank = a.num_experts / num_ranks;
  const int per_thread = (a.num_tokens + blockDim.x - 1) / blockDim.x;
  const int begin = min(a.num_tokens, int(threadIdx.x) * per_thread);
  const int end = min(a.num_tokens, begin + per_thread);
#pragma unroll
  for (int r = 0; r < kRanks; ++r) {
    if (r >= num_ranks) continue;
    for (int s = 0; s < g.rank; ++s) offset[r] += counts[s][r];
  }
  for (int t = begin; t < end; ++t) {
    const uint32_t mask = TokenRankMask(a.topk_idx + int64_t(t) * num_topk, num_topk, a.num_experts, experts_per_rank);
#pragma unroll
    for (int r = 0; r < kRanks; ++r) {
      if (r >= num_ranks) continue;
      int pos = -1;
      if ((mask >> r) & 1u) {
        pos = offset[r]++;
        if (pos >= a.num_worst_tokens) pos = -1;
      }
      a.send_pos[int64_t(t) * num_ranks + r] = pos;
    }
  }
}

// Wide groups: token t's ranks as bits (r in word r / 32); none past the tokens.
__device__ __forceinline__ void TokenRankBits(const NotifyArgs& a, int t, int experts_per_rank,
                                              uint32_t (&bits)[kRankWords]) {
#pragma unroll
  for (int j = 0; j < kRankWords; ++j) bits[j] = 0;
  if (t >= a.num_tokens) return;
  for (int k = 0; k < a.num_topk; ++k) {
    const int e = a.topk_idx[int64_t(t) * a.num_topk + k];
    if (e < 0 || e >= a.num_experts) continue;
    const int r = e / experts_per_rank;
#pragma unroll
    for (int j = 0; j < kRankWords; ++j) bits[j] |= r / kWarpSize == j ? 1u << (r % kWarpSize) : 0u;
  }
}

__device__ __forceinline__ bool RankBit(const uint32_t (&bits)[kRankWords], int r) {
  uint32_t word = 0;
#pragma unroll
  for (int j = 0; j < kRankWords; ++j) word = r / kWarpSize == j ? bits[j] : word;
  return (word >> (r % kWarpSize)) & 1u;
}

// Wide groups: tiles of blockDim.x tokens, a thread per token (as the narrow
// path, the ids are read once per pass); per rank, each warp's tokens counted
// by a ballot into totals.
__device__ void CountTokensWide(const Group& g, const NotifyArgs& a, int* totals) {
  const int lane = threadIdx.x % kWarpSize, num_ranks = g.num_ranks;
  const int experts_per_rank = a.num_experts / num_ranks;
  if (int(threadIdx.x) < num_ranks) totals[threadIdx.x] = 0;
  __syncthreads();
  for (int base = 0; base < a.num_tokens; base += blockDim.x) {
    const int t = base + threadIdx.x;
    uint32_t bits[kRankWords];
    TokenRankBits(a, t, experts_per_rank, bits);
    for (int r = 0; r < num_ranks; ++r) {
      const bool in_rank = RankBit(bits, r);
      if (t < a.num_tokens) a.is_token_in_rank[int64_t(t) * num_ranks + r] = in_rank;
      const int count = __popc(__ballot_sync(0xffffffffu, in_rank));
      if (lane == 0 && count > 0) atomicAdd(&totals[r], count);
    }
  }
}

// Positions for the wide groups, tile by tile in token order: each warp's
// count per rank, scanned over the warps by a thread per rank from the rows
// rank r already holds (from the ranks before me and the earlier tiles),
// then each token's place among its warp's by a ballot.
__device__ void SendPositionsWide(const Group& g, const NotifyArgs& a, const int (*counts)[kMaxNvlinkRanks]) {
  __shared__ int warp_counts[kNotifyThreads / kWarpSize][kMaxNvlinkRanks];  // [warp][rank], then their offsets
  __shared__ int running[kMaxNvlinkRanks];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize, num_warps = blockDim.x / kWarpSize;
  const int num_ranks = g.num_ranks, experts_per_rank = a.num_experts / num_ranks;
  const uint32_t lanes_before = (1u << lane) - 1u;
  if (int(threadIdx.x) < num_ranks) {
    int sum = 0;
    for (int s = 0; s < g.rank; ++s) sum += counts[s][threadIdx.x];
    running[threadIdx.x] = sum;
  }
  for (int base = 0; base < a.num_tokens; base += blockDim.x) {
    const int t = base + threadIdx.x;
    uint32_t bits[kRankWords];
    TokenRankBits(a, t, experts_per_rank, bits);
    for (int r = 0; r < num_ranks; ++r) {
      const int count = __popc(__ballot_sync(0xffffffffu, RankBit(bits, r)));
      if (lane == 0) warp_counts[warp][r] = count;
    }
    __syncthreads();  // the counts (and, first, running) before the scan
    if (int(threadIdx.x) < num_ranks) {
      int offset = running[threadIdx.x];
      for (int w = 0; w < num_warps; ++w) {
        const int count = warp_counts[w][threadIdx.x];
        warp_counts[w][threadIdx.x] = offset;
        offset += count;
      }
      running[threadIdx.x] = offset;
    }
    __syncthreads();  // the offsets before the positions
    for (int r = 0; r < num_ranks; ++r) {
      const bool in_rank = RankBit(bits, r);
      const uint32_t ballot = __ballot_sync(0xffffffffu, in_rank);
      int pos = -1;
      if (in_rank) {
        pos = warp_counts[warp][r] + __popc(ballot & lanes_before);
        if (pos >= a.num_worst_tokens) pos = -1;
      }
      if (t < a.num_tokens) a.send_pos[int64_t(t) * num_ranks + r] = pos;
    }
    __syncthreads();  // every warp read its offsets before the next tile's counts
  }
}

template <int kRanks>
__global__ void __launch_bounds__(kNotifyThreads, 1) DispatchNotifyKernel(Group g, NotifyArgs a) {
  __shared__ int totals[kMaxNvlinkRanks];
  __shared__ int counts[kMaxNvlinkRanks][kMaxNvlinkRanks];  // [src][dst]
  __shared__ int shared_seq, shared_tag;
  const int num_ranks = g.num_ranks, me = g.rank;
  Control* control = ControlOf(g, me);

  int offset[kRanks == kWide ? 1 : kRanks] = {};
  if constexpr (kRanks == kWide) {
    CountTokensWide(g, a, totals);
  } else {
    CountTokensNarrow(g, a, offset, totals);
  }

  if (threadIdx.x == 0) shared_seq = BeginCall(control, a.order, kDispatch, me, &shared_tag);
  __syncthreads();
  const int seq = shared_seq;
  ClearSync(a.clear, seq);
  __syncthreads();  // every thread's clears (and the wide counts' totals) before the ready flags
  if (int(threadIdx.x) < num_ranks) a.num_tokens_per_rank[threadIdx.x] = totals[threadIdx.x];
  PublishAndWait(g, seq, shared_tag, a.landing, totals, a.num_move_blocks, kDispatch, a.timeout_ns);
  for (int src = threadIdx.x; src < num_ranks; src += blockDim.x) {  // the thread that waited for src
    for (int dst = 0; dst < num_ranks; ++dst) counts[src][dst] = LoadVolatile(&control->counts[src][dst]);
  }
  __syncthreads();

  for (int i = threadIdx.x; i < num_ranks * num_ranks; i += blockDim.x) {
    const int src = i / num_ranks, dst = i % num_ranks;
    int sum = 0;
    for (int s = 0; s <= src; ++s) sum += counts[s][dst];
    a.rank_prefix_matrix[i] = sum;
  }
  if (threadIdx.x == 0) {
    int total = 0;
    for (int s = 0; s < num_ranks; ++s) total += counts[s][me];
    const int num_recv = min(total, a.num_worst_tokens);
    *a.num_recv_tokens = num_recv;
    *a.num_dropped_tokens = total - num_recv;
  }

  // A token's row at rank r: rows r receives from ranks before me, plus the
  // token's position among mine sent to r. Rows past num_worst_tokens drop.
  if constexpr (kRanks == kWide) {
    SendPositionsWide(g, a, counts);
  } else {
    SendPositionsNarrow(g, a, offset, counts);
  }
}

// Cached dispatch and combine, step 1: publish buffers, wait for the peers'.
// One warp, or a block of kNotifyThreads in staged mode (to clear the flags).
__global__ void __launch_bounds__(kNotifyThreads)
    PublishKernel(Group g, RankBuffers mine, SyncClear clear, int num_move_blocks, int mode, uint64_t timeout_ns,
                  CallOrder order) {
  __shared__ int shared_seq, shared_tag;
  if (threadIdx.x == 0) shared_seq = BeginCall(ControlOf(g, g.rank), order, mode, g.rank, &shared_tag);
  __syncthreads();
  const int seq = shared_seq;
  ClearSync(clear, seq);
  __syncthreads();  // every thread's clears before the ready flags
  PublishAndWait(g, seq, shared_tag, mine, nullptr, num_move_blocks, mode, timeout_ns);
}

// ---------------------------------------------------------------------------
// Step 2 helpers.

__device__ __forceinline__ int NextChunk(int* next_chunk, int lane) {
  int chunk = 0;
  if (lane == 0) chunk = atomicAdd(next_chunk, 1);
  return __shfl_sync(0xffffffffu, chunk, 0);
}

// Calls fn(chunk, begin, end) for chunks [begin, end) of chunk_tokens tokens
// handed to warps first come, first served (tokens cost 0..R rows, so a
// static split would not balance). A warp asks for its next chunk before
// working on the current one, which hides the atomic's latency.
template <typename Fn>
__device__ __forceinline__ void ForEachChunk(int* next_chunk, int num_tokens, int chunk_tokens, Fn&& fn) {
  const int lane = threadIdx.x % kWarpSize;
  const int num_chunks = int(NumChunks(num_tokens, chunk_tokens));
  int chunk = NextChunk(next_chunk, lane);
  while (chunk < num_chunks) {
    const int next = NextChunk(next_chunk, lane);
    const int end = int(std::min<int64_t>(num_tokens, (int64_t(chunk) + 1) * chunk_tokens));
    fn(chunk, chunk * chunk_tokens, end);
    chunk = next;
  }
}

// fn(t) for the tokens of ForEachChunk's chunks.
template <typename Fn>
__device__ __forceinline__ void ForEachToken(int* next_chunk, int num_tokens, int chunk_tokens, Fn&& fn) {
  ForEachChunk(next_chunk, num_tokens, chunk_tokens, [&](int, int begin, int end) {
    for (int t = begin; t < end; ++t) fn(t);
  });
}

// Staged copies: rows [first_row, first_row + num_rows) of every array
// present on both sides (row arrays, ids, weights, source indices), src ->
// dst at the same row indices, by `stride` threads from thread `first`, with
// coherent loads (peers write the staging area while the kernel runs).
__device__ void CopyRows(const RankBuffers& dst, const RankBuffers& src, const int64_t (&row_bytes)[kMaxRowArrays],
                         int num_topk, int first_row, int num_rows, int first, int stride) {
  auto copy = [&](void* to_array, const void* from_array, int64_t bytes_per_row) {
    if (to_array == nullptr || from_array == nullptr || bytes_per_row == 0) return;
    const int64_t offset = int64_t(first_row) * bytes_per_row, num_bytes = int64_t(num_rows) * bytes_per_row;
    StridedCopyBytes<8>(static_cast<char*>(to_array) + offset, static_cast<const char*>(from_array) + offset, num_bytes,
                        first, stride, NoAllocateLoad{});
  };
  for (int i = 0; i < kMaxRowArrays; ++i) copy(dst.rows[i], src.rows[i], row_bytes[i]);
  copy(dst.topk_idx, src.topk_idx, int64_t(num_topk) * sizeof(int));
  copy(dst.topk_weights, src.topk_weights, int64_t(num_topk) * sizeof(float));
  copy(dst.src_idx, src.src_idx, sizeof(int));
}

// ---------------------------------------------------------------------------
// Dispatch step 2: rows to their destinations.

// One warp copies a token's row (num_bytes, a multiple of sizeof(Vec)) to
// every non-null destination, with kUnroll loads in flight per lane. Not
// StridedCopy: each vector is loaded once (x is an input: read-only path)
// and stored to up to kRanks ranks.
template <int kRanks, typename Vec>
__device__ __forceinline__ void WarpCopyRowToRanks(const char* src_bytes, char* const (&dst_bytes)[kRanks],
                                                   int64_t num_bytes, int lane) {
  constexpr int kUnroll = 8;
  const Vec* src = reinterpret_cast<const Vec*>(src_bytes);
  Vec* dst[kRanks];
#pragma unroll
  for (int r = 0; r < kRanks; ++r) dst[r] = reinterpret_cast<Vec*>(dst_bytes[r]);
  const int n = int(num_bytes / sizeof(Vec));
  for (int base = lane; base < n; base += kWarpSize * kUnroll) {
    Vec v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kWarpSize;
      if (i < n) v[u] = LoadStreaming(src + i);
    }
#pragma unroll
    for (int r = 0; r < kRanks; ++r) {
      if (dst[r] == nullptr) continue;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * kWarpSize;
        if (i < n) dst[r][i] = v[u];
      }
    }
  }
}

struct SendArgs {
  const char* x[kMaxRowArrays];
  int64_t row_bytes[kMaxRowArrays];
  const int* send_pos;        // [T, R]
  const int* topk_idx;        // [T, K] (dispatch) or null (cached dispatch: weights go as they are)
  const float* topk_weights;  // [T, K] or null
  int num_tokens, num_topk, experts_per_rank, num_worst_tokens, chunk_tokens, mode;
  TrafficCounters* traffic;  // this call kind's counters, or null (not counting)
  // What this rank fills in its own outputs: the source rank of every row
  // (dispatch) and the padding rows [num_recv_tokens, N).
  const int* num_recv_tokens;
  const int* rank_prefix_matrix;  // dispatch only
  int* recv_src_rank;             // dispatch only
  int* recv_src_idx;              // dispatch only
  int* recv_topk_idx;             // dispatch only
  float* recv_topk_weights;       // or null
  // This rank's own rows land straight in its XLA outputs, in staged mode too
  // (the local rank is always in this process).
  RankBuffers local;
  // Staged mode: blocks [0, num_move_blocks) send, the others copy the
  // peers' rows from this rank's staging area to `local`.
  bool staged;
  int num_move_blocks;
  RankBuffers staging;
  StagedSync sync;
  uint64_t timeout_ns;
};

__device__ void FillReceivedMetadata(const Group& g, const SendArgs& a) {
  const int num_recv = *a.num_recv_tokens;
  const int num_rows = a.num_worst_tokens, num_topk = a.num_topk;
  const int first = blockIdx.x * blockDim.x + threadIdx.x, stride = a.num_move_blocks * blockDim.x;
  if (a.recv_src_rank != nullptr) {
    // Rows from sources <= s end at prefix[s][me]: row i's source is the
    // first s whose end passes i (a binary search down that column).
    const int* ends = a.rank_prefix_matrix + g.rank;
    for (int i = first; i < num_rows; i += stride) {
      int src = -1;
      if (i < num_recv) {
        int low = 0, high = g.num_ranks - 1;
        while (low < high) {
          const int mid = (low + high) / 2;
          if (ends[mid * g.num_ranks] > i) {
            high = mid;
          } else {
            low = mid + 1;
          }
        }
        src = low;
      }
      a.recv_src_rank[i] = src;
    }
  }
  if (a.recv_src_idx != nullptr) {
    for (int i = num_recv + first; i < num_rows; i += stride) a.recv_src_idx[i] = -1;
  }
  for (int64_t i = int64_t(num_recv) * num_topk + first; i < int64_t(num_rows) * num_topk; i += stride) {
    if (a.recv_topk_idx != nullptr) a.recv_topk_idx[i] = -1;
    if (a.recv_topk_weights != nullptr) a.recv_topk_weights[i] = 0.0f;
  }
}

// A token's row (bytes) to every non-null destination, by 16-byte vectors where the row allows.
template <int kRanks>
__device__ __forceinline__ void CopyRowToRanks(const char* src, char* const (&dst)[kRanks], int64_t bytes, int lane) {
  if (bytes % sizeof(int4) == 0) {
    WarpCopyRowToRanks<kRanks, int4>(src, dst, bytes, lane);
  } else {
    WarpCopyRowToRanks<kRanks, int>(src, dst, bytes, lane);
  }
}

// Top-k slot `out` of rank r's received rows: the destination's local expert
// id (-1 for an expert elsewhere, weight 0); cached dispatch sends weights as
// they are.
__device__ __forceinline__ void StoreTopkSlot(const SendArgs& a, const RankBuffers& dest, int r, int64_t out,
                                              int expert, float weight) {
  if (a.topk_idx != nullptr) {
    const int local = expert - r * a.experts_per_rank;
    const bool mine = expert >= 0 && local >= 0 && local < a.experts_per_rank;
    dest.topk_idx[out] = mine ? local : -1;
    if (a.topk_weights != nullptr) dest.topk_weights[out] = mine ? weight : 0.0f;
  } else if (a.topk_weights != nullptr) {
    dest.topk_weights[out] = weight;
  }
}

template <int kRanks>
__device__ __forceinline__ void SendToken(const Group& g, const SendArgs& a, const RankBuffers* dest, int t, int lane) {
  int pos[kRanks];
#pragma unroll
  for (int r = 0; r < kRanks; ++r) {
    pos[r] = r < g.num_ranks ? HandleRow(a.send_pos[int64_t(t) * g.num_ranks + r], a.num_worst_tokens) : -1;
  }
  if (lane == 0 && a.traffic != nullptr) {  // rows stored into the other ranks' memory
    int peers = 0;
#pragma unroll
    for (int r = 0; r < kRanks; ++r) peers += r != g.rank && pos[r] >= 0;
    CountTraffic(a.traffic, false, peers, a.row_bytes[0] + a.row_bytes[1]);
  }

#pragma unroll
  for (int i = 0; i < kMaxRowArrays; ++i) {
    const int64_t bytes = a.row_bytes[i];
    if (bytes == 0) continue;
    char* dst[kRanks];
#pragma unroll
    for (int r = 0; r < kRanks; ++r) dst[r] = pos[r] >= 0 ? dest[r].rows[i] + pos[r] * bytes : nullptr;
    CopyRowToRanks<kRanks>(a.x[i] + t * bytes, dst, bytes, lane);
  }

  const int num_topk = a.num_topk;
  for (int k = lane; k < num_topk; k += kWarpSize) {
    const int64_t in = int64_t(t) * num_topk + k;
    const int expert = a.topk_idx != nullptr ? a.topk_idx[in] : -1;
    const float weight = a.topk_weights != nullptr ? a.topk_weights[in] : 0.0f;
#pragma unroll
    for (int r = 0; r < kRanks; ++r) {
      if (pos[r] >= 0) StoreTopkSlot(a, dest[r], r, int64_t(pos[r]) * num_topk + k, expert, weight);
    }
  }
  if (lane == 0 && a.mode == kDispatch) {
#pragma unroll
    for (int r = 0; r < kRanks; ++r) {
      if (pos[r] >= 0) dest[r].src_idx[pos[r]] = t;
    }
  }
}

// Wide groups: lists token t's destinations (or sources), (rank, row) in rank
// order, into the warp's `list`; returns how many, in every lane. Lanes read
// 32 ranks' positions at a time.
__device__ __forceinline__ int ListRanks(const int* send_pos, int num_ranks, int num_rows, int t, int2* list,
                                         int lane) {
  __syncwarp();  // the warp is done with the previous token's list
  int n = 0;
  for (int base = 0; base < num_ranks; base += kWarpSize) {
    const int r = base + lane;
    const int pos = r < num_ranks ? HandleRow(send_pos[int64_t(t) * num_ranks + r], num_rows) : -1;
    const uint32_t ballot = __ballot_sync(0xffffffffu, pos >= 0);
    if (pos >= 0) list[n + __popc(ballot & ((1u << lane) - 1u))] = make_int2(r, pos);
    n += __popc(ballot);
  }
  __syncwarp();
  return n;
}

// SendToken for wide groups: the same stores, to the listed destinations,
// kWideBatch of them per pass over the row.
__device__ void SendTokenWide(const Group& g, const SendArgs& a, const RankBuffers* dest, int2* list, int t, int lane) {
  const int n = ListRanks(a.send_pos, g.num_ranks, a.num_worst_tokens, t, list, lane);
  if (lane == 0 && a.traffic != nullptr) {  // rows stored into the other ranks' memory
    int peers = 0;
    for (int j = 0; j < n; ++j) peers += list[j].x != g.rank;
    CountTraffic(a.traffic, false, peers, a.row_bytes[0] + a.row_bytes[1]);
  }
#pragma unroll
  for (int i = 0; i < kMaxRowArrays; ++i) {
    const int64_t bytes = a.row_bytes[i];
    if (bytes == 0) continue;
    const char* src = a.x[i] + t * bytes;
    for (int first = 0; first < n; first += kWideBatch) {
      char* dst[kWideBatch];
#pragma unroll
      for (int j = 0; j < kWideBatch; ++j) {
        const int2 d = first + j < n ? list[first + j] : make_int2(0, -1);
        dst[j] = d.y >= 0 ? dest[d.x].rows[i] + d.y * bytes : nullptr;
      }
      CopyRowToRanks<kWideBatch>(src, dst, bytes, lane);
    }
  }
  const int num_topk = a.num_topk;
  for (int k = lane; k < num_topk; k += kWarpSize) {
    const int64_t in = int64_t(t) * num_topk + k;
    const int expert = a.topk_idx != nullptr ? a.topk_idx[in] : -1;
    const float weight = a.topk_weights != nullptr ? a.topk_weights[in] : 0.0f;
    for (int j = 0; j < n; ++j) {
      const int r = list[j].x;
      StoreTopkSlot(a, dest[r], r, int64_t(list[j].y) * num_topk + k, expert, weight);
    }
  }
  if (lane == 0 && a.mode == kDispatch) {
    for (int j = 0; j < n; ++j) dest[list[j].x].src_idx[list[j].y] = t;
  }
}

// Staged dispatch: rank `rank`'s record of src's chunk, as mapped here.
__device__ __forceinline__ ChunkRecord* RecordOf(const Group& g, const StagedSync& sync, int rank, int src, int chunk) {
  return reinterpret_cast<ChunkRecord*>(g.regions[rank] + sync.records) + int64_t(src) * sync.num_chunks + chunk;
}

// Staged dispatch, after the warp sent the chunk's tokens [begin, end): tells
// every peer r which of its staging rows the chunk filled (lane r for peer r),
// once all the warp's stores are visible to the system.
__device__ void PublishChunkRecords(const Group& g, const SendArgs& a, int chunk, int begin, int end, int seq,
                                    int lane) {
  // No fence per lane: __syncwarp orders every lane's row stores before lane
  // r's release, and a release is cumulative (PTX memory model), so one
  // release per peer publishes the whole warp's rows. A full system fence in
  // every lane stalled the moving warps once per chunk.
  __syncwarp();
  for (int r = lane; r < g.num_ranks; r += kWarpSize) {  // lane serves peers lane, lane + 32, ...
    if (r == g.rank) continue;
    int first = 0, count = 0;
    for (int t = begin; t < end; ++t) {
      const int pos = HandleRow(a.send_pos[int64_t(t) * g.num_ranks + r], a.num_worst_tokens);
      if (pos < 0) continue;  // not for r, or dropped (then so are the later tokens)
      if (count++ == 0) first = pos;
    }
    ChunkRecord* record = RecordOf(g, a.sync, r, g.rank, chunk);
    record->first = first;
    record->count = count;
    StoreReleaseSys(&record->flag, seq);
  }
}

// Staged dispatch, copy role (a warp per item): copies the peers' landed rows
// from the staging area to this rank's XLA outputs, at the same row indices,
// as their chunk records arrive. Item i: piece i % pieces of the record of
// chunk i / pieces / (R - 1) of the (i / pieces % (R - 1))-th peer, so items
// follow the senders' chunk order, all peers at once.
__device__ void CopyLandedRows(const Group& g, const SendArgs& a, int seq, int lane) {
  const int num_peers = g.num_ranks - 1;
  const int pieces = (a.chunk_tokens + kCopyItemRows - 1) / kCopyItemRows;
  const int64_t num_items = int64_t(num_peers) * a.sync.num_chunks * pieces;
  int* next_copy = &ControlOf(g, g.rank)->next_copy;
  int item = NextChunk(next_copy, lane);
  while (item < num_items) {
    const int next = NextChunk(next_copy, lane);
    const int piece = item % pieces, k = item / pieces % num_peers, chunk = item / pieces / num_peers;
    const int src = k < g.rank ? k : k + 1;
    const ChunkRecord* record = RecordOf(g, a.sync, g.rank, src, chunk);
    // Lane 0 acquires the flag; __syncwarp orders the other lanes' loads after it.
    if (lane == 0) {
      WaitAtLeast(&record->flag, seq, a.timeout_ns, ModeName(a.mode), "chunk record (rows landed in staging)", g.rank,
                  src, chunk);
    }
    __syncwarp();
    const int count = LoadVolatile(&record->count) - piece * kCopyItemRows;
    if (count > 0) {
      const int first = LoadVolatile(&record->first) + piece * kCopyItemRows;
      CopyRows(a.local, a.staging, a.row_bytes, a.num_topk, first, min(count, kCopyItemRows), lane, kWarpSize);
    }
    item = next;
  }
}

// Every rank's buffers for this call, as seen here (this rank's own: `local`).
__device__ __forceinline__ void LoadRankBuffers(const Group& g, const Control* control, const RankBuffers& local,
                                                RankBuffers* buffers) {
  for (int r = threadIdx.x; r < g.num_ranks; r += blockDim.x) {
    buffers[r] = r == g.rank ? local : LoadPublished(g, control, r);
  }
  __syncthreads();
}

// The warp's slice of a wide kernel's per-token rank lists (unused below 9 ranks).
template <int kRanks>
__device__ __forceinline__ int2* WarpRankList() {
  __shared__ int2 lists[kRanks == kWide ? kMaxWarps : 1][kMaxNvlinkRanks];
  return lists[kRanks == kWide ? threadIdx.x / kWarpSize : 0];
}

template <int kRanks>
__global__ void __launch_bounds__(kMaxWarps* kWarpSize) SendKernel(Group g, SendArgs a) {
  __shared__ RankBuffers dest[kMaxNvlinkRanks];
  Control* control = ControlOf(g, g.rank);
  const int seq = LoadVolatile(&control->seq);
  const int lane = threadIdx.x % kWarpSize;
  if (int(blockIdx.x) >= a.num_move_blocks) {  // staged: copy role
    CopyLandedRows(g, a, seq, lane);
    return;
  }
  LoadRankBuffers(g, control, a.local, dest);
  int2* list = WarpRankList<kRanks>();

  FillReceivedMetadata(g, a);

  ForEachChunk(&control->next_chunk, a.num_tokens, a.chunk_tokens, [&](int chunk, int begin, int end) {
    for (int t = begin; t < end; ++t) {
      if constexpr (kRanks == kWide) {
        SendTokenWide(g, a, dest, list, t, lane);
      } else {
        SendToken<kRanks>(g, a, dest, t, lane);
      }
    }
    if (a.staged) PublishChunkRecords(g, a, chunk, begin, end, seq, lane);
  });
  SignalDone(g, seq, blockIdx.x);
}

// ---------------------------------------------------------------------------
// Combine step 2: pull and reduce.

// out = bf16(sum over r in rank order of float(src[r])), 8 bf16 per vector;
// null sources are skipped. All loads of a step are issued before the sums.
template <int kRanks, int kUnroll>
__device__ __forceinline__ void WarpReduceRow(const int4* const (&src)[kRanks], int4* out, int n, int lane) {
  for (int base = lane; base < n; base += kWarpSize * kUnroll) {
    int4 v[kRanks][kUnroll];
#pragma unroll
    for (int r = 0; r < kRanks; ++r) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = base + u * kWarpSize;
        if (src[r] != nullptr && i < n) v[r][u] = src[r][i];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kWarpSize;
      if (i >= n) continue;
      float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int r = 0; r < kRanks; ++r) {
        if (src[r] != nullptr) AddBf16x8(acc, v[r][u]);
      }
      out[i] = PackBf16x8(acc);
    }
  }
}

struct CombineArgs {
  const int* send_pos;  // [T, R]
  int num_tokens, hidden, num_topk, chunk_tokens;
  TrafficCounters* traffic;  // combine's counters, or null (not counting)
  uint16_t* out;             // bf16 [T, H]
  float* out_weights;        // [T, K] or null
  // This rank's own rows are read straight from XLA's x and weights, in
  // staged mode too (the local rank is always in this process).
  RankBuffers local;
  // Staged mode: blocks [0, num_copy_blocks) copy the rows the peers pull
  // from `local` to `staging` (CopyToStaging), the others pull.
  bool staged;
  int num_copy_blocks;
  int num_rows;                   // rows of x
  const int* num_recv_tokens;     // [] valid rows of x
  const int* rank_prefix_matrix;  // [R, R]
  RankBuffers staging;
  StagedSync sync;
  uint64_t timeout_ns;
};

// Staged combine, copy role (the whole block per item): copies the valid
// rows of x (and weights) that the peers pull into this rank's staging area,
// in aligned chunks of kStagedCopyRows rows, each followed by its ready flag
// in the region of the peer that pulls it (its flags[me][row /
// kStagedCopyRows] = seq: a remote store here, so the pullers' many waits
// poll their own memory instead of crossing NVLink). The rows of source s are the segment
// [prefix[s - 1][me], prefix[s][me]) (clipped to the valid rows); the local
// rank's own segment is read from XLA's x, never copied. Item i: the
// (i / (R - 1))-th chunk of the (i % (R - 1))-th peer's segment, so the
// pullers of every peer find their first rows early. A chunk straddling two
// segments is copied by both (same bytes), each raising its own peer's flag.
__device__ void CopyToStaging(const Group& g, const CombineArgs& a, int seq) {
  __shared__ int shared_item;
  const int me = g.rank, num_peers = g.num_ranks - 1;
  const int num_valid = min(*a.num_recv_tokens, a.num_rows);
  const int64_t row_bytes[kMaxRowArrays] = {int64_t(a.hidden) * int64_t(sizeof(uint16_t)), 0};
  // Chunks [begin, end) holding the k-th peer's segment.
  auto segment = [&](int k, int& begin, int& end) {
    const int s = k < me ? k : k + 1;
    const int row_begin = s == 0 ? 0 : min(num_valid, a.rank_prefix_matrix[(s - 1) * g.num_ranks + me]);
    const int row_end = min(num_valid, a.rank_prefix_matrix[s * g.num_ranks + me]);
    begin = row_begin / kStagedCopyRows;
    end = row_end > row_begin ? (row_end - 1) / kStagedCopyRows + 1 : begin;
  };
  int max_chunks = 0;
  for (int k = 0; k < num_peers; ++k) {
    int begin, end;
    segment(k, begin, end);
    max_chunks = max(max_chunks, end - begin);
  }
  const int64_t num_items = int64_t(num_peers) * max_chunks;
  const int64_t num_flags = NumRowFlags(a.num_rows);
  int* next_copy = &ControlOf(g, me)->next_copy;
  for (;;) {
    if (threadIdx.x == 0) shared_item = atomicAdd(next_copy, 1);
    __syncthreads();
    const int item = shared_item;
    __syncthreads();  // all read it before thread 0 takes the next one
    if (item >= num_items) return;
    int begin, end;
    const int k = item % num_peers, s = k < me ? k : k + 1;
    segment(k, begin, end);
    const int chunk = begin + item / num_peers;
    if (chunk >= end) continue;  // a shorter segment
    const int first_row = chunk * kStagedCopyRows;
    CopyRows(a.staging, a.local, row_bytes, a.num_topk, first_row, min(kStagedCopyRows, num_valid - first_row),
             threadIdx.x, blockDim.x);
    __syncthreads();  // every thread's row stores before thread 0's (cumulative) release
    if (threadIdx.x == 0) {
      int* flags = reinterpret_cast<int*>(g.regions[s] + a.sync.row_flags) + me * num_flags;
      StoreReleaseSys(&flags[chunk], seq);
    }
  }
}

// Staged combine: before token t's rows are read, waits until every peer r
// has raised the ready flag of the chunk holding the token's row at r (lane
// r % 32 for peer r, all peers at once). ready_chunk[j]: the last chunk of
// peer lane + 32 j seen ready (a warp's consecutive tokens mostly share
// chunks). The lanes that waited acquired the flags; __syncwarp orders the
// warp's loads after.
template <int kLanePeers>
__device__ __forceinline__ void WaitRowsReady(const Group& g, const CombineArgs& a, int t, int seq,
                                              int (&ready_chunk)[kLanePeers], int lane) {
#pragma unroll
  for (int j = 0; j < kLanePeers; ++j) {
    const int r = lane + j * kWarpSize;
    if (r >= g.num_ranks || r == g.rank) continue;
    const int pos = HandleRow(a.send_pos[int64_t(t) * g.num_ranks + r], a.num_rows);
    if (pos >= 0 && pos / kStagedCopyRows != ready_chunk[j]) {
      ready_chunk[j] = pos / kStagedCopyRows;
      const int* flag = reinterpret_cast<const int*>(g.regions[g.rank] + a.sync.row_flags) +
                        r * NumRowFlags(a.num_rows) + ready_chunk[j];
      WaitAtLeast(flag, seq, a.timeout_ns, ModeName(kCombine), "ready flag of staged rows", g.rank, r, ready_chunk[j]);
    }
  }
  __syncwarp();
}

// Token t's output row (and top-k weights): the sum of its rows at every rank.
template <int kRanks>
__device__ __forceinline__ void CombineToken(const Group& g, const CombineArgs& a, const RankBuffers* sources, int t,
                                             int lane) {
  // Enough loads in flight per lane to cover the NVLink latency.
  constexpr int kUnroll = kRanks <= 2 ? 8 : kRanks <= 4 ? 4 : 2;
  const int64_t row_bytes = int64_t(a.hidden) * sizeof(uint16_t);
  int pos[kRanks];
  const int4* src[kRanks];
#pragma unroll
  for (int r = 0; r < kRanks; ++r) {
    pos[r] = r < g.num_ranks ? HandleRow(a.send_pos[int64_t(t) * g.num_ranks + r], a.num_rows) : -1;
    src[r] = pos[r] >= 0 ? reinterpret_cast<const int4*>(sources[r].rows[0] + pos[r] * row_bytes) : nullptr;
  }
  if (lane == 0 && a.traffic != nullptr) {  // rows loaded from the other ranks' memory
    int peers = 0;
#pragma unroll
    for (int r = 0; r < kRanks; ++r) peers += r != g.rank && pos[r] >= 0;
    CountTraffic(a.traffic, false, peers, row_bytes);
  }
  WarpReduceRow<kRanks, kUnroll>(src, reinterpret_cast<int4*>(a.out + int64_t(t) * a.hidden), a.hidden / 8, lane);
  if (a.out_weights == nullptr) return;
  for (int k = lane; k < a.num_topk; k += kWarpSize) {
    float acc = 0.0f;
#pragma unroll
    for (int r = 0; r < kRanks; ++r) {
      if (pos[r] >= 0) acc += sources[r].topk_weights[int64_t(pos[r]) * a.num_topk + k];
    }
    a.out_weights[int64_t(t) * a.num_topk + k] = acc;
  }
}

// CombineToken for wide groups: the listed sources in rank order, kWideBatch
// of them per pass, summed in float32 as the narrow kernels do.
__device__ void CombineTokenWide(const Group& g, const CombineArgs& a, const RankBuffers* sources, int2* list, int t,
                                 int lane) {
  constexpr int kUnroll = 1;
  const int64_t row_bytes = int64_t(a.hidden) * sizeof(uint16_t);
  const int n = ListRanks(a.send_pos, g.num_ranks, a.num_rows, t, list, lane);
  if (lane == 0 && a.traffic != nullptr) {  // rows loaded from the other ranks' memory
    int peers = 0;
    for (int j = 0; j < n; ++j) peers += list[j].x != g.rank;
    CountTraffic(a.traffic, false, peers, row_bytes);
  }
  int4* out = reinterpret_cast<int4*>(a.out + int64_t(t) * a.hidden);
  const int num_vectors = a.hidden / 8;
  for (int base = lane; base < num_vectors; base += kWarpSize * kUnroll) {
    float acc[kUnroll][8] = {};
    for (int first = 0; first < n; first += kWideBatch) {
      int4 v[kWideBatch][kUnroll];
      const int4* src[kWideBatch];
#pragma unroll
      for (int j = 0; j < kWideBatch; ++j) {
        const int2 s = first + j < n ? list[first + j] : make_int2(0, -1);
        src[j] = s.y >= 0 ? reinterpret_cast<const int4*>(sources[s.x].rows[0] + s.y * row_bytes) : nullptr;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int i = base + u * kWarpSize;
          if (src[j] != nullptr && i < num_vectors) v[j][u] = src[j][i];
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int j = 0; j < kWideBatch; ++j) {
          if (src[j] != nullptr && base + u * kWarpSize < num_vectors) AddBf16x8(acc[u], v[j][u]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kWarpSize;
      if (i < num_vectors) out[i] = PackBf16x8(acc[u]);
    }
  }
  if (a.out_weights == nullptr) return;
  for (int k = lane; k < a.num_topk; k += kWarpSize) {
    float acc = 0.0f;
    for (int j = 0; j < n; ++j) acc += sources[list[j].x].topk_weights[int64_t(list[j].y) * a.num_topk + k];
    a.out_weights[int64_t(t) * a.num_topk + k] = acc;
  }
}

template <int kRanks>
__global__ void __launch_bounds__(kMaxWarps* kWarpSize) CombineKernel(Group g, CombineArgs a) {
  __shared__ RankBuffers sources[kMaxNvlinkRanks];
  Control* control = ControlOf(g, g.rank);
  const int seq = LoadVolatile(&control->seq);
  if (int(blockIdx.x) < a.num_copy_blocks) {  // staged: copy role
    CopyToStaging(g, a, seq);
    return;
  }
  LoadRankBuffers(g, control, a.local, sources);
  int2* list = WarpRankList<kRanks>();

  const int lane = threadIdx.x % kWarpSize;
  int ready_chunk[kRanks == kWide ? kRankWords : 1];  // peers per lane: lane, lane + 32, ...
#pragma unroll
  for (int& chunk : ready_chunk) chunk = -1;
  ForEachToken(&control->next_chunk, a.num_tokens, a.chunk_tokens, [&](int t) {
    if (a.staged) WaitRowsReady(g, a, t, seq, ready_chunk, lane);
    if constexpr (kRanks == kWide) {
      CombineTokenWide(g, a, sources, list, t, lane);
    } else {
      CombineToken<kRanks>(g, a, sources, t, lane);
    }
  });
  SignalDone(g, seq, blockIdx.x - a.num_copy_blocks);
}

// ---------------------------------------------------------------------------
// Step 3: wait for the peers; dispatch also counts rows per local expert.

struct FinishArgs {
  int mode, num_blocks;
  uint64_t timeout_ns;
  // Dispatch: num_recv_tokens_per_expert from the landed top-k ids.
  const int* num_recv_tokens;
  const int* landed_topk_idx;
  int num_topk, experts_per_rank;
  int* num_recv_tokens_per_expert;
};

__global__ void __launch_bounds__(kFinishThreads) FinishKernel(Group g, FinishArgs a) {
  __shared__ int histogram[kMaxLocalExperts];
  Control* control = ControlOf(g, g.rank);
  const int seq = LoadVolatile(&control->seq);
  for (int i = threadIdx.x; i < g.num_ranks * a.num_blocks; i += blockDim.x) {
    const int src = i / a.num_blocks, block = i % a.num_blocks;
    WaitAtLeast(&control->done[src][block], seq, a.timeout_ns, ModeName(a.mode), "done flag of a block", g.rank, src,
                block);
  }
  __syncthreads();
  // Every peer is done with this rank's memory: the next call may enter (the
  // histogram below reads only this call's XLA buffers).
  if (threadIdx.x == 0) LeaveCall(&control->active);
  if (a.num_recv_tokens_per_expert == nullptr) return;

  // Slots holding each local expert, over the valid rows (as the reference's bincount).
  BlockBincount(a.landed_topk_idx, a.num_recv_tokens, a.num_topk, a.experts_per_rank, histogram,
                a.num_recv_tokens_per_expert);
}

// ---------------------------------------------------------------------------
// Host side.

Group MakeGroup(const DeviceState& state) {
  Group g{};
  for (int r = 0; r < state.num_ranks; ++r) g.regions[r] = state.normal.peers[r];  // num_ranks <= kMaxNvlinkRanks (FFI)
  g.rank = state.rank;
  g.num_ranks = state.num_ranks;
  g.ipc = state.ipc;
  return g;
}

// What this rank publishes to its peers: its buffers, as offsets into its
// normal region when the peers live in other processes.
RankBuffers Publishable(const DeviceState& state, const RankBuffers& b) {
  return state.ipc ? Rebased(b, state.normal.local, nullptr) : b;
}

// The staging area of a region after the control bytes (StagedRegionBytes).
struct Staging {
  RankBuffers buffers;  // null when laid out without a region
  StagedSync sync;
  size_t end;
};

Staging StagingLayout(char* region, int num_ranks, int64_t num_rows, const int64_t row_bytes[kMaxRowArrays],
                      int num_topk, int64_t num_chunks) {
  size_t offset = kControlBytes;
  auto take = [&](size_t bytes) {
    const size_t at = offset;
    offset = AlignUp(offset + bytes, kRegionAlign);
    return at;
  };
  auto address = [region](size_t at) { return region == nullptr ? nullptr : region + at; };
  Staging s{};
  for (int i = 0; i < kMaxRowArrays; ++i) s.buffers.rows[i] = address(take(size_t(num_rows) * row_bytes[i]));
  s.buffers.topk_idx = reinterpret_cast<int*>(address(take(size_t(num_rows) * num_topk * sizeof(int))));
  s.buffers.topk_weights = reinterpret_cast<float*>(address(take(size_t(num_rows) * num_topk * sizeof(float))));
  s.buffers.src_idx = reinterpret_cast<int*>(address(take(size_t(num_rows) * sizeof(int))));
  s.sync.records = take(size_t(num_ranks) * size_t(num_chunks) * sizeof(ChunkRecord));
  s.sync.row_flags = take(size_t(num_ranks) * size_t(NumRowFlags(num_rows)) * sizeof(int));
  s.sync.num_chunks = int(num_chunks);
  s.end = offset;
  return s;
}

// The one place that chooses where peers write this rank's rows (or read
// them): XLA's own buffers, or the staging area of the normal region.
RankBuffers ChooseLanding(const RankBuffers& xla_buffers, const Staging& staging, bool staged) {
  return staged ? staging.buffers : xla_buffers;
}

// Staged mode: the flags of this rank's region that its notify (or publish)
// kernel resets (ClearSync): dispatch, the chunk records of every source;
// combine, the row flags (rounded up to int4, inside the area's alignment).
SyncClear RecordsToClear(const DeviceState& state, const Staging& staging, bool staged) {
  if (!staged) return SyncClear{nullptr, 0};
  return SyncClear{reinterpret_cast<int4*>(state.normal.local + staging.sync.records),
                   state.num_ranks * staging.sync.num_chunks};
}

SyncClear RowFlagsToClear(const DeviceState& state, const Staging& staging, int64_t num_rows, bool staged) {
  if (!staged) return SyncClear{nullptr, 0};
  const int64_t ints_per_vector = sizeof(int4) / sizeof(int);
  const int64_t num_flags = state.num_ranks * NumRowFlags(num_rows);
  return SyncClear{reinterpret_cast<int4*>(state.normal.local + staging.sync.row_flags),
                   int((num_flags + ints_per_vector - 1) / ints_per_vector)};
}

// The move kernels' blocks: `move` send or pull (the done flags count them),
// `copy` take the staged copy role. Staged mode gives the copy role as many
// blocks as the move role, at least a quarter of the SMs, and keeps the two
// within the SMs (fewer move blocks when Config.num_sms leaves no room), so
// they all run at once. Every rank must compute the same split (GPUs with
// equal SM counts): the notify kernel checks it (CheckPeerLaunch).
struct Blocks {
  int move, copy;
};

Blocks SplitBlocks(const DeviceState& state, const LaunchConfig& c) {
  if (!c.staged || state.num_ranks < 2) return Blocks{c.num_blocks, 0};
  const int num_sms = DeviceSmCount(state.device_ordinal);
  const int copy = std::max(1, std::min(c.num_blocks, std::max(num_sms - c.num_blocks, num_sms / 4)));
  return Blocks{std::max(1, std::min(c.num_blocks, num_sms - copy)), copy};
}

// Test hook: DEEP_EP_JAX_WIDE_KERNELS=1 runs the wide kernels at any group
// size, so one GPU checks them against the oracle at 2..8 ranks too (every
// path lays the memory out alike: ranks may mix them).
bool WideKernelsForced() {
  static const bool forced = [] {
    const char* value = std::getenv("DEEP_EP_JAX_WIDE_KERNELS");
    return value != nullptr && std::strcmp(value, "1") == 0;
  }();
  return forced;
}

template <template <int> class Launcher, typename... Args>
void LaunchForRanks(int num_ranks, Args&&... args) {
  if (num_ranks > 8 || WideKernelsForced()) {
    Launcher<kWide>::Run(args...);
  } else if (num_ranks <= 2) {
    Launcher<2>::Run(args...);
  } else if (num_ranks <= 4) {
    Launcher<4>::Run(args...);
  } else {
    Launcher<8>::Run(args...);
  }
}

template <int kRanks>
struct NotifyLauncher {
  static void Run(const Group& g, const NotifyArgs& a, cudaStream_t stream) {
    DispatchNotifyKernel<kRanks><<<1, kNotifyThreads, 0, stream>>>(g, a);
  }
};

template <int kRanks>
struct SendLauncher {
  static void Run(const Group& g, const SendArgs& a, const Blocks& b, const LaunchConfig& c, cudaStream_t stream) {
    SendKernel<kRanks><<<b.move + b.copy, c.num_warps * kWarpSize, 0, stream>>>(g, a);
  }
};

template <int kRanks>
struct CombineLauncher {
  static void Run(const Group& g, const CombineArgs& a, const Blocks& b, const LaunchConfig& c, cudaStream_t stream) {
    CombineKernel<kRanks><<<b.copy + b.move, c.num_warps * kWarpSize, 0, stream>>>(g, a);
  }
};

void LaunchFinish(const Group& g, FinishArgs a, int mode, const Blocks& b, const LaunchConfig& c, cudaStream_t stream) {
  a.mode = mode;
  a.num_blocks = b.move;
  a.timeout_ns = c.timeout_ns;
  FinishKernel<<<1, kFinishThreads, 0, stream>>>(g, a);
}

// The publish kernel: one warp, or a block that clears the staged flags.
void LaunchPublish(const Group& g, const RankBuffers& mine, const SyncClear& clear, int mode, const Blocks& b,
                   const LaunchConfig& c, cudaStream_t stream) {
  PublishKernel<<<1, c.staged ? kNotifyThreads : kWarpSize, 0, stream>>>(g, mine, clear, b.move, mode, c.timeout_ns,
                                                                         c.order);
}

// What dispatch and cached dispatch send alike: rows, weights, layout, and
// the staged copy role's part.
template <typename Params>
SendArgs CommonSendArgs(const Params& p, const LaunchConfig& c, int mode, const Blocks& b, const Staging& staging) {
  SendArgs send{};
  for (int i = 0; i < kMaxRowArrays; ++i) {
    send.x[i] = p.x[i];
    send.row_bytes[i] = p.row_bytes[i];
  }
  send.send_pos = p.send_pos;
  send.topk_weights = p.topk_weights;
  send.num_tokens = p.num_tokens;
  send.num_topk = p.num_topk;
  send.num_worst_tokens = p.num_worst_tokens;
  send.chunk_tokens = c.chunk_tokens;
  send.mode = mode;
  send.num_recv_tokens = p.num_recv_tokens;
  send.staged = c.staged;
  send.num_move_blocks = b.move;
  send.sync = staging.sync;
  send.timeout_ns = c.timeout_ns;
  return send;
}

// The counters of one call kind in this rank's control block, or null when not counting.
TrafficCounters* TrafficOf(const DeviceState& state, const LaunchConfig& c, int mode) {
  return c.count_traffic ? reinterpret_cast<TrafficCounters*>(state.normal.local + kTrafficOffset) + mode : nullptr;
}

// Cached dispatch moves rows and (when given) weights only.
RankBuffers RowsAndWeights(RankBuffers b, bool with_weights) {
  b.topk_idx = nullptr;
  b.src_idx = nullptr;
  if (!with_weights) b.topk_weights = nullptr;
  return b;
}

}  // namespace

size_t StagedRegionBytes(int64_t num_rows, const int64_t row_bytes[kMaxRowArrays], int num_topk, int64_t num_chunks,
                         int num_ranks) {
  return StagingLayout(nullptr, num_ranks, num_rows, row_bytes, num_topk, num_chunks).end;
}

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
  for (auto& flags : control.done) {
    for (int& flag : flags) flag = seq;
  }
  return cudaMemcpy(region, &control, sizeof(control), cudaMemcpyHostToDevice);
}

cudaError_t LaunchDispatch(const DeviceState& state, const DispatchParams& p, const LaunchConfig& c,
                           cudaStream_t stream) {
  if (state.ipc && !c.staged) return cudaErrorInvalidValue;  // peers reach only the regions
  const Group g = MakeGroup(state);
  const int experts_per_rank = p.num_experts / state.num_ranks;
  const Blocks blocks = SplitBlocks(state, c);
  const Staging staging = StagingLayout(state.normal.local, state.num_ranks, p.num_worst_tokens, p.row_bytes,
                                        p.num_topk, NumChunks(p.num_tokens, c.chunk_tokens));
  const RankBuffers landing = ChooseLanding(p.recv, staging, c.staged);

  NotifyArgs notify{p.topk_idx,
                    p.num_tokens,
                    p.num_topk,
                    p.num_experts,
                    p.num_worst_tokens,
                    p.is_token_in_rank,
                    p.num_tokens_per_rank,
                    p.rank_prefix_matrix,
                    p.send_pos,
                    p.num_recv_tokens,
                    p.num_dropped_tokens,
                    Publishable(state, landing),
                    RecordsToClear(state, staging, c.staged),
                    blocks.move,
                    c.timeout_ns,
                    c.order};
  LaunchForRanks<NotifyLauncher>(state.num_ranks, g, notify, stream);

  SendArgs send = CommonSendArgs(p, c, kDispatch, blocks, staging);
  send.traffic = TrafficOf(state, c, kDispatch);
  send.topk_idx = p.topk_idx;
  send.experts_per_rank = experts_per_rank;
  send.rank_prefix_matrix = p.rank_prefix_matrix;
  send.recv_src_rank = p.recv_src_rank;
  send.recv_src_idx = p.recv.src_idx;
  send.recv_topk_idx = p.recv.topk_idx;
  send.recv_topk_weights = p.recv.topk_weights;
  send.local = p.recv;
  send.staging = landing;
  LaunchForRanks<SendLauncher>(state.num_ranks, g, send, blocks, c, stream);

  // The histogram reads XLA's recv_topk_idx: complete once the send kernel
  // (copy role included) has finished, which precedes the finish kernel.
  FinishArgs finish{};
  finish.num_recv_tokens = p.num_recv_tokens;
  finish.landed_topk_idx = p.recv.topk_idx;
  finish.num_topk = p.num_topk;
  finish.experts_per_rank = experts_per_rank;
  finish.num_recv_tokens_per_expert = p.num_recv_tokens_per_expert;
  LaunchFinish(g, finish, kDispatch, blocks, c, stream);
  return cudaGetLastError();
}

cudaError_t LaunchCachedDispatch(const DeviceState& state, const CachedDispatchParams& p, const LaunchConfig& c,
                                 cudaStream_t stream) {
  if (state.ipc && !c.staged) return cudaErrorInvalidValue;  // peers reach only the regions
  const Group g = MakeGroup(state);
  const bool with_weights = p.topk_weights != nullptr;
  const Blocks blocks = SplitBlocks(state, c);
  const Staging staging = StagingLayout(state.normal.local, state.num_ranks, p.num_worst_tokens, p.row_bytes,
                                        p.num_topk, NumChunks(p.num_tokens, c.chunk_tokens));
  const RankBuffers recv = RowsAndWeights(p.recv, with_weights);
  const RankBuffers landing = RowsAndWeights(ChooseLanding(recv, staging, c.staged), with_weights);
  LaunchPublish(g, Publishable(state, landing), RecordsToClear(state, staging, c.staged), kCachedDispatch, blocks, c,
                stream);

  SendArgs send = CommonSendArgs(p, c, kCachedDispatch, blocks, staging);
  send.traffic = TrafficOf(state, c, kCachedDispatch);
  send.recv_topk_weights = recv.topk_weights;
  send.local = recv;
  send.staging = landing;
  LaunchForRanks<SendLauncher>(state.num_ranks, g, send, blocks, c, stream);

  LaunchFinish(g, FinishArgs{}, kCachedDispatch, blocks, c, stream);
  return cudaGetLastError();
}

cudaError_t LaunchCombine(const DeviceState& state, const CombineParams& p, const LaunchConfig& c,
                          cudaStream_t stream) {
  if (state.ipc && !c.staged) return cudaErrorInvalidValue;  // peers reach only the regions
  const Group g = MakeGroup(state);
  const int64_t row_bytes[kMaxRowArrays] = {int64_t(p.hidden) * int64_t(sizeof(uint16_t)), 0};
  const Blocks blocks = SplitBlocks(state, c);
  const Staging staging =
      StagingLayout(state.normal.local, state.num_ranks, p.num_worst_tokens, row_bytes, p.num_topk, 0);
  RankBuffers inputs{};
  inputs.rows[0] = const_cast<char*>(reinterpret_cast<const char*>(p.x));
  inputs.topk_weights = const_cast<float*>(p.topk_weights);
  RankBuffers sources = ChooseLanding(inputs, staging, c.staged);
  sources.rows[1] = nullptr;
  sources.topk_idx = nullptr;
  sources.src_idx = nullptr;
  if (p.topk_weights == nullptr) sources.topk_weights = nullptr;
  // Staged: the copy role of the combine kernel fills the staging area after
  // this; peers wait for its row flags (cleared here) before reading.
  LaunchPublish(g, Publishable(state, sources), RowFlagsToClear(state, staging, p.num_worst_tokens, c.staged), kCombine,
                blocks, c, stream);

  CombineArgs combine{};
  combine.send_pos = p.send_pos;
  combine.num_tokens = p.num_tokens;
  combine.hidden = p.hidden;
  combine.num_topk = p.num_topk;
  combine.chunk_tokens = c.chunk_tokens;
  combine.traffic = TrafficOf(state, c, kCombine);
  combine.out = p.out;
  combine.out_weights = p.out_weights;
  combine.local = inputs;
  combine.staged = c.staged;
  combine.num_copy_blocks = blocks.copy;
  combine.num_rows = p.num_worst_tokens;
  combine.num_recv_tokens = p.num_recv_tokens;
  combine.rank_prefix_matrix = p.rank_prefix_matrix;
  combine.staging = sources;
  combine.sync = staging.sync;
  combine.timeout_ns = c.timeout_ns;
  LaunchForRanks<CombineLauncher>(state.num_ranks, g, combine, blocks, c, stream);

  LaunchFinish(g, FinishArgs{}, kCombine, blocks, c, stream);
  return cudaGetLastError();
}

}  // namespace intranode
}  // namespace deep_ep_jax
