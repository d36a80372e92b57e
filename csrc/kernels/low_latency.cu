// Low-latency (decode) dispatch and combine over NVLink, as four phases:
//
//   dispatch send: each block takes tokens; it quantises a token's row once
//     (FP8 + per-128-channel scales, in shared memory), puts it once into the
//     half of every rank that owns one of its experts, at row (rank, token),
//     and lists each (token, k) there at a place in its expert's list fixed
//     by counting (prefix counts, no atomics), so the packing is deterministic.
//   dispatch recv: waits for every source's "ready" flag, packs the rows into
//     recv_x [L, R*M, H] ordered by (source rank, token, k), one copy per
//     (token, k), and writes the handle; then hands the half back to its
//     sources ("freed").
//   combine send: puts every received row's expert output back into its
//     source's half at row (token * K + k).
//   combine recv: waits for every rank's "ready" flag and sums, per token,
//     weight_k * row_k over k in order in float32 (no FMA), as the reference,
//     over the k whose expert id is in [0, E) (the ids dispatch sent).
//
// The split API runs each phase as its own kernel; a whole dispatch or combine
// runs its two phases in one cooperative kernel.
//
// The sequence number lives in the control block and is advanced by the send
// phases themselves (a split recv kernel gets it through the token), so
// CUDA-graph replays and back-to-back calls need no host work and no clean-up
// launch. Each phase detects its last block with a counter; only that block
// signals peers, after every block's puts are visible system-wide.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kernels/device.cuh"
#include "kernels/low_latency.h"

namespace deep_ep_jax {
namespace low_latency {
namespace {

constexpr int kThreads = 512;
// Every launch runs one block per SM (the whole kernels are cooperative), so
// ptxas may give a thread up to 128 registers rather than spill to fit two.
constexpr int kBlocksPerSm = 1;
constexpr int kWarps = kThreads / 32;
constexpr int kScanScratch = kWarpSize + 1;  // BlockExclusiveScanInPlace: a sum per warp, the total

enum Kernel { kDispatchSend = 0, kDispatchRecv = 1, kCombineSend = 2, kCombineRecv = 3, kNumKernels = 4 };

// The first bytes of the region. Flags hold "operation number + 1", so the
// zeroed start state means "nothing yet" and no flag is ever reset.
struct Control {
  // Number of the next operation (dispatch or combine) on this buffer. The
  // send phases read it through a C++ volatile pointer: device.cuh's
  // LoadVolatile (asm) would change how nvcc compiles the dispatch send loop.
  int seq;
  int sending;  // 1 while a send phase runs on this device (EnterCall)
  // Changes whenever this rank masks a rank or a peer tells it of one
  // (MaskRank): a wait with masking on starts its timeout again.
  int mask_news;
  int pad0[29];
  int blocks_done[kNumKernels][32];  // last-block detection, one line per kernel
  // One slot per rank of the largest group (3 * 2 * 1024 ints: 24 KiB); each
  // array starts on its own 128-byte line.
  int ready[2][kMaxGroupRanks];  // [half][source]: source's rows of that op are all here
  int freed[2][kMaxGroupRanks];  // [half][destination]: destination has read this rank's rows of that op
  int calls[2][kMaxGroupRanks];  // [half][source]: source's call tag for that op (CheckPeerCall)
  // [receive kind][source]: nanoseconds this rank's receives have waited for
  // source's rows (the first block's waits; kept, as counters, until reset).
  unsigned long long waited_ns[kWaitKinds][kMaxGroupRanks];
  // [rank]: 1 while this rank neither sends to nor waits for that rank (the
  // Buffer's mask: set on a timeout with Peers::mask_failed, by a peer that
  // masked that rank, or by LaunchMask).
  int masked[kMaxGroupRanks];
  // [half][source]: a receive's verdict on source for the op of that half,
  // VerdictKey(op) | 1 if masked, which the first block to reach one records
  // and every other block takes, so the blocks of a receive agree.
  int verdict[2][kMaxGroupRanks];
};
static_assert(sizeof(Control) <= kControlBytes, "control block too large");
static_assert(offsetof(Control, ready) % 128 == 0 && offsetof(Control, freed) % 128 == 0,
              "flags written by peers start on their own lines");

constexpr size_t kReadyOffset = offsetof(Control, ready);
constexpr size_t kFreedOffset = offsetof(Control, freed);
__host__ __device__ inline size_t ReadyFlag(int half, int source) {
  return kReadyOffset + sizeof(int) * (half * kMaxGroupRanks + source);
}
__host__ __device__ inline size_t FreedFlag(int half, int destination) {
  return kFreedOffset + sizeof(int) * (half * kMaxGroupRanks + destination);
}
__host__ __device__ inline size_t CallTagSlot(int half, int source) {
  return offsetof(Control, calls) + sizeof(int) * (half * kMaxGroupRanks + source);
}

// Copies num_bytes (a multiple of 16) with `count` cooperating threads, this
// one being `index`. StridedCopy in 16-byte vectors without
// StridedCopyBytes's alignment test: every row and offset of this mode's
// layouts is a multiple of kVectorBytes, so the decode path skips the test.
__device__ __forceinline__ void Copy16(void* dst, const void* src, size_t num_bytes, int index, int count) {
  StridedCopy<8>(static_cast<uint4*>(dst), static_cast<const uint4*>(src), int(num_bytes / 16), index, count);
}

// A block's copy of Peers' tables, in its shared memory (PeerTableBytes).
struct PeerTable {
  char* const* regions;
  const int* pes;
  // [rank]: 1 for a rank this block neither sends to nor waits for: masked in
  // the control block when the kernel started (every rank, if this one is),
  // or masked since by this block's waits (a receive: its verdict).
  int* masked;
};

// Copies the peer tables and the mask into the start of the block's dynamic
// shared memory. No barrier here: every phase passes a __syncthreads before
// its first put or signal, which publishes the copy to the whole block, and
// before it a thread reads only the masked[r] it wrote (waits take r as here).
__device__ __forceinline__ PeerTable LoadPeerTable(const Peers& p, int* smem) {
  char** regions = reinterpret_cast<char**>(smem);
  int* pes = reinterpret_cast<int*>(reinterpret_cast<char*>(smem) +
                                    AlignUp(size_t(p.num_ranks) * sizeof(char*), kVectorBytes));
  int* masked = pes + AlignUp(size_t(p.num_ranks) * sizeof(int), kVectorBytes) / sizeof(int);
  const Control* control = reinterpret_cast<const Control*>(p.local);
  const bool out = LoadVolatile(&control->masked[p.rank]) != 0;
  for (int r = threadIdx.x; r < p.num_ranks; r += blockDim.x) {
    regions[r] = p.regions[r];
    if (p.pes != nullptr) pes[r] = p.pes[r];
    masked[r] = out || LoadVolatile(&control->masked[r]) != 0;
  }
  return PeerTable{regions, pes, masked};
}

// What a phase may use of the dynamic shared memory: what follows the peer tables.
__device__ __forceinline__ int* AfterPeerTable(int* smem, int num_ranks) {
  return smem + PeerTableBytes(num_ranks) / sizeof(int);
}

// How this rank reaches the others. Over NVLink every rank's region is mapped
// here, so a put is a store through a peer pointer. The kernels are templates
// over the transport: low_latency_nvshmem.cu includes this file and builds
// them again with one that reaches ranks on other hosts through NVSHMEM.
struct NvlinkTransport {
  Peers p;
  PeerTable peers;

