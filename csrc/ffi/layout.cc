// XLA FFI handler of get_dispatch_layout: decode, validate, launch.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ffi/registration.h"
#include "kernels/layout.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace deep_ep_jax {
namespace {

ffi::Error GetDispatchLayout(cudaStream_t stream, ffi::Buffer<ffi::S32> topk_idx,
                             ffi::ResultBuffer<ffi::S32> num_tokens_per_rank,
                             ffi::ResultBuffer<ffi::S32> num_tokens_per_expert,
                             ffi::ResultBuffer<ffi::PRED> is_token_in_rank, int64_t num_experts,
                             int64_t num_ranks) {
  const auto dims = topk_idx.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("get_dispatch_layout: topk_idx must be [T, K]");
  const int64_t num_tokens = dims[0], num_topk = dims[1];
  if (num_ranks < 1 || num_experts < 1 || num_experts % num_ranks != 0) {
    return ffi::Error::InvalidArgument("get_dispatch_layout: num_experts (" + std::to_string(num_experts) +
                                       ") must be a positive multiple of num_ranks (" +
                                       std::to_string(num_ranks) + ")");
  }
  if (num_experts + num_ranks > kMaxLayoutBins) {
    return ffi::Error::InvalidArgument("get_dispatch_layout: num_experts + num_ranks must be <= " +
                                       std::to_string(kMaxLayoutBins));
  }
  if (num_tokens * (num_topk > num_ranks ? num_topk : num_ranks) > INT32_MAX) {
    return ffi::Error::InvalidArgument("get_dispatch_layout: too many tokens");
  }
  const auto rank_dims = num_tokens_per_rank->dimensions();
  const auto expert_dims = num_tokens_per_expert->dimensions();
  const auto in_rank_dims = is_token_in_rank->dimensions();
  if (rank_dims.size() != 1 || rank_dims[0] != num_ranks || expert_dims.size() != 1 ||
      expert_dims[0] != num_experts || in_rank_dims.size() != 2 || in_rank_dims[0] != num_tokens ||
      in_rank_dims[1] != num_ranks) {
    return ffi::Error::InvalidArgument("get_dispatch_layout: outputs must be [R], [E] and [T, R]");
  }

  cudaError_t err = LaunchGetDispatchLayout(
      topk_idx.typed_data(), int(num_tokens), int(num_topk), int(num_experts), int(num_ranks),
      num_tokens_per_rank->typed_data(), num_tokens_per_expert->typed_data(), is_token_in_rank->typed_data(),
      stream);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("get_dispatch_layout: launch failed: ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GetDispatchLayoutHandler, GetDispatchLayout,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Attr<int64_t>("num_experts")
                                  .Attr<int64_t>("num_ranks"),
                              {ffi::Traits::kCmdBufferCompatible});

DEEP_EP_JAX_REGISTER_FFI_TARGET("deep_ep_jax_get_dispatch_layout", GetDispatchLayoutHandler);

}  // namespace deep_ep_jax
