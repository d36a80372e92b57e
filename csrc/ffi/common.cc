#include "ffi/common.h"

namespace deep_ep_jax {

std::string ShapeString(Dims dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

bool IsShape(Dims dims, std::initializer_list<int64_t> want) {
  if (dims.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want) {
    if (dims[i++] != w) return false;
  }
  return true;
}

ffi::Error Invalid(const char* fn, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(fn) + ": " + what);
}

ffi::Error ExpectShape(const char* fn, const char* name, Dims dims, std::initializer_list<int64_t> want) {
  if (IsShape(dims, want)) return ffi::Error::Success();
  std::string expected = "[";
  size_t i = 0;
  for (int64_t w : want) expected += (i++ ? ", " : "") + std::to_string(w);
  return Invalid(fn, std::string(name) + " must have shape " + expected + "], got " + ShapeString(dims));
}

ffi::Error Launched(const char* fn, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(fn) + ": launch failed: " + cudaGetErrorString(err));
}

ffi::Error FindBuffer(const char* fn, int64_t buffer_id, int device, const DeviceState** state) {
  *state = FindDeviceState(buffer_id, device);
  if (*state != nullptr) return ffi::Error::Success();
  return Invalid(fn, "buffer " + Str(buffer_id) + " does not exist on device " + Str(device) +
                         " (destroyed, or made for other devices); create the Buffer before tracing");
}

ffi::Error CheckLaunchKnobs(const char* fn, int64_t num_sms, int max_blocks, int64_t num_warps, int max_warps,
                            int64_t timeout_ns) {
  if (num_sms < 1 || num_sms > max_blocks) {
    return Invalid(fn, "num_sms must be in [1, " + Str(max_blocks) + "], got " + Str(num_sms));
  }
  if (num_warps < 1 || num_warps > max_warps) {
    return Invalid(fn, "num_warps must be in [1, " + Str(max_warps) + "], got " + Str(num_warps));
  }
  if (timeout_ns <= 0) return Invalid(fn, "timeout_ns must be positive");
  return ffi::Error::Success();
}

}  // namespace deep_ep_jax
