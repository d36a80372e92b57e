// NVSHMEM runtime: unique-id bootstrap, symmetric-heap buffers (see nvshmem.h).
// A .cu compiled with -rdc=true: nvshmemi_init_thread lives in
// libnvshmem_device.a and initialises the device state of the module it is
// linked into, ours.
#include "runtime/nvshmem.h"

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <stdexcept>

#include "runtime/registry.h"

namespace deep_ep_jax {
namespace nvshmem {
namespace {

std::mutex init_mutex;
bool initialized = false;
int init_device = -1;

void Check(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error("deep_ep_jax: " + what + " failed: " + cudaGetErrorString(err));
  }
}

void CheckStatus(int status, const std::string& what) {
  if (status != 0) {
    throw std::runtime_error("deep_ep_jax: " + what + " failed with status " + std::to_string(status) +
                             " (NVSHMEM_DEBUG=INFO shows NVSHMEM's own log)");
  }
}

}  // namespace

std::string UniqueId() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  CheckStatus(nvshmemx_get_uniqueid(&id), "nvshmemx_get_uniqueid");
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

void Init(int device, int pe, int num_pes, const std::string& unique_id) {
  std::lock_guard<std::mutex> lock(init_mutex);
  if (initialized) {
    if (device != init_device) {
      throw std::runtime_error("deep_ep_jax: NVSHMEM is initialised on device " + std::to_string(init_device) +
                               ", not " + std::to_string(device) + " (one PE, one GPU per process)");
    }
    return;
  }
  nvshmemx_uniqueid_t id;
  if (unique_id.size() != sizeof(id)) {
    throw std::invalid_argument("deep_ep_jax: an NVSHMEM unique id has " + std::to_string(sizeof(id)) + " bytes, got " +
                                std::to_string(unique_id.size()));
  }
  std::memcpy(&id, unique_id.data(), sizeof(id));
  // NVSHMEM binds the PE to the current device (its primary context, XLA's too).
  Check(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  Check(cudaFree(nullptr), "initialising the CUDA context of device " + std::to_string(device));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  CheckStatus(nvshmemx_set_attr_uniqueid_args(pe, num_pes, &id, &attr), "nvshmemx_set_attr_uniqueid_args");
  // What nvshmemx_init_attr does, minus its exit(-1) on failure: we raise.
  int provided = 0;
  const nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                      NVSHMEM_VENDOR_PATCH_VERSION};
  CheckStatus(
      nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version),
      "NVSHMEM initialisation (unique-id bootstrap, PE " + std::to_string(pe) + " of " + std::to_string(num_pes) + ")");
  if (nvshmem_my_pe() != pe || nvshmem_n_pes() != num_pes) {
    throw std::runtime_error("deep_ep_jax: NVSHMEM came up as PE " + std::to_string(nvshmem_my_pe()) + " of " +
                             std::to_string(nvshmem_n_pes()) + ", expected " + std::to_string(pe) + " of " +
                             std::to_string(num_pes));
  }
  initialized = true;
  init_device = device;
}

bool Initialized() {
  std::lock_guard<std::mutex> lock(init_mutex);
  return initialized;
}

void Finalize() {
  std::lock_guard<std::mutex> lock(init_mutex);
  if (!initialized) return;
  Check(cudaSetDevice(init_device), "cudaSetDevice");
  nvshmem_finalize();
  initialized = false;
}

namespace {

// nvshmem_malloc (collective) of `bytes`, the first `zero_bytes` zeroed on every PE.
char* AllocateZeroed(int device, size_t bytes, size_t zero_bytes, const std::string& what) {
  char* p = static_cast<char*>(nvshmem_malloc(bytes));
  if (p == nullptr) {
    throw std::runtime_error(
        "deep_ep_jax: nvshmem_malloc of " + std::to_string(bytes) + " bytes (" + std::to_string(bytes >> 20) +
        " MiB: " + what + ") failed on device " + std::to_string(device) +
        ": the symmetric heap is too small or GPU memory is short. Set NVSHMEM_SYMMETRIC_SIZE (bytes, before the "
        "first Buffer) to hold every Buffer across hosts, and XLA_PYTHON_CLIENT_PREALLOCATE=false or a lower "
        "XLA_PYTHON_CLIENT_MEM_FRACTION");
  }
  cudaError_t err = cudaMemset(p, 0, zero_bytes);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) nvshmem_free(p);  // still collective: the others free too, then fail alike
  Check(err, "zeroing the " + what + " on device " + std::to_string(device));
  return p;
}

}  // namespace

