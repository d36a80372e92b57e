// The pybind11 module deep_ep_jax._C: FFI handler capsules, the buffer
// registry, and what the info report needs to know about the build and GPUs.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ffi/registration.h"
#include "runtime/registry.h"
#ifdef DEEP_EP_JAX_WITH_NVSHMEM
#include "runtime/nvshmem.h"
#endif

#ifndef DEEP_EP_JAX_CUDA_ARCHS
#define DEEP_EP_JAX_CUDA_ARCHS ""
#endif

namespace py = pybind11;

namespace deep_ep_jax {
namespace {

py::dict FfiTargetCapsules() {
  py::dict targets;
  for (const auto& [name, target] : FfiTargets()) {
    targets[py::str(name)] = py::capsule(reinterpret_cast<void*>(target.handler));
  }
  return targets;
}

std::map<std::string, std::vector<std::string>> FfiOutputs() {
  std::map<std::string, std::vector<std::string>> outputs;
  for (const auto& [name, target] : FfiTargets()) outputs[name] = target.results;
  return outputs;
}

std::vector<std::string> CudaArchs() {
  std::vector<std::string> archs;
  std::string all = DEEP_EP_JAX_CUDA_ARCHS;
  size_t start = 0;
  while (start < all.size()) {
    size_t end = all.find(',', start);
    if (end == std::string::npos) end = all.size();
    if (end > start) archs.push_back(all.substr(start, end - start));
    start = end + 1;
  }
  return archs;
}

std::string VersionString(int version) {
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

// Never throws: on a machine without a driver or GPU it reports the error.
py::dict DeviceInfo() {
  py::dict info;
  info["cuda_version_compiled"] = VersionString(CUDART_VERSION);
  int driver = 0;
  info["driver_cuda_version"] =
      cudaDriverGetVersion(&driver) == cudaSuccess && driver > 0 ? py::str(VersionString(driver)) : py::str("none");
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    info["error"] = std::string(cudaGetErrorString(err));
    count = 0;
  } else {
    info["error"] = py::none();
  }
  py::list devices;
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, d) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    char pci[32] = {};
    cudaDeviceGetPCIBusId(pci, sizeof(pci), d);
    py::dict dev;
    dev["ordinal"] = d;
    dev["name"] = std::string(prop.name);
    dev["compute_capability"] = std::to_string(prop.major) + "." + std::to_string(prop.minor);
    dev["sm_count"] = prop.multiProcessorCount;
    dev["total_memory_bytes"] = prop.totalGlobalMem;
    dev["pci_bus_id"] = std::string(pci);
    devices.append(dev);
  }
  info["devices"] = devices;
  // [i][j]: can device i access device j's memory; P2P performance rank
  // (lower is faster; NVLink ranks above PCIe); native atomics over the link.
  py::list can_access, performance_rank, native_atomics;
  for (int i = 0; i < count; ++i) {
    py::list access_row, rank_row, atomic_row;
    for (int j = 0; j < count; ++j) {
      int access = i == j, rank = 0, atomics = i == j;
      if (i != j) {
        cudaDeviceCanAccessPeer(&access, i, j);
        cudaDeviceGetP2PAttribute(&rank, cudaDevP2PAttrPerformanceRank, i, j);
        cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, i, j);
        cudaGetLastError();
      }
      access_row.append(bool(access));
      rank_row.append(rank);
      atomic_row.append(bool(atomics));
    }
    can_access.append(access_row);
    performance_rank.append(rank_row);
    native_atomics.append(atomic_row);
  }
  info["can_access_peer"] = can_access;
  info["p2p_performance_rank"] = performance_rank;
  info["p2p_native_atomics"] = native_atomics;
  return info;
}

// (free, total) bytes of a device, as the driver sees them: our buffers are
// plain cudaMalloc, outside XLA's allocator, so lifecycle tests read this.
std::pair<size_t, size_t> MemGetInfo(int device) {
  int previous = 0;
  size_t free_bytes = 0, total_bytes = 0;
  cudaGetDevice(&previous);
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaMemGetInfo(&free_bytes, &total_bytes);
  cudaSetDevice(previous);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string("cudaMemGetInfo failed: ") + cudaGetErrorString(err));
  }
  return {free_bytes, total_bytes};
}

