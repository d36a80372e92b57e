// Expert-major rows: the layout (counts, aligned offsets, each pair's row),
// the copy of rows into it, and the weighted reduction back per token row.
// Bit-identical to deep_ep_jax/backends/reference_expert_major.py: positions
// are integers placed in a fixed order, sums run over k in order with the
// multiply and the add rounded separately. The rows' FP8 transposed gather is
// in fp8_quant.cu.
#include <algorithm>
#include <cstdint>

#include "kernels/device.cuh"
#include "kernels/expert_major.h"

namespace deep_ep_jax {
namespace {

constexpr int kCountThreads = 256;
constexpr int kCountMaxBlocks = 264;
constexpr int kPlaceThreads = 512;
constexpr int kPlaceItems = 8;  // consecutive pairs per thread and scan
constexpr int kExpandThreads = 256;
constexpr int kReduceThreads = 128;
constexpr int kMaxGridBlocks = 1 << 16;  // grid-stride loops cover the rest

// Pairs per local expert: shared-memory histograms, then one atomic per
// non-empty bin into the zeroed counts (integer sums: any order gives the same).
__global__ void __launch_bounds__(kCountThreads)
    CountPairsKernel(const int* __restrict__ topk_idx, int64_t num_pairs, int num_local_experts,
                     int* __restrict__ pair_counts) {
  extern __shared__ int bins[];  // [num_local_experts]
  for (int e = threadIdx.x; e < num_local_experts; e += blockDim.x) bins[e] = 0;
  __syncthreads();
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < num_pairs; p += stride) {
    const int e = topk_idx[p];
    if (e >= 0 && e < num_local_experts) atomicAdd(&bins[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_local_experts; e += blockDim.x) {
    if (bins[e] != 0) atomicAdd(&pair_counts[e], bins[e]);
  }
}

// Sum over the block's threads; scratch: kWarpSize int64 of shared memory.
__device__ __forceinline__ int64_t BlockSum(int64_t value, int64_t* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  for (int d = kWarpSize / 2; d > 0; d /= 2) value += __shfl_down_sync(0xffffffffu, value, d);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < int(blockDim.x / kWarpSize) ? scratch[lane] : 0;
    for (int d = kWarpSize / 2; d > 0; d /= 2) value += __shfl_down_sync(0xffffffffu, value, d);
    if (lane == 0) scratch[0] = value;
  }
  __syncthreads();
  const int64_t total = scratch[0];
  __syncthreads();  // scratch may be reused
  return total;
}

// One block per local expert e: its group's offset from the counts before
// it, then its pairs in p order, numbered by block-wide prefix sums over
// chunks of kPlaceThreads * kPlaceItems pairs.
__global__ void __launch_bounds__(kPlaceThreads)
    PlacePairsKernel(const int* __restrict__ topk_idx, int64_t num_pairs, int64_t alignment, int num_rows,
                     const int* __restrict__ pair_counts, int* __restrict__ group_sizes,
                     int* __restrict__ group_offsets, int* __restrict__ pair_row, int* __restrict__ row_pair,
                     int* __restrict__ num_dropped) {
  __shared__ int64_t sum_scratch[kWarpSize];
  __shared__ int warp_sums[kWarpSize];
  __shared__ int chunk_total[1];
  const int e = blockIdx.x;

  int64_t aligned_before = 0;
  for (int i = threadIdx.x; i < e; i += blockDim.x) {
    aligned_before += (int64_t(pair_counts[i]) + alignment - 1) / alignment * alignment;
  }
  const int64_t offset = BlockSum(aligned_before, sum_scratch);
  const int count = pair_counts[e];
  const int start = int(offset < num_rows ? offset : num_rows);
  const int size = int(std::min<int64_t>(count, num_rows - start));
  if (threadIdx.x == 0) {
    group_offsets[e] = start;
    group_sizes[e] = size;
    if (count > size) atomicAdd(num_dropped, count - size);
  }

  int placed = 0;  // pairs of e numbered so far, the same in every thread
  const int64_t chunk = int64_t(blockDim.x) * kPlaceItems;
  for (int64_t base = 0; base < num_pairs && placed < size; base += chunk) {
    const int64_t first = base + int64_t(threadIdx.x) * kPlaceItems;
    int ids[kPlaceItems];
    int position[1] = {0};
#pragma unroll
    for (int i = 0; i < kPlaceItems; ++i) {
      ids[i] = first + i < num_pairs ? topk_idx[first + i] : -1;
      position[0] += ids[i] == e;
    }
    const int matches = position[0];
    BlockExclusiveScan<1>(position, 1, warp_sums, chunk_total);
    if (matches != 0) {
      int pos = placed + position[0];
#pragma unroll
      for (int i = 0; i < kPlaceItems; ++i) {
        if (ids[i] != e) continue;
        if (pos < size) {
          pair_row[first + i] = start + pos;
          row_pair[start + pos] = int(first + i);
        }
        ++pos;
      }
    }
    placed += chunk_total[0];
    __syncthreads();  // the next scan rewrites warp_sums and chunk_total
  }
}

// Zeroes num_bytes (a multiple of 4), this thread's share of `stride` threads.
__device__ __forceinline__ void StridedZero(void* dst, int64_t num_bytes, int first, int stride) {
  if ((reinterpret_cast<uintptr_t>(dst) | uintptr_t(num_bytes)) % sizeof(int4) == 0) {
    int4* d = static_cast<int4*>(dst);
    for (int64_t i = first; i < num_bytes / int64_t(sizeof(int4)); i += stride) d[i] = make_int4(0, 0, 0, 0);
  } else {
    int* d = static_cast<int*>(dst);
    for (int64_t i = first; i < num_bytes / int64_t(sizeof(int)); i += stride) d[i] = 0;
  }
}

// One warp per expert-major row: the pair's token row, or zeros.
__global__ void __launch_bounds__(kExpandThreads)
    ExpandRowsKernel(ExpandArrays arrays, const int* __restrict__ row_pair, int num_rows, int num_src_rows,
                     int num_topk) {
  const int lane = threadIdx.x % kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  for (int64_t row = int64_t(blockIdx.x) * warps + threadIdx.x / kWarpSize; row < num_rows;
       row += int64_t(gridDim.x) * warps) {
    const int pair = row_pair[row];
    const int64_t token = pair >= 0 ? pair / num_topk : -1;
    const bool used = token >= 0 && token < num_src_rows;
#pragma unroll
    for (int a = 0; a < kMaxRowArrays; ++a) {
      const int64_t bytes = arrays.row_bytes[a];
      if (bytes == 0) continue;
      char* dst = arrays.dst[a] + row * bytes;
      if (used) {
        StridedCopyBytes<4>(dst, arrays.src[a] + token * bytes, bytes, lane, kWarpSize);
      } else {
        StridedZero(dst, bytes, lane, kWarpSize);
      }
    }
  }
}

// One block per token row (grid-stride), one thread per 8 channels: the sum
// over k in order, each product rounded before its add, as the reference.
template <bool kWeighted>
__global__ void __launch_bounds__(kReduceThreads)
    ReduceRowsKernel(const int4* __restrict__ expert_y, int num_rows, const float* __restrict__ weights,
                     const int* __restrict__ pair_row, int num_tokens, int num_topk, int vectors_per_row,
                     int4* __restrict__ out) {
  for (int64_t n = blockIdx.x; n < num_tokens; n += gridDim.x) {
    const int* rows = pair_row + n * num_topk;
    for (int v = threadIdx.x; v < vectors_per_row; v += blockDim.x) {
      float acc[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
      for (int k = 0; k < num_topk; ++k) {
        const int row = rows[k];
        if (row < 0 || row >= num_rows) continue;
        const int4 y = expert_y[int64_t(row) * vectors_per_row + v];  // one 16-byte load
        float f[8];
        UnpackBf16x8(y, f);
        if constexpr (kWeighted) {
          const float w = weights[n * num_topk + k];
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(w, f[j]));
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], f[j]);
        }
      }
      out[n * vectors_per_row + v] = PackBf16x8(acc);
    }
  }
}

