// FP8 quantizations (fp8_quant.py's kernels): the rows' and columns' amaxes,
// the rows quantized, and the transposed gather that quantizes rows and
// columns (also the expert-major rows' FP8 weight-gradient operand). Bit for
// bit fp8_quant's XLA maths: products rounded separately, no fused
// multiply-add, float8 conversions saturated.
#include <algorithm>
#include <climits>
#include <cstdint>

#include <cuda_fp8.h>

#include "kernels/device.cuh"
#include "kernels/fp8_quant.h"

namespace deep_ep_jax {
namespace {

constexpr int kTransposeThreads = 256;
constexpr int kTransposeTile = 128;      // rows and bytes of a tile (a 128-byte line each way)
constexpr int kChunk = 16;               // bytes per vector: a row's chunk, or a column's 16 rows
constexpr int kMaxGridBlocks = 1 << 16;  // grid-stride loops cover the rest
constexpr int kAmaxThreads = 256;
constexpr int kAmaxWarps = kAmaxThreads / kWarpSize;
static_assert(kAmaxBandCols == kWarpSize * kChunk);  // a warp covers a band's row: 16 bf16 (32 bytes) a lane
constexpr int kAmaxUnroll = 4;                       // rows per warp with their loads in flight at once
constexpr int kQuantizeRowsThreads = 256;            // a warp per row
constexpr int kQuantizeRowsUnroll = 4;               // chunks per lane with their loads in flight at once
constexpr int kSwigluCachedChunks = 8;               // chunks a lane keeps between the passes: rows of up to 2048
constexpr float kFp8MinAmax = 1e-30f;                // fp8_quant.FP8_MIN_AMAX

// float8_e4m3fn of (a.x, a.y): rounded to nearest even, +-448 where larger
// (satfinite keeps NaN), as fp8_quant's clip and convert, bit for bit.
__device__ __forceinline__ uint32_t ToFp8x2(float2 a) {
  return uint32_t(__nv_cvt_float2_to_fp8x2(a, __NV_SATFINITE, __NV_E4M3));
}

// 16 bf16 values as 16 float8_e4m3fn bytes: fp8(v * multiplier * inverse[j])
// (inverse null: 1), each product rounded (no fused multiply-add): fp8_quant's
// maths, bit for bit.
__device__ __forceinline__ int4 QuantizedChunk(const int4 (&bf16)[2], float multiplier,
                                               const float* __restrict__ inverse) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(bf16);
  uint32_t words[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float4 s =
        inverse != nullptr ? __ldg(reinterpret_cast<const float4*>(inverse) + q) : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
    const float2 a = __bfloat1622float2(pairs[2 * q]), b = __bfloat1622float2(pairs[2 * q + 1]);
    const float2 low =
        make_float2(__fmul_rn(__fmul_rn(a.x, multiplier), s.x), __fmul_rn(__fmul_rn(a.y, multiplier), s.y));
    const float2 high =
        make_float2(__fmul_rn(__fmul_rn(b.x, multiplier), s.z), __fmul_rn(__fmul_rn(b.y, multiplier), s.w));
    words[q] = ToFp8x2(low) | (ToFp8x2(high) << 16);
  }
  return make_int4(int(words[0]), int(words[1]), int(words[2]), int(words[3]));
}

// One block per tile of 128 rows by 128 output bytes of one batch entry
// (grid-stride): the rows' bytes gathered into shared memory in 16-byte chunks,
// then each column's 128 bytes written as a row of dst_t: a thread reads 16 rows
// of 4 columns as words and transposes them by byte permutes (a quarter of the
// shared loads that reading one byte at a time takes).
// Chunk c of tile row r sits at chunk c ^ (r / 16 % 8): a thread reading a 16-row
// run and its neighbours reading the other runs of those columns hit different banks.
// kQuantize: the rows are bf16, each chunk read as 32 bytes and quantized
// (QuantizedChunk) with its row's multiplier; a row whose multiplier is 0 gives 0.
// kRowCopy (with kQuantize): each chunk also quantized with its row's inverse
// scale into dst_rows, in place (the per-row copy from the same read).
template <bool kQuantize, bool kRowCopy>
__global__ void __launch_bounds__(kTransposeThreads) TransposedRowsKernel(TransposedRows p) {
  static_assert(kQuantize || !kRowCopy);
  constexpr int kChunksPerRow = kTransposeTile / kChunk;
  constexpr int kItems = kTransposeTile * kChunksPerRow / kTransposeThreads;  // chunks per thread, each way
  constexpr int kLoads = kQuantize ? 2 : 1;                                   // 16-byte loads per chunk
  static_assert(kItems * kTransposeThreads == kTransposeTile * kChunksPerRow);
  static_assert(kTransposeThreads == kTransposeTile / 4 * kChunksPerRow);  // the stores: 4 columns by a run each
  __shared__ __align__(16) uint8_t tile[kTransposeTile * kTransposeTile];
  const int num_rows = p.num_rows;
  const int64_t hidden = p.hidden;
  const int64_t row_tiles = (int64_t(num_rows) + kTransposeTile - 1) / kTransposeTile;
  const int64_t tiles_per_entry = row_tiles * (hidden / kTransposeTile);
  const bool vector_stores = num_rows % kChunk == 0;  // each column's 16-row runs 16-byte aligned
  for (int64_t t = blockIdx.x; t < tiles_per_entry * p.batch; t += gridDim.x) {
    const int64_t b = t / tiles_per_entry, in_entry = t % tiles_per_entry;
    const int64_t first_row = (in_entry % row_tiles) * kTransposeTile;
    const int64_t first_col = (in_entry / row_tiles) * kTransposeTile;
    const int64_t entry_src_rows = b * p.num_src_rows;
    // This entry's source rows as bf16 (kQuantize; float8 rows are read as bytes of p.src).
    const __nv_bfloat16* src_bf16 = reinterpret_cast<const __nv_bfloat16*>(p.src) + entry_src_rows * hidden;
    const int64_t entry_rows = b * num_rows;  // this entry's first row in the [batch, rows] arrays
    // All of a thread's loads in flight at once: its rows' pairs (and multipliers), then their chunks.
    int64_t token[kItems];
    float multiplier[kItems];
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t row = first_row + (k * kTransposeThreads + threadIdx.x) / kChunksPerRow;
      if (p.row_pair == nullptr) {
        token[k] = row < num_rows ? row : -1;
      } else {
        const int pair = row < num_rows ? p.row_pair[row] : -1;
        token[k] = pair >= 0 && pair / p.num_topk < p.num_src_rows ? pair / p.num_topk : -1;
      }
      multiplier[k] =
          kQuantize && token[k] >= 0 && p.row_multipliers != nullptr ? p.row_multipliers[entry_rows + row] : 1.0f;
      if (!kRowCopy && multiplier[k] == 0.0f) token[k] = -1;  // nothing of the row is needed
    }
    // Addressed in elements of the entry's bf16 rows (kQuantize) or in bytes: ptxas schedules the loads
    // better so than from one byte offset per entry times the element size (the same loads and registers).
    int4 raw[kItems][kLoads];
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t col = first_col + (k * kTransposeThreads + threadIdx.x) % kChunksPerRow * kChunk;
      if constexpr (kQuantize) {
        const int4* from = reinterpret_cast<const int4*>(src_bf16 + token[k] * hidden + col);
#pragma unroll
        for (int h = 0; h < kLoads; ++h) raw[k][h] = token[k] >= 0 ? from[h] : make_int4(0, 0, 0, 0);
      } else {  // float8 bytes
        const int4* from = reinterpret_cast<const int4*>(p.src + (entry_src_rows + token[k]) * hidden + col);
        raw[k][0] = token[k] >= 0 ? *from : make_int4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int i = k * kTransposeThreads + threadIdx.x, r = i / kChunksPerRow, c = i % kChunksPerRow;
      const int64_t col = first_col + c * kChunk;
      int4 chunk = raw[k][0];
      if constexpr (kQuantize) {
        const float* inverse = p.col_inverse_scales + b * hidden + col;
        chunk = token[k] >= 0 && multiplier[k] != 0.0f ? QuantizedChunk(raw[k], multiplier[k], inverse)
                                                       : make_int4(0, 0, 0, 0);
      }
      if constexpr (kRowCopy) {
        if (token[k] >= 0) {
          const int64_t row = entry_rows + first_row + r;
          *reinterpret_cast<int4*>(p.dst_rows + row * hidden + col) =
              QuantizedChunk(raw[k], p.row_inverse_scales[row], nullptr);
        }
      }
      *reinterpret_cast<int4*>(tile + r * kTransposeTile + (c ^ (r / kChunk % kChunksPerRow)) * kChunk) = chunk;
    }
    __syncthreads();
    uint8_t* dst_t = p.dst_t + b * hidden * num_rows;
    {  // 4 byte columns by one 16-row run per thread: 16 words of the tile transposed by byte permutes
      const int run = threadIdx.x % kChunksPerRow, group = threadIdx.x / kChunksPerRow;  // columns 4 group ..+3
      const int64_t row = first_row + run * kChunk;
      if (row < num_rows) {
        const uint32_t* from = reinterpret_cast<const uint32_t*>(tile + run * kChunk * kTransposeTile +
                                                                 ((group * 4 / kChunk) ^ run) * kChunk) +
                               group % 4;
        uint32_t cols[4][4];  // [column][rows 4 q .. 4 q + 3], little-endian
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          uint32_t w[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) w[i] = from[(4 * q + i) * (kTransposeTile / 4)];
          const uint32_t low01 = __byte_perm(w[0], w[1], 0x5140), low23 = __byte_perm(w[2], w[3], 0x5140);
          const uint32_t high01 = __byte_perm(w[0], w[1], 0x7362), high23 = __byte_perm(w[2], w[3], 0x7362);
          cols[0][q] = __byte_perm(low01, low23, 0x5410);
          cols[1][q] = __byte_perm(low01, low23, 0x7632);
          cols[2][q] = __byte_perm(high01, high23, 0x5410);
          cols[3][q] = __byte_perm(high01, high23, 0x7632);
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          uint8_t* to = dst_t + (first_col + group * 4 + c) * int64_t(num_rows) + row;
          if (vector_stores) {
            *reinterpret_cast<int4*>(to) =
                make_int4(int(cols[c][0]), int(cols[c][1]), int(cols[c][2]), int(cols[c][3]));
          } else {
            for (int j = 0; j < kChunk && row + j < num_rows; ++j) to[j] = uint8_t(cols[c][j / 4] >> (8 * (j % 4)));
          }
        }
      }
    }
    __syncthreads();  // the next tile rewrites the shared memory
  }
}

