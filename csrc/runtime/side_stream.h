// Low-latency send halves that overlap XLA's work (Config.low_latency_overlap_sms):
// they run on a stream of ours beside XLA's, one per device, forked after
// XLA's earlier work, so the compute XLA places between a send and its receive
// runs while the send's stores cross NVLink. The receive half joins the send
// before it launches on XLA's stream. A send and its receive are paired by
// their token buffer's address, which XLA keeps unique while the pair is in
// flight (the receive takes the token).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace deep_ep_jax {

// Makes this device's side stream (created on first use) wait for the work
// enqueued on `xla` so far; returns it in *side.
cudaError_t ForkSideStream(int device, cudaStream_t xla, cudaStream_t* side);
// After a send's launch on the side stream: remembers it under (buffer, key).
cudaError_t RecordSideSend(int device, int64_t buffer_id, const void* key);
// Makes `xla` wait for the send remembered under (buffer, key) and forgets
// it; *found is false (and nothing happens) if there is none.
cudaError_t JoinSideSend(int device, int64_t buffer_id, const void* key, cudaStream_t xla, bool* found);
// Sends of the buffer forked on this device and not joined yet.
int PendingSideSends(int device, int64_t buffer_id);
// Drops the buffer's pending sends on every device (their work must be done:
// DestroyBuffer synchronises the devices first).
void ForgetSideSends(int64_t buffer_id);

}  // namespace deep_ep_jax
