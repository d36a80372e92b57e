// Buffer registry. One process driving all GPUs of its EP groups: plain
// cudaMalloc on each device, peer access between the devices of a group, and
// raw peer pointers (valid everywhere thanks to unified virtual addressing).
// One process per GPU: the same allocations, exported and opened through
// CUDA IPC handles that Python trades between the processes.
#include "runtime/registry.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "runtime/side_stream.h"

namespace deep_ep_jax {
namespace {

// Handlers look states up concurrently (one host thread per GPU), so lookups
// take a shared lock; create/destroy take it exclusively. std::map nodes are
// stable, so returned DeviceState pointers stay valid until DestroyBuffer.
std::shared_mutex registry_mutex;
std::map<std::pair<int64_t, int>, DeviceState> device_states;        // (buffer id, device)
std::map<int64_t, std::vector<int>> buffer_devices;                  // buffer id -> its devices
std::map<int64_t, std::vector<std::vector<int>>> ipc_groups;         // IPC buffer id -> its groups (-1: remote)
std::map<std::pair<int64_t, int>, std::vector<void*>> ipc_mappings;  // (buffer id, device) -> opened peers
std::map<int64_t, std::function<void()>> external_releases;          // buffer id -> frees its memory
int64_t next_buffer_id = 1;

static_assert(kIpcHandleBytes == 2 * sizeof(cudaIpcMemHandle_t), "kIpcHandleBytes: two cudaIpcMemHandle_t");

void Check(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it so that later, unrelated calls do not report it
    throw std::runtime_error("deep_ep_jax: " + what + " failed: " + cudaGetErrorString(err));
  }
}

// Sets the current device for a scope and restores the caller's afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    Check(cudaGetDevice(&previous_), "cudaGetDevice");
    Check(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

// Each non-empty region holds at least its control block.
size_t RegionBytes(size_t requested) { return requested == 0 ? 0 : std::max(requested, kControlBytes); }

char* AllocateZeroed(int device, size_t num_bytes, const char* mode) {
  if (num_bytes == 0) return nullptr;
  void* ptr = nullptr;
  cudaError_t err = cudaMalloc(&ptr, num_bytes);
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    std::ostringstream msg;
    msg << "deep_ep_jax: out of GPU memory allocating the " << mode << " buffer on device " << device << ": requested "
        << num_bytes << " bytes (" << (num_bytes >> 20) << " MiB), free " << free_bytes << " bytes ("
        << (free_bytes >> 20) << " MiB) of " << (total_bytes >> 20)
        << " MiB. XLA preallocates 75% of GPU memory by default: set "
        << "XLA_PYTHON_CLIENT_MEM_FRACTION lower (e.g. 0.6) or XLA_PYTHON_CLIENT_PREALLOCATE=false "
        << "before importing jax, or ask for a smaller buffer.";
    throw std::runtime_error(msg.str());
  }
  Check(err, "cudaMalloc of " + std::to_string(num_bytes) + " bytes on device " + std::to_string(device));
  err = cudaMemset(ptr, 0, num_bytes);
  if (err != cudaSuccess) cudaFree(ptr);
  Check(err, "cudaMemset on device " + std::to_string(device));
  return static_cast<char*>(ptr);
}

void EnablePeerAccess(int device, int peer) {
  int can_access = 0;
  Check(cudaDeviceCanAccessPeer(&can_access, device, peer), "cudaDeviceCanAccessPeer");
  if (!can_access) {
    throw std::runtime_error("deep_ep_jax: device " + std::to_string(device) + " cannot access device " +
                             std::to_string(peer) +
                             " (no CUDA peer access between them, e.g. no NVLink/PCIe P2P); "
                             "the devices of one EP group must all reach each other");
  }
  DeviceGuard guard(device);
  cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();
    return;
  }
  Check(err, "cudaDeviceEnablePeerAccess(" + std::to_string(device) + " -> " + std::to_string(peer) + ")");
}