// |v|'s bits as a non-negative int: ordered as |v| is, NaN above inf, so an
// integer max keeps NaNs.
__device__ __forceinline__ int MagnitudeBits(float v) { return __float_as_int(v) & 0x7fffffff; }

// One block per (batch entry, strip of strip_rows rows, band of kAmaxBandCols
// columns): lane l of each warp holds columns band + 16 l .. + 15 of rows warp,
// warp + kAmaxWarps, ... Each row's amax over the band is a warp-wide max,
// merged into row_amax (zeroed before) by an integer atomicMax: any order gives
// the same. The columns' amax over the strip is written per strip, for the
// caller to reduce. A band per block, not the strip's bands in turn: a strip of
// activations' rows is short, and a block per strip then leaves most of the GPU
// idle, with barriers between bands of only a few row steps.
__global__ void __launch_bounds__(kAmaxThreads)
    AmaxRowsAndColumnsKernel(const int4* __restrict__ x, int num_rows, int64_t cols,
                             const float* __restrict__ row_multipliers, int strip_rows, int num_strips, int num_bands,
                             int* __restrict__ row_amax, int* __restrict__ col_amax_parts) {
  __shared__ int col_max[kAmaxWarps][kChunk][kWarpSize];  // column 16 l + j of the band at [j][l]: no conflicts
  const int64_t b = blockIdx.x / (int64_t(num_strips) * num_bands);
  const int strip = blockIdx.x / num_bands % num_strips;
  const int64_t band = int64_t(blockIdx.x % num_bands) * kAmaxBandCols;
  const int64_t first_row = b * num_rows + int64_t(strip) * strip_rows;  // in the [batch * rows] view
  const int rows = min(strip_rows, num_rows - strip * strip_rows);
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t col = band + lane * kChunk;
  const bool in_row = col < cols;
  int col_bits[kChunk];
#pragma unroll
  for (int j = 0; j < kChunk; ++j) col_bits[j] = 0;
  for (int r0 = warp; r0 < rows; r0 += kAmaxWarps * kAmaxUnroll) {
    int4 raw[kAmaxUnroll][2];
    float multiplier[kAmaxUnroll];
#pragma unroll
    for (int u = 0; u < kAmaxUnroll; ++u) {  // every load in flight before any use
      const int r = r0 + u * kAmaxWarps;
      const bool load = r < rows && in_row;
      const int4* from = x + ((first_row + r) * cols + col) / 8;
      raw[u][0] = load ? from[0] : make_int4(0, 0, 0, 0);
      raw[u][1] = load ? from[1] : make_int4(0, 0, 0, 0);
      multiplier[u] = row_multipliers != nullptr && r < rows ? row_multipliers[first_row + r] : 1.0f;
    }
#pragma unroll
    for (int u = 0; u < kAmaxUnroll; ++u) {
      const int r = r0 + u * kAmaxWarps;
      if (r >= rows) break;  // the same for the whole warp
      const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(raw[u]);
      int bits = 0;
#pragma unroll
      for (int j = 0; j < kChunk / 2; ++j) {
        const float2 v = __bfloat1622float2(pairs[j]);
        bits = max(bits, max(MagnitudeBits(v.x), MagnitudeBits(v.y)));
        if (row_multipliers == nullptr) {
          col_bits[2 * j] = max(col_bits[2 * j], MagnitudeBits(v.x));
          col_bits[2 * j + 1] = max(col_bits[2 * j + 1], MagnitudeBits(v.y));
        } else if (multiplier[u] != 0.0f) {  // a row whose multiplier is 0 is 0 in z
          col_bits[2 * j] = max(col_bits[2 * j], MagnitudeBits(__fmul_rn(v.x, multiplier[u])));
          col_bits[2 * j + 1] = max(col_bits[2 * j + 1], MagnitudeBits(__fmul_rn(v.y, multiplier[u])));
        }
      }
      bits = __reduce_max_sync(0xffffffffu, bits);
      if (lane == 0 && bits != 0) atomicMax(row_amax + first_row + r, bits);
    }
  }
#pragma unroll
  for (int j = 0; j < kChunk; ++j) col_max[warp][j][lane] = col_bits[j];
  __syncthreads();
  for (int c = threadIdx.x; c < kAmaxBandCols && band + c < cols; c += blockDim.x) {
    int bits = 0;
#pragma unroll
    for (int w = 0; w < kAmaxWarps; ++w) bits = max(bits, col_max[w][c % kChunk][c / kChunk]);
    col_amax_parts[(b * num_strips + strip) * cols + band + c] = bits;
  }
}

