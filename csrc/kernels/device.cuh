// Device helpers shared by every kernel family, each written once: the
// memory accesses with their PTX qualifiers (volatile, acquire and release
// at system scope, loads that skip L1), spin-waits that fail loudly (rank,
// mode, counter) instead of hanging, the strided copies, block-wide counting
// and scans, and bf16 sums in float32. Kernel files keep only what one
// family needs.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstdio>

#include "common/call_order.h"
#include "common/limits.h"

// Ends every message printed before a __trap(): the trap loses this process's
// CUDA context, so the message says what to do (a string literal, for printf).
#define DEEP_EP_JAX_TRAP_NOTE \
  " [deep_ep_jax: this process's CUDA context is lost; restart it (docs/multiprocess.md, \"When a process dies\")]\n"

namespace deep_ep_jax {

constexpr int kWarpSize = 32;

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---------------------------------------------------------------------------
// Memory accesses. Peers meet through flags in NVLink-mapped (or NVSHMEM)
// memory: acquire/release at system scope order the data around a flag.

__device__ __forceinline__ int LoadAcquireSys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseSys(int* p, int v) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The same for 64-bit words (the pipelined kernels' tails: sequence number and count in one).
__device__ __forceinline__ uint64_t LoadAcquireSys64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseSys64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Values peers (or earlier kernels) wrote, read around the incoherent L1,
// with no ordering: sequence numbers, counts behind an acquired flag.
__device__ __forceinline__ int LoadVolatile(const int* p) {
  int v;
  asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// The same for a struct of 8-byte words (published pointers), word by word.
template <typename T>
__device__ __forceinline__ T LoadVolatileWords(const T* p) {
  static_assert(sizeof(T) % sizeof(uint64_t) == 0, "LoadVolatileWords reads whole 8-byte words");
  T value;
  const uint64_t* src = reinterpret_cast<const uint64_t*>(p);
  uint64_t* dst = reinterpret_cast<uint64_t*>(&value);
#pragma unroll
  for (int i = 0; i < int(sizeof(T) / sizeof(uint64_t)); ++i) {
    asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(dst[i]) : "l"(src + i));
  }
  return value;
}

// Rows peers write while the kernel runs: coherent loads (the read-only path
// is not coherent) that do not allocate in L1.
__device__ __forceinline__ int4 LoadNoAllocate(const int4* p) {
  int4 v;
  asm volatile("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ int LoadNoAllocate(const int* p) {
  int v;
  asm volatile("ld.global.L1::no_allocate.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// Inputs never written while the kernel runs: read-only path, no L1 allocation.
__device__ __forceinline__ int4 LoadStreaming(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ int LoadStreaming(const int* p) {
  int v;
  asm volatile("ld.global.nc.L1::no_allocate.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// ---------------------------------------------------------------------------
// Sequence numbers. Each mode counts its calls in 32 bits, which wrap after
// 2^32 calls (2^31 as signed int): increments are unsigned, and a flag has
// reached a target when it is at most 2^31 - 1 calls past it, so comparisons
// hold across the wrap. A flag reset for a call must hold a value before the
// call's number (its predecessor, PreviousSeq), never a fixed 0, which would
// read as reached once the numbers pass 2^31.

__device__ __forceinline__ bool SeqReached(int value, int target) {
  return int(unsigned(value) - unsigned(target)) >= 0;
}

__device__ __forceinline__ int NextSeq(int seq) { return int(unsigned(seq) + 1u); }

__device__ __forceinline__ int PreviousSeq(int seq) { return int(unsigned(seq) - 1u); }

// Spins until *flag has reached target (SeqReached: wrap-safe *flag >=
// target). After timeout_ns prints what it waited for and traps, so the XLA
// call fails with an error instead of hanging.
__device__ __forceinline__ void WaitAtLeast(const int* flag, int target, uint64_t timeout_ns, const char* mode,
                                            const char* counter, int rank, int peer, int channel) {
  if (SeqReached(LoadAcquireSys(flag), target)) return;
  const uint64_t start = GlobalTimerNs();
  while (!SeqReached(LoadAcquireSys(flag), target)) {
    if (GlobalTimerNs() - start > timeout_ns) {
      printf(
          "deep_ep_jax timeout: %s rank %d waited %.1f s for %s from peer %d (channel %d): "
          "value %d, expected >= %d" DEEP_EP_JAX_TRAP_NOTE,
          mode, rank, timeout_ns * 1e-9, counter, peer, channel, LoadAcquireSys(flag), target);
      __trap();
    }
  }
}

// Peers meet by block index (done flags per block), so every rank must launch
// the same grid; each publishes its count with its ready flag and checks its
// peers' here, after acquiring their flag. A mismatch (another
// Config.num_sms in another process, GPUs with different SM counts, MIG
// slices) prints both counts and ranks and traps, as a timeout does, instead
// of hanging or racing.
__device__ __forceinline__ void CheckPeerLaunch(int mine, int theirs, const char* mode, const char* what, int rank,
                                                int peer) {
  if (theirs == mine) return;
  printf(
      "deep_ep_jax launch mismatch: %s rank %d launched %d %s, peer %d launched %d; every rank must launch the "
      "same (equal Config.num_sms on every process, GPUs with equal SM counts)" DEEP_EP_JAX_TRAP_NOTE,
      mode, rank, mine, what, peer, theirs);
  __trap();
}

// ---------------------------------------------------------------------------
// Calls of one Buffer (common/call_order.h): one at a time on each device, at
// the same position of the chain on every rank. Both checks print what they
// found and trap, as a timeout does.

__device__ __forceinline__ const char* CallKindName(int kind) {
  switch (kind) {
    case kDispatchCall:
      return "dispatch";
    case kCachedDispatchCall:
      return "cached_dispatch";
    case kCombineCall:
      return "combine";
    case kLowLatencyDispatchCall:
      return "low-latency dispatch";
    case kLowLatencyCombineCall:
      return "low-latency combine";
    default:
      return "unknown call";
  }
}

// By the one thread of the call that publishes its tag: takes the call's
// position, writes the next one to XLA's result, returns the tag.
// Without an order (an overlapped low-latency send, which runs beside XLA's
// stream and must not touch XLA's buffers) the tag names the kind only.
__device__ __forceinline__ int TakeCallTag(const CallOrder& order, int kind) {
  if (order.position == nullptr) return kind;
  const int position = *order.position;
  *order.next_position = position + 1;
  return position * kNumCallKinds + kind;
}

// A peer's tag against this rank's, once the peer's flag for this call (its
// sequence number) has been acquired.
__device__ __forceinline__ void CheckPeerCall(int mine, int theirs, int rank, int peer) {
  if (theirs == mine) return;
  printf(
      "deep_ep_jax call order mismatch: rank %d is at call %d (%s) of its program on this Buffer, peer %d at "
      "call %d (%s): the ranks ran the Buffer's calls in different orders (see docs/design.md, \"Calls of one "
      "Buffer\")" DEEP_EP_JAX_TRAP_NOTE,
      rank, mine / kNumCallKinds, CallKindName(mine % kNumCallKinds), peer, theirs / kNumCallKinds,
      CallKindName(theirs % kNumCallKinds));
  __trap();
}

// First and last thing of a call on this device (one thread each): *active
// is 1 while a call of the Buffer runs here.
__device__ __forceinline__ void EnterCall(int* active, int kind, int rank) {
  if (atomicExch(active, 1) == 0) return;
  printf(
      "deep_ep_jax overlapping calls: a %s entered on rank %d while another call of the same Buffer was still "
      "running there; calls of one Buffer must run one at a time (see docs/design.md, \"Calls of one "
      "Buffer\")" DEEP_EP_JAX_TRAP_NOTE,
      CallKindName(kind), rank);
  __trap();
}

__device__ __forceinline__ void LeaveCall(int* active) { atomicExch(active, 0); }

// Before a warp's NVSHMEM put (nvshmemx_*_warp) of bytes its lanes have just
// written to the send area, by every lane. The transport reads that source
// after the put is posted: the NIC by DMA from GPU memory (IBGDA, or the
// proxy thread's post), NVSHMEM's peer-to-peer path by the warp's own loads.
// Both read GPU memory at GPU scope, so GPU scope is what the stores need:
// NVSHMEM itself fences a put's source at GPU scope, and at system scope only
// when the source is in host memory (the send area is in the symmetric heap,
// GPU memory). A fence orders only the calling thread's stores, hence every
// lane fences before __syncwarp hands over to the lane that posts the put. A
// system fence would also wait for the warp's earlier NVLink stores to drain.
// Visibility at the target comes later: nvshmem_quiet, then the flag.
__device__ __forceinline__ void FenceStagedForWarpPut() {
  __threadfence();
  __syncwarp();
}

// ---------------------------------------------------------------------------
// Copies.

// How StridedCopy reads a vector: a plain load (the default), or
// LoadNoAllocate for rows peers write while the kernel runs.
struct PlainLoad {
  template <typename Vec>
  __device__ __forceinline__ Vec operator()(const Vec* p) const {
    return *p;
  }
};

struct NoAllocateLoad {
  template <typename Vec>
  __device__ __forceinline__ Vec operator()(const Vec* p) const {
    return LoadNoAllocate(p);
  }
};

// This thread's share of a copy of n vectors by `stride` threads: src[i] ->
// dst[i] for i = first, first + stride, ... kUnroll loads go out before their
// stores, to keep several transfers in flight per thread. `load` reads one
// vector (staged copies pass coherent loads that do not allocate in L1).
template <int kUnroll, typename Index, typename Vec, typename Load = PlainLoad>
__device__ __forceinline__ void StridedCopy(Vec* dst, const Vec* src, Index n, int first, int stride, Load load = {}) {
  for (Index base = first; base < n; base += Index(stride) * kUnroll) {
    Vec v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const Index i = base + Index(u) * stride;
      if (i < n) v[u] = load(src + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const Index i = base + Index(u) * stride;
      if (i < n) dst[i] = v[u];
    }
  }
}

// StridedCopy of num_bytes (a multiple of 4): 16-byte vectors when both
// pointers and the size allow it, else 4-byte words (rows of FP8 scales or
// top-k entries may be multiples of 4 bytes only).
template <int kUnroll, typename Load = PlainLoad>
__device__ __forceinline__ void StridedCopyBytes(void* dst, const void* src, int64_t num_bytes, int first, int stride,
                                                 Load load = {}) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | uintptr_t(num_bytes);
  if (bits % sizeof(int4) == 0) {
    StridedCopy<kUnroll>(static_cast<int4*>(dst), static_cast<const int4*>(src), num_bytes / int64_t(sizeof(int4)),
                         first, stride, load);
  } else {
    StridedCopy<kUnroll>(static_cast<int*>(dst), static_cast<const int*>(src), num_bytes / int64_t(sizeof(int)), first,
                         stride, load);
  }
}

// ---------------------------------------------------------------------------
// Routing.

// Bit r is set when the token has an expert on rank r (r < 32: groups of
// up to 32 ranks only).
__device__ __forceinline__ uint32_t TokenRankMask(const int* topk, int num_topk, int num_experts,
                                                  int experts_per_rank) {
  uint32_t mask = 0;
  for (int k = 0; k < num_topk; ++k) {
    const int e = topk[k];
    if (e >= 0 && e < num_experts) mask |= 1u << (e / experts_per_rank);
  }
  return mask;
}

// A row of a handle's send positions (send_pos: the token's row at a rank,
// -1 for none). A hand-made handle may hold any int: rows outside [0,
// num_rows) count as not sent, so no kernel writes or reads out of bounds.
__device__ __forceinline__ int HandleRow(int pos, int num_rows) { return pos < num_rows ? pos : -1; }

// ---------------------------------------------------------------------------
// Block-wide counting and scans.

// counts[e] = how many ids equal e, for e in [0, num_bins), over the first
// *num_rows rows of ids_per_row ids (other ids are skipped), by the whole
// block; bins: num_bins ints of shared memory. The finish kernels' rows per
// local expert, from the landed top-k ids.
__device__ __forceinline__ void BlockBincount(const int* ids, const int* num_rows, int ids_per_row, int num_bins,
                                              int* bins, int* counts) {
  for (int e = threadIdx.x; e < num_bins; e += blockDim.x) bins[e] = 0;
  __syncthreads();
  const int64_t n = int64_t(*num_rows) * ids_per_row;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int e = ids[i];
    if (e >= 0 && e < num_bins) atomicAdd(&bins[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_bins; e += blockDim.x) counts[e] = bins[e];
}

// Exclusive prefix sum over the block's threads, in thread order, of each of
// the first num_counters counters in `values`; the block totals land in
// `totals`. warp_sums: kWarpSize * kCounters ints of shared memory, totals:
// kCounters. A caller that reuses warp_sums right after must __syncthreads()
// first.
template <int kCounters>
__device__ __forceinline__ void BlockExclusiveScan(int (&values)[kCounters], int num_counters, int* warp_sums,
                                                   int* totals) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  int inclusive[kCounters];
#pragma unroll
  for (int r = 0; r < kCounters; ++r) {
    int x = r < num_counters ? values[r] : 0;
#pragma unroll
    for (int d = 1; d < kWarpSize; d <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, d);
      if (lane >= d) x += y;
    }
    inclusive[r] = x;
    if (lane == kWarpSize - 1) warp_sums[warp * kCounters + r] = x;
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int r = 0; r < kCounters; ++r) {
      const int own = lane < num_warps ? warp_sums[lane * kCounters + r] : 0;
      int x = own;
#pragma unroll
      for (int d = 1; d < kWarpSize; d <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, d);
        if (lane >= d) x += y;
      }
      if (lane < num_warps) warp_sums[lane * kCounters + r] = x - own;
      if (lane == kWarpSize - 1) totals[r] = x;
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kCounters; ++r) {
    if (r < num_counters) values[r] = inclusive[r] - values[r] + warp_sums[warp * kCounters + r];
  }
}

// ---------------------------------------------------------------------------
// FP8 and float maths as XLA computes them for the reference (bit-exact results).

constexpr float kFp8Max = 448.0f;
// XLA rewrites amax / 448 as amax * (1 / 448): a constant divisor becomes a
// multiply by its float32 reciprocal.
constexpr float kInvFp8Max = 1.0f / kFp8Max;

// XLA lowers float32 division to div.full.f32 (-nvptx-prec-divf32=1): up to
// 2 ulp off, not correctly rounded.
__device__ __forceinline__ float DivFull(float a, float b) {
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// ---------------------------------------------------------------------------
// bf16 sums in float32.

// Accumulates 8 bf16 in float; unpacks 8 bf16 to floats; packs 8 floats back to bf16 (round to nearest even).
__device__ __forceinline__ void AddBf16x8(float (&acc)[8], const int4& v) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(pairs[j]);
    acc[2 * j] += f.x;
    acc[2 * j + 1] += f.y;
  }
}

__device__ __forceinline__ void UnpackBf16x8(const int4& v, float (&f)[8]) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 two = __bfloat1622float2(pairs[j]);
    f[2 * j] = two.x;
    f[2 * j + 1] = two.y;
  }
}

__device__ __forceinline__ int4 PackBf16x8(const float (&acc)[8]) {
  int4 v;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) pairs[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
  return v;
}

}  // namespace deep_ep_jax
