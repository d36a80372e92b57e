// XLA FFI handler of get_dispatch_layout: decode, validate, launch.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi/common.h"
#include "kernels/layout.h"

namespace deep_ep_jax {

// Per token, the ranks and experts of its top-k (kernels/layout.h).
static ffi::Error GetDispatchLayout(cudaStream_t stream, int32_t device, ffi::Buffer<ffi::S32> topk_idx,
                                    ffi::ResultBuffer<ffi::S32> num_tokens_per_rank,
                                    ffi::ResultBuffer<ffi::S32> num_tokens_per_expert,
                                    ffi::ResultBuffer<ffi::PRED> is_token_in_rank, int64_t num_experts,
                                    int64_t num_ranks) {
  constexpr const char* fn = "get_dispatch_layout";
  const Dims dims = topk_idx.dimensions();
  if (dims.size() != 2) return Invalid(fn, "topk_idx must be [T, K]");
  const int64_t num_tokens = dims[0], num_topk = dims[1];
  if (num_ranks < 1 || num_experts < 1 || num_experts % num_ranks != 0) {
    return Invalid(
        fn, "num_experts (" + Str(num_experts) + ") must be a positive multiple of num_ranks (" + Str(num_ranks) + ")");
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
  return Launched(fn,
                  LaunchGetDispatchLayout(topk_idx.typed_data(), int(num_tokens), int(num_topk), int(num_experts),
                                          int(num_ranks), num_tokens_per_rank->typed_data(),
                                          num_tokens_per_expert->typed_data(), is_token_in_rank->typed_data(), stream));
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(GetDispatchLayoutHandler, GetDispatchLayout,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // topk_idx [T, K]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // num_tokens_per_rank [R]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // num_tokens_per_expert [E]
                                  .Ret<ffi::Buffer<ffi::PRED>>()  // is_token_in_rank [T, R]
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_ranks"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace deep_ep_jax