// 8 values of a row from its 16-byte chunk(s) as float32: bf16 values, or with
// kSwiglu bf16(silu(g) * u) of the gate chunk raw[0] and the up chunk raw[1]
// (silu(g) = g * (1 / (1 + exp(-g))), each operation rounded, the division
// XLA's div.full: XLA's jax.nn.silu(g) * u bit for bit, its exp being expf's).
template <bool kSwiglu>
__device__ __forceinline__ void RowValues(const int4 (&raw)[kSwiglu ? 2 : 1], float (&v)[8]) {
  UnpackBf16x8(raw[0], v);
  if constexpr (kSwiglu) {
    const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&raw[1]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 up = __bfloat1622float2(b[j]);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float g = v[2 * j + h], sigmoid = DivFull(1.0f, __fadd_rn(1.0f, expf(-g)));
        v[2 * j + h] = __bfloat162float(__float2bfloat16_rn(__fmul_rn(__fmul_rn(g, sigmoid), h ? up.y : up.x)));
      }
    }
  }
}

// A row's scale from its amax's magnitude bits: max(amax, FP8_MIN_AMAX) * (1 / 448), NaN where
// amax is; and its correctly rounded inverse (fp8_quant._scales, _inverse).
__device__ __forceinline__ float2 RowScaleAndInverse(int amax_bits) {
  const float amax = __int_as_float(amax_bits);
  const float scale = amax != amax ? amax : __fmul_rn(fmaxf(amax, kFp8MinAmax), kInvFp8Max);
  return make_float2(scale, __frcp_rn(scale));
}