  __device__ char* local() const { return p.local; }
  __device__ Control* control() const { return reinterpret_cast<Control*>(local()); }
  // Copies local bytes to `offset` of rank's region (a cooperative group of
  // whole warps). stage_offset: where a transport that needs registered
  // memory as the source (NVSHMEM) stages them first; unused here.
  __device__ void Put(int rank, size_t offset, const void* src, size_t num_bytes, int index, int count,
                      size_t /*stage_offset*/ = 0) const {
    Copy16(peers.regions[rank] + offset, src, num_bytes, index, count);
  }
  __device__ void PutInt(int rank, size_t offset, int value) const {
    *reinterpret_cast<int*>(peers.regions[rank] + offset) = value;
  }
  // After it, this thread's puts are visible to every rank.
  __device__ void Fence() const { __threadfence_system(); }
  // Release store of a flag in rank's control block.
  __device__ void Signal(int rank, size_t offset, int value) const {
    StoreReleaseSys(reinterpret_cast<int*>(peers.regions[rank] + offset), value);
  }
};

// Waits until a flag of this rank's control block (every transport's peers
// signal there) has reached `target` (SeqReached: wrap-safe) and returns
// true, or returns false once give_up() says so. A wait that was not over at
// once adds its time to *waited_ns (when not null). Past timeout_ns it
// returns false with `masking` (whose timeout starts again when a rank is
// newly masked here: Control::mask_news), else traps with a message naming
// what it waited for.
template <typename GiveUp>
__device__ bool WaitFlag(const Peers& p, size_t offset, int target, uint64_t timeout_ns, bool masking, const char* mode,
                         const char* counter, int peer, int op, unsigned long long* waited_ns, GiveUp give_up) {
  const int* flag = reinterpret_cast<const int*>(p.local + offset);
  if (SeqReached(LoadAcquireSys(flag), target)) return true;
  const int* news = &reinterpret_cast<const Control*>(p.local)->mask_news;
  int seen = LoadVolatile(news);
  const uint64_t start = GlobalTimerNs();
  uint64_t now = start, since = start;
  while (!SeqReached(LoadAcquireSys(flag), target)) {
    now = GlobalTimerNs();
    if (give_up()) return false;
    // A peer just masked a rank: the one awaited may have been waiting for it.
    if (masking && LoadVolatile(news) != seen) {
      seen = LoadVolatile(news);
      since = now;
    }
    if (now - since > timeout_ns) {
      if (masking) return false;
      printf(
          "deep_ep_jax timeout: %s rank %d waited %.1f s for %s from peer %d (operation %d): "
          "value %d, expected %d" DEEP_EP_JAX_TRAP_NOTE,
          mode, p.rank, timeout_ns * 1e-9, counter, peer, op, LoadAcquireSys(flag), target);
      __trap();
    }
  }
  if (waited_ns != nullptr) atomicAdd(waited_ns, static_cast<unsigned long long>(now - start));
  return true;
}

template <typename Transport>
__device__ __forceinline__ bool MaskedInControl(const Transport& tr, int r) {
  return LoadVolatile(&tr.control()->masked[r]) != 0;
}

// This rank is masked in its own control block (a peer told it, mid-kernel
// perhaps): it is out, sends to and waits for no one from now on.
template <typename Transport>
__device__ __forceinline__ bool Out(const Transport& tr) {
  return MaskedInControl(tr, tr.p.rank);
}

// Masks rank r in this block and in the control block (from this kernel on).
// The first to mask it says so once and tells every other rank, r included
// where mapped (its waits for r give up, and those waiting for a rank that
// waited for r start their timeouts again; a stalled r finds itself masked
// and sends nothing), so one rank's timeout does not grow into others'. A
// rank that is out only marks its block.
template <typename Transport>
__device__ void MaskRank(const Transport& tr, int r, const char* mode) {
  tr.peers.masked[r] = 1;
  if (Out(tr) || atomicExch(&tr.control()->masked[r], 1) != 0) return;
  printf("deep_ep_jax: %s rank %d masks rank %d: no answer within the timeout (Config.mask_failed_ranks)\n", mode,
         tr.p.rank, r);
  const int news = tr.p.rank * kMaxGroupRanks + r + 1;  // one value per (rank, masked rank)
  atomicExch(&tr.control()->mask_news, news);
  const size_t entry = offsetof(Control, masked) + sizeof(int) * r;
  for (int q = 0; q < tr.p.num_ranks; ++q) {
    if (q == tr.p.rank || (q == r ? tr.peers.regions[r] == nullptr : MaskedInControl(tr, q))) continue;
    tr.PutInt(q, entry, 1);
    tr.PutInt(q, offsetof(Control, mask_news), news);
  }
  tr.Fence();  // delivered now (NVSHMEM: completed), not at some later fence
}

// Send phases: whether to send to destination r: it is not masked and has
// read this half of operation op - 2 (its freed flag). With masking on, a
// destination that does not free it within the timeout is masked.
template <typename Transport>
__device__ bool WaitFreed(const Transport& tr, int half, int r, unsigned op, const char* mode) {
  if (tr.peers.masked[r]) return false;
  const bool freed = WaitFlag(tr.p, FreedFlag(half, r), int(op - 1u), tr.p.timeout_ns, tr.p.mask_failed, mode,
                              "the freed flag (more than two low-latency operations in flight?)", r, int(op), nullptr,
                              [&] { return MaskedInControl(tr, r) || Out(tr); });
  if (!freed) MaskRank(tr, r, mode);
  return freed;
}

// A receive's verdict key for operation op: never has bit 0 set (the mask bit).
__host__ __device__ constexpr int VerdictKey(unsigned op) { return int((op + 1u) << 1); }

// The last operation before `seq` on `half` (seq - 1 or seq - 2: operations alternate halves).
__host__ __device__ constexpr unsigned LastOpOfHalf(unsigned seq, int half) {
  return seq - 1u - ((seq - 1u - unsigned(half)) & 1u);
}

// Where the first block of a receive adds its wait for `source` (the other
// blocks wait for the same flags, so they count nothing).
template <typename Transport>
__device__ __forceinline__ unsigned long long* WaitedNs(const Transport& tr, int kind, int source) {
  return blockIdx.x == 0 ? &tr.control()->waited_ns[kind][source] : nullptr;
}

// Receive phases: waits for source r's rows of operation op (its ready flag)
// unless r is masked; leaves the block's masked[r] saying whether they count.
// The blocks of one receive agree: the first to reach a verdict (the flag
// came; or r is masked, or timed out with masking on) records it in the
// control block, and every other block takes it, so no block reads rows
// another skips. With masking on a receive waits 1.5x the timeout: a live
// source may be late by up to one timeout of its send's own wait for a failed
// rank. Its own rows always come (the send before it signals them), so a
// rank never masks itself.
template <typename Transport>
__device__ void WaitReady(const Transport& tr, int half, int r, unsigned op, const char* mode, int wait_kind) {
  int* verdict = &tr.control()->verdict[half][r];
  const int key = VerdictKey(op);
  const int before = LoadVolatile(verdict);
  int v = before;
  if ((v & ~1) != key) {
    const bool self = r == tr.p.rank, masking = tr.p.mask_failed && !self;
    const uint64_t timeout_ns = self ? 3 * tr.p.timeout_ns : masking ? tr.p.timeout_ns * 3 / 2 : tr.p.timeout_ns;
    const bool arrived =
        !tr.peers.masked[r] &&
        WaitFlag(tr.p, ReadyFlag(half, r), int(op + 1u), timeout_ns, masking, mode, "the ready flag", r, int(op),
                 WaitedNs(tr, wait_kind, r),
                 [&] { return (LoadVolatile(verdict) & ~1) == key || (masking && MaskedInControl(tr, r)) || Out(tr); });
    const int proposed = key | (arrived ? 0 : 1);
    const int old = atomicCAS(verdict, before, proposed);
    v = old == before ? proposed : old;  // else another block's verdict on this op
  }
  if (!(v & 1)) {
    tr.peers.masked[r] = 0;
    LoadAcquireSys(reinterpret_cast<const int*>(tr.local() + ReadyFlag(half, r)));  // its rows, for this block too
  } else if (!tr.peers.masked[r]) {
    MaskRank(tr, r, mode);
  }
}

__device__ __forceinline__ size_t HalfOffset(const Peers& p, int half) {
  return kControlBytes + size_t(half) * p.half_bytes;
}

// In-place exclusive prefix sum of data[0, n) by the whole block; data[n - 1]
// ends up as the sum of the first n - 1 entries (callers pass one extra entry
// to get the total). Each thread scans a slice; BlockExclusiveScan offsets
// the slices. scratch: kScanScratch ints of shared memory.
__device__ void BlockExclusiveScanInPlace(int* data, int n, int* scratch) {
  const int per_thread = (n + blockDim.x - 1) / blockDim.x;
  const int begin = min(n, int(threadIdx.x) * per_thread);
  const int end = min(n, begin + per_thread);
  int running[1] = {0};
  for (int i = begin; i < end; ++i) running[0] += data[i];
  BlockExclusiveScan(running, 1, scratch, scratch + kWarpSize);
  for (int i = begin; i < end; ++i) {
    const int v = data[i];
    data[i] = running[0];
    running[0] += v;
  }
  __syncthreads();
}

// Spreads rows [0, num_rows) over every warp of the grid; when warps
// outnumber rows, 2 or 4 warps (of one block) share a row. Calls
// fn(row, index, count): this thread is `index` of the `count` copying it.
template <typename Fn>
__device__ __forceinline__ void ForEachRow(int num_rows, Fn fn) {
  const int num_warps = gridDim.x * kWarps;
  const int ratio = num_warps / max(1, num_rows);
  const int warps_per_row = ratio >= 4 ? 4 : ratio >= 2 ? 2 : 1;
  const int num_groups = num_warps / warps_per_row;
  const int warp = blockIdx.x * kWarps + threadIdx.x / 32;
  const int index = (warp % warps_per_row) * 32 + threadIdx.x % 32;
  for (int row = warp / warps_per_row; row < num_rows; row += num_groups) fn(row, index, warps_per_row * 32);
}

// Index of the last entry <= value in the non-decreasing starts[0, n), given starts[0] <= value.
__device__ __forceinline__ int FindSegment(const int* starts, int n, int value) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (starts[mid] <= value)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// bins[e] += number of i in [0, n) with values[i] == e (0 <= e < num_bins),
// and, when bins_below is given, bins_below[e] += the same over [0, n_below):
// one pass over the values for both. One shared atomic per distinct value per
// warp, so skewed routing does not serialise.
__device__ void BlockHistogram(const int* values, int n, int num_bins, int* bins, int n_below = 0,
                               int* bins_below = nullptr) {
  for (int base = 0; base < n; base += blockDim.x) {
    const int i = base + threadIdx.x;
    int v = i < n ? values[i] : -1;
    if (v >= num_bins) v = -1;
    const int lane = threadIdx.x & 31;
    const unsigned same = __match_any_sync(0xffffffffu, v);
    if (v >= 0 && lane == __ffs(same) - 1) atomicAdd(&bins[v], __popc(same));
    if (bins_below != nullptr) {
      const int w = i < n_below ? v : -1;
      const unsigned same_below = __match_any_sync(0xffffffffu, w);
      if (w >= 0 && lane == __ffs(same_below) - 1) atomicAdd(&bins_below[w], __popc(same_below));
    }
  }
}

// True in every thread of the block that finishes last; that block may then
// signal the peers. By then every block's loads are done and, after a send
// phase (`puts`), every thread's puts are visible system-wide. A receive
// phase's own writes stay on this GPU (the kernel's end publishes them), so it
// skips the system fence, which would wait for them to drain.
template <typename Transport>
__device__ bool LastBlock(const Transport& tr, int* blocks_done, bool puts) {
  __shared__ int is_last;
  if (puts) tr.Fence();
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // the block's loads (consumed before the barrier) and puts before its count
    is_last = atomicAdd(blocks_done, 1) == int(gridDim.x) - 1;
    if (is_last) *blocks_done = 0;  // every block has arrived: ready for the next launch
    __threadfence();
  }
  __syncthreads();
  return is_last;
}

// Send phases, by block 0 (always launched, never without work): enters the
// call on this device and takes its tag (common/call_order.h) into *tag.
template <typename Transport>
__device__ __forceinline__ void BeginSend(const Transport& tr, const CallOrder& order, int kind, int* tag) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    EnterCall(&tr.control()->sending, kind, tr.p.rank);
    *tag = TakeCallTag(order, kind);
  }
}

