// The XLA FFI targets of the extension. Each handler is written as in JAX's
// examples/ffi: a function with its full signature, and right below it
// XLA_FFI_DEFINE_HANDLER_SYMBOL binding it (in csrc/ffi/<mode>.cc). Every
// binding takes the stream and the device ordinal first. registration.cc
// lists every target once: its name, its handler symbol and the names of its
// results in order. The pybind11 module hands them to Python (_C.ffi_targets(),
// registered with jax.ffi.register_ffi_target(name, capsule,
// platform="CUDA"), and _C.ffi_outputs(), which Python checks its result
// names against).
#pragma once

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

// Every target, by name.
const std::map<std::string, FfiTarget>& FfiTargets();

}  // namespace deep_ep_jax