// fp8(v[j] * inverse), each product rounded.
__device__ __forceinline__ uint2 QuantizedValues(const float (&v)[8], float inverse) {
  uint32_t words[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    words[q] = ToFp8x2(make_float2(__fmul_rn(v[4 * q], inverse), __fmul_rn(v[4 * q + 1], inverse))) |
               (ToFp8x2(make_float2(__fmul_rn(v[4 * q + 2], inverse), __fmul_rn(v[4 * q + 3], inverse))) << 16);
  }
  return make_uint2(words[0], words[1]);
}

// One warp per row (grid-stride): the row's amax (magnitude bits), then its
// values times the inverse of its scale in float8: fp8_quant.quantize_rows, bit
// for bit. A row is `chunks` 16-byte chunks of bf16 src (kSwiglu: 2 * chunks,
// the gate's then the up's) and of 8 bytes of dst. kCached 0: the second pass
// reads the row again (from L1 or L2); kCached > 0 (chunks <= 32 * kCached):
// a lane keeps its chunks' values in registers, as bf16, between the passes
// (the SwiGLU's exp and division then run once per value).
template <bool kSwiglu, int kCached>
__global__ void __launch_bounds__(kQuantizeRowsThreads)
    QuantizeRowsKernel(const int4* __restrict__ src, int64_t num_rows, int64_t chunks, uint2* __restrict__ dst,
                       float* __restrict__ scales) {
  constexpr int kLoads = kSwiglu ? 2 : 1;
  constexpr int kUnroll = kCached > 0 ? kCached : kQuantizeRowsUnroll;  // chunks a lane loads at once
  constexpr int64_t kStep = int64_t(kWarpSize) * kUnroll;
  const int lane = threadIdx.x % kWarpSize, warps = blockDim.x / kWarpSize;
  for (int64_t row = int64_t(blockIdx.x) * warps + threadIdx.x / kWarpSize; row < num_rows;
       row += int64_t(gridDim.x) * warps) {
    const int4* in = src + row * chunks * kLoads;
    // Loads of kUnroll chunks in flight, then their values (0 past the row).
    auto load = [&](int64_t first, int4(&raw)[kUnroll][kLoads]) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t c = first + u * kWarpSize;
#pragma unroll
        for (int h = 0; h < kLoads; ++h) raw[u][h] = c < chunks ? in[h * chunks + c] : make_int4(0, 0, 0, 0);
      }
    };
    int bits = 0;
    int4 kept[kCached > 0 ? kCached : 1];  // kCached: the values as bf16
    for (int64_t first = lane; first < chunks; first += kStep) {
      int4 raw[kUnroll][kLoads];
      load(first, raw);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float v[8];
        RowValues<kSwiglu>(raw[u], v);
#pragma unroll
        for (int j = 0; j < 8; ++j) bits = max(bits, MagnitudeBits(v[j]));
        if constexpr (kCached > 0) kept[u] = PackBf16x8(v);  // exact: the values are bf16
      }
    }
    const float2 scale = RowScaleAndInverse(__reduce_max_sync(0xffffffffu, bits));
    if constexpr (kCached > 0) {
#pragma unroll
      for (int u = 0; u < kCached; ++u) {
        const int64_t c = lane + u * kWarpSize;
        if (c >= chunks) break;
        float v[8];
        UnpackBf16x8(kept[u], v);
        dst[row * chunks + c] = QuantizedValues(v, scale.y);
      }
    } else {
      for (int64_t first = lane; first < chunks; first += kStep) {
        int4 raw[kUnroll][kLoads];
        load(first, raw);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t c = first + u * kWarpSize;
          if (c >= chunks) break;
          float v[8];
          RowValues<kSwiglu>(raw[u], v);
          dst[row * chunks + c] = QuantizedValues(v, scale.y);
        }
      }
    }
    if (lane == 0) scales[row] = scale.x;
  }
}

