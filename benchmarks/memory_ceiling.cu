// What this GPU's memory moves at its best, as a ceiling for the copy and store kernels: 16-byte
// stores, streaming (evict-first) stores, a copy, a read and cudaMemsetAsync over 7.5 GB (w_in's bf16
// [128, 7168, 4096]), each timed by CUDA events on the fifth of five rounds, at 4, 8 and 16 blocks
// of 256 threads per SM (132 SMs). Not part of the build; from the repository root:
//
//     nvcc -O3 -arch=sm_90 -o /tmp/memory_ceiling benchmarks/memory_ceiling.cu && /tmp/memory_ceiling
#include <cstdio>
#include <cuda_runtime.h>

template <bool kStreaming>  // streaming: evict-first stores (__stcs)
__global__ void Write(int4* d, size_t n, int v) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const int4 value = make_int4(v, v + 1, v + 2, int(i));
    if constexpr (kStreaming) __stcs(d + i, value); else d[i] = value;
  }
}

__global__ void Copy(const int4* s, int4* d, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    d[i] = s[i];
}

__global__ void Read(const int4* s, size_t n, int* out) {
  int acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const int4 v = s[i];
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345) *out = acc;  // keeps the loads
}

int main() {
  const size_t bytes = size_t(128) * 7168 * 4096 * 2, n = bytes / 16;
  int4 *a, *b;
  int* out;
  if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess || cudaMalloc(&out, 4) != cudaSuccess) {
    printf("cudaMalloc of 2 x %.1f GB failed\n", bytes / 1e9);
    return 1;
  }
  cudaMemset(a, 1, bytes);
  cudaMemset(b, 1, bytes);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  const char* names[5] = {"write", "write .cs", "copy", "read", "memset"};
  for (int blocks : {132 * 4, 132 * 8, 132 * 16}) {
    for (int round = 0; round < 5; ++round) {
      float ms[5];
      for (int c = 0; c < 5; ++c) {
        cudaEventRecord(start);
        if (c == 0) Write<false><<<blocks, 256>>>(b, n, round);
        if (c == 1) Write<true><<<blocks, 256>>>(b, n, round);
        if (c == 2) Copy<<<blocks, 256>>>(a, b, n);
        if (c == 3) Read<<<blocks, 256>>>(a, n, out);
        if (c == 4) cudaMemsetAsync(b, round, bytes);
        cudaEventRecord(stop);
        cudaEventSynchronize(stop);
        cudaEventElapsedTime(&ms[c], start, stop);
      }
      if (round == 4) {
        for (int c = 0; c < 5; ++c) {  // a copy moves its bytes twice (read and write)
          printf("blocks %d %-10s %.3f ms %.2f TB/s\n", blocks, names[c], ms[c], (c == 2 ? 2 : 1) * bytes / ms[c] / 1e9);
        }
      }
    }
  }
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
