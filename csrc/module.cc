// The pybind11 module deep_ep_jax._C: FFI handler capsules and their results'
// names, the kernels' limits and the sizes of the memory they lay out (so that
// Python sizes buffers with the same code), the buffer registry, and what the
// info report needs to know about the build and GPUs.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/traffic.h"
#include "ffi/registration.h"
#include "kernels/internode.h"
#include "kernels/intranode.h"
#include "kernels/layout.h"
#include "kernels/low_latency.h"
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

// ---------------------------------------------------------------------------
// Limits and sizes (the interface with deep_ep_jax/backends).

// One value each for both normal-mode paths: Python checks its Config against it.
static_assert(intranode::kMaxBlocks == internode::kMaxBlocks && intranode::kMaxWarps == internode::kMaxWarps &&
                  intranode::kMaxLocalExperts == internode::kMaxLocalExperts,
              "normal mode's limits differ between one host and several");

std::map<std::string, int64_t> Limits() {
  return {
      // Ranks of an EP group: low-latency mode serves any group up to
      // max_group_ranks; normal mode one NVLink domain on one host (up to
      // max_nvlink_ranks), and up to max_internode_normal_ranks across hosts
      // of at most max_internode_host_ranks.
      {"max_group_ranks", kMaxGroupRanks},
      {"max_nvlink_ranks", kMaxNvlinkRanks},
      {"max_internode_host_ranks", kMaxInternodeHostRanks},
      {"max_internode_normal_ranks", kMaxInternodeNormalRanks},
      {"control_bytes", int64_t(kControlBytes)},
      {"max_local_experts", intranode::kMaxLocalExperts},
      {"fp8_block", low_latency::kFp8Block},
      {"mxfp8_block", low_latency::kMxfp8Block},
      {"low_latency_max_topk", low_latency::kMaxTopk},
      {"low_latency_max_experts", low_latency::kMaxExperts},
      {"low_latency_max_shared_bytes", int64_t(low_latency::kMaxSharedBytes)},
      {"max_layout_bins", kMaxLayoutBins},
      {"max_blocks", intranode::kMaxBlocks},
      {"max_warps", intranode::kMaxWarps},
      {"max_amax_strip_rows", kMaxAmaxStripRows},
      {"amax_band_cols", kAmaxBandCols},
  };
}

// A count or size argument: the kernels take them as int (ValueError otherwise).
int CountArg(const char* fn, const char* name, int64_t value) {
  if (value < 0 || value > INT_MAX) {
    throw std::invalid_argument(std::string(fn) + ": " + name + " must be in [0, " + std::to_string(INT_MAX) +
                                "], got " + std::to_string(value));
  }
  return int(value);
}

size_t StagedRegionBytes(int64_t num_rows, int64_t row_bytes, int64_t scale_bytes, int64_t num_topk, int64_t num_chunks,
                         int64_t num_ranks) {
  const char* fn = "staged_region_bytes";
  const int64_t rows[intranode::kMaxRowArrays] = {CountArg(fn, "row_bytes", row_bytes),
                                                  CountArg(fn, "scale_bytes", scale_bytes)};
  if (num_ranks < 1 || num_ranks > kMaxNvlinkRanks) {
    throw std::invalid_argument(std::string(fn) + ": num_ranks must be in [1, " + std::to_string(kMaxNvlinkRanks) +
                                "], got " + std::to_string(num_ranks));
  }
  return intranode::StagedRegionBytes(CountArg(fn, "num_rows", num_rows), rows, CountArg(fn, "num_topk", num_topk),
                                      CountArg(fn, "num_chunks", num_chunks), int(num_ranks));
}

// The internode layout is header code: its sizes are known in a build without NVSHMEM too.
void CheckEqualHosts(const char* fn, int ranks, int nodes) {
  if (nodes < 1 || ranks % nodes != 0) {
    throw std::invalid_argument(std::string(fn) +
                                ": num_ranks must be a multiple of num_nodes (hosts of equal size), got " +
                                std::to_string(ranks) + " and " + std::to_string(nodes));
  }
}