// Synchronises each device, then frees its regions. Best effort: used both by
// DestroyBuffer (which has synchronised every device first) and to roll back
// a failed CreateBuffer (no kernel has run).
void FreeStates(const std::vector<DeviceState>& states) {
  for (const DeviceState& s : states) {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(s.device_ordinal);
    cudaDeviceSynchronize();
    if (s.normal.local && !s.nvshmem) cudaFree(s.normal.local);            // else: its release frees it
    if (s.low_latency.local && !s.nvshmem) cudaFree(s.low_latency.local);  // else: its release frees it
    if (s.device_peers) cudaFree(s.device_peers);                          // device_pes lives in the same allocation
    cudaSetDevice(previous);
  }
}

// allow_remote: -1 marks a rank of another process (CreateIpcBuffer). A
// normal region (normal_bytes > 0) is for intranode normal mode, whose
// kernels serve one NVLink domain.
void ValidateGroups(const std::vector<std::vector<int>>& groups, bool allow_remote, size_t normal_bytes) {
  if (groups.empty()) throw std::invalid_argument("deep_ep_jax: CreateBuffer needs at least one group");
  for (const auto& group : groups) {  // the sizes first: they need no GPU
    if (group.empty() || group.size() > size_t(kMaxGroupRanks)) {
      throw std::invalid_argument("deep_ep_jax: an EP group must have 1.." + std::to_string(kMaxGroupRanks) +
                                  " devices, got " + std::to_string(group.size()));
    }
    if (normal_bytes > 0 && group.size() > size_t(kMaxNvlinkRanks)) {
      throw std::invalid_argument(
          "deep_ep_jax: normal mode supports at most " + std::to_string(kMaxNvlinkRanks) +
          " ranks on one host (one NVLink domain), the EP group has " + std::to_string(group.size()) +
          " (low-latency mode: " + std::to_string(kMaxGroupRanks) + "); create the buffer without a normal region");
    }
  }
  int device_count = 0;
  Check(cudaGetDeviceCount(&device_count), "cudaGetDeviceCount");
  std::set<int> seen;
  for (const auto& group : groups) {
    for (int device : group) {
      if (allow_remote && device == -1) continue;
      if (device < 0 || device >= device_count) {
        throw std::invalid_argument("deep_ep_jax: device " + std::to_string(device) + " does not exist (" +
                                    std::to_string(device_count) + " CUDA devices visible)");
      }
      if (!seen.insert(device).second) {
        throw std::invalid_argument("deep_ep_jax: device " + std::to_string(device) +
                                    " appears twice in the buffer's groups");
      }
    }
  }
}

// Both regions of a device as IPC handles (zeros for an empty region).
std::string ExportHandles(const DeviceState& s) {
  std::string bytes(kIpcHandleBytes, '\0');
  const char* regions[2] = {s.normal.local, s.low_latency.local};
  for (int i = 0; i < 2; ++i) {
    if (regions[i] == nullptr) continue;
    cudaIpcMemHandle_t handle;
    Check(cudaIpcGetMemHandle(&handle, const_cast<char*>(regions[i])),
          "cudaIpcGetMemHandle on device " + std::to_string(s.device_ordinal));
    std::memcpy(&bytes[i * sizeof(handle)], &handle, sizeof(handle));
  }
  return bytes;
}

void SynchronizeDevice(int device) {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  cudaDeviceSynchronize();
  cudaGetLastError();
  cudaSetDevice(previous);
}

// Best effort, on the device that opened them.
void CloseMappings(int device, const std::vector<void*>& mappings) {
  if (mappings.empty()) return;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  for (void* ptr : mappings) cudaIpcCloseMemHandle(ptr);
  cudaGetLastError();
  cudaSetDevice(previous);
}

