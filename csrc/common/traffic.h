// Traffic counters (Config.count_traffic, a debug mode): per kind of
// normal-mode call (dispatch, cached dispatch, combine), the rows a rank's
// kernels moved, and their bytes, over NVLink (into or out of another rank's
// memory on its host) and over the network (puts to another host). They live
// in the last bytes of the control block of the rank's normal region, which
// both normal-mode layouts leave free (their Control structs are checked to
// end before), zeroed with the region. Bytes count the rows' data (and FP8
// scales), not top-k ids, weights or metadata. Python reads them with
// _C.read_traffic (Buffer.traffic()); docs/internode.md says who counts what.
#pragma once

#include <cstddef>

#include "common/call_order.h"
#include "common/limits.h"

namespace deep_ep_jax {

struct TrafficCounters {
  unsigned long long nvlink_rows, nvlink_bytes, network_rows, network_bytes;
};

// One TrafficCounters per normal-mode call kind, indexed by its CallKind.
constexpr int kTrafficKinds = kCombineCall + 1;
constexpr size_t kTrafficBytes = 256;
constexpr size_t kTrafficOffset = kControlBytes - kTrafficBytes;
static_assert(kTrafficKinds * sizeof(TrafficCounters) <= kTrafficBytes, "traffic counters exceed their bytes");

#ifdef __CUDACC__
// Adds rows of bytes_per_row bytes each to the counters of one call kind
// (null when counting is off: nothing happens). One thread per call.
__device__ __forceinline__ void CountTraffic(TrafficCounters* counters, bool network, unsigned long long rows,
                                             unsigned long long bytes_per_row) {
  if (counters == nullptr || rows == 0) return;
  atomicAdd(network ? &counters->network_rows : &counters->nvlink_rows, rows);
  atomicAdd(network ? &counters->network_bytes : &counters->nvlink_bytes, rows * bytes_per_row);
}
#endif

}  // namespace deep_ep_jax