size_t InternodeDispatchRegionBytes(int64_t num_tokens, int64_t num_rows, int64_t num_topk, int64_t row_bytes,
                                    int64_t scale_bytes, int64_t num_ranks, int64_t num_nodes) {
  const char* fn = "internode_dispatch_region_bytes";
  const internode::Shapes shapes{CountArg(fn, "num_tokens", num_tokens),
                                 CountArg(fn, "num_rows", num_rows),
                                 CountArg(fn, "num_topk", num_topk),
                                 {CountArg(fn, "row_bytes", row_bytes), CountArg(fn, "scale_bytes", scale_bytes)}};
  const int ranks = CountArg(fn, "num_ranks", num_ranks), nodes = CountArg(fn, "num_nodes", num_nodes);
  CheckEqualHosts(fn, ranks, nodes);
  return internode::DispatchRegionBytes(shapes, ranks, nodes);
}

// The parts of the internode region that grow with the group: control bytes
// and synchronisation area (R alone), and combine's slots (R * T rows).
size_t InternodeSyncBytes(int64_t num_ranks) {
  return internode::SyncBytes(CountArg("internode_sync_bytes", "num_ranks", num_ranks));
}

size_t InternodeCombineSlotBytes(int64_t num_tokens, int64_t num_topk, int64_t hidden, int64_t num_ranks) {
  const char* fn = "internode_combine_slot_bytes";
  const internode::Shapes shapes{CountArg(fn, "num_tokens", num_tokens),
                                 0,
                                 CountArg(fn, "num_topk", num_topk),
                                 {2 * int64_t(CountArg(fn, "hidden", hidden)), 0}};
  return internode::CombineSlotBytes(shapes, CountArg(fn, "num_ranks", num_ranks));
}

size_t InternodeCombineRegionBytes(int64_t num_tokens, int64_t num_rows, int64_t num_topk, int64_t hidden,
                                   int64_t num_ranks, int64_t num_nodes) {
  const char* fn = "internode_combine_region_bytes";
  const internode::Shapes shapes{CountArg(fn, "num_tokens", num_tokens),
                                 CountArg(fn, "num_rows", num_rows),
                                 CountArg(fn, "num_topk", num_topk),
                                 {2 * int64_t(CountArg(fn, "hidden", hidden)), 0}};
  const int ranks = CountArg(fn, "num_ranks", num_ranks), nodes = CountArg(fn, "num_nodes", num_nodes);
  CheckEqualHosts(fn, ranks, nodes);
  return internode::CombineRegionBytes(shapes, ranks, nodes);
}

size_t LowLatencyDispatchHalfBytes(int64_t num_ranks, int64_t num_local_experts, int64_t max_tokens, int64_t num_topk,
                                   int64_t hidden, bool fp8) {
  const char* fn = "low_latency_dispatch_half_bytes";
  return low_latency::MakeDispatchLayout(CountArg(fn, "num_ranks", num_ranks),
                                         CountArg(fn, "num_local_experts", num_local_experts),
                                         CountArg(fn, "max_tokens", max_tokens), CountArg(fn, "num_topk", num_topk),
                                         CountArg(fn, "hidden", hidden), fp8)
      .bytes;
}

size_t LowLatencyCombineHalfBytes(int64_t max_tokens, int64_t num_topk, int64_t hidden) {
  const char* fn = "low_latency_combine_half_bytes";
  return low_latency::CombineBytes(CountArg(fn, "max_tokens", max_tokens), CountArg(fn, "num_topk", num_topk),
                                   CountArg(fn, "hidden", hidden));
}

// Halves hold whole multiples of this (low_latency::HalfBytes rounds down to it).
constexpr size_t kHalfAlign = 256;