// Stores states under a fresh id; returns it.
int64_t Register(std::vector<DeviceState>& states) {
  std::unique_lock<std::shared_mutex> lock(registry_mutex);
  const int64_t id = next_buffer_id++;
  std::vector<int>& devices = buffer_devices[id];
  for (DeviceState& s : states) {
    s.buffer_id = id;
    devices.push_back(s.device_ordinal);
    device_states[{id, s.device_ordinal}] = s;
  }
  return id;
}

}  // namespace

void UploadPeerTable(DeviceState& s) {
  if (s.low_latency.local == nullptr) return;  // no low-latency kernels run on it
  const size_t n = size_t(s.num_ranks);
  if (s.low_latency.peers.size() != n || (s.nvshmem && (s.pes.size() != n || s.nodes.size() != n))) {
    throw std::logic_error("deep_ep_jax: UploadPeerTable: per-rank vectors of the wrong size");
  }
  DeviceGuard guard(s.device_ordinal);
  const size_t pes_offset = AlignUp(n * sizeof(char*), kVectorBytes);
  const size_t nodes_offset = pes_offset + AlignUp(n * sizeof(int), kVectorBytes);
  if (s.device_peers == nullptr) {
    void* table = nullptr;
    Check(cudaMalloc(&table, nodes_offset + 3 * n * sizeof(int)),
          "cudaMalloc of the peer table on device " + std::to_string(s.device_ordinal));
    s.device_peers = static_cast<char**>(table);
    s.device_pes = s.nvshmem ? reinterpret_cast<int*>(static_cast<char*>(table) + pes_offset) : nullptr;
    s.device_nodes = s.nvshmem ? reinterpret_cast<int*>(static_cast<char*>(table) + nodes_offset) : nullptr;
  }
  Check(cudaMemcpy(s.device_peers, s.low_latency.peers.data(), n * sizeof(char*), cudaMemcpyHostToDevice),
        "copying the peer table to device " + std::to_string(s.device_ordinal));
  if (s.device_pes != nullptr) {
    Check(cudaMemcpy(s.device_pes, s.pes.data(), n * sizeof(int), cudaMemcpyHostToDevice),
          "copying the PE table to device " + std::to_string(s.device_ordinal));
  }
  if (s.device_nodes != nullptr) {
    // node, local index, rank at (node, local index): see DeviceState.
    std::vector<int> table(3 * n, -1), per_node(n, 0);
    const int per_host = s.num_nodes > 0 ? s.num_ranks / s.num_nodes : 0;
    for (size_t r = 0; r < n; ++r) {
      const int node = s.nodes[r], local = per_node[size_t(node)]++;
      table[r] = node;
      table[n + r] = local;
      if (local < per_host && size_t(node * per_host + local) < n)
        table[2 * n + size_t(node * per_host + local)] = int(r);
    }
    Check(cudaMemcpy(s.device_nodes, table.data(), table.size() * sizeof(int), cudaMemcpyHostToDevice),
          "copying the host table to device " + std::to_string(s.device_ordinal));
  }
}

int64_t CreateBuffer(const std::vector<std::vector<int>>& groups, size_t normal_bytes, size_t low_latency_bytes) {
  ValidateGroups(groups, /*allow_remote=*/false, normal_bytes);
  const size_t normal_region = RegionBytes(normal_bytes);
  const size_t low_latency_region = RegionBytes(low_latency_bytes);

  // Allocate and map outside the registry lock: this is slow, and handlers of
  // other buffers must keep running.
  std::vector<DeviceState> states;
  try {
    for (const auto& group : groups) {
      const size_t first = states.size();
      for (size_t rank = 0; rank < group.size(); ++rank) {
        states.emplace_back();  // in the list first, so a rollback frees what it got
        DeviceState& s = states.back();
        s.device_ordinal = group[rank];
        s.rank = int(rank);
        s.num_ranks = int(group.size());
        DeviceGuard guard(s.device_ordinal);
        s.normal.num_bytes = normal_region;
        s.normal.local = AllocateZeroed(s.device_ordinal, normal_region, "normal-mode");
        s.low_latency.num_bytes = low_latency_region;
        s.low_latency.local = AllocateZeroed(s.device_ordinal, low_latency_region, "low-latency");
        s.normal.peers.resize(group.size());
        s.low_latency.peers.resize(group.size());
      }
      for (int device : group) {
        for (int peer : group) {
          if (peer != device) EnablePeerAccess(device, peer);
        }
      }
      for (size_t i = first; i < states.size(); ++i) {
        for (size_t rank = 0; rank < group.size(); ++rank) {
          states[i].normal.peers[rank] = states[first + rank].normal.local;
          states[i].low_latency.peers[rank] = states[first + rank].low_latency.local;
        }
        UploadPeerTable(states[i]);
      }
    }
  } catch (...) {
    FreeStates(states);
    throw;
  }

  return Register(states);
}

