// CUDA sign codec (docs/kernels.md), on the helpers of kernels/sign.h (the CPU codec's own code,
// so words and scales are bit-identical).
//
// Words: a warp per 32 consecutive words; lane l reads value 32 w + l of each (coalesced) and a
// ballot makes the word. Scales: a thread block per chunk; its threads are the lanes of the
// chunk's halving tree (kernels/sign.h): each walks its rows in bit-reversed order (the threads of
// a warp read consecutive floats) and the block halves the lanes in shared memory. Unpacking:
// a thread per value.
#include <cstdint>

#include "kernels/cuda_launch.h"
#include "kernels/sign.h"
#include "kernels/sign_cuda.h"

namespace jaxcomp::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 1 << 16;

__global__ void __launch_bounds__(kThreads) words_kernel(const float* __restrict__ x, int64_t rows, int64_t n,
                                                         uint32_t* __restrict__ words) {
  const int64_t row_words = sign::num_words(n);
  const int lane = threadIdx.x % kWarp;
  const int64_t first = (int64_t{blockIdx.x} * kThreads + threadIdx.x) / kWarp;
  const int64_t stride = int64_t{gridDim.x} * (kThreads / kWarp);
  // Uniform across a warp: every lane runs the same iterations.
  for (int64_t word = first; word < rows * row_words; word += stride) {
    const int64_t row = word / row_words, w = word - row * row_words;
    const int64_t i = w * kWarp + lane;
    const bool bit = i < n && sign::sign_bit(x[row * n + i]) != 0;
    const uint32_t packed = __ballot_sync(0xFFFFFFFFu, bit);
    if (lane == 0) words[word] = packed;
  }
}

__global__ void __launch_bounds__(kThreads) scales_kernel(const float* __restrict__ x, int64_t rows, int64_t n,
                                                          int64_t chunk, float* __restrict__ scales) {
  __shared__ float lanes[kThreads];
  const int64_t row_chunks = sign::num_chunks(n, chunk);
  const int64_t p = sign::tree_size(chunk);
  const int64_t width = p < kThreads ? p : kThreads;
  const int64_t tree_rows = p / width;
  for (int64_t c = blockIdx.x; c < rows * row_chunks; c += gridDim.x) {
    const int64_t row = c / row_chunks, q = c - row * row_chunks;
    const int64_t count = n - q * chunk < chunk ? n - q * chunk : chunk;
    const float* chunk_x = x + row * n + q * chunk;
    if (threadIdx.x < width) lanes[threadIdx.x] = sign::lane_sum(chunk_x, count, width, tree_rows, threadIdx.x);
    __syncthreads();
    for (int64_t h = width / 2; h >= 1; h /= 2) {
      float sum = 0.0f;
      if (threadIdx.x < h) sum = lanes[threadIdx.x] + lanes[threadIdx.x + h];
      __syncthreads();
      if (threadIdx.x < h) lanes[threadIdx.x] = sum;
      __syncthreads();
    }
    if (threadIdx.x == 0) scales[c] = sign::scale_of(lanes[0], count);
    __syncthreads();  // lanes[0] is read before the next chunk overwrites it
  }
}

__global__ void __launch_bounds__(kThreads) unpack_kernel(const uint32_t* __restrict__ words,
                                                          const float* __restrict__ scales, int64_t rows, int64_t n,
                                                          int64_t chunk, float* __restrict__ x) {
  const int64_t row_words = sign::num_words(n), row_chunks = sign::num_chunks(n, chunk);
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < rows * n; i += int64_t{gridDim.x} * kThreads) {
    const int64_t row = i / n, j = i - row * n;
    const float plus = scales[row * row_chunks + j / chunk];
    x[i] = (words[row * row_words + j / 32] >> (j % 32)) & 1u ? plus : -plus;
  }
}

unsigned grid_for(int64_t threads_needed) {
  const int64_t blocks = (threads_needed + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid);
}

cudaError_t pack_rows(const float* x, int64_t rows, int64_t n, int64_t chunk, uint32_t* words, float* scales,
                      cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  cudaError_t err = launch(words_kernel, grid_for(rows * sign::num_words(n) * kWarp), kThreads, stream, x, rows, n,
                           words);
  if (err != cudaSuccess) return err;
  const int64_t chunks = rows * sign::num_chunks(n, chunk);
  return launch(scales_kernel, static_cast<unsigned>(chunks < kMaxGrid ? chunks : kMaxGrid), kThreads, stream, x,
                rows, n, chunk, scales);
}

}  // namespace

Status sign_pack(const float* x, int64_t rows, int64_t n, int64_t chunk, uint32_t* words, float* scales,
                 cudaStream_t stream) {
  return StatusOf(pack_rows(x, rows, n, chunk, words, scales, stream), "jaxcomp sign_pack kernels");
}

Status sign_unpack(const uint32_t* words, const float* scales, int64_t rows, int64_t n, int64_t chunk, float* x,
                   cudaStream_t stream) {
  if (rows == 0) return Status();
  return StatusOf(launch(unpack_kernel, grid_for(rows * n), kThreads, stream, words, scales, rows, n, chunk, x),
                  "jaxcomp sign_unpack kernel");
}

}  // namespace jaxcomp::cuda
