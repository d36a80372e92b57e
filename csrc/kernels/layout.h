// get_dispatch_layout: which ranks and experts each token goes to.
#pragma once

#include <cuda_runtime.h>

#include "common/limits.h"  // kMaxLayoutBins

namespace deep_ep_jax {

// topk_idx int32 [num_tokens, num_topk]; expert e lives on rank
// e / (num_experts / num_ranks); ids outside [0, num_experts) are ignored.
// Writes num_tokens_per_rank [num_ranks] (tokens with >= 1 expert on the rank),
// num_tokens_per_expert [num_experts] ((token, k) pairs per expert) and
// is_token_in_rank [num_tokens, num_ranks]. Only enqueues work on `stream`.
cudaError_t LaunchGetDispatchLayout(const int* topk_idx, int num_tokens, int num_topk, int num_experts, int num_ranks,
                                    int* num_tokens_per_rank, int* num_tokens_per_expert, bool* is_token_in_rank,
                                    cudaStream_t stream);

}  // namespace deep_ep_jax