// Send phases, by block 0 once every destination has freed this half: the
// call's tag into each destination's slot for it, before the ready flags
// (LastBlock's fence orders it before them: each thread's tags, then its
// fence).
template <typename Transport>
__device__ __forceinline__ void PublishCallTag(const Transport& tr, int half, int tag) {
  if (blockIdx.x != 0) return;
  for (int r = threadIdx.x; r < tr.p.num_ranks; r += blockDim.x) {
    if (!tr.peers.masked[r]) tr.PutInt(r, CallTagSlot(half, tr.p.rank), tag);
  }
}

// The last block of a phase: `flag` = value in this rank's control block and
// every unmasked rank's; none but its own once this rank is out. Masked in
// this block or in the control block: another block may have masked r and
// skipped its rows (each block masks before its LastBlock count).
template <typename Transport>
__device__ __forceinline__ void SignalAll(const Transport& tr, size_t flag, int value) {
  const bool out = Out(tr);
  for (int r = threadIdx.x; r < tr.p.num_ranks; r += blockDim.x) {
    if (r == tr.p.rank || (!out && !tr.peers.masked[r] && !MaskedInControl(tr, r))) tr.Signal(r, flag, value);
  }
}

// Receive phases, after every source's ready flag and a __syncthreads: each
// source sent this op from the same call as this rank.
template <typename Transport>
__device__ __forceinline__ void CheckCallTags(const Transport& tr, int half) {
  const char* local = tr.local();
  for (int r = threadIdx.x; r < tr.p.num_ranks; r += blockDim.x) {
    if (tr.peers.masked[r]) continue;
    CheckPeerCall(LoadVolatile(reinterpret_cast<const int*>(local + CallTagSlot(half, tr.p.rank))),
                  LoadVolatile(reinterpret_cast<const int*>(local + CallTagSlot(half, r))), tr.p.rank, r);
  }
}