// The smallest region whose halves (low_latency::HalfBytes) hold a dispatch
// of bf16 rows (FP8 rows are smaller) and a combine of these shapes.
size_t LowLatencyRegionBytes(int64_t num_ranks, int64_t num_local_experts, int64_t hidden, int64_t max_tokens,
                             int64_t num_topk) {
  const char* fn = "low_latency_region_bytes";
  const int ranks = CountArg(fn, "num_ranks", num_ranks), local = CountArg(fn, "num_local_experts", num_local_experts);
  const int h = CountArg(fn, "hidden", hidden), m = CountArg(fn, "max_tokens", max_tokens);
  const int k = CountArg(fn, "num_topk", num_topk);
  const size_t half =
      std::max(low_latency::MakeDispatchLayout(ranks, local, m, k, h, false).bytes, low_latency::CombineBytes(m, k, h));
  return kControlBytes + 2 * low_latency::AlignUp(half, kHalfAlign);
}

// A combine's staged rows across hosts: one bf16 row per (source rank,
// token, k), R * M * K * H * 2 bytes, the term of the send area that grows
// with the group (low_latency::CombineStageBytes).
size_t LowLatencyCombineStageBytes(int64_t num_ranks, int64_t hidden, int64_t max_tokens, int64_t num_topk) {
  const char* fn = "low_latency_combine_stage_bytes";
  return low_latency::CombineStageBytes(CountArg(fn, "num_ranks", num_ranks), CountArg(fn, "max_tokens", max_tokens),
                                        CountArg(fn, "num_topk", num_topk), CountArg(fn, "hidden", hidden));
}

// The send area of a buffer across hosts: a dispatch's staged bf16 rows or a combine's.
size_t LowLatencySendBytes(int64_t num_ranks, int64_t hidden, int64_t max_tokens, int64_t num_topk) {
  const char* fn = "low_latency_send_bytes";
  const int h = CountArg(fn, "hidden", hidden);
  const int m = CountArg(fn, "max_tokens", max_tokens), k = CountArg(fn, "num_topk", num_topk);
  const size_t dispatch = low_latency::DispatchStageBytes(m, k, low_latency::DispatchRowBytes(h, false));
  const size_t combine = LowLatencyCombineStageBytes(num_ranks, hidden, max_tokens, num_topk);
  return low_latency::AlignUp(std::max(dispatch, combine), kHalfAlign);
}

size_t LowLatencyHalfBytes(int64_t region_bytes) {
  if (region_bytes < 0) throw std::invalid_argument("low_latency_half_bytes: region_bytes must be >= 0");
  return low_latency::HalfBytes(size_t(region_bytes));
}

size_t LowLatencySharedBytes(int64_t num_ranks, int64_t num_experts, int64_t hidden, bool fp8) {
  const char* fn = "low_latency_shared_bytes";
  return low_latency::SharedBytesNeeded(CountArg(fn, "num_ranks", num_ranks), CountArg(fn, "num_experts", num_experts),
                                        CountArg(fn, "hidden", hidden), fp8);
}

// ---------------------------------------------------------------------------

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

// Runs normal(state) on each of the buffer's normal regions (one host or
// across hosts) on this process's devices and low_latency(state) on each
// low-latency region, after synchronising the devices (test hooks, counters).
template <typename Normal, typename LowLatency>
void ForEachRegion(const char* hook, int64_t buffer_id, Normal normal, LowLatency low_latency) {
  SynchronizeBuffer(buffer_id);
  int previous = 0;
  cudaGetDevice(&previous);
  for (const DeviceState& s : DeviceStatesOf(buffer_id)) {
    cudaError_t err = cudaSetDevice(s.device_ordinal);
    if (err == cudaSuccess && s.normal.local != nullptr) err = normal(s);
    if (err == cudaSuccess && s.low_latency.local != nullptr) err = low_latency(s);
    if (err != cudaSuccess) {
      cudaGetLastError();
      cudaSetDevice(previous);
      throw std::runtime_error(std::string(hook) + " on device " + std::to_string(s.device_ordinal) + ": " +
                               cudaGetErrorString(err));
    }
  }
  cudaSetDevice(previous);
}

