// Scattering a sparse aggregate straight into the leaves of the update: the inverse of
// kernels/pack.h for the methods that send (index, value) pairs (top-k, random-k).
//
//   every leaf = 0
//   for each row r in order, each j:  i = indices[r][j]; if 0 <= i < n:  out[i] += values[r][j]
//                                                                       (or out[i] = ..., `add` 0)
//   each entry written, once:         out[i] = (drop and out[i] not finite ? 0 : out[i]) * scale
//   silenced:                          every leaf stays 0
//
// where out is the leaves' values laid end to end (n of them). split_leaves is the dense form:
//
//   every leaf's values = (drop and dense[i] not finite ? 0 : dense[i]) * scale   (silenced: 0)
//
// one read of each value and one write into its leaf, where XLA slices each leaf out of the
// vector: a distinct kernel per leaf (its offset is a constant of the fused loop), which XLA:CPU
// compiles one by one, 10 ms each; a model of 1,000 leaves paid 20-60 s of compile for them.
//
// Done by XLA, the sparse form was a 100 MB zeroed vector, a scatter into it, and a copy of each
// leaf's slice out of it: two passes over fresh memory where one write of the leaves is needed
// (docs/performance.md). The sum runs in row order in float32, so it is bit for bit what XLA's row-by-row scatter-add gives; the entries are
// split among the tasks by index, so each entry is owned by one task and the order stays. No XLA
// headers; the adapter is ffi/scatter_cpu.cc.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/parallel.h"
#include "kernels/status.h"

namespace jaxcomp {

// One leaf of the update: where its values go and how many there are.
struct ScatterLeaf {
  float* data = nullptr;
  int64_t size = 0;
};

// The sparse aggregate: `rows` rows of `per_row` (index, value) pairs, added in row order.
struct ScatterRows {
  const int32_t* indices = nullptr;
  const float* values = nullptr;
  int64_t rows = 0;
  int64_t per_row = 0;
};

// What happens to the sum: `add` 0 sets each entry instead (one row, distinct indices), `drop`
// turns non-finite sums into 0, `scale` multiplies every sum, `silenced` leaves every leaf 0.
struct ScatterOptions {
  float scale = 1.0f;
  bool add = true;
  bool drop = false;
  bool silenced = false;
};

namespace scatter_detail {

// Values per task at least: a task's start-up (one scan of the pairs) is small beside this.
// (The sanitizer fuzz test defines it smaller, to split its short vectors among tasks.)
#ifndef JAXCOMP_SCATTER_TASK_VALUES
#define JAXCOMP_SCATTER_TASK_VALUES (int64_t{1} << 20)
#endif
constexpr int64_t kTaskValues = JAXCOMP_SCATTER_TASK_VALUES;
// How many pairs ahead the scatter prefetches its destination.
constexpr int64_t kAhead = 16;

// The leaves laid end to end: the leaf holding global index i, and i's place in it.
class Layout {
 public:
  Layout(const ScatterLeaf* leaves, int64_t num_leaves) : leaves_(leaves), starts_(num_leaves + 1, 0) {
    for (int64_t l = 0; l < num_leaves; ++l) starts_[l + 1] = starts_[l] + leaves[l].size;
  }
  int64_t size() const { return starts_.back(); }
  float* at(int64_t i) const {
    const int64_t l = std::upper_bound(starts_.begin(), starts_.end(), i) - starts_.begin() - 1;
    return leaves_[l].data + (i - starts_[l]);
  }
  // Calls fn(pointer, count) on each leaf's part of [begin, end) of the global values.
  template <typename Fn>
  void each_part(int64_t begin, int64_t end, Fn fn) const {
    const int64_t first = std::upper_bound(starts_.begin(), starts_.end(), begin) - starts_.begin() - 1;
    for (int64_t l = std::max<int64_t>(first, 0); l + 1 < static_cast<int64_t>(starts_.size()); ++l) {
      const int64_t lo = std::max(begin, starts_[l]), hi = std::min(end, starts_[l + 1]);
      if (lo >= end) break;
      if (hi > lo) fn(leaves_[l].data + (lo - starts_[l]), hi - lo);
    }
  }