// (buffer id, IPC handles per local device as bytes), for Python to trade.
py::tuple CreateIpcBufferPy(const std::vector<std::vector<int>>& groups, size_t normal_bytes,
                            size_t low_latency_bytes) {
  IpcBuffer buffer;
  {
    py::gil_scoped_release release;
    buffer = CreateIpcBuffer(groups, normal_bytes, low_latency_bytes);
  }
  py::list handles;
  for (const std::string& h : buffer.handles) handles.append(py::bytes(h));
  return py::make_tuple(buffer.buffer_id, handles);
}

}  // namespace
}  // namespace deep_ep_jax

PYBIND11_MODULE(_C, m) {
  using namespace deep_ep_jax;
  m.doc() = "deep_ep_jax CUDA extension: XLA FFI handlers and the communication buffer registry";
  m.def("ffi_targets", &FfiTargetCapsules, "dict: FFI target name -> PyCapsule of its handler");
  m.def("ffi_outputs", &FfiOutputs, "dict: FFI target name -> the names of its results, in order");
  m.def("create_buffer", &CreateBuffer, py::arg("groups"), py::arg("normal_bytes"), py::arg("low_latency_bytes"),
        py::call_guard<py::gil_scoped_release>(),
        "Allocates the buffer on every device of each group (device ordinals, rank = position); returns its id");
  m.def("destroy_buffer", &DestroyBuffer, py::arg("buffer_id"), py::call_guard<py::gil_scoped_release>(),
        "Synchronises the buffer's devices, closes its IPC mappings and frees its memory; an unknown id raises "
        "ValueError");
  m.def("create_ipc_buffer", &CreateIpcBufferPy, py::arg("groups"), py::arg("normal_bytes"),
        py::arg("low_latency_bytes"),
        "One process per GPU: allocates the buffer on this process's devices of each group (device ordinal per "
        "rank, -1 for a rank of another process); returns (id, [IPC handle bytes per local device, group order])");
  m.def("open_ipc_peers", &OpenIpcPeers, py::arg("buffer_id"), py::arg("handles"),
        py::call_guard<py::gil_scoped_release>(),
        "Opens the peers' IPC handles (handles[group][rank] bytes; local ranks ignored) to map their regions");
  m.def("synchronize_buffer", &SynchronizeBuffer, py::arg("buffer_id"), py::call_guard<py::gil_scoped_release>(),
        "Waits for all work on the buffer's devices");
  m.def("num_live_buffers", &NumLiveBuffers);
  m.def("cuda_archs", &CudaArchs, "GPU architectures compiled in, e.g. ['sm_90']");
  m.def("mem_get_info", &MemGetInfo, py::arg("device"), "(free, total) bytes of a CUDA device (cudaMemGetInfo)");
  m.def("device_info", &DeviceInfo, "CUDA devices, peer access and P2P attributes (for deep_ep_jax.info)");
  // EP groups across hosts (deep_ep_jax/nvshmem.py); absent from a build without NVSHMEM.
#ifdef DEEP_EP_JAX_WITH_NVSHMEM
  m.attr("with_nvshmem") = true;
  m.def("nvshmem_unique_id", [] { return py::bytes(nvshmem::UniqueId()); },
        "A fresh NVSHMEM unique id (PE 0, before nvshmem_init), as bytes");
  m.def("nvshmem_init", [](int device, int pe, int num_pes, const py::bytes& unique_id) {
          std::string id = unique_id;
          py::gil_scoped_release release;
          nvshmem::Init(device, pe, num_pes, id);
        },
        py::arg("device"), py::arg("pe"), py::arg("num_pes"), py::arg("unique_id"),
        "Collective: NVSHMEM on `device` as PE `pe` of `num_pes` (unique-id bootstrap)");
  m.def("nvshmem_initialized", &nvshmem::Initialized);
  m.def("nvshmem_finalize", &nvshmem::Finalize, py::call_guard<py::gil_scoped_release>(),
        "Collective: shuts NVSHMEM down (after every NVSHMEM buffer is destroyed)");
  m.def("create_nvshmem_buffer", &nvshmem::CreateBuffer, py::arg("device"), py::arg("rank"), py::arg("pes"),
        py::arg("nodes"), py::arg("normal_bytes"), py::arg("low_latency_bytes"),
        py::arg("send_bytes"), py::call_guard<py::gil_scoped_release>(),
        "Collective: the normal region (none when 0) and the low-latency region (and send area) in the symmetric "
        "heap for `rank` of an EP group across hosts; pes[r] and nodes[r] (host index) per rank. Returns the "
        "buffer id");
#else
  m.attr("with_nvshmem") = false;
#endif
}