// Test hook: rewrites the control blocks of the buffer's regions on this
// process's devices (normal and low-latency) as if `seq` calls had run in
// each mode, so that a test can run calls across the 2^31 and 2^32 wraps of
// the sequence numbers. seq in [-2^31, 2^32), taken modulo 2^32. Synchronises
// the devices first; with peers in other processes, every process must have
// synchronised and met at a barrier before, and meet again after (no peer
// may write a flag meanwhile).
void SetSequenceForTesting(int64_t buffer_id, int64_t seq) {
  if (seq < int64_t(INT32_MIN) || seq > int64_t(UINT32_MAX)) {
    throw std::invalid_argument("set_sequence_for_testing: seq must be in [-2^31, 2^32), got " + std::to_string(seq));
  }
  const int value = int(uint32_t(seq));
  ForEachRegion(
      "set_sequence_for_testing", buffer_id,
      [value](const DeviceState& s) {
#ifdef DEEP_EP_JAX_WITH_NVSHMEM
        if (s.nvshmem && s.num_nodes > 1) return internode::SetSequenceForTesting(s.normal.local, s.num_ranks, value);
#endif
        return intranode::SetSequenceForTesting(s.normal.local, value);
      },
      [value](const DeviceState& s) { return low_latency::SetSequenceForTesting(s.low_latency.local, value); });
}

// Test hook: marks the buffer's regions on this process's devices as if a
// call were running there (normal and low-latency), so that the next call
// stops as overlapping (kernels/device.cuh, EnterCall). Synchronises first.
void MarkCallRunningForTesting(int64_t buffer_id) {
  ForEachRegion(
      "mark_call_running_for_testing", buffer_id,
      [](const DeviceState& s) {
#ifdef DEEP_EP_JAX_WITH_NVSHMEM
        if (s.nvshmem && s.num_nodes > 1) return internode::MarkCallRunningForTesting(s.normal.local);
#endif
        return intranode::MarkCallRunningForTesting(s.normal.local);
      },
      [](const DeviceState& s) { return low_latency::MarkCallRunningForTesting(s.low_latency.local); });
}

// Per rank of this process: counters of one kind, a list per call or receive kind.
using Counters = std::vector<std::pair<int, std::vector<std::vector<unsigned long long>>>>;

// The traffic counters (common/traffic.h) of the buffer's normal regions on
// this process's devices, after synchronising them: [(rank, [[nvlink_rows,
// nvlink_bytes, network_rows, network_bytes] per call kind])]; with `reset`,
// zeroes them instead (and returns nothing).
Counters TrafficOf(int64_t buffer_id, bool reset) {
  Counters result;
  auto traffic = [&](const DeviceState& s) {
    TrafficCounters counters[kTrafficKinds] = {};
    const cudaError_t err =
        reset ? cudaMemcpy(s.normal.local + kTrafficOffset, counters, sizeof(counters), cudaMemcpyHostToDevice)
              : cudaMemcpy(counters, s.normal.local + kTrafficOffset, sizeof(counters), cudaMemcpyDeviceToHost);
    std::vector<std::vector<unsigned long long>> kinds;
    for (const TrafficCounters& c : counters) {
      kinds.push_back({c.nvlink_rows, c.nvlink_bytes, c.network_rows, c.network_bytes});
    }
    if (err == cudaSuccess && !reset) result.emplace_back(s.rank, kinds);
    return err;
  };
  ForEachRegion(reset ? "reset_traffic" : "read_traffic", buffer_id, traffic,
                [](const DeviceState&) { return cudaSuccess; });
  return result;
}

