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
    throw std::invalid_argument("deep_ep_jax: an NVSHMEM unique id has " + std::to_string(sizeof(id)) +
                                " bytes, got " + std::to_string(unique_id.size()));
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
  CheckStatus(nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version),
              "NVSHMEM initialisation (unique-id bootstrap, PE " + std::to_string(pe) + " of " +
                  std::to_string(num_pes) + ")");
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

int64_t CreateBuffer(int device, int rank, const std::vector<int>& pes, const std::vector<bool>& same_host,
                     size_t low_latency_bytes, size_t send_bytes) {
  const int num_ranks = int(pes.size());
  if (!Initialized() || device != init_device) {
    throw std::runtime_error("deep_ep_jax: NVSHMEM is not initialised on device " + std::to_string(device));
  }
  if (num_ranks < 1 || num_ranks > kMaxRanks || same_host.size() != pes.size() || rank < 0 || rank >= num_ranks) {
    throw std::invalid_argument("deep_ep_jax: an NVSHMEM buffer's EP group must have 1.." +
                                std::to_string(kMaxRanks) + " ranks, one PE and one same-host flag each");
  }
  if (pes[rank] != nvshmem_my_pe()) {
    throw std::invalid_argument("deep_ep_jax: rank " + std::to_string(rank) + " is PE " + std::to_string(pes[rank]) +
                                ", but this process is PE " + std::to_string(nvshmem_my_pe()));
  }
  Check(cudaSetDevice(device), "cudaSetDevice");
  const size_t region = std::max(low_latency_bytes, kControlBytes);
  char* local = static_cast<char*>(nvshmem_malloc(region + send_bytes));  // collective
  if (local == nullptr) {
    throw std::runtime_error(
        "deep_ep_jax: nvshmem_malloc of " + std::to_string(region + send_bytes) + " bytes (" +
        std::to_string((region + send_bytes) >> 20) + " MiB: low-latency region and send area) failed on device " +
        std::to_string(device) + ": the symmetric heap is too small or GPU memory is short. Set "
        "NVSHMEM_SYMMETRIC_SIZE (bytes, before the first Buffer) to hold every Buffer across hosts, and "
        "XLA_PYTHON_CLIENT_PREALLOCATE=false or a lower XLA_PYTHON_CLIENT_MEM_FRACTION");
  }
  cudaError_t err = cudaMemset(local, 0, region);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) nvshmem_free(local);  // still collective: the others free too, then fail alike
  Check(err, "zeroing the low-latency region on device " + std::to_string(device));
  nvshmem_barrier_all();  // every PE's region is zeroed before any kernel writes to it

  DeviceState s;
  s.device_ordinal = device;
  s.rank = rank;
  s.num_ranks = num_ranks;
  s.nvshmem = true;
  s.low_latency.local = local;
  s.low_latency.num_bytes = region;
  s.send_bytes = send_bytes;
  for (int r = 0; r < num_ranks; ++r) {
    s.pes[r] = pes[r];
    // Null (NVSHMEM's transports) for other hosts, and where NVSHMEM cannot map the peer.
    if (r == rank) {
      s.low_latency.peers[r] = local;
    } else if (same_host[r]) {
      s.low_latency.peers[r] = static_cast<char*>(nvshmem_ptr(local, pes[r]));
    }
  }
  return RegisterExternalBuffer(s, [device, local] {
    cudaSetDevice(device);
    nvshmem_free(local);  // collective
  });
}

}  // namespace nvshmem
}  // namespace deep_ep_jax