IpcBuffer CreateIpcBuffer(const std::vector<std::vector<int>>& groups, size_t normal_bytes, size_t low_latency_bytes) {
  ValidateGroups(groups, /*allow_remote=*/true, normal_bytes);
  for (const auto& group : groups) {
    if (std::count_if(group.begin(), group.end(), [](int d) { return d >= 0; }) > 1) {
      throw std::invalid_argument(
          "deep_ep_jax: an IPC buffer's EP group holds several devices of this process; use one process per "
          "GPU, or one process for all GPUs of each group (CreateBuffer)");
    }
  }
  const size_t normal_region = RegionBytes(normal_bytes);
  const size_t low_latency_region = RegionBytes(low_latency_bytes);

  std::vector<DeviceState> states;
  IpcBuffer result{0, {}};
  try {
    for (const auto& group : groups) {
      for (size_t rank = 0; rank < group.size(); ++rank) {
        if (group[rank] < 0) continue;
        states.emplace_back();  // in the list first, so a rollback frees what it got
        DeviceState& s = states.back();
        s.device_ordinal = group[rank];
        s.rank = int(rank);
        s.num_ranks = int(group.size());
        s.ipc = true;
        DeviceGuard guard(s.device_ordinal);
        s.normal.num_bytes = normal_region;
        s.normal.local = AllocateZeroed(s.device_ordinal, normal_region, "normal-mode");
        s.low_latency.num_bytes = low_latency_region;
        s.low_latency.local = AllocateZeroed(s.device_ordinal, low_latency_region, "low-latency");
        // Peers may write into the regions as soon as they get the handles.
        Check(cudaDeviceSynchronize(),
              "cudaDeviceSynchronize after zeroing on device " + std::to_string(s.device_ordinal));
        s.normal.peers.assign(group.size(), nullptr);  // the others' come with OpenIpcPeers
        s.low_latency.peers.assign(group.size(), nullptr);
        s.normal.peers[rank] = s.normal.local;
        s.low_latency.peers[rank] = s.low_latency.local;
        UploadPeerTable(s);
        result.handles.push_back(ExportHandles(s));
      }
    }
  } catch (...) {
    FreeStates(states);
    throw;
  }
  result.buffer_id = Register(states);
  std::unique_lock<std::shared_mutex> lock(registry_mutex);
  ipc_groups[result.buffer_id] = groups;
  return result;
}

