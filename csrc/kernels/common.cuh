// Device helpers shared by every kernel family: system-scope acquire/release
// flags for meeting peers through NVLink memory, and spin-waits that fail
// loudly (rank, mode, counter) instead of hanging.
#pragma once

#include <cstdint>
#include <cstdio>

namespace deep_ep_jax {

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int ld_acquire_sys(const int* p) {
  int v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(int* p, int v) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void atomic_add_release_sys(int* p, int v) {
  asm volatile("red.release.sys.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Spins until *flag >= target. After timeout_ns prints what it waited for
// and traps, so the XLA call fails with an error instead of hanging.
__device__ __forceinline__ void wait_at_least(const int* flag, int target, uint64_t timeout_ns,
                                              const char* mode, const char* counter, int rank,
                                              int peer, int channel) {
  if (ld_acquire_sys(flag) >= target) return;
  const uint64_t start = global_timer_ns();
  while (ld_acquire_sys(flag) < target) {
    if (global_timer_ns() - start > timeout_ns) {
      printf("deep_ep_jax timeout: %s rank %d waited %.1f s for %s from peer %d (channel %d): "
             "value %d, expected >= %d\n",
             mode, rank, timeout_ns * 1e-9, counter, peer, channel, ld_acquire_sys(flag), target);
      __trap();
    }
  }
}

}  // namespace deep_ep_jax
