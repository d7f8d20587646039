// Top-k selection by magnitude on the CPU: exact top-k and the MSTopK threshold search.
//
// Semantics are docs/kernels.md's: key(x) = bits(x) & 0x7FFFFFFF (NaN ranks largest), ties go
// to the lower index, selections come out in ascending index order, and `rounds` bisection
// rounds over the key leave a bracket [lo, hi) of width 2^(31 - rounds).
//
// The bisection never has to run round by round. Let K be the k-th largest key. C(t) >= k
// exactly when t <= K, so after `rounds` rounds `lo` is K with its low 31 - rounds bits cleared
// and hi = lo + 2^(31 - rounds). Exact top-k is the case rounds = 31 (lo = K, hi = K + 1: take
// every key above K, then the lowest-index keys equal to K). Everything reduces to finding
// enough leading bits of K:
//
// * long rows: one parallel pass builds per-part histograms of the key's top 16 bits; the bin
//   holding K is where the cumulative count from the top reaches k, which settles rounds <= 16.
//   Finer rounds take a second pass that histograms the low 15 bits of the keys in that bin
//   only. The per-part histograms also say how many keys each part has above `hi` and inside
//   the bracket, so prefix sums give every part its output offset, and one more parallel pass
//   writes the selection in index order (the first parts take the bracket keys still needed).
// * short rows: std::nth_element on a copy of the keys finds K directly; rows run in parallel.
//
// Plain C++17 with no XLA headers; parallelism comes from the caller through jaxcomp::Parallel.
// Functions report bad arguments as an error string (empty on success) and never throw.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "kernels/parallel.h"

namespace jaxcomp {
namespace topk_internal {

constexpr int kKeyBits = 31;
constexpr int kCoarseBits = 16;                    // first pass: 8 exponent + 8 mantissa bits
constexpr int kFineBits = kKeyBits - kCoarseBits;  // second pass: the rest of the key
constexpr int64_t kCoarseBins = int64_t{1} << kCoarseBits;
constexpr int64_t kFineBins = int64_t{1} << kFineBits;

// Below this row length nth_element beats zeroing and walking a 65536-bin histogram.
constexpr int64_t kSortRowLength = int64_t{1} << 14;
// A part of a row split across threads must be long enough to pay for its own histogram.
constexpr int64_t kMinPartLength = int64_t{1} << 15;
// Part boundaries fall on whole cache lines of floats, so parts never share a line.
constexpr int64_t kPartAlign = 16;

inline uint32_t MagnitudeKey(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits & 0x7FFFFFFFu;
}

inline float FloatFromBits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// The bisection's final bracket for one row and the counts the outputs need.
struct Bracket {
  uint32_t lo = 0;    // lower threshold key: at least k keys are >= lo
  uint32_t hi = 0;    // upper threshold key (up to 2^31): fewer than k keys are >= hi
  int64_t above = 0;  // #{key >= hi}, all of them in the exact top-k set
  int64_t count = 0;  // #{key >= lo}, find_threshold's count
};

// The bracket after `rounds` rounds, given (at least the top `rounds` bits of) the k-th key.
inline Bracket BracketAround(uint32_t kth_key, int rounds) {
  const int width_bits = kKeyBits - rounds;
  Bracket bracket;
  bracket.lo = (kth_key >> width_bits) << width_bits;
  bracket.hi = bracket.lo + (uint32_t{1} << width_bits);
  return bracket;
}

// Writes, in index order, every entry of x[begin, end) with key >= hi and the first `quota`
// entries with lo <= key < hi. Returns how many it wrote.
inline int64_t WriteSelected(const float* x, int64_t begin, int64_t end, uint32_t lo, uint32_t hi, int64_t quota,
                             float* values, int32_t* indices) {
  int64_t written = 0;
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t key = MagnitudeKey(x[i]);
    if (key >= hi || (key >= lo && quota > 0)) {
      if (key < hi) --quota;
      values[written] = x[i];
      indices[written] = static_cast<int32_t>(i);
      ++written;
    }
  }
  return written;
}

// Short rows: the k-th key by nth_element over `keys` (scratch of n entries).
inline Bracket SortSearch(const float* x, int64_t n, int64_t k, int rounds, uint32_t* keys) {
  for (int64_t i = 0; i < n; ++i) keys[i] = MagnitudeKey(x[i]);
  std::nth_element(keys, keys + (k - 1), keys + n, std::greater<uint32_t>());
  Bracket bracket = BracketAround(keys[k - 1], rounds);
  int64_t above = 0, count = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t key = MagnitudeKey(x[i]);
    above += key >= bracket.hi;
    count += key >= bracket.lo;
  }
  bracket.above = above;
  bracket.count = count;
  return bracket;
}