__device__ __forceinline__ float Bf16Lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float Bf16Hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// Smallest power of two >= s, exactly (s is a positive normal float here).
__device__ __forceinline__ float CeilPow2(float s) {
  const uint32_t bits = __float_as_uint(s);
  uint32_t exponent = bits & 0x7f800000u;
  if (bits & 0x007fffffu) exponent += 0x00800000u;
  return __uint_as_float(exponent);
}

// FP8 scales follow what XLA computes for the reference (kInvFp8Max, DivFull).
__device__ __forceinline__ uint32_t Fp8x2(float a, float b, float inv_scale) {
  float2 v;
  v.x = fminf(fmaxf(__fmul_rn(a, inv_scale), -kFp8Max), kFp8Max);
  v.y = fminf(fmaxf(__fmul_rn(b, inv_scale), -kFp8Max), kFp8Max);
  return __nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3);
}

// Quantises bf16 row [H] into staging: FP8 [H] then its scales, float32 [H / 128], or with mxfp8
// float8_e8m0fnu [H / 32] (powers of two, rounded up): the same bytes per row either way.
// Thread i takes 8 channels; 16 consecutive threads (4 with mxfp8) share one scale.
__device__ void QuantizeRow(const uint4* row, int hidden, bool round_scale, bool mxfp8, char* staging) {
  const int units = hidden / 8;
  const int lanes = mxfp8 ? kMxfp8Block / 8 : kFp8Block / 8;  // threads per scale, uniform
  float* scales = reinterpret_cast<float*>(staging + hidden);
  for (int base = 0; base < units; base += blockDim.x) {  // uniform: whole warps shuffle
    const int u = base + threadIdx.x;
    const bool active = u < units;  // units % 16 == 0, so a 16-lane group is all in or all out
    const uint4 raw = active ? row[u] : make_uint4(0, 0, 0, 0);
    const float v[8] = {Bf16Lo(raw.x), Bf16Hi(raw.x), Bf16Lo(raw.y), Bf16Hi(raw.y),
                        Bf16Lo(raw.z), Bf16Hi(raw.z), Bf16Lo(raw.w), Bf16Hi(raw.w)};
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
    for (int o = lanes / 2; o >= 1; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float scale = __fmul_rn(fmaxf(amax, 1e-4f), kInvFp8Max);
    if (round_scale || mxfp8) scale = CeilPow2(scale);
    const float inv_scale = DivFull(1.0f, scale);
    if (active) {
      uint2 q;
      q.x = Fp8x2(v[0], v[1], inv_scale) | (Fp8x2(v[2], v[3], inv_scale) << 16);
      q.y = Fp8x2(v[4], v[5], inv_scale) | (Fp8x2(v[6], v[7], inv_scale) << 16);
      reinterpret_cast<uint2*>(staging)[u] = q;
      if (u % lanes == 0) {
        if (mxfp8) {
          reinterpret_cast<uint8_t*>(scales)[u / lanes] = uint8_t(__float_as_uint(scale) >> 23);  // its exponent
        } else {
          scales[u / lanes] = scale;
        }
      }
    }
  }
}

// The dispatch send phase's shared ints (DispatchSendPhase has the layout);
// the FP8 staging row follows them.
__host__ __device__ inline size_t DispatchSendInts(int num_experts) {
  return 2 * size_t(num_experts) + 1 + kScanScratch + 1 + kMaxTopk;
}

size_t DispatchSendSharedBytes(int num_experts, int hidden, bool fp8) {
  return AlignUp(sizeof(int) * DispatchSendInts(num_experts), kVectorBytes) +
         (fp8 ? DispatchRowBytes(hidden, true) : 0);
}

size_t DispatchRecvSharedBytes(int num_rows_lists) {
  return sizeof(int) * (2 * size_t(num_rows_lists) + 2 + kScanScratch);
}

// Each operation below is a send phase and a receive phase, as device
// functions: the split kernels run one phase each (the send/recv halves of the
// API), the whole kernels run both in one cooperative launch, which saves a
// launch and lets a block start its receive work while other blocks still
// send. The send phase returns the operation's sequence number.

// Asks L2 for this thread's share of a row before other work, so the row's
// first loads do not wait on HBM.
__device__ __forceinline__ void PrefetchRow(const uint4* row, int units) {
  for (int u = threadIdx.x; u < units; u += blockDim.x) asm volatile("prefetch.global.L2 [%0];" ::"l"(row + u));
}

// The distinct ranks that own one of the token's experts, ascending (the
// order of TokenRankMask's bits), into dests[0, n); returns n in every lane.
// By one whole warp: lane l keeps ranks [32 l, 32 l + 32) as a bit mask, and
// a scan of the lanes' counts places each lane's ranks.
static_assert(kMaxGroupRanks <= 32 * 32, "TokenDestinations keeps one 32-bit mask per lane");
__device__ __forceinline__ int TokenDestinations(const int* topk, int num_topk, int num_experts, int experts_per_rank,
                                                 int* dests) {
  const int lane = threadIdx.x % 32;
  uint32_t mask = 0;
  for (int k = 0; k < num_topk; ++k) {
    const int e = topk[k];
    if (e >= 0 && e < num_experts) {
      const int r = e / experts_per_rank;
      if (r / 32 == lane) mask |= 1u << (r % 32);
    }
  }
  const int count = __popc(mask);
  int end = count;  // inclusive scan of the counts over the lanes
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, end, o);
    if (lane >= o) end += v;
  }
  int pos = end - count;
  for (uint32_t m = mask; m != 0; m &= m - 1) dests[pos++] = lane * 32 + __ffs(m) - 1;
  return __shfl_sync(0xffffffffu, end, 31);
}

