// Low-latency dispatch and combine for an EP group across hosts: the kernels
// of low_latency.cu, built again with a transport that reaches ranks on other
// hosts through NVSHMEM's portable device API (NVSHMEM picks IBGDA, IBRC, its
// peer-to-peer transport, ... at run time) and ranks on this host through
// their mapped regions, as over NVLink. Compiled with -rdc=true and
// device-linked against libnvshmem_device.a (setup.py), only with NVSHMEM.
//
// Including the .cu keeps one copy of the kernels: this file defines only the
// transport and the launchers (low_latency.cu's own NVLink launchers are left
// out by DEEP_EP_JAX_LOW_LATENCY_NVSHMEM_BUILD), so the NVLink build of the
// kernels is unchanged.
#include <nvshmem.h>
#include <nvshmemx.h>

#define DEEP_EP_JAX_LOW_LATENCY_NVSHMEM_BUILD
#include "kernels/low_latency.cu"

namespace deep_ep_jax {
namespace low_latency {
namespace {

// The region is in NVSHMEM's symmetric heap at the same offset on every PE,
// so a rank's region is addressed by this rank's own pointer plus its PE.
struct NvshmemTransport {
  Peers p;
  PeerTable peers;  // the block's copy in shared memory

  __device__ char* local() const { return p.local; }
  __device__ Control* control() const { return reinterpret_cast<Control*>(local()); }
  __device__ bool mapped(int rank) const { return peers.regions[rank] != nullptr; }

  // A cooperative group of whole warps: each warp stages its share of the
  // bytes in the send area (the source of an RDMA write must be registered
  // memory; x and shared memory are not) and puts it with one warp call.
  __device__ void Put(int rank, size_t offset, const void* src, size_t num_bytes, int index, int count,
                      size_t stage_offset) const {
    if (mapped(rank)) {
      Copy16(peers.regions[rank] + offset, src, num_bytes, index, count);
      return;
    }
    const int num_warps = count / 32, warp = index / 32, lane = index % 32;
    const size_t chunk = AlignUp((num_bytes + num_warps - 1) / num_warps, kVectorBytes);
    const size_t begin = min(num_bytes, size_t(warp) * chunk);
    const size_t n = min(num_bytes, begin + chunk) - begin;
    if (n == 0) return;  // the whole warp alike
    char* stage = local() + p.send_offset + stage_offset + begin;
    Copy16(stage, static_cast<const char*>(src) + begin, n, lane, 32);
    FenceStagedForWarpPut();
    nvshmemx_putmem_nbi_warp(local() + offset + begin, stage, n, peers.pes[rank]);
  }
  __device__ void PutInt(int rank, size_t offset, int value) const {
    if (mapped(rank)) {
      *reinterpret_cast<int*>(peers.regions[rank] + offset) = value;
    } else {
      nvshmem_int_p(reinterpret_cast<int*>(local() + offset), value, peers.pes[rank]);
    }
  }
  // After it, this thread's stores and puts are complete everywhere: nvshmem_quiet
  // completes the NVSHMEM operations (the caller's at least), the fence the stores.
  __device__ void Fence() const {
    __threadfence_system();
    nvshmem_quiet();
  }
  // Every block's puts completed before the last block signals (Fence()), so
  // the flag may travel separately from the data.
  __device__ void Signal(int rank, size_t offset, int value) const {
    if (mapped(rank)) {
      StoreReleaseSys(reinterpret_cast<int*>(peers.regions[rank] + offset), value);
    } else {
      nvshmem_int_atomic_set(reinterpret_cast<int*>(local() + offset), value, peers.pes[rank]);
    }
  }
  // Flags land in this rank's own control block whatever the transport (WaitFlag).
};

}  // namespace

const Launchers& NvshmemLaunchers() { return LaunchersWith<NvshmemTransport>::Table(); }

}  // namespace low_latency
}  // namespace deep_ep_jax
