// get_dispatch_layout. Each block counts its tiles of tokens into shared-memory
// histograms, then adds them to the zeroed outputs with one atomic per
// non-empty bin. Integer sums do not depend on the order of the atomics, so
// the results are deterministic.
#include <algorithm>
#include <cstdint>

#include "kernels/layout.h"

namespace deep_ep_jax {
namespace {

constexpr int kThreads = 256;
constexpr int kTokensPerTile = 128;
constexpr int kMaxGridBlocks = 264;  // two waves' worth on an H100/H200 is plenty for T <= 64k

__device__ __forceinline__ bool IsValidExpert(int expert, int num_experts) {
  return expert >= 0 && expert < num_experts;
}

__global__ void __launch_bounds__(kThreads)
    GetDispatchLayoutKernel(const int* __restrict__ topk_idx, int num_tokens, int num_topk, int num_experts,
                            int num_ranks, int* __restrict__ num_tokens_per_rank,
                            int* __restrict__ num_tokens_per_expert, bool* __restrict__ is_token_in_rank) {
  extern __shared__ int bins[];  // [num_experts] (token, k) pairs per expert, then [num_ranks] tokens per rank
  int* expert_bins = bins;
  int* rank_bins = bins + num_experts;
  const int num_bins = num_experts + num_ranks;
  for (int i = threadIdx.x; i < num_bins; i += blockDim.x) bins[i] = 0;
  __syncthreads();

  const int experts_per_rank = num_experts / num_ranks;
  for (int64_t first = int64_t(blockIdx.x) * kTokensPerTile; first < num_tokens;
       first += int64_t(gridDim.x) * kTokensPerTile) {
    const int64_t last = first + kTokensPerTile < num_tokens ? first + kTokensPerTile : num_tokens;

    for (int64_t i = first * num_topk + threadIdx.x; i < last * num_topk; i += blockDim.x) {
      const int expert = topk_idx[i];
      if (IsValidExpert(expert, num_experts)) atomicAdd(&expert_bins[expert], 1);
    }

    // One thread per (token, rank): consecutive threads write consecutive bools.
    for (int64_t i = first * num_ranks + threadIdx.x; i < last * num_ranks; i += blockDim.x) {
      const int64_t token = i / num_ranks;
      const int rank = int(i - token * num_ranks);
      const int* row = topk_idx + token * num_topk;
      bool in_rank = false;
      for (int k = 0; k < num_topk; ++k) {
        const int expert = row[k];
        in_rank |= IsValidExpert(expert, num_experts) && expert / experts_per_rank == rank;
      }
      is_token_in_rank[i] = in_rank;
      if (in_rank) atomicAdd(&rank_bins[rank], 1);
    }
  }
  __syncthreads();

  for (int i = threadIdx.x; i < num_bins; i += blockDim.x) {
    if (bins[i] == 0) continue;
    int* out = i < num_experts ? &num_tokens_per_expert[i] : &num_tokens_per_rank[i - num_experts];
    atomicAdd(out, bins[i]);
  }
}

}  // namespace

cudaError_t LaunchGetDispatchLayout(const int* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                                    int* num_tokens_per_rank, int* num_tokens_per_expert, bool* is_token_in_rank,
                                    cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(num_tokens_per_rank, 0, sizeof(int) * num_ranks, stream);
  if (err != cudaSuccess) return err;
  err = cudaMemsetAsync(num_tokens_per_expert, 0, sizeof(int) * num_experts, stream);
  if (err != cudaSuccess || num_tokens == 0) return err;

  const int num_blocks =
      int(std::min<int64_t>((int64_t(num_tokens) + kTokensPerTile - 1) / kTokensPerTile, kMaxGridBlocks));
  const size_t shared_bytes = sizeof(int) * size_t(num_experts + num_ranks);
  GetDispatchLayoutKernel<<<num_blocks, kThreads, shared_bytes, stream>>>(topk_idx, num_tokens, num_topk, num_experts,
                                                                          num_ranks, num_tokens_per_rank,
                                                                          num_tokens_per_expert, is_token_in_rank);
  return cudaGetLastError();
}

}  // namespace deep_ep_jax
