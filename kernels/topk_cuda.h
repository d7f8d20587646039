// Host entry points of the CUDA top-k and threshold kernels (kernels/topk.cu).
//
// Semantics are those of docs/kernels.md: magnitude key bits(x) & 0x7FFFFFFF (NaN largest), the
// bisection definition of `rounds`, ties to the lower index, output in ascending index order.
// Launch failures come back as a kInternal Status. Everything is enqueued on `stream`; nothing synchronizes with the host or allocates: the caller
// passes `scratch` of at least select_scratch_bytes(rows, n, rounds) bytes for select_topk, or
// threshold_scratch_bytes(rows, n, rounds) for find_threshold (256-byte aligned).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/status.h"

namespace jaxcomp::cuda {

// Scratch for the selection's per-tile histograms, at most (about 1 byte per value with an 11-bit
// last digit, 1/4 byte at exact top-k): rows longer than 2^28 values (2^30 at exact top-k) take
// one more pass over memory instead, so a row of 2^31 - 1 values needs about 256 MiB, not 2 GiB.
// Tests pass less.
constexpr size_t kTileHistogramBudget = size_t{256} << 20;

// Scratch for the candidate buffers, at most: each row's keys >= the first digit's lower bound
// (value and index, 8 bytes each) are kept for the later passes when they fit in an eighth of the
// row (at least 256 entries), so about 1 byte per value, and at most 2^25 candidates a chunk of
// rows. Tests pass less to force rows whose candidates do not fit (they read their values again).
constexpr size_t kCandidateBudget = size_t{256} << 20;

// Rows of a chunk of the radix select's scratch, at most. The host emulation of the kernels
// (ci/cuda_host.sh, JAXCOMP_CUDA_HOST_EMULATION) runs every thread of a launch as a fiber: its
// smaller chunks take the multi-chunk cases through two chunks with a quarter of the rows. The
// chunking code is the same; only this constant differs.
#ifdef JAXCOMP_CUDA_HOST_EMULATION
constexpr int64_t kMaxRowsPerChunk = 1024;
#else
constexpr int64_t kMaxRowsPerChunk = 4096;
#endif

// Device scratch needed by select_topk for `rows` rows of `n` values of any element type (given
// the same budgets):
// about 8 KiB a row, up to kMaxRowsPerChunk rows, plus the per-tile histograms and candidate buffers.
size_t select_scratch_bytes(int64_t rows, int64_t n, int rounds, size_t tile_histogram_budget = kTileHistogramBudget,
                            size_t candidate_budget = kCandidateBudget);

// Device scratch needed by find_threshold (given the same budget): no per-tile data, and
// candidate buffers only at rounds > 22 (three passes).
size_t threshold_scratch_bytes(int64_t rows, int64_t n, int rounds, size_t candidate_budget = kCandidateBudget);

// The candidate slots select_topk gives each row (0: it filters no row), for tests: a row whose
// C(lo) after the first digit exceeds them reads its values in every pass.
int64_t select_candidate_slots(int64_t rows, int64_t n, int rounds, size_t tile_histogram_budget = kTileHistogramBudget,
                               size_t candidate_budget = kCandidateBudget);

// The element type of x (and of the selected values): float32, or bfloat16 / float16 as their
// 16-bit patterns. The kernels read 16-bit input directly (no upcast pass) and key each value by
// its float32 upcast (exact; a float16 signalling NaN comes out quiet, as XLA's convert makes
// it), so results are those of the float32 upcast: the same indices, thresholds and counts, and
// values that are the input's own bits.
enum class Element { kF32, kBF16, kF16 };

// Writes, per row, the k selected entries of threshold_topk(x, k, rounds) in ascending index
// order; rounds = 31 is exact top-k. x: [rows, n]; values (of x's type), indices: [rows, k].
// Requires 1 <= k <= n <= 2^31 - 1 and 1 <= rounds <= 31 (the caller validates).
Status select_topk(Element type, const void* x, int64_t rows, int64_t n, int64_t k, int rounds, void* values,
                   int32_t* indices, void* scratch, cudaStream_t stream,
                   size_t tile_histogram_budget = kTileHistogramBudget, size_t candidate_budget = kCandidateBudget);
Status select_topk(const float* x, int64_t rows, int64_t n, int64_t k, int rounds, float* values, int32_t* indices,
                   void* scratch, cudaStream_t stream, size_t tile_histogram_budget = kTileHistogramBudget,
                   size_t candidate_budget = kCandidateBudget);

// find_threshold(x, k, rounds) per row: threshold = float from bits(lo), count = C(lo) (float32
// and int32 whatever x's type).
Status find_threshold(Element type, const void* x, int64_t rows, int64_t n, int64_t k, int rounds, float* threshold,
                      int32_t* count, void* scratch, cudaStream_t stream, size_t candidate_budget = kCandidateBudget);
Status find_threshold(const float* x, int64_t rows, int64_t n, int64_t k, int rounds, float* threshold,
                      int32_t* count, void* scratch, cudaStream_t stream, size_t candidate_budget = kCandidateBudget);

}  // namespace jaxcomp::cuda
