// Host entry points of the CUDA sign codec (kernels/sign.cu). Same format as the CPU kernels
// (kernels/sign.h, docs/kernels.md): the words and scales are bit-identical.
//
// Launch failures come back as a kInternal Status. Everything is enqueued on `stream`; nothing
// synchronizes with the host, allocates, or needs scratch, so the launches can be captured into a
// CUDA graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/status.h"

namespace jaxcomp::cuda {

// x: [rows, n] float32 -> words: [rows, ceil(n / 32)], scales: [rows, ceil(n / chunk)]. Requires
// 1 <= n, chunk <= 2^31 - 1 (the caller validates).
Status sign_pack(const float* x, int64_t rows, int64_t n, int64_t chunk, uint32_t* words, float* scales,
                 cudaStream_t stream);

// words: [rows, ceil(n / 32)], scales: [rows, ceil(n / chunk)] -> x: [rows, n] float32.
Status sign_unpack(const uint32_t* words, const float* scales, int64_t rows, int64_t n, int64_t chunk, float* x,
                   cudaStream_t stream);

}  // namespace jaxcomp::cuda
