// What the XLA FFI handlers share: one way to check a call and report what
// is wrong, and the parts of the target lists (ffi/registration.h) that
// several targets bind.
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
// Normal mode's launch knobs against the kernels' bounds.
ffi::Error CheckLaunchKnobs(const char* fn, int64_t num_sms, int max_blocks, int64_t num_warps, int max_warps,
                            int64_t timeout_ns);

}  // namespace deep_ep_jax

// Returns from the enclosing handler the error of `expr` if it failed.
#define DEEP_EP_JAX_RETURN_IF_ERROR(expr)                                   \
  do {                                                                      \
    if (::xla::ffi::Error error_ = (expr); error_.failure()) return error_; \
  } while (0)

// Normal mode: the parts both paths (intranode.cc on one host, internode.cc
// across hosts) bind; each adds its handle arrays, scratch results and launch
// knobs. Dispatch: the rows and routing in, the received rows and the
// handle's arrays out.
#define DEEP_EP_JAX_NORMAL_DISPATCH_ARGS(ARG) \
  ARG(ffi::AnyBuffer, x)                      \
  ARG(ffi::AnyBuffer, x_scales)               \
  ARG(ffi::Buffer<ffi::S32>, topk_idx)        \
  ARG(ffi::Buffer<ffi::F32>, topk_weights)
#define DEEP_EP_JAX_NORMAL_DISPATCH_RETS(RET)            \
  RET(ffi::AnyBuffer, recv_x)                            \
  RET(ffi::AnyBuffer, recv_x_scales)                     \
  RET(ffi::Buffer<ffi::S32>, recv_topk_idx)              \
  RET(ffi::Buffer<ffi::F32>, recv_topk_weights)          \
  RET(ffi::Buffer<ffi::PRED>, is_token_in_rank)          \
  RET(ffi::Buffer<ffi::S32>, num_tokens_per_rank)        \
  RET(ffi::Buffer<ffi::S32>, rank_prefix_matrix)         \
  RET(ffi::Buffer<ffi::S32>, send_pos)                   \
  RET(ffi::Buffer<ffi::S32>, recv_src_idx)               \
  RET(ffi::Buffer<ffi::S32>, recv_src_rank)              \
  RET(ffi::Buffer<ffi::S32>, num_recv_tokens)            \
  RET(ffi::Buffer<ffi::S32>, num_recv_tokens_per_expert) \
  RET(ffi::Buffer<ffi::S32>, num_dropped_tokens)
// Cached dispatch: rows and weights along a handle's layout.
#define DEEP_EP_JAX_NORMAL_CACHED_DISPATCH_ARGS(ARG) \
  ARG(ffi::AnyBuffer, x)                             \
  ARG(ffi::AnyBuffer, x_scales)                      \
  ARG(ffi::Buffer<ffi::F32>, topk_weights)           \
  ARG(ffi::Buffer<ffi::S32>, send_pos)               \
  ARG(ffi::Buffer<ffi::S32>, num_recv_tokens)
#define DEEP_EP_JAX_NORMAL_CACHED_DISPATCH_RETS(RET) \
  RET(ffi::AnyBuffer, recv_x)                        \
  RET(ffi::AnyBuffer, recv_x_scales)                 \
  RET(ffi::Buffer<ffi::F32>, recv_topk_weights)
// Combine: expert outputs and the handle in (each path then adds its own
// handle arrays), the reduced rows out.
#define DEEP_EP_JAX_NORMAL_COMBINE_ARGS(ARG) \
  ARG(ffi::Buffer<ffi::BF16>, x)             \
  ARG(ffi::Buffer<ffi::F32>, topk_weights)   \
  ARG(ffi::Buffer<ffi::S32>, send_pos)       \
  ARG(ffi::Buffer<ffi::S32>, num_recv_tokens)
#define DEEP_EP_JAX_NORMAL_COMBINE_RETS(RET) \
  RET(ffi::Buffer<ffi::BF16>, out)           \
  RET(ffi::Buffer<ffi::F32>, out_weights)
// Launch knobs of both paths (cuda_normal.py's _launch_attrs; the one-host
// kernels also take chunk_tokens and staged).
#define DEEP_EP_JAX_NORMAL_LAUNCH_ATTRS(ATTR) \
  ATTR(int64_t, num_sms)                      \
  ATTR(int64_t, num_warps)                    \
  ATTR(int64_t, timeout_ns)
