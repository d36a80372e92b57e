// Normal-mode (training / prefill) dispatch and combine over NVLink, for one
// process driving all GPUs of an EP group.
//
// Each call is a fixed launch sequence with no host synchronisation:
//   1. notify (one block): advance this device's call sequence number, publish
//      to every peer the device addresses the peers will access (and, for
//      dispatch, this rank's per-destination token counts), wait for theirs.
//   2. move (num_blocks blocks, a warp per token, tokens handed out in chunks
//      by a work counter): dispatch writes each token's row straight to its
//      final row in every destination rank's buffers; combine reads each
//      token's rows from every rank and sums them in rank order. Each block
//      then tells every peer it is done with the peer's memory.
//   3. finish: wait until every peer's blocks are done with this rank's
//      memory, so XLA never reads partial rows nor frees memory a peer reads.
// Staged mode (one process per GPU, or DEEP_EP_JAX_STAGED=1) lands rows in
// the normal region after the control bytes (peers cannot reach XLA's
// buffers), and the move kernels get extra copy-role blocks that overlap the
// local copies with the transfer: dispatch copies each chunk of landed rows to
// XLA's outputs as soon as its sender publishes a chunk record; combine copies
// XLA's x to the staging area in chunks of rows, each with a ready flag that
// the pulling peers wait for. The local rank's own rows skip the staging area.
// Peers meet through flags in the control bytes of DeviceState::normal,
// compared against the sequence number, so consecutive calls (and CUDA-graph
// replays) need no resets.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/call_order.h"
#include "common/limits.h"
#include "common/traffic.h"
#include "runtime/registry.h"

namespace deep_ep_jax {
namespace intranode {

// The normal-mode limits live in common/limits.h; declared here as well so
// that intranode::kMaxBlocks and the like name them too.
using deep_ep_jax::kMaxBlocks;
using deep_ep_jax::kMaxLocalExperts;
using deep_ep_jax::kMaxRowArrays;
using deep_ep_jax::kMaxWarps;

// A rank's buffers that its peers access in one call: where its received rows
// land (dispatch), or where its rows are read from (combine: rows[0] and
// topk_weights). Either XLA's buffers or a staging area in the normal region.
struct RankBuffers {
  char* rows[kMaxRowArrays];
  int* topk_idx;
  float* topk_weights;
  int* src_idx;
};

// Launch knobs, the same on every rank of the group.
struct LaunchConfig {
  int num_blocks;    // SMs of the move kernels
  int num_warps;     // warps per block of the move kernels
  int chunk_tokens;  // consecutive tokens a warp takes from the work counter at a time
  uint64_t timeout_ns;
  bool staged;                 // land rows in the normal region and copy them locally (fallback)
  CallOrder order;             // this call's place among the Buffer's calls (per call, not a knob)
  bool count_traffic = false;  // add to the traffic counters (common/traffic.h)
};

struct DispatchParams {
  // Inputs, per token: row arrays (row_bytes 0 when absent), routing.
  const char* x[kMaxRowArrays];
  int64_t row_bytes[kMaxRowArrays];
  const int* topk_idx;        // [T, K] global expert ids, -1 for none
  const float* topk_weights;  // [T, K]
  int num_tokens, num_topk, num_experts, num_worst_tokens;
  // Token-side outputs.
  bool* is_token_in_rank;    // [T, R]
  int* num_tokens_per_rank;  // [R]
  int* rank_prefix_matrix;   // [R, R], inclusive over source ranks
  int* send_pos;             // [T, R]
  // Receive-side outputs (N = num_worst_tokens rows).
  RankBuffers recv;  // recv_x (+ scales), recv_topk_idx, recv_topk_weights, recv_src_idx
  int* recv_src_rank;
  int* num_recv_tokens;
  int* num_recv_tokens_per_expert;  // [E / R]
  int* num_dropped_tokens;
};

struct CachedDispatchParams {
  const char* x[kMaxRowArrays];
  int64_t row_bytes[kMaxRowArrays];
  const float* topk_weights;   // [T, K] or null
  const int* send_pos;         // [T, R] from the handle
  const int* num_recv_tokens;  // [] from the handle
  int num_tokens, num_topk, num_worst_tokens;
  RankBuffers recv;  // rows and topk_weights
};

struct CombineParams {
  const uint16_t* x;              // bf16 [N, H]
  const float* topk_weights;      // [N, K] or null
  const int* send_pos;            // [T, R]
  const int* num_recv_tokens;     // [] rows of x that are valid (from the handle)
  const int* rank_prefix_matrix;  // [R, R] from the handle (staged: which rows each source pulls)
  int num_tokens, hidden, num_topk, num_worst_tokens;
  uint16_t* out;       // bf16 [T, H]
  float* out_weights;  // [T, K] or null
};

// Chunks of chunk_tokens tokens a dispatch hands out (staged: a record each per source).
__host__ __device__ inline int64_t NumChunks(int64_t num_tokens, int64_t chunk_tokens) {
  return (num_tokens + chunk_tokens - 1) / chunk_tokens;
}

// Bytes of the normal region (control included) that a staged call needs:
// num_rows rows of each row array, then [num_rows, num_topk] ids and weights
// and [num_rows] source indices, then the copy role's synchronisation:
// [num_ranks][num_chunks] chunk records of 16 bytes (dispatch: num_chunks =
// NumChunks(tokens, chunk_tokens); 0 for combine) and, per kStagedCopyRows
// rows, num_ranks int flags, one per source (combine).
constexpr int kStagedCopyRows = 32;
size_t StagedRegionBytes(int64_t num_rows, const int64_t row_bytes[kMaxRowArrays], int num_topk, int64_t num_chunks,
                         int num_ranks);

// Test hook (_C.set_sequence_for_testing): rewrites `region`'s control block
// as if `seq` calls had run (the sequence number, and every flag that holds
// one), so a test can start just below a wrap. The region's device and every
// peer must be idle. Blocking (cudaMemcpy).
cudaError_t SetSequenceForTesting(char* region, int seq);
// Test hook (_C.mark_call_running_for_testing): marks `region` as if a call
// were running on its device, so the next call stops as overlapping. Blocking.
cudaError_t MarkCallRunningForTesting(char* region);

// Only enqueue work on `stream`.
cudaError_t LaunchDispatch(const DeviceState& state, const DispatchParams& p, const LaunchConfig& config,
                           cudaStream_t stream);
cudaError_t LaunchCachedDispatch(const DeviceState& state, const CachedDispatchParams& p, const LaunchConfig& config,
                                 cudaStream_t stream);
cudaError_t LaunchCombine(const DeviceState& state, const CombineParams& p, const LaunchConfig& config,
                          cudaStream_t stream);

}  // namespace intranode
}  // namespace deep_ep_jax
