// Low-latency send halves that overlap XLA's work (Config.low_latency_overlap_sms):
// they run on a stream of ours beside XLA's, one per device, forked after
// XLA's earlier work, so the compute XLA places between a send and its receive
// runs while the send's stores cross NVLink. The receive half joins the send
// before it launches on XLA's stream. A send and its receive are paired by
// their token buffer's address, which XLA keeps unique while the pair is in
// flight (the receive takes the token).
//
// The policy, for every low-latency launch on a buffer (the FFI handlers call
// one step before and one after each launch): an overlapped send is recorded
// as pending until its receive joins it; every other launch on the buffer (a
// send or receive on XLA's stream, a whole operation) is refused while one is
// pending, since the side stream runs unordered with XLA's stream until the
// join. An overlapped receive may run while the next overlapped send is out.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace deep_ep_jax {

// The outcome of a step: done, refused (the program broke the policy: an
// invalid argument for the caller) or a CUDA call failed.
struct SideStreamStatus {
  enum Code { kOk, kRefused, kCudaError };
  Code code = kOk;
  std::string message;  // what went wrong, without the operation's name
  bool ok() const { return code == kOk; }
};

// Before a send half's launch: where it runs. Overlapped: the side stream,
// forked from the work enqueued on `xla` so far. Otherwise `xla`, refused
// while an overlapped send of the buffer is pending.
SideStreamStatus BeginSend(int device, int64_t buffer_id, cudaStream_t xla, bool overlapped, cudaStream_t* stream);
// After a send half's launch: an overlapped one is pending under its token
// until its receive.
SideStreamStatus EndSend(int device, int64_t buffer_id, const void* token, bool overlapped);
// Before a receive half's launch on `xla`. Overlapped: `xla` waits for the
// send of this token (refused when none is pending). Otherwise refused while
// an overlapped send of the buffer is pending.
SideStreamStatus BeginReceive(int device, int64_t buffer_id, const void* token, cudaStream_t xla, bool overlapped);
// Before a whole operation (both halves in one launch): refused while an
// overlapped send of the buffer is pending.
SideStreamStatus CheckNoPendingSend(int device, int64_t buffer_id);

// Drops the buffer's pending sends on every device (their work must be done:
// DestroyBuffer synchronises the devices first).
void ForgetSideSends(int64_t buffer_id);

}  // namespace deep_ep_jax
