// Pieces of XLA FFI handler bindings that several handlers share, so a
// handler's argument list is written once for every path that takes it.
// Use after `namespace ffi = xla::ffi;`, inside ffi::Ffi::Bind() chains, e.g.
//   ffi::Ffi::Bind() DEEP_EP_JAX_STREAM_AND_DEVICE DEEP_EP_JAX_NORMAL_COMBINE_ARGS ...
#pragma once

// Every handler's context: the stream and the device it runs on.
#define DEEP_EP_JAX_STREAM_AND_DEVICE .Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>()

// Normal mode (intranode.cc, internode.cc). Dispatch: the rows and routing
// in, then the received rows and the handle's arrays out.
#define DEEP_EP_JAX_NORMAL_DISPATCH_ARGS \
  .Arg<ffi::AnyBuffer>()        /* x */            \
  .Arg<ffi::AnyBuffer>()        /* x_scales */     \
  .Arg<ffi::Buffer<ffi::S32>>() /* topk_idx */     \
  .Arg<ffi::Buffer<ffi::F32>>() /* topk_weights */
#define DEEP_EP_JAX_NORMAL_DISPATCH_RETS                       \
  .Ret<ffi::AnyBuffer>()         /* recv_x */                     \
  .Ret<ffi::AnyBuffer>()         /* recv_x_scales */              \
  .Ret<ffi::Buffer<ffi::S32>>()  /* recv_topk_idx */              \
  .Ret<ffi::Buffer<ffi::F32>>()  /* recv_topk_weights */          \
  .Ret<ffi::Buffer<ffi::PRED>>() /* is_token_in_rank */           \
  .Ret<ffi::Buffer<ffi::S32>>()  /* num_tokens_per_rank */        \
  .Ret<ffi::Buffer<ffi::S32>>()  /* rank_prefix_matrix */         \
  .Ret<ffi::Buffer<ffi::S32>>()  /* send_pos */                   \
  .Ret<ffi::Buffer<ffi::S32>>()  /* recv_src_idx */               \
  .Ret<ffi::Buffer<ffi::S32>>()  /* recv_src_rank */              \
  .Ret<ffi::Buffer<ffi::S32>>()  /* num_recv_tokens */            \
  .Ret<ffi::Buffer<ffi::S32>>()  /* num_recv_tokens_per_expert */ \
  .Ret<ffi::Buffer<ffi::S32>>()  /* num_dropped_tokens */
// Cached dispatch: rows and weights along a handle's layout.
#define DEEP_EP_JAX_NORMAL_CACHED_DISPATCH_ARGS \
  .Arg<ffi::AnyBuffer>()        /* x */               \
  .Arg<ffi::AnyBuffer>()        /* x_scales */        \
  .Arg<ffi::Buffer<ffi::F32>>() /* topk_weights */    \
  .Arg<ffi::Buffer<ffi::S32>>() /* send_pos */        \
  .Arg<ffi::Buffer<ffi::S32>>() /* num_recv_tokens */
#define DEEP_EP_JAX_NORMAL_CACHED_DISPATCH_RETS \
  .Ret<ffi::AnyBuffer>()        /* recv_x */          \
  .Ret<ffi::AnyBuffer>()        /* recv_x_scales */   \
  .Ret<ffi::Buffer<ffi::F32>>() /* recv_topk_weights */
// Combine: expert outputs and the handle in (each path adds its own handle
// arrays after these), the reduced rows out.
#define DEEP_EP_JAX_NORMAL_COMBINE_ARGS \
  .Arg<ffi::Buffer<ffi::BF16>>() /* x */            \
  .Arg<ffi::Buffer<ffi::F32>>()  /* topk_weights */ \
  .Arg<ffi::Buffer<ffi::S32>>()  /* send_pos */     \
  .Arg<ffi::Buffer<ffi::S32>>()  /* num_recv_tokens */
#define DEEP_EP_JAX_NORMAL_COMBINE_RETS \
  .Ret<ffi::Buffer<ffi::BF16>>() /* out */ \
  .Ret<ffi::Buffer<ffi::F32>>()  /* out_weights */
