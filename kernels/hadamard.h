// The unnormalized Walsh-Hadamard transform of rows whose length is a power of two.
//
// Butterflies in place, stage h = 1, 2, 4, ..., n/2: (a, b) -> (a + b, a - b) for every pair of
// entries h apart inside blocks of 2h. One row (at most 2^14 floats = 64 KiB in THC's use) stays
// in cache for all its log2(n) stages, so the whole transform costs about one pass over memory,
// against 2 * 128 multiply-adds per value for the same transform as two small matrix products.
// jaxcomp/hadamard.py's XLA path runs the same stages in the same order, so both give the same
// floats bit for bit.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "kernels/parallel.h"
#include "kernels/status.h"

namespace jaxcomp {

inline bool IsPowerOfTwo(int64_t n) { return n >= 1 && (n & (n - 1)) == 0; }

// The first three stages (h = 1, 2, 4) on one group of 8 floats, in registers, in the order the
// stage-by-stage loop would compute them.
inline void Hadamard8(float* x) {
  float a[8];
  for (int j = 0; j < 8; j += 2) { a[j] = x[j] + x[j + 1]; a[j + 1] = x[j] - x[j + 1]; }
  float b[8];
  for (int j = 0; j < 8; j += 4) {
    b[j] = a[j] + a[j + 2]; b[j + 2] = a[j] - a[j + 2];
    b[j + 1] = a[j + 1] + a[j + 3]; b[j + 3] = a[j + 1] - a[j + 3];
  }
  for (int j = 0; j < 4; ++j) { x[j] = b[j] + b[j + 4]; x[j + 4] = b[j] - b[j + 4]; }
}

// In place on one row of n = 2^m floats. Every stage computes the same (a + b, a - b) pairs as
// the plain stage loop; only the short stages (h < 8) are grouped so that the long ones, whose
// inner loops the compiler vectorizes, do most of the work.
inline void HadamardRow(float* x, int64_t n) {
  int64_t h = 1;
  if (n >= 8) {
    for (int64_t i = 0; i < n; i += 8) Hadamard8(x + i);
    h = 8;
  }
  for (; h < n; h *= 2) {
    for (int64_t i = 0; i < n; i += 2 * h) {
      float* __restrict lo = x + i;
      float* __restrict hi = x + i + h;
      for (int64_t j = 0; j < h; ++j) {
        const float a = lo[j], b = hi[j];
        lo[j] = a + b;
        hi[j] = a - b;
      }
    }
  }
}

// out[r] = H_n x[r] for each of `rows` rows of n floats; x and out may be the same buffer.
inline Status Hadamard(const float* x, int64_t rows, int64_t n, float* out, const Parallel& parallel) {
  if (!IsPowerOfTwo(n)) return Status::InvalidArgument("the row length must be a power of two, got " + std::to_string(n));
  if (rows < 0) return Status::InvalidArgument("rows must be >= 0, got " + std::to_string(rows));
  if (rows == 0) return Status();
  // Tasks of whole rows, about 256 KiB each, so small rows do not pay a task each.
  const int64_t rows_per_task = n >= 65536 ? 1 : 65536 / n;
  const int64_t tasks = (rows + rows_per_task - 1) / rows_per_task;
  parallel.run(tasks, [&](int64_t task) {
    const int64_t begin = task * rows_per_task;
    const int64_t end = begin + rows_per_task < rows ? begin + rows_per_task : rows;
    for (int64_t r = begin; r < end; ++r) {
      float* row = out + r * n;
      if (row != x + r * n) std::memcpy(row, x + r * n, sizeof(float) * static_cast<size_t>(n));
      HadamardRow(row, n);
    }
  });
  return Status();
}

}  // namespace jaxcomp