// Long rows: histogram radix select over `parts` contiguous parts of the row. Holds the scratch
// (about 400 KB per part), so one instance serves many rows.
class HistogramSearch {
 public:
  explicit HistogramSearch(int64_t parts)
      : parts_(parts),
        coarse_(parts * kCoarseBins),
        fine_(parts * kFineBins),
        total_(kCoarseBins),
        above_(parts),
        inside_(parts),
        quota_(parts),
        offset_(parts) {}

  Bracket Search(const float* x, int64_t n, int64_t k, int rounds, const Parallel& parallel) {
    parallel.run(parts_, [&](int64_t part) {
      uint32_t* hist = &coarse_[part * kCoarseBins];
      std::fill(hist, hist + kCoarseBins, 0u);
      int64_t begin, end;
      split_range(n, parts_, part, kPartAlign, &begin, &end);
      for (int64_t i = begin; i < end; ++i) ++hist[MagnitudeKey(x[i]) >> kFineBits];
    });
    const uint32_t* total = Merge(coarse_, kCoarseBins, parallel);
    int64_t above_bin = 0;  // keys in bins above the k-th key's bin
    int64_t bin = kCoarseBins - 1;
    while (above_bin + total[bin] < k) above_bin += total[bin--];  // stops: all bins hold n >= k
    const uint32_t kth_bin = static_cast<uint32_t>(bin);
    uint32_t kth_key = kth_bin << kFineBits;

    if (rounds > kCoarseBits) {
      parallel.run(parts_, [&](int64_t part) {
        uint32_t* hist = &fine_[part * kFineBins];
        std::fill(hist, hist + kFineBins, 0u);
        int64_t begin, end;
        split_range(n, parts_, part, kPartAlign, &begin, &end);
        for (int64_t i = begin; i < end; ++i) {
          const uint32_t key = MagnitudeKey(x[i]);
          if ((key >> kFineBits) == kth_bin) ++hist[key & (kFineBins - 1)];
        }
      });
      const uint32_t* fine_total = Merge(fine_, kFineBins, parallel);
      int64_t above_fine = above_bin;
      int64_t fine_bin = kFineBins - 1;
      while (above_fine + fine_total[fine_bin] < k) above_fine += fine_total[fine_bin--];
      kth_key |= static_cast<uint32_t>(fine_bin);
    }

    Bracket bracket = BracketAround(kth_key, rounds);
    parallel.run(parts_, [&](int64_t part) { CountPart(part, kth_bin, rounds, bracket); });
    for (int64_t part = 0; part < parts_; ++part) {
      bracket.above += above_[part];
      bracket.count += above_[part] + inside_[part];
    }
    return bracket;
  }

  // Writes the k selected entries of the row last passed to Search (which returned `bracket`).
  void Write(const float* x, int64_t n, int64_t k, const Bracket& bracket, float* values, int32_t* indices,
             const Parallel& parallel) {
    int64_t still_needed = k - bracket.above;  // bracket keys to take, lowest indices first
    int64_t offset = 0;
    for (int64_t part = 0; part < parts_; ++part) {
      quota_[part] = std::min(inside_[part], still_needed);
      still_needed -= quota_[part];
      offset_[part] = offset;
      offset += above_[part] + quota_[part];
    }
    parallel.run(parts_, [&](int64_t part) {
      int64_t begin, end;
      split_range(n, parts_, part, kPartAlign, &begin, &end);
      WriteSelected(x, begin, end, bracket.lo, bracket.hi, quota_[part], values + offset_[part],
                    indices + offset_[part]);
    });
  }