int GridBlocks(int64_t items, int64_t per_block, int64_t max_blocks) {
  return int(std::max<int64_t>(1, std::min<int64_t>((items + per_block - 1) / per_block, max_blocks)));
}

}  // namespace

cudaError_t LaunchExpertLayout(const int* topk_idx, int64_t num_pairs, int num_local_experts, int64_t alignment,
                               int num_rows, int* pair_counts, int* group_sizes, int* group_offsets, int* pair_row,
                               int* row_pair, int* num_dropped, cudaStream_t stream) {
  // Zero counts; every pair and row -1 (all bytes 0xff) until placed.
  cudaError_t err = cudaMemsetAsync(pair_counts, 0, sizeof(int) * size_t(num_local_experts), stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(num_dropped, 0, sizeof(int), stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(pair_row, 0xff, sizeof(int) * size_t(num_pairs), stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(row_pair, 0xff, sizeof(int) * size_t(num_rows), stream);
  if (err != cudaSuccess) return err;
  if (num_pairs > 0) {
    CountPairsKernel<<<GridBlocks(num_pairs, kCountThreads, kCountMaxBlocks), kCountThreads,
                       sizeof(int) * size_t(num_local_experts), stream>>>(topk_idx, num_pairs, num_local_experts,
                                                                          pair_counts);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  PlacePairsKernel<<<num_local_experts, kPlaceThreads, 0, stream>>>(topk_idx, num_pairs, alignment, num_rows,
                                                                    pair_counts, group_sizes, group_offsets, pair_row,
                                                                    row_pair, num_dropped);
  return cudaGetLastError();
}

cudaError_t LaunchExpandRows(const ExpandArrays& arrays, const int* row_pair, int num_rows, int num_src_rows,
                             int num_topk, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  const int warps = kExpandThreads / kWarpSize;
  ExpandRowsKernel<<<GridBlocks(num_rows, warps, kMaxGridBlocks), kExpandThreads, 0, stream>>>(
      arrays, row_pair, num_rows, num_src_rows, num_topk);
  return cudaGetLastError();
}

cudaError_t LaunchReduceRows(const __nv_bfloat16* expert_y, int num_rows, const float* weights, const int* pair_row,
                             int num_tokens, int num_topk, int hidden, __nv_bfloat16* out, cudaStream_t stream) {
  if (num_tokens == 0 || hidden == 0) return cudaSuccess;
  const int blocks = GridBlocks(num_tokens, 1, kMaxGridBlocks);
  const int vectors_per_row = hidden / 8;
  const int4* y = reinterpret_cast<const int4*>(expert_y);
  int4* o = reinterpret_cast<int4*>(out);
  if (weights != nullptr) {
    ReduceRowsKernel<true><<<blocks, kReduceThreads, 0, stream>>>(y, num_rows, weights, pair_row, num_tokens, num_topk,
                                                                  vectors_per_row, o);
  } else {
    ReduceRowsKernel<false><<<blocks, kReduceThreads, 0, stream>>>(y, num_rows, nullptr, pair_row, num_tokens, num_topk,
                                                                   vectors_per_row, o);
  }
  return cudaGetLastError();
}

}  // namespace deep_ep_jax
