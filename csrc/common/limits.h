// Every limit and shared size constant of the extension, written once, for
// host and device code alike (kernels, runtime, FFI handlers, the pybind11
// module). Plain constexpr: nvcc's --expt-relaxed-constexpr lets device code
// use AlignUp too.
//
// (Not csrc/limits.h: with -Icsrc that name would hide the C library's
// <limits.h> from every header that includes it.)
#pragma once

#include <cstddef>

namespace deep_ep_jax {

// Ranks of one EP group: the registry (DeviceState keeps per-rank vectors and
// a device-side peer table), NVSHMEM buffers and low-latency mode (its
// control block keeps 3 flags per rank and half, 24 KiB at 1024 ranks; a
// token's destinations are a bit mask across one warp, 32 x 32 bits).
constexpr int kMaxGroupRanks = 1024;

// Ranks of one NVLink domain (a GB200 NVL72 rack): intranode normal mode
// keeps one slot per rank in its control block (which must fit kControlBytes)
// and in the kernels' shared memory. Up to 8 ranks its kernels keep a token's
// destinations in registers (one unrolled slot per rank); beyond, they list
// them per token in shared memory.
constexpr int kMaxNvlinkRanks = 72;

// Internode normal mode: ranks of one host (its kernels' Group keeps their
// regions by value; a token's holders on a host are a 32-bit mask, and
// combine's waits give a lane to each of the host's ranks).
constexpr int kMaxInternodeHostRanks = 32;

// Internode normal mode: hosts of at most kMaxInternodeHostRanks ranks each; its
// synchronisation area is laid out per group (kernels/internode.h), its
// kernels loop over ranks and hosts and keep per-rank tables in shared memory
// (a few ints per rank), so the group is bounded by low-latency mode's limit.
// Memory bounds it first: combine keeps a slot per (rank, token), R * T * 2H
// bytes (_C.internode_combine_slot_bytes).
constexpr int kMaxInternodeNormalRanks = kMaxGroupRanks;

// Bytes of zeroed control data at the start of each region (flags, sequence
// numbers, published pointers), owned by that mode's kernels; each mode's
// Control struct is checked to fit.
constexpr size_t kControlBytes = size_t(1) << 16;

// Arrays laid out inside a region (normal-mode staging and landing areas,
// low-latency halves) start at multiples of this.
constexpr size_t kRegionAlign = 256;

// The widest copy vector (int4): rows and packets inside the layouts are
// padded to it, so their copies use 16-byte accesses.
constexpr size_t kVectorBytes = 16;

// n rounded up to a multiple of a.
constexpr size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Channels per FP8 scale: FP8 rows travel with float32 scales [T, H / kFp8Block]
// (the public contract; the Python API checks its own constant against it).
constexpr int kFp8Block = 128;
// Channels per MXFP8 scale (float8_e8m0fnu): low-latency dispatch's mxfp8 rows.
constexpr int kMxfp8Block = 32;

// Normal mode (intranode and internode kernels).
// Upper bound of Config.num_sms: the done flags keep one slot per (rank, block).
constexpr int kMaxBlocks = 132;
// Upper bound of Config.num_warps: the move kernels' __launch_bounds__.
constexpr int kMaxWarps = 16;
// num_experts / num_ranks: the finish kernel's shared-memory histogram.
constexpr int kMaxLocalExperts = 4096;
// Row arrays a token carries: bf16 rows, or FP8 rows and their float32 scales.
constexpr int kMaxRowArrays = 2;

// The FP8 copies' amax kernel (kernels/fp8_quant.h): a block takes a strip
// of at most kMaxAmaxStripRows rows (each strip leaves one partial maximum per
// column) by a band of kAmaxBandCols columns (16 per lane of a warp).
constexpr int kMaxAmaxStripRows = 512;
constexpr int kAmaxBandCols = 512;

// get_dispatch_layout: num_experts + num_ranks, its per-block shared-memory
// histograms (48 KiB, the default dynamic shared memory limit).
constexpr int kMaxLayoutBins = 12 * 1024;

// Low-latency mode.
namespace low_latency {
// Top-k slots per token a low-latency call may use.
constexpr int kMaxTopk = 64;
// Experts of a low-latency call: the send kernel's shared-memory histograms.
constexpr int kMaxExperts = 2048;
// Dynamic shared memory of a low-latency kernel (SharedBytesNeeded): the
// default per-block limit, so launches need no opt-in.
constexpr size_t kMaxSharedBytes = 48 * 1024;
}  // namespace low_latency

}  // namespace deep_ep_jax