 private:
  // Sums the per-part histograms (parts x bins in `hists`); with one part there is nothing to add.
  const uint32_t* Merge(const std::vector<uint32_t>& hists, int64_t bins, const Parallel& parallel) {
    if (parts_ == 1) return hists.data();
    parallel.run(parts_, [&](int64_t slice) {
      int64_t begin, end;
      split_range(bins, parts_, slice, kPartAlign, &begin, &end);
      std::copy(hists.begin() + begin, hists.begin() + end, total_.begin() + begin);
      for (int64_t part = 1; part < parts_; ++part) {
        const uint32_t* hist = &hists[part * bins];
        for (int64_t b = begin; b < end; ++b) total_[b] += hist[b];
      }
    });
    return total_.data();
  }

  // This part's number of keys >= hi and in [lo, hi), read off its histograms.
  void CountPart(int64_t part, uint32_t kth_bin, int rounds, const Bracket& bracket) {
    const uint32_t* coarse = &coarse_[part * kCoarseBins];
    int64_t above = 0, inside = 0;
    if (rounds <= kCoarseBits) {  // lo and hi are whole coarse bins
      const int64_t lo_bin = bracket.lo >> kFineBits, hi_bin = bracket.hi >> kFineBits;
      for (int64_t b = hi_bin; b < kCoarseBins; ++b) above += coarse[b];
      for (int64_t b = lo_bin; b < hi_bin; ++b) inside += coarse[b];
    } else {  // lo and hi lie inside the k-th key's coarse bin
      const uint32_t* fine = &fine_[part * kFineBins];
      const int64_t bin_start = int64_t{kth_bin} << kFineBits;
      const int64_t lo_fine = bracket.lo - bin_start, hi_fine = bracket.hi - bin_start;
      for (int64_t b = kth_bin + 1; b < kCoarseBins; ++b) above += coarse[b];
      for (int64_t b = hi_fine; b < kFineBins; ++b) above += fine[b];
      for (int64_t b = lo_fine; b < hi_fine; ++b) inside += fine[b];
    }
    above_[part] = above;
    inside_[part] = inside;
  }

  int64_t parts_;
  std::vector<uint32_t> coarse_;  // parts x kCoarseBins: counts of key >> kFineBits
  std::vector<uint32_t> fine_;    // parts x kFineBins: low key bits, within the k-th key's coarse bin
  std::vector<uint32_t> total_;   // the merged histogram
  std::vector<int64_t> above_;    // per part: #{key >= hi}
  std::vector<int64_t> inside_;   // per part: #{lo <= key < hi}
  std::vector<int64_t> quota_;    // per part: how many of its bracket keys it selects
  std::vector<int64_t> offset_;   // per part: where its selection starts in the output
};

inline std::string CheckArguments(int64_t rows, int64_t n, int64_t k, int64_t rounds) {
  if (rows < 0) return "rows must be >= 0, got " + std::to_string(rows);
  if (n < 1 || n > INT32_MAX) return "n must be in [1, 2^31 - 1], got " + std::to_string(n);
  if (k < 1 || k > n) return "k must be in [1, " + std::to_string(n) + "], got " + std::to_string(k);
  if (rounds < 1 || rounds > kKeyBits) return "rounds must be in [1, 31], got " + std::to_string(rounds);
  return "";
}