int64_t CreateBuffer(int device, int rank, const std::vector<int>& pes, const std::vector<int>& nodes,
                     size_t normal_bytes, size_t low_latency_bytes, size_t send_bytes) {
  const int num_ranks = int(pes.size());
  if (!Initialized() || device != init_device) {
    throw std::runtime_error("deep_ep_jax: NVSHMEM is not initialised on device " + std::to_string(device));
  }
  if (num_ranks < 1 || num_ranks > kMaxGroupRanks || nodes.size() != pes.size() || rank < 0 || rank >= num_ranks) {
    throw std::invalid_argument("deep_ep_jax: an NVSHMEM buffer's EP group must have 1.." +
                                std::to_string(kMaxGroupRanks) + " ranks, one PE and one host index each");
  }
  for (int n : nodes) {
    if (n < 0 || n >= num_ranks) throw std::invalid_argument("deep_ep_jax: host indices must be in [0, ranks)");
  }
  const int num_nodes = *std::max_element(nodes.begin(), nodes.end()) + 1;
  // One node (an NVLink domain across hosts) runs the one-node kernels.
  const int max_normal_ranks = num_nodes == 1 ? kMaxNvlinkRanks : kMaxInternodeNormalRanks;
  if (normal_bytes > 0 && num_ranks > max_normal_ranks) {
    throw std::invalid_argument(
        "deep_ep_jax: normal mode " + std::string(num_nodes == 1 ? "in one NVLink domain" : "across hosts") +
        " supports at most " + std::to_string(max_normal_ranks) + " ranks in all, the EP group has " +
        std::to_string(num_ranks) + " (low-latency mode: " + std::to_string(kMaxGroupRanks) +
        "); create the buffer without a normal region");
  }
  if (normal_bytes > 0 && num_nodes > 1) {  // internode normal mode: nodes of equal size
    for (int b = 0; b < num_nodes; ++b) {
      const int size = int(std::count(nodes.begin(), nodes.end(), b));
      if (size * num_nodes != num_ranks || size > kMaxInternodeHostRanks) {
        throw std::invalid_argument("deep_ep_jax: normal mode across hosts needs hosts of equal size, at most " +
                                    std::to_string(kMaxInternodeHostRanks) + " ranks each; host " + std::to_string(b) +
                                    " has " + std::to_string(size) + " of " + std::to_string(num_ranks));
      }
    }
  }
  if (pes[rank] != nvshmem_my_pe()) {
    throw std::invalid_argument("deep_ep_jax: rank " + std::to_string(rank) + " is PE " + std::to_string(pes[rank]) +
                                ", but this process is PE " + std::to_string(nvshmem_my_pe()));
  }
  Check(cudaSetDevice(device), "cudaSetDevice");
  const size_t region = std::max(low_latency_bytes, kControlBytes);
  char* local = AllocateZeroed(device, region + send_bytes, region, "low-latency region and send area");
  char* normal = nullptr;
  if (normal_bytes > 0) {
    const size_t normal_region = std::max(normal_bytes, kControlBytes);
    try {
      // All of it: the synchronisation area after the control bytes grows with the group (kernels/internode.h).
      normal = AllocateZeroed(device, normal_region, normal_region, "normal-mode region");
    } catch (...) {
      nvshmem_free(local);
      throw;
    }
    normal_bytes = normal_region;
  }
  nvshmem_barrier_all();  // every PE's regions are zeroed before any kernel writes to them

  DeviceState s;
  s.device_ordinal = device;
  s.rank = rank;
  s.num_ranks = num_ranks;
  s.nvshmem = true;
  s.ipc = true;  // peers in other processes: the one-node kernels exchange offsets and stage rows
  s.low_latency.local = local;
  s.low_latency.num_bytes = region;
  s.normal.local = normal;
  s.normal.num_bytes = normal_bytes;
  s.send_bytes = send_bytes;
  s.pes = pes;
  s.nodes = nodes;
  s.low_latency.peers.assign(num_ranks, nullptr);
  s.normal.peers.assign(num_ranks, nullptr);
  for (int r = 0; r < num_ranks; ++r) {
    // Null (NVSHMEM's transports) for other hosts, and where NVSHMEM cannot map the peer.
    if (r == rank) {
      s.low_latency.peers[r] = local;
      s.normal.peers[r] = normal;
    } else if (nodes[r] == nodes[rank]) {
      s.low_latency.peers[r] = static_cast<char*>(nvshmem_ptr(local, pes[r]));
      if (normal != nullptr) {
        s.normal.peers[r] = static_cast<char*>(nvshmem_ptr(normal, pes[r]));
        // Normal mode moves rows over NVLink within a node: it needs the mapping.
        if (s.normal.peers[r] == nullptr) {
          // Not freed: nvshmem_free is collective, and PEs of other hosts do not
          // fail here; the memory goes with the process (the job cannot run).
          throw std::runtime_error(
              "deep_ep_jax: NVSHMEM cannot map rank " + std::to_string(r) + " (PE " + std::to_string(pes[r]) +
              ") of this node into device " + std::to_string(device) +
              " (nvshmem_ptr is null): normal mode needs NVLink/P2P between the GPUs of a node (a host, or an NVLink "
              "domain across hosts, which NVSHMEM maps where the fabric and IMEX allow); set "
              "DEEP_EP_JAX_NVLINK_DOMAIN=none to keep nodes within hosts, or DEEP_EP_JAX_GPUS_PER_NVLINK_DOMAIN=1 to "
              "make each GPU a node");
        }
      }
    }
  }
  s.num_nodes = num_nodes;
  // As the mapping failure above: on failure the symmetric memory stays (its free is collective).
  UploadPeerTable(s);
  return RegisterExternalBuffer(s, [device, local, normal] {
    cudaSetDevice(device);
    if (normal != nullptr) nvshmem_free(normal);  // collective
    nvshmem_free(local);
  });
}

}  // namespace nvshmem
}  // namespace deep_ep_jax