template <typename Transport, bool kFp8>
__device__ __forceinline__ unsigned DispatchSendPhase(const DispatchSendArgs& a, const PeerTable& table, int* smem) {
  const Transport tr{a.peers, table};
  const int num_ranks = a.peers.num_ranks, rank = a.peers.rank;
  const int num_experts = a.num_experts, num_topk = a.num_topk, hidden = a.hidden;
  const int num_local = num_experts / num_ranks;
  int* expert_start = smem;                      // [E + 1]: this rank's rows per expert, exclusive scan
  int* before = expert_start + num_experts + 1;  // [E]: rows per expert of tokens before the current one
  int* scratch = before + num_experts;
  int* token_dests = scratch + kScanScratch;  // [1 + kMaxTopk]: a token's destinations: count, then ranks
  char* staging = reinterpret_cast<char*>(smem) + AlignUp(sizeof(int) * DispatchSendInts(num_experts), kVectorBytes);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The last warp lists a token's destinations before the barrier that
  // precedes its puts (the first token's while warp 0 waits below).
  constexpr int kListWarp = kWarps - 1;
  auto list_destinations = [&](int t) {
    const int n =
        TokenDestinations(a.topk_idx + size_t(t) * num_topk, num_topk, num_experts, num_local, token_dests + 1);
    if (lane == 0) token_dests[0] = n;
  };

  Control* control = tr.control();
  __shared__ int call_tag;
  BeginSend(tr, a.order, kLowLatencyDispatchCall, &call_tag);
  const unsigned op = *reinterpret_cast<volatile unsigned*>(&control->seq);
  const int half = op & 1;
  const size_t half_offset = HalfOffset(a.peers, half);
  const DispatchLayout& layout = a.layout;
  const int first_token = blockIdx.x;
  auto token_row = [&](int t) {
    return reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.x) + size_t(t) * hidden);
  };

  // Blocks without a token (a whole kernel runs one block per SM) skip to the
  // end; block 0 always sends the counts.
  const bool active = first_token < a.num_tokens || blockIdx.x == 0;
  // The first token's quantisation and destinations need no buffer: they hide the wait below.
  if (first_token < a.num_tokens) {
    if (kFp8)
      QuantizeRow(token_row(first_token), hidden, a.round_scale, a.mxfp8, staging);
    else
      PrefetchRow(token_row(first_token), hidden / 8);
    if (warp == kListWarp) list_destinations(first_token);
  }
  // Every destination must have read this half of operation op - 2 (or be masked).
  if (active) {
    for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) WaitFreed(tr, half, r, op, "low-latency dispatch send");
  }
  __syncthreads();
  PublishCallTag(tr, half, call_tag);

  // The rows first: a token's row goes once to each rank that owns one of its
  // experts (not once per expert: a quarter of the NVLink bytes at top-8 over
  // two ranks), at row (this rank, token), which needs no counting; so the
  // counting below overlaps their flight. The spare warps help with each copy.
  for (int t = first_token; t < a.num_tokens; t += gridDim.x) {
    const uint4* row = token_row(t);
    if (t != first_token) {
      if (kFp8) QuantizeRow(row, hidden, a.round_scale, a.mxfp8, staging);
      if (warp == kListWarp) list_destinations(t);
    }
    __syncthreads();
    const int num_dests = token_dests[0];
    const int warps_per_dest = max(1, kWarps / max(1, num_dests));
    const int num_groups = kWarps / warps_per_dest;
    const int group = warp / warps_per_dest, group_thread = (warp % warps_per_dest) * 32 + lane;
    const void* src = kFp8 ? static_cast<const void*>(staging) : static_cast<const void*>(row);
    const size_t row_offset =
        half_offset + layout.rows_offset + (size_t(rank) * layout.max_tokens + t) * layout.row_bytes;
    for (int i = group; group < num_groups && i < num_dests; i += num_groups) {  // spare warps (16 % 3) sit out
      if (tr.peers.masked[token_dests[1 + i]]) continue;
      tr.Put(token_dests[1 + i], row_offset, src, layout.row_bytes, group_thread, warps_per_dest * 32,
             (size_t(t) * num_topk + i) * layout.row_bytes);
    }
    __syncthreads();  // staging and token_dests are reused by the next token
  }

  // Then the lists: the counts per expert, and where each (token, k) stands in
  // its expert's list (prefix counts, no atomics), for the receiver.
  if (active) {
    for (int i = threadIdx.x; i <= num_experts; i += blockDim.x) expert_start[i] = 0;
    for (int i = threadIdx.x; i < num_experts; i += blockDim.x) before[i] = 0;
    __syncthreads();
    // All rows per expert, and those of the tokens before this block's first.
    BlockHistogram(a.topk_idx, a.num_tokens * num_topk, num_experts, expert_start,
                   min(first_token, a.num_tokens) * num_topk, before);
    __syncthreads();
    BlockExclusiveScanInPlace(expert_start, num_experts + 1, scratch);
    if (blockIdx.x == 0) {
      for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
        const int dst = e / num_local;
        if (tr.peers.masked[dst]) continue;
        const size_t offset =
            half_offset + layout.counts_offset + sizeof(int) * (size_t(rank) * num_local + e % num_local);
        tr.PutInt(dst, offset, expert_start[e + 1] - expert_start[e]);
      }
    }
  }
  for (int t = first_token; t < a.num_tokens; t += gridDim.x) {
    if (t != first_token) {  // `before` moves on by the tokens since the previous one
      __syncthreads();
      BlockHistogram(a.topk_idx + size_t(t - gridDim.x) * num_topk, int(gridDim.x) * num_topk, num_experts, before);
      __syncthreads();
    }
    const int* experts = a.topk_idx + size_t(t) * num_topk;
    for (int k = threadIdx.x; k < num_topk; k += blockDim.x) {
      const int e = experts[k];
      if (e < 0 || e >= num_experts) continue;
      int slot = before[e];
      for (int j = 0; j < k; ++j) slot += experts[j] == e;
      const int dst = e / num_local;
      if (tr.peers.masked[dst]) continue;
      const int pos = expert_start[e] - expert_start[dst * num_local] + slot;
      tr.PutInt(dst, half_offset + layout.infos_offset + sizeof(int) * (size_t(rank) * layout.capacity + pos),
                t * num_topk + k);
    }
  }

  if (LastBlock(tr, &control->blocks_done[kDispatchSend][0], true)) {
    SignalAll(tr, ReadyFlag(half, rank), int(op + 1u));
    if (threadIdx.x == 0) {
      LeaveCall(&control->sending);
      control->seq = int(op + 1u);
      if (a.token != nullptr) *a.token = int(op);
    }
  }
  return op;
}

