// Each handler file registers its FFI targets here with a static registrar;
// the pybind11 module hands them all to Python, which registers them with
// jax.ffi.register_ffi_target(name, capsule, platform="CUDA").
#pragma once

#include <map>
#include <string>

#include "xla/ffi/api/c_api.h"

namespace deep_ep_jax {

using FfiHandler = XLA_FFI_Error*(XLA_FFI_CallFrame*);

std::map<std::string, FfiHandler*>& FfiTargets();

struct FfiTargetRegistrar {
  FfiTargetRegistrar(const char* name, FfiHandler* handler) {
    FfiTargets()[name] = handler;
  }
};

}  // namespace deep_ep_jax

// DEEP_EP_JAX_REGISTER_FFI_TARGET("deep_ep_jax_dispatch", DispatchHandler);
#define DEEP_EP_JAX_REGISTER_FFI_TARGET(name, symbol) \
  static ::deep_ep_jax::FfiTargetRegistrar ffi_registrar_##symbol(name, symbol)