 private:
  const ScatterLeaf* leaves_;
  std::vector<int64_t> starts_;
};

// Fails on a negative count or size, or on a missing pointer.
inline Status CheckLeaves(const ScatterLeaf* leaves, int64_t num_leaves) {
  if (num_leaves < 0 || (num_leaves > 0 && leaves == nullptr)) {
    return Status::InvalidArgument("leaves must be a list of >= 0 leaves");
  }
  for (int64_t l = 0; l < num_leaves; ++l) {
    if (leaves[l].size < 0 || (leaves[l].size > 0 && leaves[l].data == nullptr)) {
      return Status::InvalidArgument("leaf " + std::to_string(l) + " has size " + std::to_string(leaves[l].size) +
                                     (leaves[l].data == nullptr ? " and no data" : ""));
    }
  }
  return Status();
}

inline float Finish(float t, const ScatterOptions& o) {
  if (o.drop && !(std::fabs(t) <= std::numeric_limits<float>::max())) t = 0.0f;
  return t * o.scale;
}

// One task: the entries with index in [begin, end): zeroed, summed in row order, finished once.
inline void ScatterRange(const ScatterRows& r, const Layout& layout, const ScatterOptions& o, int64_t begin,
                         int64_t end) {
  layout.each_part(begin, end, [](float* p, int64_t count) { std::memset(p, 0, sizeof(float) * count); });
  if (o.silenced) return;
  const int64_t m = r.rows * r.per_row;
  const bool one_row = r.rows <= 1;
  for (int64_t e = 0; e < m; ++e) {
    if (e + kAhead < m) {  // the random writes are latency-bound: ask for a later one's line now
      const int64_t ahead = r.indices[e + kAhead];
      if (ahead >= begin && ahead < end) __builtin_prefetch(layout.at(ahead), 1);
    }
    const int64_t i = r.indices[e];
    if (i < begin || i >= end) continue;
    float* out = layout.at(i);
    const float t = o.add ? *out + r.values[e] : r.values[e];
    *out = one_row ? Finish(t, o) : t;  // one row: each index once, finished on the way
  }
  if (one_row || (o.scale == 1.0f && !o.drop)) return;
  // Several rows may hold an index: finish every entry in one streaming pass (an entry no row
  // touched is 0, and stays 0: the scale is > 0).
  layout.each_part(begin, end, [&o](float* p, int64_t count) {
    for (int64_t j = 0; j < count; ++j) p[j] = Finish(p[j], o);
  });
}

}  // namespace scatter_detail

// The leaves of the update from the sparse aggregate (the header's formula). Indices outside
// [0, n) are dropped (padding). Fails, writing nothing, on a negative count or size, on missing
// pointers, or on a scale that is not finite and > 0.
inline Status scatter_leaves(const ScatterRows& rows, const ScatterLeaf* leaves, int64_t num_leaves,
                             const ScatterOptions& options, const Parallel& parallel) {
  if (rows.rows < 0 || rows.per_row < 0) {
    return Status::InvalidArgument("indices and values must have rows >= 0 and pairs per row >= 0, got " +
                                   std::to_string(rows.rows) + " x " + std::to_string(rows.per_row));
  }
  if (rows.rows * rows.per_row > 0 && (rows.indices == nullptr || rows.values == nullptr)) {
    return Status::InvalidArgument("indices and values must not be null");
  }
  if (Status s = scatter_detail::CheckLeaves(leaves, num_leaves); !s.ok()) return s;
  if (!std::isfinite(options.scale) || !(options.scale > 0)) {
    return Status::InvalidArgument("scale must be finite and > 0, got " + std::to_string(options.scale));
  }
  const scatter_detail::Layout layout(leaves, num_leaves);
  const int64_t n = layout.size();
  if (n == 0) return Status();
  const int64_t tasks =
      std::max<int64_t>(1, std::min<int64_t>(parallel.concurrency, n / scatter_detail::kTaskValues));
  parallel.run(tasks, [&](int64_t t) {
    int64_t begin, end;
    split_range(n, tasks, t, 16, &begin, &end);
    scatter_detail::ScatterRange(rows, layout, options, begin, end);
  });
  return Status();
}

// The leaves of the update from a dense aggregate of at least their total size (the header's
// split_leaves formula). Fails, writing nothing, on a negative size, on missing pointers, on a
// vector shorter than the leaves, or on a scale that is not finite and > 0.
inline Status split_leaves(const float* dense, int64_t n, const ScatterLeaf* leaves, int64_t num_leaves,
                           float scale, bool silenced, const Parallel& parallel, bool drop = false) {
  if (Status s = scatter_detail::CheckLeaves(leaves, num_leaves); !s.ok()) return s;
  const scatter_detail::Layout layout(leaves, num_leaves);
  const int64_t total = layout.size();
  if (n < total || (total > 0 && dense == nullptr)) {
    return Status::InvalidArgument("dense must hold at least the leaves' " + std::to_string(total) +
                                   " values, got " + std::to_string(n));
  }
  if (!std::isfinite(scale) || !(scale > 0)) {
    return Status::InvalidArgument("scale must be finite and > 0, got " + std::to_string(scale));
  }
  if (total == 0) return Status();
  const int64_t tasks =
      std::max<int64_t>(1, std::min<int64_t>(parallel.concurrency, total / scatter_detail::kTaskValues));
  parallel.run(tasks, [&](int64_t t) {
    int64_t begin, end;
    split_range(total, tasks, t, 16, &begin, &end);
    const float* from = dense + begin;
    layout.each_part(begin, end, [&](float* p, int64_t count) {
      if (silenced) {
        std::memset(p, 0, sizeof(float) * count);
      } else if (drop) {  // (an error-fed residual: a value that overflowed is not kept)
        for (int64_t j = 0; j < count; ++j) p[j] = (std::isfinite(from[j]) ? from[j] : 0.0f) * scale;
      } else if (scale == 1.0f) {  // the values as they are, NaN payloads included
        std::memcpy(p, from, sizeof(float) * count);
      } else {
        for (int64_t j = 0; j < count; ++j) p[j] = from[j] * scale;
      }
      from += count;
    });
  });
  return Status();
}

}  // namespace jaxcomp