template <typename Transport, bool kFp8>
__device__ __forceinline__ void DispatchRecvPhase(const DispatchRecvArgs& a, unsigned op, const PeerTable& table,
                                                  int* smem) {
  const Transport tr{a.peers, table};
  const int num_ranks = a.peers.num_ranks, rank = a.peers.rank;
  const int num_local = a.num_local_experts, num_topk = a.num_topk, hidden = a.hidden;
  const int num_lists = num_local * num_ranks;  // (expert, source) row lists
  const int rows_per_expert = num_ranks * a.max_tokens;
  int* row_start = smem;                       // [L*R + 1], (expert, source) order: first output row of each list
  int* seg_start = row_start + num_lists + 1;  // [R*L + 1], (source, expert) order: first row in the source's segment
  int* scratch = seg_start + num_lists + 1;

  const int half = op & 1;
  const char* half_base = tr.local() + HalfOffset(a.peers, half);
  const DispatchLayout& layout = a.layout;

  for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) {
    WaitReady(tr, half, r, op, "low-latency dispatch recv", kDispatchWait);
  }
  __syncthreads();
  CheckCallTags(tr, half);

  const int* counts = reinterpret_cast<const int*>(half_base + layout.counts_offset);  // [source][expert]
  for (int i = threadIdx.x; i < num_lists; i += blockDim.x) {
    const int c = tr.peers.masked[i / num_local] ? 0 : counts[i];  // a masked source sent nothing
    row_start[(i % num_local) * num_ranks + i / num_local] = c;
    seg_start[i] = c;
  }
  if (threadIdx.x == 0) row_start[num_lists] = seg_start[num_lists] = 0;
  __syncthreads();
  BlockExclusiveScanInPlace(row_start, num_lists + 1, scratch);
  BlockExclusiveScanInPlace(seg_start, num_lists + 1, scratch);
  auto expert_count = [&](int e) {
    return min(row_start[(e + 1) * num_ranks] - row_start[e * num_ranks], rows_per_expert);
  };

  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e < num_local; e += blockDim.x) a.recv_count[e] = expert_count(e);
  }
  // The handle says -1 on padding rows.
  const int64_t num_slots = int64_t(num_local) * rows_per_expert;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < num_slots;
       i += int64_t(gridDim.x) * blockDim.x) {
    if (int(i % rows_per_expert) >= expert_count(int(i / rows_per_expert))) {
      a.recv_src_rank[i] = a.recv_src_token[i] = a.recv_src_topk[i] = -1;
    }
  }

  const int* infos = reinterpret_cast<const int*>(half_base + layout.infos_offset);
  ForEachRow(row_start[num_lists], [&](int f, int index, int count) {
    const int list = FindSegment(row_start, num_lists, f);
    const int e = list / num_ranks, src = list % num_ranks;
    const int j = f - row_start[list];
    const int out = row_start[list] - row_start[e * num_ranks] + j;
    if (out >= rows_per_expert) return;  // more rows than the output holds (duplicate experts): dropped
    const size_t slot =
        size_t(src) * layout.capacity + (seg_start[src * num_local + e] - seg_start[src * num_local] + j);
    const int info = infos[slot];  // t * K + k
    const int t = info / num_topk;
    if (t < 0 || t >= a.max_tokens) return;  // never, as the sender writes every counted row's info
    const char* from = half_base + layout.rows_offset + (size_t(src) * layout.max_tokens + t) * layout.row_bytes;
    const size_t dst_row = size_t(e) * rows_per_expert + out;
    if (kFp8) {
      Copy16(static_cast<char*>(a.recv_x) + dst_row * hidden, from, hidden, index, count);
      const float* scales = reinterpret_cast<const float*>(from + hidden);
      const int num_scales = hidden / kFp8Block;
      for (int i = index; i < num_scales; i += count) a.recv_scales[dst_row * num_scales + i] = scales[i];
    } else {
      Copy16(static_cast<char*>(a.recv_x) + dst_row * hidden * 2, from, size_t(hidden) * 2, index, count);
    }
    if (index == 0) {
      a.recv_src_rank[dst_row] = src;
      a.recv_src_token[dst_row] = t;
      a.recv_src_topk[dst_row] = info % num_topk;
    }
  });

  if (LastBlock(tr, &tr.control()->blocks_done[kDispatchRecv][0], false))
    SignalAll(tr, FreedFlag(half, rank), int(op + 1u));
}

template <typename Transport>
__device__ __forceinline__ unsigned CombineSendPhase(const CombineSendArgs& a, const PeerTable& table, int* smem) {
  const Transport tr{a.peers, table};
  const int num_ranks = a.peers.num_ranks, rank = a.peers.rank;
  const int num_local = a.num_local_experts, num_topk = a.num_topk, hidden = a.hidden;
  const int rows_per_expert = num_ranks * a.max_tokens;
  int* row_start = smem;  // [L + 1]: first flat row of each expert
  int* scratch = row_start + num_local + 1;

  Control* control = tr.control();
  __shared__ int call_tag;
  BeginSend(tr, a.order, kLowLatencyCombineCall, &call_tag);
  const unsigned op = *reinterpret_cast<volatile unsigned*>(&control->seq);
  const int half = op & 1;
  const size_t half_offset = HalfOffset(a.peers, half);

  for (int e = threadIdx.x; e < num_local; e += blockDim.x)
    row_start[e] = min(max(a.recv_count[e], 0), rows_per_expert);
  if (threadIdx.x == 0) row_start[num_local] = 0;
  __syncthreads();
  BlockExclusiveScanInPlace(row_start, num_local + 1, scratch);

  // Every source must have read this half of operation op - 2 (or be masked).
  for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) WaitFreed(tr, half, r, op, "low-latency combine send");
  __syncthreads();
  PublishCallTag(tr, half, call_tag);

  const size_t row_bytes = size_t(hidden) * 2;
  ForEachRow(row_start[num_local], [&](int f, int index, int count) {
    const int e = FindSegment(row_start, num_local, f);
    const size_t row = size_t(e) * rows_per_expert + (f - row_start[e]);
    const int src = a.recv_src_rank[row], t = a.recv_src_token[row], k = a.recv_src_topk[row];
    if (src < 0 || src >= num_ranks || t < 0 || t >= a.max_tokens || k < 0 || k >= num_topk) return;
    if (tr.peers.masked[src]) return;
    const char* from = static_cast<const char*>(a.x) + row * row_bytes;
    tr.Put(src, half_offset + (size_t(t) * num_topk + k) * row_bytes, from, row_bytes, index, count,
           ((size_t(src) * a.max_tokens + t) * num_topk + k) * row_bytes);
  });

  if (LastBlock(tr, &control->blocks_done[kCombineSend][0], true)) {
    SignalAll(tr, ReadyFlag(half, rank), int(op + 1u));
    if (threadIdx.x == 0) {
      LeaveCall(&control->sending);
      control->seq = int(op + 1u);
      if (a.token != nullptr) *a.token = int(op);
    }
  }
  return op;
}

