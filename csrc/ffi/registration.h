// How an XLA FFI target is declared: once, as one list of what it binds, in
// order, from which come the binding, the handler's parameters and the names
// of its results. A list is a macro of four macro parameters:
//
//   #define MY_OP(ARG, REMAINING_ARGS, RET, ATTR)  (one line per part, each ending in a backslash)
//     ARG(ffi::AnyBuffer, x)
//     REMAINING_ARGS(keep_alive)
//     RET(ffi::Buffer<ffi::S32>, token)
//     ATTR(int64_t, buffer_id)
//
//   ffi::Error MyOp(DEEP_EP_JAX_HANDLER_PARAMS(MY_OP)) { ... x, token, buffer_id ... }
//   DEEP_EP_JAX_FFI_TARGET("deep_ep_jax_my_op", MyOpHandler, MyOp, MY_OP, {ffi::Traits::kCmdBufferCompatible});
//
// Every handler also gets the stream (`stream`) and the device ordinal
// (`device`) first. A RET(T, name) parameter is an ffi::Result<T>; an ATTR's
// name is also its attribute name. The pybind11 module hands the targets to
// Python (_C.ffi_targets(), registered with jax.ffi.register_ffi_target(name,
// capsule, platform="CUDA")) with their results' names (_C.ffi_outputs()).
#pragma once

#include <cuda_runtime.h>

#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace deep_ep_jax {

namespace ffi = ::xla::ffi;

using FfiHandler = XLA_FFI_Error*(XLA_FFI_CallFrame*);

struct FfiTarget {
  FfiHandler* handler = nullptr;
  std::vector<std::string> results;  // names, in order
};

std::map<std::string, FfiTarget>& FfiTargets();

struct FfiTargetRegistrar {
  FfiTargetRegistrar(const char* name, FfiHandler* handler, std::initializer_list<const char*> results) {
    FfiTargets()[name] = FfiTarget{handler, std::vector<std::string>(results.begin(), results.end())};
  }
};

}  // namespace deep_ep_jax

// The list's parts as a binding, as parameters, as result names.
#define DEEP_EP_JAX_BIND_ARG(type, name) .Arg<type>()
#define DEEP_EP_JAX_BIND_REMAINING_ARGS(name) .RemainingArgs()
#define DEEP_EP_JAX_BIND_RET(type, name) .Ret<type>()
#define DEEP_EP_JAX_BIND_ATTR(type, name) .Attr<type>(#name)
#define DEEP_EP_JAX_PARAM(type, name) , type name
#define DEEP_EP_JAX_REMAINING_ARGS_PARAM(name) , ::xla::ffi::RemainingArgs name
#define DEEP_EP_JAX_RET_PARAM(type, name) , ::xla::ffi::Result<type> name
#define DEEP_EP_JAX_SKIP(type, name)
#define DEEP_EP_JAX_SKIP_REMAINING_ARGS(name)
#define DEEP_EP_JAX_RET_NAME(type, name) #name,

#define DEEP_EP_JAX_HANDLER_PARAMS(OP)                                                       \
  cudaStream_t stream, int32_t device OP(DEEP_EP_JAX_PARAM, DEEP_EP_JAX_REMAINING_ARGS_PARAM, \
                                         DEEP_EP_JAX_RET_PARAM, DEEP_EP_JAX_PARAM)

#define DEEP_EP_JAX_BINDING(OP)                                                                             \
  ::xla::ffi::Ffi::Bind().Ctx<::xla::ffi::PlatformStream<cudaStream_t>>().Ctx<::xla::ffi::DeviceOrdinal>() \
      OP(DEEP_EP_JAX_BIND_ARG, DEEP_EP_JAX_BIND_REMAINING_ARGS, DEEP_EP_JAX_BIND_RET, DEEP_EP_JAX_BIND_ATTR)

// Defines the handler symbol `symbol` (impl bound to OP, with traits: {} or
// {ffi::Traits::kCmdBufferCompatible}) and registers it as target `name`.
#define DEEP_EP_JAX_FFI_TARGET(name, symbol, impl, OP, traits)                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, impl, DEEP_EP_JAX_BINDING(OP), traits);     \
  static ::deep_ep_jax::FfiTargetRegistrar ffi_registrar_##symbol(                 \
      name, symbol, {OP(DEEP_EP_JAX_SKIP, DEEP_EP_JAX_SKIP_REMAINING_ARGS, DEEP_EP_JAX_RET_NAME, DEEP_EP_JAX_SKIP)})
