// XLA FFI handler of get_dispatch_layout: decode, validate, launch.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi/common.h"
#include "kernels/layout.h"

namespace deep_ep_jax {
namespace {

// What the target binds (ffi/registration.h).
#define GET_DISPATCH_LAYOUT(ARG, REMAINING_ARGS, RET, ATTR) \
  ARG(ffi::Buffer<ffi::S32>, topk_idx)                      \
  RET(ffi::Buffer<ffi::S32>, num_tokens_per_rank)           \
  RET(ffi::Buffer<ffi::S32>, num_tokens_per_expert)         \
  RET(ffi::Buffer<ffi::PRED>, is_token_in_rank)             \
  ATTR(int64_t, num_experts)                                \
  ATTR(int64_t, num_ranks)

ffi::Error GetDispatchLayout(DEEP_EP_JAX_HANDLER_PARAMS(GET_DISPATCH_LAYOUT)) {
  constexpr const char* fn = "get_dispatch_layout";
  const Dims dims = topk_idx.dimensions();
  if (dims.size() != 2) return Invalid(fn, "topk_idx must be [T, K]");
  const int64_t num_tokens = dims[0], num_topk = dims[1];
  if (num_ranks < 1 || num_experts < 1 || num_experts % num_ranks != 0) {
    return Invalid(fn, "num_experts (" + Str(num_experts) + ") must be a positive multiple of num_ranks (" +
                           Str(num_ranks) + ")");
  }
  if (num_experts + num_ranks > kMaxLayoutBins) {
    return Invalid(fn, "num_experts + num_ranks must be <= " + Str(kMaxLayoutBins));
  }
  if (num_tokens * (num_topk > num_ranks ? num_topk : num_ranks) > INT32_MAX) return Invalid(fn, "too many tokens");
  if (!IsShape(num_tokens_per_rank->dimensions(), {num_ranks}) ||
      !IsShape(num_tokens_per_expert->dimensions(), {num_experts}) ||
      !IsShape(is_token_in_rank->dimensions(), {num_tokens, num_ranks})) {
    return Invalid(fn, "outputs must be [R], [E] and [T, R]");
  }
  return Launched(fn, LaunchGetDispatchLayout(topk_idx.typed_data(), int(num_tokens), int(num_topk), int(num_experts),
                                              int(num_ranks), num_tokens_per_rank->typed_data(),
                                              num_tokens_per_expert->typed_data(), is_token_in_rank->typed_data(),
                                              stream));
}

}  // namespace

DEEP_EP_JAX_FFI_TARGET("deep_ep_jax_get_dispatch_layout", GetDispatchLayoutHandler, GetDispatchLayout,
                       GET_DISPATCH_LAYOUT, {ffi::Traits::kCmdBufferCompatible});

}  // namespace deep_ep_jax