// The wait-time counters (kernels/low_latency.h) of the buffer's low-latency
// regions on this process's devices, after synchronising them: [(rank,
// [[ns waited for each source] per receive kind: dispatch, combine])]; with
// `reset`, zeroes them instead (and returns nothing).
Counters WaitTimesOf(int64_t buffer_id, bool reset) {
  Counters result;
  auto wait_times = [&](const DeviceState& s) {
    const size_t n = size_t(s.num_ranks);
    std::vector<unsigned long long> host(low_latency::kWaitKinds * n);
    const cudaError_t err = low_latency::CopyWaitTimes(s.low_latency.local, s.num_ranks, host.data(), reset);
    std::vector<std::vector<unsigned long long>> kinds;
    for (int kind = 0; kind < low_latency::kWaitKinds; ++kind) {
      kinds.emplace_back(host.begin() + kind * n, host.begin() + (kind + 1) * n);
    }
    if (err == cudaSuccess && !reset) result.emplace_back(s.rank, kinds);
    return err;
  };
  ForEachRegion(
      reset ? "reset_wait_times" : "read_wait_times", buffer_id, [](const DeviceState&) { return cudaSuccess; },
      wait_times);
  return result;
}

// The masks (Config.mask_failed_ranks) of the buffer's low-latency regions on
// this process's devices, after synchronising them: [(device ordinal, [ranks
// that device's rank has masked])].
std::vector<std::pair<int, std::vector<int>>> MasksOf(int64_t buffer_id) {
  std::vector<std::pair<int, std::vector<int>>> result;
  auto mask = [&](const DeviceState& s) {
    std::vector<int> host(size_t(s.num_ranks));
    const cudaError_t err = low_latency::CopyMask(s.low_latency.local, s.num_ranks, host.data());
    std::vector<int> masked;
    for (int r = 0; r < s.num_ranks; ++r) {
      if (host[r] != 0) masked.push_back(r);
    }
    if (err == cudaSuccess) result.emplace_back(s.device_ordinal, masked);
    return err;
  };
  ForEachRegion("read_masks", buffer_id, [](const DeviceState&) { return cudaSuccess; }, mask);
  return result;
}

}  // namespace
}  // namespace deep_ep_jax

