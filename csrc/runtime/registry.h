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
#include <functional>
#include <string>
#include <vector>

#include "common/limits.h"  // kMaxGroupRanks, kControlBytes

namespace deep_ep_jax {

// One mode's memory on one device, and its peers' as mapped on this device.
struct Region {
  char* local = nullptr;
  size_t num_bytes = 0;
  std::vector<char*> peers;  // [num_ranks], peers[rank] == local
};

// Everything a handler needs about a buffer on one device.
struct DeviceState {
  int64_t buffer_id = 0;
  int device_ordinal = -1;
  int rank = 0;       // position of this device in its EP group
  int num_ranks = 1;  // size of the EP group
  // Peers live in other processes (CUDA IPC, or NVSHMEM): they cannot use this
  // process's pointers, so kernels exchange offsets into the regions, and
  // normal mode lands rows in the regions (staged) instead of in XLA's buffers.
  bool ipc = false;
  Region normal;
  Region low_latency;
  // An EP group across hosts: the low-latency region is in NVSHMEM's
  // symmetric heap (runtime/nvshmem.h), followed by send_bytes of send area;
  // low_latency.peers[r] is null for a rank on another host, reached as PE
  // pes[r]. The normal region (internode normal mode, kernels/internode.h; or
  // the one-node kernels where one node, an NVLink domain, spans the hosts) is
  // there too, mapped (nvshmem_ptr) for the ranks of this rank's node.
  bool nvshmem = false;
  std::vector<int> pes;  // [num_ranks] (NVSHMEM buffers only)
  size_t send_bytes = 0;
  std::vector<int> nodes;  // [num_ranks] host index of each rank (ranks of a host in rank order), 0..num_nodes-1
  int num_nodes = 1;
  // Device memory (one cudaMalloc, freed with the state) holding copies of
  // low_latency.peers and pes, [num_ranks] each: the low-latency kernels
  // serve every rank of groups of up to kMaxGroupRanks and read these (once
  // per block) rather than arrays passed by value. Normal mode, at most
  // kMaxNvlinkRanks ranks, passes its peers by value. Null without a
  // low-latency region.
  char** device_peers = nullptr;
  int* device_pes = nullptr;  // null unless nvshmem
  // NVSHMEM buffers: [3][num_ranks] ints in the same allocation: each rank's
  // host (nodes), its index among its host's ranks, and the rank at
  // (host b, index j) at b * (num_ranks / num_nodes) + j (-1 where hosts
  // differ in size). Internode normal mode reads them (kernels/internode.cu).
  int* device_nodes = nullptr;
};

// (Re)writes s.device_peers / device_pes from s.low_latency.peers and s.pes
// on s's device, allocating them on first use (blocking). Throws
// std::runtime_error on failure. Nothing may run on the buffer meanwhile.
void UploadPeerTable(DeviceState& s);

// groups: device ordinals of each EP group (one group per index of the other
// mesh axes); a device's rank is its position in its group. Allocates both
// regions on every device, zeroes them, enables peer access inside each group.
// Throws std::runtime_error with a readable message on failure (out of
// memory, no peer access, ...).
int64_t CreateBuffer(const std::vector<std::vector<int>>& groups, size_t normal_bytes, size_t low_latency_bytes);

// One process per GPU (or a few GPUs per process) with peers in other
// processes, in two steps so that the handle exchange happens in Python:
// 1. CreateIpcBuffer: groups hold each rank's local device ordinal, or -1
//    for a rank of another process. Allocates both regions on every local
//    device and returns the buffer id and, for each local device in group
//    order, its CUDA IPC handles (kIpcHandleBytes: normal then low-latency;
//    zeros for an empty region).
// 2. OpenIpcPeers: handles[group][rank] as returned by the owning process
//    (ignored for local ranks) are opened on each local device; local peers
//    are mapped through peer access. Until then peers[] of other processes
//    are null: the buffer must not be used.
constexpr size_t kIpcHandleBytes = 2 * 64;  // two cudaIpcMemHandle_t
struct IpcBuffer {
  int64_t buffer_id;
  std::vector<std::string> handles;  // per local device, in group order
};
IpcBuffer CreateIpcBuffer(const std::vector<std::vector<int>>& groups, size_t normal_bytes, size_t low_latency_bytes);
void OpenIpcPeers(int64_t buffer_id, const std::vector<std::vector<std::string>>& handles);

// A buffer whose memory someone else allocated (NVSHMEM's symmetric heap):
// registered as is; DestroyBuffer synchronises its device and calls release
// instead of cudaFree. Returns the buffer id.
int64_t RegisterExternalBuffer(DeviceState state, std::function<void()> release);

// Synchronises every device of the buffer, then closes its opened IPC
// mappings and frees its regions: no device's memory goes while another
// device of the buffer may still write into it (a low-latency receive
// signals its peers at its very end).
void DestroyBuffer(int64_t buffer_id);
// Waits for all work on the buffer's devices (before a cross-process barrier
// that precedes DestroyBuffer, so no peer still accesses memory being freed).
void SynchronizeBuffer(int64_t buffer_id);
// nullptr when the buffer does not exist on that device.
const DeviceState* FindDeviceState(int64_t buffer_id, int device_ordinal);
// Copies of the buffer's states on this process's devices (test hooks);
// std::invalid_argument when the buffer does not exist.
std::vector<DeviceState> DeviceStatesOf(int64_t buffer_id);
// Number of live buffers (for lifecycle tests).
int NumLiveBuffers();
// SMs of a device, asked once per device (132, an H100/H200's, if the query fails).
int DeviceSmCount(int device_ordinal);

}  // namespace deep_ep_jax
