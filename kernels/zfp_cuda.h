// Host entry points of the CUDA ZFP-style codec (kernels/zfp.cu). Same bit format as the CPU
// codec (docs/kernels.md, kernels/zfp_block.h): the words are bit-identical.
//
// Launch failures come back as a kInternal Status. Everything is enqueued on `stream`; nothing synchronizes with the host, allocates, or needs
// scratch, so the launches can be captured into a CUDA graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/status.h"

namespace jaxcomp::cuda {

// Words per row, as jaxcomp.zfp_num_words(n, rate).
int64_t zfp_num_words(int64_t n, int rate);

// x: [rows, n] float32 -> words: [rows, zfp_num_words(n, rate)]. Requires 1 <= rate <= 32 and
// 1 <= n <= 2^31 - 1 (the caller validates).
Status zfp_encode(const float* x, int64_t rows, int64_t n, int rate, uint32_t* words, cudaStream_t stream);

// words: [rows, zfp_num_words(n, rate)] -> x: [rows, n] float32.
Status zfp_decode(const uint32_t* words, int64_t rows, int64_t n, int rate, float* x, cudaStream_t stream);

}  // namespace jaxcomp::cuda
