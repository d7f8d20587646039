// Packing gradient leaves into one flat error-fed vector in a single pass:
//   out[offset_i + j] = (g_i[j] finite ? g_i[j] : 0) + r_i[j]      (r_i optional)
// and the number of non-finite g values. This is what `compress(granularity="model")` does
// before every method; done by XLA it took a select-and-add loop per leaf plus a concatenate,
// two to three passes over fresh memory (docs/performance.md), and with at most 8 leaves an
// XLA:CPU fused concatenate that was 30x slower still. No XLA headers; the adapter is
// ffi/pack_cpu.cc.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/parallel.h"
#include "kernels/status.h"

namespace jaxcomp {

// One leaf: its gradient, its residual (nullptr: none) and its number of values.
struct PackPart {
  const float* grad = nullptr;
  const float* residual = nullptr;
  int64_t size = 0;
};

namespace pack_detail {

// Values per task: large enough that a task's start-up (a binary search) is nothing.
constexpr int64_t kTaskValues = int64_t{1} << 16;

// out[begin, end) of the flat vector, starting in part `part` at `offset` (its first value's
// position in the flat vector); returns the non-finite gradient values seen.
inline int64_t PackRange(const PackPart* parts, int64_t num_parts, int64_t part, int64_t offset, int64_t begin,
                         int64_t end, float* out) {
  int64_t bad = 0;
  for (int64_t pos = begin; pos < end && part < num_parts; ++part) {
    const PackPart& p = parts[part];
    const int64_t stop = offset + p.size < end ? offset + p.size : end;
    const float* g = p.grad + (pos - offset);
    const float* r = p.residual != nullptr ? p.residual + (pos - offset) : nullptr;
    float* o = out + pos;
    const int64_t count = stop - pos;
    for (int64_t j = 0; j < count; ++j) {
      const bool finite = std::isfinite(g[j]);
      bad += !finite;
      const float clean = finite ? g[j] : 0.0f;
      o[j] = r != nullptr ? clean + r[j] : clean;
    }
    pos = stop;
    offset += p.size;
  }
  return bad;
}

}  // namespace pack_detail

// Packs `parts` into `out` (their sizes summed) and stores the non-finite gradient values
// counted in `*nonfinite` (a float, as the metric it feeds; exact below 2^24).
inline Status pack_error_fed(const PackPart* parts, int64_t num_parts, float* out, float* nonfinite,
                             const Parallel& parallel) {
  if (num_parts < 0) return Status::InvalidArgument("num_parts must be >= 0, got " + std::to_string(num_parts));
  std::vector<int64_t> offsets(num_parts + 1, 0);
  for (int64_t i = 0; i < num_parts; ++i) {
    if (parts[i].size < 0 || (parts[i].size > 0 && parts[i].grad == nullptr)) {
      return Status::InvalidArgument("part " + std::to_string(i) + " has no gradient or a negative size");
    }
    offsets[i + 1] = offsets[i] + parts[i].size;
  }
  const int64_t n = offsets[num_parts];
  const int64_t tasks = n == 0 ? 0 : (n + pack_detail::kTaskValues - 1) / pack_detail::kTaskValues;
  std::vector<int64_t> bad(tasks, 0);
  parallel.run(tasks, [&](int64_t t) {
    const int64_t begin = t * pack_detail::kTaskValues;
    const int64_t end = begin + pack_detail::kTaskValues < n ? begin + pack_detail::kTaskValues : n;
    // The part holding `begin`: the last offset <= begin among non-empty parts.
    int64_t lo = 0, hi = num_parts;  // offsets[lo] <= begin < offsets[hi]
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      (offsets[mid] <= begin ? lo : hi) = mid;
    }
    bad[t] = pack_detail::PackRange(parts, num_parts, lo, offsets[lo], begin, end, out);
  });
  int64_t total = 0;
  for (int64_t b : bad) total += b;
  *nonfinite = static_cast<float>(total);
  return Status();
}

}  // namespace jaxcomp