void OpenIpcPeers(int64_t buffer_id, const std::vector<std::vector<std::string>>& handles) {
  std::vector<std::vector<int>> groups;
  {
    std::shared_lock<std::shared_mutex> lock(registry_mutex);
    auto it = ipc_groups.find(buffer_id);
    if (it == ipc_groups.end()) {
      throw std::invalid_argument("deep_ep_jax: buffer " + std::to_string(buffer_id) +
                                  " is not an IPC buffer (CreateIpcBuffer) or was destroyed");
    }
    groups = it->second;
  }
  if (handles.size() != groups.size()) {
    throw std::invalid_argument("deep_ep_jax: OpenIpcPeers needs handles for " + std::to_string(groups.size()) +
                                " groups, got " + std::to_string(handles.size()));
  }
  // Open outside the lock; publish the pointers once every open succeeded.
  struct Opened {
    int device;
    std::vector<char*> normal, low_latency;  // [rank], this device's own included
    std::vector<void*> mappings;
  };
  std::vector<Opened> opened;
  try {
    for (size_t g = 0; g < groups.size(); ++g) {
      const auto& group = groups[g];
      if (handles[g].size() != group.size()) {
        throw std::invalid_argument("deep_ep_jax: OpenIpcPeers: group " + std::to_string(g) + " has " +
                                    std::to_string(group.size()) + " ranks, got " + std::to_string(handles[g].size()) +
                                    " handles");
      }
      for (size_t rank = 0; rank < group.size(); ++rank) {
        if (group[rank] < 0) continue;
        const DeviceState* state = FindDeviceState(buffer_id, group[rank]);
        if (state == nullptr) throw std::invalid_argument("deep_ep_jax: OpenIpcPeers: the buffer was destroyed");
        opened.push_back(Opened{group[rank], state->normal.peers, state->low_latency.peers, {}});
        Opened& o = opened.back();
        DeviceGuard guard(o.device);
        for (size_t peer = 0; peer < group.size(); ++peer) {
          if (peer == rank) continue;
          const std::string& bytes = handles[g][peer];
          if (bytes.size() != kIpcHandleBytes) {
            throw std::invalid_argument("deep_ep_jax: the IPC handles of rank " + std::to_string(peer) + " are " +
                                        std::to_string(bytes.size()) + " bytes, expected " +
                                        std::to_string(kIpcHandleBytes));
          }
          char** targets[2] = {&o.normal[peer], &o.low_latency[peer]};
          const bool present[2] = {state->normal.local != nullptr, state->low_latency.local != nullptr};
          for (int i = 0; i < 2; ++i) {
            if (!present[i]) continue;  // same sizes everywhere: the peer's region is empty too
            cudaIpcMemHandle_t handle;
            std::memcpy(&handle, bytes.data() + i * sizeof(handle), sizeof(handle));
            void* ptr = nullptr;
            Check(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess),
                  "cudaIpcOpenMemHandle of rank " + std::to_string(peer) + "'s " +
                      (i == 0 ? "normal-mode" : "low-latency") + " region on device " + std::to_string(o.device));
            o.mappings.push_back(ptr);
            *targets[i] = static_cast<char*>(ptr);
          }
        }
      }
    }
    // The kernels' copy of the peers, before any call can use them.
    for (const Opened& o : opened) {
      const DeviceState* state = FindDeviceState(buffer_id, o.device);
      if (state == nullptr) throw std::invalid_argument("deep_ep_jax: OpenIpcPeers: the buffer was destroyed");
      DeviceState copy = *state;  // shares its device_peers, written in place
      copy.low_latency.peers = o.low_latency;
      UploadPeerTable(copy);
    }
  } catch (...) {
    for (const Opened& o : opened) CloseMappings(o.device, o.mappings);
    throw;
  }

  std::unique_lock<std::shared_mutex> lock(registry_mutex);
  for (Opened& o : opened) {
    DeviceState& s = device_states.at({buffer_id, o.device});
    s.normal.peers = o.normal;
    s.low_latency.peers = o.low_latency;
    std::vector<void*>& mappings = ipc_mappings[{buffer_id, o.device}];
    CloseMappings(o.device, mappings);  // opened before (a second call): replaced
    mappings = std::move(o.mappings);
  }
}

int64_t RegisterExternalBuffer(DeviceState state, std::function<void()> release) {
  std::vector<DeviceState> states{state};
  const int64_t id = Register(states);
  std::unique_lock<std::shared_mutex> lock(registry_mutex);
  external_releases[id] = std::move(release);
  return id;
}