template <typename Transport>
__device__ __forceinline__ void CombineRecvPhase(const CombineRecvArgs& a, unsigned op, const PeerTable& table) {
  const Transport tr{a.peers, table};
  const int num_ranks = a.peers.num_ranks, rank = a.peers.rank;
  const int num_topk = a.num_topk, hidden = a.hidden;
  const int half = op & 1;
  const char* rows = tr.local() + HalfOffset(a.peers, half);

  for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) {
    WaitReady(tr, half, r, op, "low-latency combine recv", kCombineWait);
  }
  __syncthreads();
  CheckCallTags(tr, half);
  const int num_local = a.num_experts / num_ranks;

  // One thread per (token, 8 channels): out = sum over k in order of w_k * y_k.
  const int units = hidden / 8;
  const int64_t total = int64_t(a.num_tokens) * units;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int t = int(i / units), u = int(i % units);
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    constexpr int kChunk = 8;  // rows loaded before they are summed, for memory parallelism
    for (int k0 = 0; k0 < num_topk; k0 += kChunk) {
      uint4 y[kChunk];
      float w[kChunk];
      unsigned valid = 0;
#pragma unroll
      for (int c = 0; c < kChunk; ++c) {
        const int slot = t * num_topk + k0 + c;
        y[c] = make_uint4(0, 0, 0, 0);
        w[c] = 0.0f;
        const int e = k0 + c < num_topk ? a.topk_idx[slot] : -1;
        // As dispatch: ids outside [0, E) name no expert; a masked rank's experts sent nothing.
        if (e >= 0 && e < a.num_experts && !tr.peers.masked[e / num_local]) {
          valid |= 1u << c;
          w[c] = a.topk_weights[slot];
          y[c] = reinterpret_cast<const uint4*>(rows + size_t(slot) * hidden * 2)[u];
        }
      }
#pragma unroll
      for (int c = 0; c < kChunk; ++c) {  // in k order, skipping k with no expert
        if (!((valid >> c) & 1u)) continue;
        const float v[8] = {Bf16Lo(y[c].x), Bf16Hi(y[c].x), Bf16Lo(y[c].y), Bf16Hi(y[c].y),
                            Bf16Lo(y[c].z), Bf16Hi(y[c].z), Bf16Lo(y[c].w), Bf16Hi(y[c].w)};
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w[c], v[i]));
      }
    }
    uint4 packed;
    uint32_t* words = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(acc[2 * c], acc[2 * c + 1]);
      words[c] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    reinterpret_cast<uint4*>(a.out)[i] = packed;
  }

  if (LastBlock(tr, &tr.control()->blocks_done[kCombineRecv][0], false))
    SignalAll(tr, FreedFlag(half, rank), int(op + 1u));
}

// The kernels: halves (split API) and whole operations. Each block first
// copies the peer tables into its shared memory; the phases get the rest.
template <typename Transport, bool kFp8>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) DispatchSendKernel(DispatchSendArgs a) {
  extern __shared__ __align__(16) int smem[];
  const PeerTable table = LoadPeerTable(a.peers, smem);
  DispatchSendPhase<Transport, kFp8>(a, table, AfterPeerTable(smem, a.peers.num_ranks));
}

template <typename Transport, bool kFp8>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) DispatchRecvKernel(DispatchRecvArgs a) {
  extern __shared__ __align__(16) int smem[];
  const PeerTable table = LoadPeerTable(a.peers, smem);
  DispatchRecvPhase<Transport, kFp8>(a, unsigned(*a.token), table, AfterPeerTable(smem, a.peers.num_ranks));
}

template <typename Transport, bool kFp8>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) DispatchKernel(DispatchSendArgs send, DispatchRecvArgs recv) {
  extern __shared__ __align__(16) int smem[];
  const PeerTable table = LoadPeerTable(send.peers, smem);
  int* rest = AfterPeerTable(smem, send.peers.num_ranks);
  const unsigned op = DispatchSendPhase<Transport, kFp8>(send, table, rest);
  __syncthreads();  // shared memory after the peer tables changes hands
  DispatchRecvPhase<Transport, kFp8>(recv, op, table, rest);
}

template <typename Transport>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) CombineSendKernel(CombineSendArgs a) {
  extern __shared__ __align__(16) int smem[];
  const PeerTable table = LoadPeerTable(a.peers, smem);
  CombineSendPhase<Transport>(a, table, AfterPeerTable(smem, a.peers.num_ranks));
}

template <typename Transport>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) CombineRecvKernel(CombineRecvArgs a) {
  extern __shared__ __align__(16) int smem[];
  CombineRecvPhase<Transport>(a, unsigned(*a.token), LoadPeerTable(a.peers, smem));
}

template <typename Transport>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) CombineKernel(CombineSendArgs send, CombineRecvArgs recv) {
  extern __shared__ __align__(16) int smem[];
  const PeerTable table = LoadPeerTable(send.peers, smem);
  CombineRecvPhase<Transport>(
      recv, CombineSendPhase<Transport>(send, table, AfterPeerTable(smem, send.peers.num_ranks)), table);
}

