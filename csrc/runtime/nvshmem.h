// NVSHMEM for EP groups across hosts: one PE per process (PE = jax process
// index), initialised once with the unique-id bootstrap (Python trades the id
// through the jax.distributed key-value store), and low-latency buffers in its
// symmetric heap. Only in a build with NVSHMEM (DEEP_EP_JAX_WITH_NVSHMEM).
// Every function throws std::runtime_error with a readable message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace deep_ep_jax {
namespace nvshmem {

// A fresh unique id (PE 0, before Init), as bytes to trade.
std::string UniqueId();

// Initialises NVSHMEM on `device` (made current) as PE `pe` of `num_pes`,
// from PE 0's unique id. Collective: every process calls it. The symmetric
// heap size comes from NVSHMEM_SYMMETRIC_SIZE (Python sets it from the
// buffer hints unless the user did). Once per process.
void Init(int device, int pe, int num_pes, const std::string& unique_id);
bool Initialized();

// Collective: frees nothing (buffers must be destroyed first) and shuts NVSHMEM down.
void Finalize();

// Collective (nvshmem_malloc, same sizes everywhere): the regions of `rank`
// of an EP group in the symmetric heap, zeroed on every PE before it returns:
// the normal region (normal_bytes, none when 0) and the low-latency region
// followed by send_bytes of send area. pes[r]: the PE of rank r; nodes[r]:
// its host (0..num_nodes-1); ranks of this rank's host are reached through
// their mapped memory (nvshmem_ptr), others through NVSHMEM's transports.
// Returns the registry's buffer id; DestroyBuffer frees it (collectively:
// every PE destroys its buffers).
int64_t CreateBuffer(int device, int rank, const std::vector<int>& pes, const std::vector<int>& nodes,
                     size_t normal_bytes, size_t low_latency_bytes, size_t send_bytes);

}  // namespace nvshmem
}  // namespace deep_ep_jax
