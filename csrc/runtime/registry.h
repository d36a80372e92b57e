// Process-wide registry of communication buffers.
//
// A Buffer (Python) owns, on every device of its mesh axis, two regions of
// plain cudaMalloc memory: one for normal-mode kernels and one for low-latency
// kernels. FFI handlers find a device's state from (buffer id attribute,
// DeviceOrdinal). Peer pointers are mapped through CUDA peer access (one
// process driving all GPUs) or CUDA IPC (one process per GPU).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace deep_ep_jax {

constexpr int kMaxRanks = 8;
// Each region starts with this many zeroed bytes of control data (signals,
// sequence numbers, pointer slots) owned by that mode's kernels.
constexpr size_t kControlBytes = size_t(1) << 16;

// One mode's memory on one device, and its peers' as mapped on this device.
struct Region {
  char* local = nullptr;
  size_t num_bytes = 0;
  char* peers[kMaxRanks] = {};  // peers[rank] == local; pass by value to kernels
};

// Everything a handler needs about a buffer on one device.
struct DeviceState {
  int64_t buffer_id = 0;
  int device_ordinal = -1;
  int rank = 0;       // position of this device in its EP group
  int num_ranks = 1;  // size of the EP group
  Region normal;
  Region low_latency;
};

// groups: device ordinals of each EP group (one group per index of the other
// mesh axes); a device's rank is its position in its group. Allocates both
// regions on every device, zeroes them, enables peer access inside each group.
// Throws std::runtime_error with a readable message on failure (out of
// memory, no peer access, ...).
int64_t CreateBuffer(const std::vector<std::vector<int>>& groups,
                     size_t normal_bytes, size_t low_latency_bytes);
void DestroyBuffer(int64_t buffer_id);
// nullptr when the buffer does not exist on that device.
const DeviceState* FindDeviceState(int64_t buffer_id, int device_ordinal);
// Number of live buffers (for lifecycle tests).
int NumLiveBuffers();

}  // namespace deep_ep_jax
