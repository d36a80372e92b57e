#include "runtime/side_stream.h"

#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace deep_ep_jax {
namespace {

struct DeviceSide {
  cudaStream_t stream = nullptr;
  std::vector<cudaEvent_t> idle;                                    // events to reuse
  std::map<std::tuple<int64_t, const void*>, cudaEvent_t> pending;  // (buffer, token) -> end of its send
};

std::mutex mutex;
std::map<int, DeviceSide> sides;  // by device ordinal; lives as long as the process

// Runs fn with `device` current, as the handlers' callers expect it back.
template <typename Fn>
cudaError_t OnDevice(int device, Fn fn) {
  int previous = -1;
  if (cudaError_t err = cudaGetDevice(&previous); err != cudaSuccess) return err;
  if (previous != device) {
    if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) return err;
  }
  const cudaError_t err = fn();
  if (previous != device) cudaSetDevice(previous);
  return err;
}

cudaError_t TakeEvent(int device, DeviceSide& side, cudaEvent_t* event) {
  if (!side.idle.empty()) {
    *event = side.idle.back();
    side.idle.pop_back();
    return cudaSuccess;
  }
  return OnDevice(device, [&] { return cudaEventCreateWithFlags(event, cudaEventDisableTiming); });
}

// Makes this device's side stream (created on first use) wait for the work
// enqueued on `xla` so far; returns it in *side_stream.
cudaError_t ForkSideStream(int device, cudaStream_t xla, cudaStream_t* side_stream) {
  std::lock_guard<std::mutex> lock(mutex);
  DeviceSide& side = sides[device];
  if (side.stream == nullptr) {
    cudaError_t err = OnDevice(device, [&] { return cudaStreamCreateWithFlags(&side.stream, cudaStreamNonBlocking); });
    if (err != cudaSuccess) return err;
  }
  cudaEvent_t fork;
  if (cudaError_t err = TakeEvent(device, side, &fork); err != cudaSuccess) return err;
  cudaError_t err = cudaEventRecord(fork, xla);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(side.stream, fork, 0);
  side.idle.push_back(fork);  // reusable at once: the wait took the record as it is now
  *side_stream = side.stream;
  return err;
}

// After a send's launch on the side stream: remembers it under (buffer, key).
cudaError_t RecordSideSend(int device, int64_t buffer_id, const void* key) {
  std::lock_guard<std::mutex> lock(mutex);
  DeviceSide& side = sides[device];
  cudaEvent_t done;
  if (cudaError_t err = TakeEvent(device, side, &done); err != cudaSuccess) return err;
  if (cudaError_t err = cudaEventRecord(done, side.stream); err != cudaSuccess) {
    side.idle.push_back(done);
    return err;
  }
  auto [it, inserted] = side.pending.emplace(std::make_tuple(buffer_id, key), done);
  if (!inserted) {  // a token XLA reused without a receive in between: the newer send is what a receive waits for
    side.idle.push_back(it->second);
    it->second = done;
  }
  return cudaSuccess;
}

// Makes `xla` wait for the send remembered under (buffer, key) and forgets
// it; *found is false (and nothing happens) if there is none.
cudaError_t JoinSideSend(int device, int64_t buffer_id, const void* key, cudaStream_t xla, bool* found) {
  std::lock_guard<std::mutex> lock(mutex);
  DeviceSide& side = sides[device];
  auto it = side.pending.find(std::make_tuple(buffer_id, key));
  *found = it != side.pending.end();
  if (!*found) return cudaSuccess;
  const cudaError_t err = cudaStreamWaitEvent(xla, it->second, 0);
  side.idle.push_back(it->second);
  side.pending.erase(it);
  return err;
}

// Sends of the buffer forked on this device and not joined yet.
int PendingSideSends(int device, int64_t buffer_id) {
  std::lock_guard<std::mutex> lock(mutex);
  auto it = sides.find(device);
  if (it == sides.end()) return 0;
  int n = 0;
  for (const auto& entry : it->second.pending) n += std::get<0>(entry.first) == buffer_id;
  return n;
}

SideStreamStatus Refused(std::string message) { return {SideStreamStatus::kRefused, std::move(message)}; }

SideStreamStatus CudaStatus(const char* what, cudaError_t err) {
  if (err == cudaSuccess) return {};
  return {SideStreamStatus::kCudaError, std::string(what) + ": " + cudaGetErrorString(err)};
}

}  // namespace

SideStreamStatus CheckNoPendingSend(int device, int64_t buffer_id) {
  const int pending = PendingSideSends(device, buffer_id);
  if (pending == 0) return {};
  return Refused(std::to_string(pending) +
                 " overlapped send(s) of this buffer still wait for their receive; with "
                 "config.low_latency_overlap_sms, receive them before any other low-latency operation of the buffer");
}

SideStreamStatus BeginSend(int device, int64_t buffer_id, cudaStream_t xla, bool overlapped, cudaStream_t* stream) {
  *stream = xla;
  if (!overlapped) return CheckNoPendingSend(device, buffer_id);
  return CudaStatus("forking the side stream", ForkSideStream(device, xla, stream));
}

SideStreamStatus EndSend(int device, int64_t buffer_id, const void* token, bool overlapped) {
  if (!overlapped) return {};
  return CudaStatus("recording the send", RecordSideSend(device, buffer_id, token));
}

SideStreamStatus BeginReceive(int device, int64_t buffer_id, const void* token, cudaStream_t xla, bool overlapped) {
  if (!overlapped) return CheckNoPendingSend(device, buffer_id);
  bool found = false;
  if (SideStreamStatus status = CudaStatus("joining the send", JoinSideSend(device, buffer_id, token, xla, &found));
      !status.ok()) {
    return status;
  }
  if (!found) {
    return Refused(
        "no overlapped send of this buffer is pending for this token (was the send made with a buffer "
        "whose config.low_latency_overlap_sms differs?)");
  }
  return {};
}

void ForgetSideSends(int64_t buffer_id) {
  std::lock_guard<std::mutex> lock(mutex);
  for (auto& [device, side] : sides) {
    for (auto it = side.pending.begin(); it != side.pending.end();) {
      if (std::get<0>(it->first) != buffer_id) {
        ++it;
        continue;
      }
      side.idle.push_back(it->second);
      it = side.pending.erase(it);
    }
  }
}

}  // namespace deep_ep_jax