void DestroyBuffer(int64_t buffer_id) {
  std::vector<DeviceState> states;
  std::vector<std::pair<int, std::vector<void*>>> mappings;  // (device, opened peers)
  std::function<void()> release;
  {
    std::unique_lock<std::shared_mutex> lock(registry_mutex);
    auto it = buffer_devices.find(buffer_id);
    if (it == buffer_devices.end()) {
      throw std::invalid_argument("deep_ep_jax: buffer " + std::to_string(buffer_id) +
                                  " does not exist (never created, or already destroyed)");
    }
    for (int device : it->second) {
      auto state = device_states.find({buffer_id, device});
      states.push_back(state->second);
      device_states.erase(state);
      auto mapping = ipc_mappings.find({buffer_id, device});
      if (mapping != ipc_mappings.end()) {
        mappings.emplace_back(device, std::move(mapping->second));
        ipc_mappings.erase(mapping);
      }
    }
    buffer_devices.erase(it);
    ipc_groups.erase(buffer_id);
    auto external = external_releases.find(buffer_id);
    if (external != external_releases.end()) {
      release = std::move(external->second);
      external_releases.erase(external);
    }
  }
  // Outside the lock: a device synchronisation can take a while. Every
  // device first, before anything is freed: a device being idle does not
  // mean its peers are (a peer's low-latency receive writes its "freed" flag
  // into this device's region as its last step). Across processes, Python
  // barriers every process after synchronising, before this.
  for (const DeviceState& s : states) SynchronizeDevice(s.device_ordinal);
  // Peers' mappings are closed before our own memory goes.
  for (const auto& [device, ptrs] : mappings) CloseMappings(device, ptrs);
  FreeStates(states);
  ForgetSideSends(buffer_id);  // overlapped sends never received (a refused program's)
  if (release) release();
}

void SynchronizeBuffer(int64_t buffer_id) {
  std::vector<int> devices;
  {
    std::shared_lock<std::shared_mutex> lock(registry_mutex);
    auto it = buffer_devices.find(buffer_id);
    if (it == buffer_devices.end()) {
      throw std::invalid_argument("deep_ep_jax: buffer " + std::to_string(buffer_id) + " does not exist");
    }
    devices = it->second;
  }
  for (int device : devices) {
    DeviceGuard guard(device);
    Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize on device " + std::to_string(device));
  }
}

const DeviceState* FindDeviceState(int64_t buffer_id, int device_ordinal) {
  std::shared_lock<std::shared_mutex> lock(registry_mutex);
  auto it = device_states.find({buffer_id, device_ordinal});
  return it == device_states.end() ? nullptr : &it->second;
}

std::vector<DeviceState> DeviceStatesOf(int64_t buffer_id) {
  std::shared_lock<std::shared_mutex> lock(registry_mutex);
  auto it = buffer_devices.find(buffer_id);
  if (it == buffer_devices.end()) {
    throw std::invalid_argument("deep_ep_jax: buffer " + std::to_string(buffer_id) + " does not exist");
  }
  std::vector<DeviceState> states;
  for (int device : it->second) states.push_back(device_states.at({buffer_id, device}));
  return states;
}

int NumLiveBuffers() {
  std::shared_lock<std::shared_mutex> lock(registry_mutex);
  return int(buffer_devices.size());
}

int DeviceSmCount(int device_ordinal) {
  constexpr int kMaxDevices = 64, kFallback = 132;
  static std::atomic<int> cache[kMaxDevices];
  if (device_ordinal < 0 || device_ordinal >= kMaxDevices) return kFallback;
  int n = cache[device_ordinal].load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device_ordinal) != cudaSuccess || n <= 0) {
      cudaGetLastError();
      n = kFallback;
    }
    cache[device_ordinal].store(n, std::memory_order_relaxed);
  }
  return n;
}

}  // namespace deep_ep_jax
