// What the XLA FFI handlers share: one way to check a call and report what
// is wrong, and the checks of the arrays several targets take.
//
// Checking style: each check returns an ffi::Error (Success, or
// InvalidArgument "<target>: <what>"), built only on failure, and the handler
// returns the first failure (DEEP_EP_JAX_RETURN_IF_ERROR, or `return
// Invalid(...)` after a failed condition). A kernel launch's status comes back
// through Launched.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "common/call_order.h"
#include "common/limits.h"
#include "ffi/registration.h"
#include "runtime/registry.h"

namespace deep_ep_jax {

using Dims = ffi::Span<const int64_t>;

inline std::string Str(int64_t v) { return std::to_string(v); }
std::string ShapeString(Dims dims);  // "[2, 3]"
bool IsShape(Dims dims, std::initializer_list<int64_t> want);

// InvalidArgument "fn: what".
ffi::Error Invalid(const char* fn, const std::string& what);
// Invalid "fn: name must have shape [..], got [..]" unless dims is want.
ffi::Error ExpectShape(const char* fn, const char* name, Dims dims, std::initializer_list<int64_t> want);
// Success, or Internal "fn: launch failed: <CUDA error>".
ffi::Error Launched(const char* fn, cudaError_t err);

// The buffer's state on this device (*state), or Invalid when it has none.
ffi::Error FindBuffer(const char* fn, int64_t buffer_id, int device, const DeviceState** state);
// The order state's operand and result as int32 [1], as the kernels' CallOrder.
ffi::Error CheckCallOrder(const char* fn, ffi::Buffer<ffi::S32> order, ffi::Result<ffi::Buffer<ffi::S32>> order_out,
                          CallOrder* call);
// Success if other GPUs can read `ptr` (an XLA buffer the peers of a
// direct-mode call read in place), or Invalid naming `what`: XLA keeps the
// constants of a program in module memory, which other GPUs cannot map.
ffi::Error CheckPeersCanRead(const char* fn, const char* what, const void* ptr);
// Normal mode's launch knobs against the kernels' bounds.
ffi::Error CheckLaunchKnobs(const char* fn, int64_t num_sms, int max_blocks, int64_t num_warps, int max_warps,
                            int64_t timeout_ns);
// num_experts: a positive multiple of the ranks, at most max_per_rank on each
// rank and max_total in all (the kernels' shared-memory histograms).
ffi::Error CheckNumExperts(const char* fn, int64_t num_experts, int64_t num_ranks, int64_t max_per_rank,
                           int64_t max_total);

}  // namespace deep_ep_jax

// Returns from the enclosing handler the error of `expr` if it failed.
#define DEEP_EP_JAX_RETURN_IF_ERROR(expr)                                   \
  do {                                                                      \
    if (::xla::ffi::Error error_ = (expr); error_.failure()) return error_; \
  } while (0)

namespace deep_ep_jax {

// Normal mode: the checks both paths make of the parts they share, so a
// handler never launches on shapes its kernels cannot index (each path then
// checks its own arrays and its region). Row arrays: x bf16 [rows, H] (H % 8
// == 0: 16-byte rows) or FP8 e4m3 [rows, H] (H % 128 == 0) with x_scales
// float32 [rows, H / 128] ([rows, 0] for bf16).
struct NormalShapes {
  int64_t num_tokens;  // T
  int64_t num_rows;    // N, the received rows
  int64_t num_topk;    // K (0 when no weights travel)
  int64_t hidden;      // H
};
// Row arrays as pointers and bytes per row (0 when absent).
struct RowArrays {
  const char* data[kMaxRowArrays];
  int64_t row_bytes[kMaxRowArrays];
};
// Into a kernel's parameters.
inline void SetRowArrays(const RowArrays& rows, const char* (&data)[kMaxRowArrays],
                         int64_t (&row_bytes)[kMaxRowArrays]) {
  for (int i = 0; i < kMaxRowArrays; ++i) {
    data[i] = rows.data[i];
    row_bytes[i] = rows.row_bytes[i];
  }
}

// Bytes of a combine's bf16 rows: whole 16-byte vectors.
ffi::Error CheckBf16Hidden(const char* fn, int64_t hidden);
// Every row index the kernels compute fits their 32-bit ints.
ffi::Error CheckRowIndices(const char* fn, const NormalShapes& s, int64_t num_ranks);

// Normal mode's arrays, as both paths bind them (intranode.cc on one host,
// internode.cc across hosts; each adds its own). Dispatch: the rows and routing
// in, the received rows and the handle's arrays out.
ffi::Error CheckDispatch(const char* fn, int64_t num_ranks, int64_t num_experts, NormalShapes* s, RowArrays* rows,
                         const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_scales, const ffi::Buffer<ffi::S32>& topk_idx,
                         const ffi::Buffer<ffi::F32>& topk_weights, ffi::Result<ffi::AnyBuffer>& recv_x,
                         ffi::Result<ffi::AnyBuffer>& recv_x_scales, ffi::ResultBuffer<ffi::S32>& recv_topk_idx,
                         ffi::ResultBuffer<ffi::F32>& recv_topk_weights, ffi::ResultBuffer<ffi::PRED>& is_token_in_rank,
                         ffi::ResultBuffer<ffi::S32>& num_tokens_per_rank,
                         ffi::ResultBuffer<ffi::S32>& rank_prefix_matrix, ffi::ResultBuffer<ffi::S32>& send_pos,
                         ffi::ResultBuffer<ffi::S32>& recv_src_idx, ffi::ResultBuffer<ffi::S32>& recv_src_rank,
                         ffi::ResultBuffer<ffi::S32>& num_recv_tokens,
                         ffi::ResultBuffer<ffi::S32>& num_recv_tokens_per_expert,
                         ffi::ResultBuffer<ffi::S32>& num_dropped_tokens);
// Cached dispatch: rows and weights along a handle's layout.
ffi::Error CheckCachedDispatch(const char* fn, int64_t num_ranks, NormalShapes* s, RowArrays* rows,
                               const ffi::AnyBuffer& x, const ffi::AnyBuffer& x_scales,
                               const ffi::Buffer<ffi::F32>& topk_weights, const ffi::Buffer<ffi::S32>& send_pos,
                               const ffi::Buffer<ffi::S32>& num_recv_tokens, ffi::Result<ffi::AnyBuffer>& recv_x,
                               ffi::Result<ffi::AnyBuffer>& recv_x_scales,
                               ffi::ResultBuffer<ffi::F32>& recv_topk_weights);
// Combine: expert outputs and the handle in, the reduced rows out.
ffi::Error CheckCombine(const char* fn, int64_t num_ranks, NormalShapes* s, const ffi::Buffer<ffi::BF16>& x,
                        const ffi::Buffer<ffi::F32>& topk_weights, const ffi::Buffer<ffi::S32>& send_pos,
                        const ffi::Buffer<ffi::S32>& num_recv_tokens, ffi::ResultBuffer<ffi::BF16>& out,
                        ffi::ResultBuffer<ffi::F32>& out_weights);

}  // namespace deep_ep_jax