int GridBlocks(int64_t items, int64_t per_block, int64_t max_blocks) {
  return int(std::max<int64_t>(1, std::min<int64_t>((items + per_block - 1) / per_block, max_blocks)));
}

}  // namespace

cudaError_t LaunchTransposedRows(const TransposedRows& rows, bool quantize, cudaStream_t stream) {
  if (rows.num_rows == 0 || rows.hidden == 0 || rows.batch == 0) return cudaSuccess;
  const int64_t tiles =
      rows.batch * ((int64_t(rows.num_rows) + kTransposeTile - 1) / kTransposeTile) * (rows.hidden / kTransposeTile);
  auto kernel = !quantize                  ? TransposedRowsKernel<false, false>
                : rows.dst_rows != nullptr ? TransposedRowsKernel<true, true>
                                           : TransposedRowsKernel<true, false>;
  kernel<<<GridBlocks(tiles, 1, kMaxGridBlocks), kTransposeThreads, 0, stream>>>(rows);
  return cudaGetLastError();
}

cudaError_t LaunchAmaxRowsAndColumns(const __nv_bfloat16* x, int64_t batch, int num_rows, int64_t cols,
                                     const float* row_multipliers, int strip_rows, int* row_amax, int* col_amax_parts,
                                     cudaStream_t stream) {
  if (batch == 0 || num_rows == 0 || cols == 0) return cudaSuccess;
  if (strip_rows < 1 || strip_rows > kMaxAmaxStripRows || cols % kChunk != 0) return cudaErrorInvalidValue;
  const int num_strips = (num_rows + strip_rows - 1) / strip_rows;
  const int64_t num_bands = (cols + kAmaxBandCols - 1) / kAmaxBandCols;
  if (batch * num_strips * num_bands > INT_MAX) return cudaErrorInvalidValue;
  // The rows' maxima are merged by atomicMax from 0 (magnitude bits are never negative).
  const cudaError_t err = cudaMemsetAsync(row_amax, 0, sizeof(int) * size_t(batch) * num_rows, stream);
  if (err != cudaSuccess) return err;
  AmaxRowsAndColumnsKernel<<<int(batch * num_strips * num_bands), kAmaxThreads, 0, stream>>>(
      reinterpret_cast<const int4*>(x), num_rows, cols, row_multipliers, strip_rows, num_strips, int(num_bands),
      row_amax, col_amax_parts);
  return cudaGetLastError();
}

cudaError_t LaunchQuantizeRows(const __nv_bfloat16* src, int64_t num_rows, int64_t cols, bool swiglu, uint8_t* dst,
                               float* scales, cudaStream_t stream) {
  if (num_rows == 0 || cols == 0) return cudaSuccess;
  if (cols % 8 != 0) return cudaErrorInvalidValue;
  const int warps = kQuantizeRowsThreads / kWarpSize;
  const int blocks = GridBlocks(num_rows, warps, kMaxGridBlocks);
  const bool cached = swiglu && cols / 8 <= kWarpSize * kSwigluCachedChunks;
  auto kernel = !swiglu  ? QuantizeRowsKernel<false, 0>
                : cached ? QuantizeRowsKernel<true, kSwigluCachedChunks>
                         : QuantizeRowsKernel<true, 0>;
  kernel<<<blocks, kQuantizeRowsThreads, 0, stream>>>(reinterpret_cast<const int4*>(src), num_rows, cols / 8,
                                                      reinterpret_cast<uint2*>(dst), scales);
  return cudaGetLastError();
}

}  // namespace deep_ep_jax
