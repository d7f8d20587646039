// Sorted runs merged: AR-Topk's SPLIT leader gathers every device's top-k indices (each device's
// in ascending order) and needs them as one ascending list, each repeat marked.
//
// out = sort(runs, flattened), then every entry equal to the one before it replaced by `pad`:
// the same as a full sort (jnp.sort) followed by the repeat mask, for any input. Runs that are
// ascending, as the top-k kernels write them, are merged pairwise, log2(runs) passes of a
// branch-free merge (a full sort of 252K indices took XLA:CPU 6-8 ms, about half a pass over a
// 25M-value gradient); any run that is not ascending sends the whole input to std::sort.
//
// Plain C++17 with no XLA headers. Reports bad arguments as a jaxcomp::Status and never throws.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "kernels/status.h"

namespace jaxcomp {
namespace merge_internal {

// std::merge of two ascending int32 ranges into `out`, without a branch per entry: the next
// entry is the smaller head (the first range's on a tie), and the pointers advance by the
// comparison's result (std::merge's branch mispredicts about every other entry on indices from
// different devices).
inline void MergeTwo(const int32_t* a, const int32_t* a_end, const int32_t* b, const int32_t* b_end, int32_t* out) {
  while (a < a_end && b < b_end) {
    const int32_t x = *a, y = *b;
    const bool take_b = y < x;
    *out++ = take_b ? y : x;
    a += !take_b;
    b += take_b;
  }
  out = std::copy(a, a_end, out);
  std::copy(b, b_end, out);
}

}  // namespace merge_internal

inline Status MergeRuns(const int32_t* runs, int64_t num_runs, int64_t run_length, int32_t pad, int32_t* out) {
  if (num_runs < 1 || run_length < 1) {
    return Status::InvalidArgument("runs must be at least 1 x 1, got " + std::to_string(num_runs) + " x " +
                                   std::to_string(run_length));
  }
  const int64_t total = num_runs * run_length;
  bool ascending = true;
  for (int64_t r = 0; r < num_runs && ascending; ++r) {
    ascending = std::is_sorted(runs + r * run_length, runs + (r + 1) * run_length);
  }
  std::copy(runs, runs + total, out);
  if (!ascending) {
    std::sort(out, out + total);
  } else if (num_runs > 1) {
    try {
      // Kept by the thread between calls: a fresh megabyte would be fresh pages every step.
      thread_local std::vector<int32_t> scratch;
      if (static_cast<int64_t>(scratch.size()) < total) scratch.resize(total);
      int32_t* from = out;
      int32_t* to = scratch.data();
      for (int64_t width = run_length; width < total; width *= 2) {  // sorted blocks of `width`
        for (int64_t begin = 0; begin < total; begin += 2 * width) {
          const int64_t middle = std::min(begin + width, total), end = std::min(begin + 2 * width, total);
          merge_internal::MergeTwo(from + begin, from + middle, from + middle, from + end, to + begin);
        }
        std::swap(from, to);
      }
      if (from != out) std::copy(from, from + total, out);
    } catch (const std::exception& e) {  // the scratch's allocation is the only thing that throws
      return Status::ResourceExhausted(std::string("merge kernel could not allocate its scratch: ") + e.what());
    }
  }
  for (int64_t i = total - 1; i > 0; --i) {
    if (out[i] == out[i - 1]) out[i] = pad;  // from the end: each compares with the unmarked one
  }
  return Status();
}

}  // namespace jaxcomp