PYBIND11_MODULE(_C, m) {
  using namespace deep_ep_jax;
  m.doc() = "deep_ep_jax CUDA extension: XLA FFI handlers and the communication buffer registry";
  m.def("ffi_targets", &FfiTargetCapsules, "dict: FFI target name -> PyCapsule of its handler");
  m.def("ffi_outputs", &FfiOutputs, "dict: FFI target name -> the names of its results, in order");
  // Limits and sizes, from the code that lays the memory out (plain ints; ValueError for a negative or too large
  // argument).
  m.def("limits", &Limits,
        "dict: the kernels' limits (max_group_ranks, max_nvlink_ranks, max_internode_host_ranks, "
        "max_internode_normal_ranks, control_bytes, "
        "fp8_block, ...)");
  m.def("staged_region_bytes", &StagedRegionBytes, py::arg("num_rows"), py::arg("row_bytes"), py::arg("scale_bytes"),
        py::arg("num_topk"), py::arg("num_chunks"), py::arg("num_ranks"),
        "Bytes of the normal region (control included) a staged call of a num_ranks group needs (num_chunks: "
        "ceil(tokens / chunk_tokens) for dispatch, 0 for combine)");
  m.def("internode_dispatch_region_bytes", &InternodeDispatchRegionBytes, py::arg("num_tokens"), py::arg("num_rows"),
        py::arg("num_topk"), py::arg("row_bytes"), py::arg("scale_bytes"), py::arg("num_ranks"), py::arg("num_nodes"),
        "Bytes of the normal region a dispatch across hosts needs (RuntimeError without NVSHMEM)");
  m.def("internode_combine_region_bytes", &InternodeCombineRegionBytes, py::arg("num_tokens"), py::arg("num_rows"),
        py::arg("num_topk"), py::arg("hidden"), py::arg("num_ranks"), py::arg("num_nodes"),
        "Bytes of the normal region a combine across hosts needs (RuntimeError without NVSHMEM)");
  m.def("internode_sync_bytes", &InternodeSyncBytes, py::arg("num_ranks"),
        "Bytes at the start of every internode normal region: control bytes and the synchronisation area (each "
        "source's counts, ready and done flags), which grows with the group");
  m.def("internode_combine_slot_bytes", &InternodeCombineSlotBytes, py::arg("num_tokens"), py::arg("num_topk"),
        py::arg("hidden"), py::arg("num_ranks"),
        "Bytes of a combine's slots across hosts, where a forwarder gathers its host's rows, one (row, weights) per "
        "(index on the host, source host, token): R * T * (2H + 4K) rounded up");
  m.def("low_latency_half_bytes", &LowLatencyHalfBytes, py::arg("region_bytes"),
        "Usable bytes of each half of a low-latency region");
  m.def("low_latency_dispatch_half_bytes", &LowLatencyDispatchHalfBytes, py::arg("num_ranks"),
        py::arg("num_local_experts"), py::arg("max_tokens"), py::arg("num_topk"), py::arg("hidden"), py::arg("fp8"),
        "Bytes of one half a low-latency dispatch uses");
  m.def("low_latency_combine_half_bytes", &LowLatencyCombineHalfBytes, py::arg("max_tokens"), py::arg("num_topk"),
        py::arg("hidden"), "Bytes of one half a low-latency combine uses");
  m.def("low_latency_region_bytes", &LowLatencyRegionBytes, py::arg("num_ranks"), py::arg("num_local_experts"),
        py::arg("hidden"), py::arg("max_tokens"), py::arg("num_topk"),
        "Bytes of a low-latency region whose halves hold a dispatch (bf16 rows) and a combine of these shapes");
  m.def("low_latency_send_bytes", &LowLatencySendBytes, py::arg("num_ranks"), py::arg("hidden"), py::arg("max_tokens"),
        py::arg("num_topk"),
        "Bytes of the send area of a low-latency buffer across hosts for these shapes: the larger of a dispatch's "
        "staged rows (M * K) and a combine's (low_latency_combine_stage_bytes: R * M * K * H * 2, which grows with "
        "the group)");
  m.def("low_latency_combine_stage_bytes", &LowLatencyCombineStageBytes, py::arg("num_ranks"), py::arg("hidden"),
        py::arg("max_tokens"), py::arg("num_topk"),
        "Bytes a low-latency combine across hosts stages its rows in: R * M * K * H * 2");
  m.def("low_latency_shared_bytes", &LowLatencySharedBytes, py::arg("num_ranks"), py::arg("num_experts"),
        py::arg("hidden"), py::arg("fp8"),
        "Dynamic shared memory the low-latency kernels need (at most limits()['low_latency_max_shared_bytes'])");
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
  m.def("set_sequence_for_testing", &SetSequenceForTesting, py::arg("buffer_id"), py::arg("seq"),
        py::call_guard<py::gil_scoped_release>(),
        "Test hook: every sequence number of the buffer (normal and low-latency, this process's devices) and its "
        "flags set as if `seq` calls had run (seq in [-2^31, 2^32), modulo 2^32); synchronises the devices first");
  m.def("mark_call_running_for_testing", &MarkCallRunningForTesting, py::arg("buffer_id"),
        py::call_guard<py::gil_scoped_release>(),
        "Test hook: the buffer's regions on this process's devices marked as if a call were running there, so the "
        "next call stops as overlapping; synchronises the devices first");
  m.def(
      "read_traffic", [](int64_t buffer_id) { return TrafficOf(buffer_id, false); }, py::arg("buffer_id"),
      py::call_guard<py::gil_scoped_release>(),
      "Traffic counters of the buffer's normal regions on this process's devices (Config.count_traffic): "
      "[(rank, [[nvlink_rows, nvlink_bytes, network_rows, network_bytes] for dispatch, cached dispatch, "
      "combine])]; synchronises the devices first");
  m.def(
      "reset_traffic", [](int64_t buffer_id) { TrafficOf(buffer_id, true); }, py::arg("buffer_id"),
      py::call_guard<py::gil_scoped_release>(),
      "Zeroes the traffic counters of the buffer's normal regions on this process's devices; synchronises first");
  m.def(
      "read_wait_times", [](int64_t buffer_id) { return WaitTimesOf(buffer_id, false); }, py::arg("buffer_id"),
      py::call_guard<py::gil_scoped_release>(),
      "Wait-time counters of the buffer's low-latency regions on this process's devices: [(rank, [[nanoseconds "
      "waited for each source rank] for dispatch's and combine's receives])]; synchronises the devices first");
  m.def(
      "reset_wait_times", [](int64_t buffer_id) { WaitTimesOf(buffer_id, true); }, py::arg("buffer_id"),
      py::call_guard<py::gil_scoped_release>(),
      "Zeroes the wait-time counters of the buffer's low-latency regions on this process's devices; synchronises "
      "first");
  m.def("read_masks", &MasksOf, py::arg("buffer_id"), py::call_guard<py::gil_scoped_release>(),
        "Masks of the buffer's low-latency regions on this process's devices (Config.mask_failed_ranks): "
        "[(device ordinal, [masked ranks])]; synchronises the devices first");
  m.def("cuda_archs", &CudaArchs, "GPU architectures compiled in, e.g. ['sm_90']");
  m.def("mem_get_info", &MemGetInfo, py::arg("device"), "(free, total) bytes of a CUDA device (cudaMemGetInfo)");
  m.def("device_info", &DeviceInfo, "CUDA devices, peer access and P2P attributes (for deep_ep_jax.info)");
  // EP groups across hosts (deep_ep_jax/distributed/nvshmem.py); absent from a build without NVSHMEM.
#ifdef DEEP_EP_JAX_WITH_NVSHMEM
  m.attr("with_nvshmem") = true;
  m.def(
      "nvshmem_unique_id", [] { return py::bytes(nvshmem::UniqueId()); },
      "A fresh NVSHMEM unique id (PE 0, before nvshmem_init), as bytes");
  m.def(
      "nvshmem_init",
      [](int device, int pe, int num_pes, const py::bytes& unique_id) {
        std::string id = unique_id;
        py::gil_scoped_release release;
        nvshmem::Init(device, pe, num_pes, id);
      },
      py::arg("device"), py::arg("pe"), py::arg("num_pes"), py::arg("unique_id"),
      "Collective: NVSHMEM on `device` as PE `pe` of `num_pes` (unique-id bootstrap)");
  m.def("nvshmem_initialized", &nvshmem::Initialized);
  m.def("internode_combine_pipeline_fits", &internode::CombinePipelineFits, py::arg("device"), py::arg("num_blocks"),
        py::arg("num_warps"),
        "Whether combine across hosts runs pipelined at this grid on `device` (all its blocks resident at once), "
        "else its serial kernels");
  m.def("nvshmem_finalize", &nvshmem::Finalize, py::call_guard<py::gil_scoped_release>(),
        "Collective: shuts NVSHMEM down (after every NVSHMEM buffer is destroyed)");
  m.def("create_nvshmem_buffer", &nvshmem::CreateBuffer, py::arg("device"), py::arg("rank"), py::arg("pes"),
        py::arg("nodes"), py::arg("normal_bytes"), py::arg("low_latency_bytes"), py::arg("send_bytes"),
        py::call_guard<py::gil_scoped_release>(),
        "Collective: the normal region (none when 0) and the low-latency region (and send area) in the symmetric "
        "heap for `rank` of an EP group across hosts; pes[r] and nodes[r] (host index) per rank. Returns the "
        "buffer id");
#else
  m.attr("with_nvshmem") = false;
#endif
}