// Launchers, for a transport. Decode runs alone, so the kernels take every SM
// (a split send overlapped with XLA's work takes fewer: SendBlocks).
// The whole operations are cooperative launches: their receive phase waits
// for every block's send phase, so all blocks must be resident at once (one
// per SM; the launch fails rather than hangs if not).
template <typename Kernel, typename... Args>
cudaError_t LaunchCooperative(Kernel kernel, int grid, size_t shared, cudaStream_t stream, const Args&... args) {
  cudaLaunchAttribute cooperative{};
  cooperative.id = cudaLaunchAttributeCooperative;
  cooperative.val.cooperative = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  config.attrs = &cooperative;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// Blocks of a split send: one per SM, or fewer when it runs beside XLA's work.
inline int SendBlocks(int max_blocks, int device) {
  const int sms = DeviceSmCount(device);
  return max_blocks > 0 ? std::min(max_blocks, sms) : sms;
}

template <typename Transport>
struct LaunchersWith {
  static cudaError_t DispatchSend(const DispatchSendArgs& args, int device, cudaStream_t stream) {
    const int grid = std::max(1, std::min(args.num_tokens, SendBlocks(args.max_blocks, device)));
    const size_t shared =
        PeerTableBytes(args.peers.num_ranks) + DispatchSendSharedBytes(args.num_experts, args.hidden, args.fp8);
    auto kernel = args.fp8 ? DispatchSendKernel<Transport, true> : DispatchSendKernel<Transport, false>;
    kernel<<<grid, kThreads, shared, stream>>>(args);
    return cudaGetLastError();
  }

  static cudaError_t DispatchRecv(const DispatchRecvArgs& args, int device, cudaStream_t stream) {
    const size_t shared =
        PeerTableBytes(args.peers.num_ranks) + DispatchRecvSharedBytes(args.num_local_experts * args.peers.num_ranks);
    auto kernel = args.fp8 ? DispatchRecvKernel<Transport, true> : DispatchRecvKernel<Transport, false>;
    kernel<<<DeviceSmCount(device), kThreads, shared, stream>>>(args);
    return cudaGetLastError();
  }

  static cudaError_t Dispatch(const DispatchSendArgs& send, const DispatchRecvArgs& recv, int device,
                              cudaStream_t stream) {
    const size_t shared = PeerTableBytes(send.peers.num_ranks) +
                          std::max(DispatchSendSharedBytes(send.num_experts, send.hidden, send.fp8),
                                   DispatchRecvSharedBytes(recv.num_local_experts * recv.peers.num_ranks));
    auto kernel = send.fp8 ? DispatchKernel<Transport, true> : DispatchKernel<Transport, false>;
    return LaunchCooperative(kernel, DeviceSmCount(device), shared, stream, send, recv);
  }

  static size_t CombineSendShared(const CombineSendArgs& args) {
    return PeerTableBytes(args.peers.num_ranks) + sizeof(int) * (size_t(args.num_local_experts) + 1 + kScanScratch);
  }

  static cudaError_t CombineSend(const CombineSendArgs& args, int device, cudaStream_t stream) {
    CombineSendKernel<Transport>
        <<<SendBlocks(args.max_blocks, device), kThreads, CombineSendShared(args), stream>>>(args);
    return cudaGetLastError();
  }

  static cudaError_t CombineRecv(const CombineRecvArgs& args, int device, cudaStream_t stream) {
    CombineRecvKernel<Transport>
        <<<DeviceSmCount(device), kThreads, PeerTableBytes(args.peers.num_ranks), stream>>>(args);
    return cudaGetLastError();
  }

  static cudaError_t Combine(const CombineSendArgs& send, const CombineRecvArgs& recv, int device,
                             cudaStream_t stream) {
    return LaunchCooperative(CombineKernel<Transport>, DeviceSmCount(device), CombineSendShared(send), stream, send,
                             recv);
  }

  static const Launchers& Table() {
    static const Launchers table{&DispatchSend, &DispatchRecv, &Dispatch, &CombineSend, &CombineRecv, &Combine};
    return table;
  }
};

}  // namespace

// The NVLink build; low_latency_nvshmem.cu defines this macro and builds the
// NVSHMEM launchers from the templates above instead.
#ifndef DEEP_EP_JAX_LOW_LATENCY_NVSHMEM_BUILD
size_t SharedBytesNeeded(int num_ranks, int num_experts, int hidden, bool fp8) {
  return PeerTableBytes(num_ranks) +
         std::max(DispatchSendSharedBytes(num_experts, hidden, fp8), DispatchRecvSharedBytes(num_experts));
}

const Launchers& NvlinkLaunchers() { return LaunchersWith<NvlinkTransport>::Table(); }

// seq is the next operation's number; flags hold "operation number + 1", so
// after operations [0, seq) every ready and freed flag holds seq.
cudaError_t SetSequenceForTesting(char* region, int seq) {
  Control control;
  cudaError_t err = cudaMemcpy(&control, region, sizeof(control), cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) return err;
  control.seq = seq;
  for (auto& flags : control.ready) {
    for (int& flag : flags) flag = seq;
  }
  for (auto& flags : control.freed) {
    for (int& flag : flags) flag = seq;
  }
  // Each half's last receive, operation seq - 1 or seq - 2, found every rank's rows.
  for (int half = 0; half < 2; ++half) {
    for (int& verdict : control.verdict[half]) verdict = VerdictKey(LastOpOfHalf(unsigned(seq), half));
  }
  return cudaMemcpy(region, &control, sizeof(control), cudaMemcpyHostToDevice);
}

cudaError_t MarkCallRunningForTesting(char* region) {
  const int running = 1;
  return cudaMemcpy(region + offsetof(Control, sending), &running, sizeof(running), cudaMemcpyHostToDevice);
}

namespace {
// One block: LaunchMask's work (see low_latency.h).
__global__ void MaskKernel(char* region, int rank, int num_ranks, const int* set_to, int* mask) {
  Control* control = reinterpret_cast<Control*>(region);
  if (set_to != nullptr) {
    const bool was_out = control->masked[rank] != 0, now_out = set_to[rank] != 0;
    const unsigned seq = unsigned(control->seq);
    for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) {
      const bool was = was_out || control->masked[r] != 0, now = now_out || set_to[r] != 0;
      if (was && !now) {
        // r takes part again: as if it had freed each half's last operation
        // (seq - 1, seq - 2); a flag already there (or past it) stays.
        for (int half = 0; half < 2; ++half) {
          const int freed = int(LastOpOfHalf(seq, half) + 1u);
          if (!SeqReached(control->freed[half][r], freed)) control->freed[half][r] = freed;
        }
      }
    }
    __syncthreads();  // every old entry read before any is replaced
    for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) control->masked[r] = set_to[r] != 0;
    __syncthreads();
  }
  for (int r = threadIdx.x; r < num_ranks; r += blockDim.x) mask[r] = control->masked[r];
}
}  // namespace

cudaError_t LaunchMask(char* region, int rank, int num_ranks, const int* set_to, int* mask, cudaStream_t stream) {
  MaskKernel<<<1, 1024, 0, stream>>>(region, rank, num_ranks, set_to, mask);
  return cudaGetLastError();
}

cudaError_t CopyWaitTimes(char* region, int num_ranks, unsigned long long* host, bool reset) {
  const size_t bytes = size_t(num_ranks) * sizeof(unsigned long long);
  for (int kind = 0; kind < kWaitKinds; ++kind) {
    char* counters = region + offsetof(Control, waited_ns) + size_t(kind) * kMaxGroupRanks * sizeof(unsigned long long);
    const cudaError_t err = reset
                                ? cudaMemset(counters, 0, bytes)
                                : cudaMemcpy(host + size_t(kind) * num_ranks, counters, bytes, cudaMemcpyDeviceToHost);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t CopyMask(const char* region, int num_ranks, int* host) {
  return cudaMemcpy(host, region + offsetof(Control, masked), size_t(num_ranks) * sizeof(int), cudaMemcpyDeviceToHost);
}
#endif  // DEEP_EP_JAX_LOW_LATENCY_NVSHMEM_BUILD

}  // namespace low_latency
}  // namespace deep_ep_jax