// Finds every row's bracket and writes either the selection (values, indices: rows x k) or the
// threshold (threshold, count: rows); the other pair is null.
inline std::string SearchRows(const float* x, int64_t rows, int64_t n, int64_t k, int64_t rounds,
                              const Parallel& parallel, float* values, int32_t* indices, float* threshold,
                              int32_t* count) {
  std::string error = CheckArguments(rows, n, k, rounds);
  if (!error.empty() || rows == 0) return error;
  const int r = static_cast<int>(rounds);
  const bool select = values != nullptr;
  auto emit = [&](int64_t row, const Bracket& bracket) {
    if (!select) {
      threshold[row] = FloatFromBits(bracket.lo);
      count[row] = static_cast<int32_t>(bracket.count);
    }
  };
  const Parallel serial;
  const int64_t concurrency = std::max<int64_t>(1, parallel.concurrency);
  try {
    const int64_t parts = std::min(concurrency, std::max<int64_t>(1, n / kMinPartLength));
    if (parts > 1 && rows < concurrency) {  // few long rows: split each row across threads
      HistogramSearch search(parts);
      for (int64_t row = 0; row < rows; ++row) {
        const float* xr = x + row * n;
        const Bracket bracket = search.Search(xr, n, k, r, parallel);
        emit(row, bracket);
        if (select) search.Write(xr, n, k, bracket, values + row * k, indices + row * k, parallel);
      }
      return "";
    }
    // Many rows (or short ones): each thread takes whole rows, with its own scratch.
    const int64_t tasks = std::min(rows, concurrency);
    const bool sort = n < kSortRowLength;
    std::vector<uint32_t> keys(sort ? tasks * n : 0);
    std::vector<HistogramSearch> searches;
    if (!sort) searches.assign(tasks, HistogramSearch(1));
    parallel.run(tasks, [&](int64_t task) {
      int64_t first, last;
      split_range(rows, tasks, task, 1, &first, &last);
      for (int64_t row = first; row < last; ++row) {
        const float* xr = x + row * n;
        if (sort) {
          const Bracket bracket = SortSearch(xr, n, k, r, &keys[task * n]);
          emit(row, bracket);
          if (select) WriteSelected(xr, 0, n, bracket.lo, bracket.hi, k - bracket.above, values + row * k,
                                    indices + row * k);
        } else {
          const Bracket bracket = searches[task].Search(xr, n, k, r, serial);
          emit(row, bracket);
          if (select) searches[task].Write(xr, n, k, bracket, values + row * k, indices + row * k, serial);
        }
      }
    });
  } catch (const std::exception& e) {  // scratch allocation is the only thing that can throw
    return std::string("top-k kernel failed: ") + e.what();
  }
  return "";
}

}  // namespace topk_internal

// Exact top-k by magnitude of each row of x (rows x n, row-major): values and indices are
// rows x k, each row in ascending index order. Returns an error message, or "" on success.
inline std::string TopK(const float* x, int64_t rows, int64_t n, int64_t k, float* values, int32_t* indices,
                        const Parallel& parallel) {
  return topk_internal::SearchRows(x, rows, n, k, topk_internal::kKeyBits, parallel, values, indices, nullptr,
                                   nullptr);
}

// MSTopK bisection: per row, the lower threshold after `rounds` rounds and the number of
// entries whose magnitude key is at least that threshold's.
inline std::string FindThreshold(const float* x, int64_t rows, int64_t n, int64_t k, int64_t rounds,
                                 float* threshold, int32_t* count, const Parallel& parallel) {
  return topk_internal::SearchRows(x, rows, n, k, rounds, parallel, nullptr, nullptr, threshold, count);
}

// Exactly k entries per row: every key >= the upper threshold, then the lowest-index keys in the
// bracket. Same output layout as TopK; equals it when rounds = 31.
inline std::string ThresholdTopK(const float* x, int64_t rows, int64_t n, int64_t k, int64_t rounds, float* values,
                                 int32_t* indices, const Parallel& parallel) {
  return topk_internal::SearchRows(x, rows, n, k, rounds, parallel, values, indices, nullptr, nullptr);
}

}  // namespace jaxcomp
