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
// * long rows: one parallel pass keeps the candidates: entries whose key reaches a floor
//   estimated from a sample of the row (somewhat more than k entries). It only compares and
//   copies (blocks without a candidate are skipped by one vectorized test), so it runs near
//   memory speed. When it kept at least k, K is a candidate's key and everything else is read
//   off the candidates: per-part histograms of their keys' top 16 bits (the bin holding K is
//   where the cumulative count from the top reaches k, which settles rounds <= 16), the low 15
//   bits of K (rounds > 16) from the candidates in K's bin, and how many keys each part has
//   above `hi` and inside the bracket, so prefix sums give every part its output offset and
//   each part writes its selection from its candidates, in index order (the first parts take
//   the bracket keys still needed). When the sample misled (fewer than k candidates) or a
//   part's candidates overflow its buffer, one pass histograms every key of the row and
//   collects again, and full passes over the row do what the candidates cannot.
//   With fewer rows than threads each row is split into parts across threads, else every
//   thread takes whole rows (one part each).
// * short rows: an exponent histogram finds K's binade, std::nth_element on that binade's keys
//   finds K; rows run in parallel.
//
// Plain C++17 with no XLA headers; parallelism comes from the caller through jaxcomp::Parallel.
// Functions report bad arguments as a jaxcomp::Status (kernels/status.h) and never throw.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "kernels/parallel.h"
#include "kernels/status.h"

namespace jaxcomp {
namespace topk_internal {

constexpr int kKeyBits = 31;
constexpr int kCoarseBits = 16;                    // first pass: 8 exponent + 8 mantissa bits
constexpr int kFineBits = kKeyBits - kCoarseBits;  // second pass: the rest of the key
constexpr int64_t kCoarseBins = int64_t{1} << kCoarseBits;
constexpr int64_t kFineBins = int64_t{1} << kFineBits;

// Short rows select within one binade (the exponent: 256 bins); from about this length on,
// zeroing and reading the 65536-bin histogram costs less than that row's nth_element.
constexpr int64_t kShortRowLength = int64_t{1} << 15;
constexpr int kMantissaBits = 23;
constexpr int64_t kBinades = int64_t{1} << (kKeyBits - kMantissaBits);
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

// Selections are sparse, so scans test whole blocks with vectorized compares first and look at
// single entries only in blocks that hold a candidate.
constexpr int64_t kScanBlock = 32;
constexpr uint32_t kKeyRangeEnd = uint32_t{1} << kKeyBits;

// Whether some key of x[0, kScanBlock) lies in [lo, end).
inline bool AnyKeyInRange(const float* x, uint32_t lo, uint32_t end) {
  const uint32_t width = end - lo;
  uint32_t hits = 0;
  for (int64_t j = 0; j < kScanBlock; ++j) hits |= (MagnitudeKey(x[j]) - lo) < width ? 1u : 0u;
  return hits != 0;
}

// Builds one part's selection in index order: every entry offered with key >= hi, and the
// first `quota` offered with lo <= key < hi.
class Selection {
 public:
  Selection(uint32_t lo, uint32_t hi, int64_t quota, float* values, int32_t* indices)
      : lo_(lo), hi_(hi), quota_(quota), values_(values), indices_(indices) {}

  void Offer(float value, int64_t index) {
    const uint32_t key = MagnitudeKey(value);
    if (key >= hi_ || (key >= lo_ && quota_ > 0)) {
      if (key < hi_) --quota_;
      values_[written_] = value;
      indices_[written_] = static_cast<int32_t>(index);
      ++written_;
    }
  }

 private:
  uint32_t lo_, hi_;
  int64_t quota_;
  float* values_;
  int32_t* indices_;
  int64_t written_ = 0;
};

// Offers x[begin, end) to `selection`, skipping blocks without a key >= lo.
inline void SelectFrom(const float* x, int64_t begin, int64_t end, uint32_t lo, Selection* selection) {
  int64_t i = begin;
  for (; i + kScanBlock <= end; i += kScanBlock) {
    if (!AnyKeyInRange(x + i, lo, kKeyRangeEnd)) continue;
    for (int64_t j = i; j < i + kScanBlock; ++j) selection->Offer(x[j], j);
  }
  for (; i < end; ++i) selection->Offer(x[i], i);
}

// Keeps x[begin, end)'s entries whose key is >= floor (values and indices, in index order) while
// they fit in `capacity`, and returns how many there are, counting on past the capacity. Blocks
// without one are skipped with one vectorized test; in the others, while a whole block fits,
// every entry is written and the count advances past the kept ones only (no branch per entry).
inline int64_t CollectCandidates(const float* x, int64_t begin, int64_t end, uint32_t floor, float* values,
                                 int32_t* indices, int64_t capacity) {
  int64_t count = 0;
  auto offer = [&](int64_t i) {
    if (MagnitudeKey(x[i]) < floor) return;
    if (count < capacity) {
      values[count] = x[i];
      indices[count] = static_cast<int32_t>(i);
    }
    ++count;
  };
  int64_t i = begin;
  for (; i + kScanBlock <= end; i += kScanBlock) {
    if (!AnyKeyInRange(x + i, floor, kKeyRangeEnd)) continue;
    if (count + kScanBlock > capacity) {
      for (int64_t j = i; j < i + kScanBlock; ++j) offer(j);
      continue;
    }
    for (int64_t j = i; j < i + kScanBlock; ++j) {
      values[count] = x[j];
      indices[count] = static_cast<int32_t>(j);
      count += MagnitudeKey(x[j]) >= floor;
    }
  }
  for (; i < end; ++i) offer(i);
  return count;
}

// The bin of the k-th largest key: the highest b with above + hist[b] + hist[b + 1] + ... >= k,
// where `above` (updated to include the bins past b) counts keys beyond the histogram. Every
// key must lie in or beyond it, and there are at least k. Whole blocks of bins are skipped
// with one (vectorized) sum: most high bins of a 65536-bin histogram are empty.
inline int64_t FindKthBin(const uint32_t* hist, int64_t bins, int64_t k, int64_t* above) {
  constexpr int64_t kBlock = 64;
  int64_t end = bins;  // bins [end, bins) are counted in *above
  while (end >= kBlock) {
    int64_t block = 0;
    for (int64_t b = end - kBlock; b < end; ++b) block += hist[b];
    if (*above + block >= k) break;
    *above += block;
    end -= kBlock;
  }
  int64_t bin = end - 1;
  while (*above + hist[bin] < k) *above += hist[bin--];
  return bin;
}

// Short rows: an exponent histogram finds the binade of the k-th key, then nth_element runs on
// that binade's keys only. `keys` is scratch of n entries.
inline Bracket ShortRowSearch(const float* x, int64_t n, int64_t k, int rounds, uint32_t* keys) {
  uint32_t binades[kBinades] = {};
  for (int64_t i = 0; i < n; ++i) ++binades[MagnitudeKey(x[i]) >> kMantissaBits];
  int64_t above = 0;  // keys in binades above the k-th key's
  const int64_t binade = FindKthBin(binades, kBinades, k, &above);
  int64_t in_binade = 0;
  for (int64_t i = 0; i < n; ++i) {  // branch-free: about as many keys stay as leave
    const uint32_t key = MagnitudeKey(x[i]);
    keys[in_binade] = key;
    in_binade += (key >> kMantissaBits) == static_cast<uint32_t>(binade);
  }
  const int64_t rank = k - 1 - above;
  std::nth_element(keys, keys + rank, keys + in_binade, std::greater<uint32_t>());
  Bracket bracket = BracketAround(keys[rank], rounds);
  // From 8 rounds on the bracket lies inside K's binade, so the binade's keys are all it takes
  // to count; fewer rounds leave a bracket spanning binades, counted over the whole row.
  auto count_keys = [&bracket](int64_t length, auto key_at) {
    for (int64_t i = 0; i < length; ++i) {
      const uint32_t key = key_at(i);
      bracket.above += key >= bracket.hi;
      bracket.count += key >= bracket.lo;
    }
  };
  if (rounds >= kKeyBits - kMantissaBits) {
    bracket.above = bracket.count = above;
    count_keys(in_binade, [keys](int64_t i) { return keys[i]; });
  } else {
    count_keys(n, [x](int64_t i) { return MagnitudeKey(x[i]); });
  }
  return bracket;
}

// Candidate collection: the first pass keeps every entry whose key reaches a floor estimated
// from a sample, so the bracket and the selection come from the (few) candidates instead of
// histograms of the whole row and more passes over it. Fewer than k candidates or a full
// buffer send the row to the histogram pass (which collects again) and the full passes.
constexpr int64_t kMaxSamples = int64_t{1} << 14;
constexpr int64_t kSampleSpacing = 256;           // one sample per 256 entries, up to kMaxSamples
constexpr int64_t kMinSamples = 256;              // fewer give too loose a floor to bother
constexpr int64_t kMinSampleWindow = 16;          // rows shorter than 256 * 16 collect nothing
constexpr double kMaxCandidateFraction = 0.125;   // above this, plain passes are as cheap
constexpr double kCandidateHeadroom = 1.5;        // buffer size over the sampled fraction
constexpr int64_t kCandidateSlack = 1024;         // extra buffer entries per part

// Up to this many parts, histogram bookkeeping runs on the calling thread alone.
constexpr int64_t kSerialBookkeepingParts = 4;

// Long rows: histogram radix select over `parts` contiguous parts of the row. Holds the
// scratch (about 400 KB per part plus candidate buffers), so one instance serves many rows.
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
        offset_(parts),
        samples_(kMaxSamples),
        candidate_start_(parts + 1),
        candidate_count_(parts) {}

  int64_t parts() const { return parts_; }

  // The row's bracket. `collect`: also gather candidates, worth it when a selection follows
  // or rounds > 16 (they then replace the pass over the k-th key's coarse bin).
  Bracket Search(const float* x, int64_t n, int64_t k, int rounds, bool collect, const Parallel& parallel) {
    const uint32_t floor = collect ? PlanCandidates(x, n, k, rounds) : kNoCandidates;
    if (floor == kNoCandidates || !CollectOnly(x, n, k, floor, parallel)) HistogramPass(x, n, floor, parallel);
    const uint32_t* total = Merge(coarse_, kCoarseBins, parallel);
    int64_t above_bin = 0;  // keys in bins above the k-th key's bin
    const uint32_t kth_bin = static_cast<uint32_t>(FindKthBin(total, kCoarseBins, k, &above_bin));
    uint32_t kth_key = kth_bin << kFineBits;

    // Candidates are usable when they hold every key from the coarse bracket floor up.
    use_candidates_ = floor != kNoCandidates &&
                      floor <= BracketAround(kth_key, std::min(rounds, kCoarseBits)).lo;
    for (int64_t part = 0; use_candidates_ && part < parts_; ++part) {
      use_candidates_ = candidate_count_[part] <= candidate_start_[part + 1] - candidate_start_[part];
    }

    if (rounds > kCoarseBits) {
      // From the candidates it is little work: no barrier with threads that may be busy elsewhere.
      const Parallel& fine = use_candidates_ ? BookkeepingParallel(parallel) : parallel;
      fine.run(parts_, [&](int64_t part) { FineHistogram(x, n, part, kth_bin); });
      const uint32_t* fine_total = Merge(fine_, kFineBins, parallel);
      int64_t above_fine = above_bin;
      kth_key |= static_cast<uint32_t>(FindKthBin(fine_total, kFineBins, k, &above_fine));
    }

    Bracket bracket = BracketAround(kth_key, rounds);
    BookkeepingParallel(parallel).run(parts_, [&](int64_t part) { CountPart(part, kth_bin, rounds, bracket); });
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
      Selection selection(bracket.lo, bracket.hi, quota_[part], values + offset_[part], indices + offset_[part]);
      if (use_candidates_) {
        const float* candidate_values = candidate_values_.get() + candidate_start_[part];
        const int32_t* candidate_indices = candidate_indices_.get() + candidate_start_[part];
        for (int64_t c = 0; c < candidate_count_[part]; ++c) selection.Offer(candidate_values[c], candidate_indices[c]);
      } else {
        int64_t begin, end;
        split_range(n, parts_, part, kPartAlign, &begin, &end);
        SelectFrom(x, begin, end, bracket.lo, &selection);
      }
    });
  }

 private:
  static constexpr uint32_t kNoCandidates = ~uint32_t{0};  // above every key

  // Sizes the candidate buffers and returns the candidate floor, or kNoCandidates when
  // collecting would not pay (short row, large k, few rounds) or memory is short.
  uint32_t PlanCandidates(const float* x, int64_t n, int64_t k, int rounds) {
    if (n < kMinSamples * kMinSampleWindow) return kNoCandidates;
    const int64_t samples = std::min(kMaxSamples, std::max(kMinSamples, n / kSampleSpacing));
    // One sample in each of `samples` equal windows, at a scrambled offset so that periodic
    // data (rows of a flattened matrix) cannot line up with the sample.
    const int64_t window = n / samples;
    for (int64_t s = 0; s < samples; ++s) {
      const uint64_t scrambled = (static_cast<uint64_t>(s) + 1) * 0x9E3779B97F4A7C15ull;
      samples_[s] = MagnitudeKey(x[s * window + static_cast<int64_t>((scrambled >> 32) % window)]);
    }
    // The sample's count above the true k-th key is about binomial(samples, k / n): going four
    // standard deviations (and a few ranks) further down makes a floor above it very unlikely.
    const double expected_rank = static_cast<double>(k) * samples / n;
    const int64_t rank = static_cast<int64_t>(expected_rank + 4.0 * std::sqrt(expected_rank) + 4.0);
    if (rank >= samples) return kNoCandidates;
    std::nth_element(samples_.begin(), samples_.begin() + rank, samples_.begin() + samples,
                     std::greater<uint32_t>());
    const uint32_t floor = BracketAround(samples_[rank], std::min(rounds, kCoarseBits)).lo;
    int64_t sampled_candidates = 0;
    for (int64_t s = 0; s < samples; ++s) sampled_candidates += samples_[s] >= floor;
    const double fraction = static_cast<double>(sampled_candidates) / samples;
    if (fraction > kMaxCandidateFraction) return kNoCandidates;

    for (int64_t part = 0; part < parts_; ++part) {
      int64_t begin, end;
      split_range(n, parts_, part, kPartAlign, &begin, &end);
      const int64_t capacity = static_cast<int64_t>((end - begin) * fraction * kCandidateHeadroom) + kCandidateSlack;
      candidate_start_[part + 1] = candidate_start_[part] + std::min(capacity, end - begin);
    }
    const int64_t needed = candidate_start_[parts_];
    if (needed > candidate_capacity_) {  // may run inside a parallel task: no exceptions
      candidate_values_.reset(new (std::nothrow) float[needed]);
      candidate_indices_.reset(new (std::nothrow) int32_t[needed]);
      candidate_capacity_ = candidate_values_ && candidate_indices_ ? needed : 0;
      if (candidate_capacity_ == 0) return kNoCandidates;
    }
    return floor;
  }

  // The common case's only pass over the row: each part keeps its candidates (every key >= the
  // floor), with no histogram of the row, then histograms its candidates' keys. True when they
  // all fit and number at least k: the k-th key is then a candidate's, and the candidates'
  // histograms are all the search needs. Otherwise (the sample misled) HistogramPass runs.
  bool CollectOnly(const float* x, int64_t n, int64_t k, uint32_t floor, const Parallel& parallel) {
    parallel.run(parts_, [&](int64_t part) {
      int64_t begin, end;
      split_range(n, parts_, part, kPartAlign, &begin, &end);
      const float* candidate_values = candidate_values_.get() + candidate_start_[part];
      const int64_t capacity = candidate_start_[part + 1] - candidate_start_[part];
      const int64_t count = CollectCandidates(x, begin, end, floor, candidate_values_.get() + candidate_start_[part],
                                              candidate_indices_.get() + candidate_start_[part], capacity);
      candidate_count_[part] = count;
      if (count > capacity) return;  // (HistogramPass will run)
      uint32_t* hist = &coarse_[part * kCoarseBins];
      std::fill(hist, hist + kCoarseBins, 0u);
      for (int64_t c = 0; c < count; ++c) ++hist[MagnitudeKey(candidate_values[c]) >> kFineBits];
    });
    int64_t total = 0;
    for (int64_t part = 0; part < parts_; ++part) {
      if (candidate_count_[part] > candidate_start_[part + 1] - candidate_start_[part]) return false;
      total += candidate_count_[part];
    }
    return total >= k;
  }

  // One pass over the row: each part's histogram of the keys' top 16 bits, and its candidates
  // (every key >= floor; none with kNoCandidates).
  void HistogramPass(const float* x, int64_t n, uint32_t floor, const Parallel& parallel) {
    parallel.run(parts_, [&](int64_t part) {
      uint32_t* hist = &coarse_[part * kCoarseBins];
      std::fill(hist, hist + kCoarseBins, 0u);
      int64_t begin, end;
      split_range(n, parts_, part, kPartAlign, &begin, &end);
      if (floor == kNoCandidates) {
        for (int64_t i = begin; i < end; ++i) ++hist[MagnitudeKey(x[i]) >> kFineBits];
        return;
      }
      float* candidate_values = candidate_values_.get() + candidate_start_[part];
      int32_t* candidate_indices = candidate_indices_.get() + candidate_start_[part];
      const int64_t capacity = candidate_start_[part + 1] - candidate_start_[part];
      int64_t count = 0;
      for (int64_t i = begin; i < end; ++i) {
        const uint32_t key = MagnitudeKey(x[i]);
        ++hist[key >> kFineBits];
        if (key >= floor) {
          if (count < capacity) {
            candidate_values[count] = x[i];
            candidate_indices[count] = static_cast<int32_t>(i);
          }
          ++count;  // keeps counting past the capacity, to detect the overflow
        }
      }
      candidate_count_[part] = count;
    });
  }

  // This part's histogram of the low key bits inside the k-th key's coarse bin.
  void FineHistogram(const float* x, int64_t n, int64_t part, uint32_t kth_bin) {
    uint32_t* hist = &fine_[part * kFineBins];
    std::fill(hist, hist + kFineBins, 0u);
    auto add = [&](float value) {
      const uint32_t key = MagnitudeKey(value);
      if ((key >> kFineBits) == kth_bin) ++hist[key & (kFineBins - 1)];
    };
    if (use_candidates_) {
      const float* candidate_values = candidate_values_.get() + candidate_start_[part];
      for (int64_t c = 0; c < candidate_count_[part]; ++c) add(candidate_values[c]);
      return;
    }
    int64_t begin, end;
    split_range(n, parts_, part, kPartAlign, &begin, &end);
    const uint32_t bin_start = kth_bin << kFineBits, bin_end = bin_start + kFineBins;
    int64_t i = begin;
    for (; i + kScanBlock <= end; i += kScanBlock) {
      if (!AnyKeyInRange(x + i, bin_start, bin_end)) continue;
      for (int64_t j = i; j < i + kScanBlock; ++j) add(x[j]);
    }
    for (; i < end; ++i) add(x[i]);
  }

  // Merging and counting histograms take microseconds per part: with few parts the caller does
  // them alone rather than wait at one more barrier for threads that may be busy elsewhere.
  const Parallel& BookkeepingParallel(const Parallel& parallel) const {
    return parts_ <= kSerialBookkeepingParts ? serial_ : parallel;
  }

  // Sums the per-part histograms (parts x bins in `hists`); with one part there is nothing to add.
  const uint32_t* Merge(const std::vector<uint32_t>& hists, int64_t bins, const Parallel& parallel) {
    if (parts_ == 1) return hists.data();
    BookkeepingParallel(parallel).run(parts_, [&](int64_t slice) {
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
  std::vector<uint32_t> samples_;  // sampled keys, for the candidate floor
  // Candidates of part p: candidate_{values,indices}_[candidate_start_[p] + c] for
  // c < candidate_count_[p], in index order; the buffer ends at candidate_start_[p + 1].
  std::unique_ptr<float[]> candidate_values_;
  std::unique_ptr<int32_t[]> candidate_indices_;
  int64_t candidate_capacity_ = 0;
  std::vector<int64_t> candidate_start_;
  std::vector<int64_t> candidate_count_;
  bool use_candidates_ = false;  // the last Search's candidates hold every key it may select
  Parallel serial_;
};

inline Status CheckArguments(int64_t rows, int64_t n, int64_t k, int64_t rounds) {
  if (rows < 0) return Status::InvalidArgument("rows must be >= 0, got " + std::to_string(rows));
  if (n < 1 || n > INT32_MAX) return Status::InvalidArgument("n must be in [1, 2^31 - 1], got " + std::to_string(n));
  if (k < 1 || k > n) {
    return Status::InvalidArgument("k must be in [1, " + std::to_string(n) + "], got " + std::to_string(k));
  }
  if (rounds < 1 || rounds > kKeyBits) {
    return Status::InvalidArgument("rounds must be in [1, 31], got " + std::to_string(rounds));
  }
  return Status();
}

// Finds every row's bracket and writes either the selection (values, indices: rows x k) or the
// threshold (threshold, count: rows); the other pair is null.
inline Status SearchRows(const float* x, int64_t rows, int64_t n, int64_t k, int64_t rounds,
                              const Parallel& parallel, float* values, int32_t* indices, float* threshold,
                              int32_t* count) {
  Status status = CheckArguments(rows, n, k, rounds);
  if (!status.ok() || rows == 0) return status;
  const int r = static_cast<int>(rounds);
  const bool select = values != nullptr;
  const bool collect = select || r > kCoarseBits;
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
      // Reused by later calls from this thread: fresh candidate buffers (megabytes for long
      // rows) would cost a page fault per 4 KB written, about a tenth of the search. Calls on
      // one thread never overlap: the caller blocks in Parallel::run until its tasks finish.
      thread_local std::unique_ptr<HistogramSearch> cached_search;
      if (!cached_search || cached_search->parts() != parts) cached_search.reset(new HistogramSearch(parts));
      HistogramSearch& search = *cached_search;
      for (int64_t row = 0; row < rows; ++row) {
        const float* xr = x + row * n;
        const Bracket bracket = search.Search(xr, n, k, r, collect, parallel);
        emit(row, bracket);
        if (select) search.Write(xr, n, k, bracket, values + row * k, indices + row * k, parallel);
      }
      return Status();
    }
    // Many rows (or short ones): each thread takes whole rows, with its own scratch.
    const int64_t tasks = std::min(rows, concurrency);
    const bool short_rows = n < kShortRowLength;
    std::vector<uint32_t> keys(short_rows ? tasks * n : 0);
    std::vector<HistogramSearch> searches;
    if (!short_rows) {
      searches.reserve(tasks);
      for (int64_t task = 0; task < tasks; ++task) searches.emplace_back(1);
    }
    parallel.run(tasks, [&](int64_t task) {
      int64_t first, last;
      split_range(rows, tasks, task, 1, &first, &last);
      for (int64_t row = first; row < last; ++row) {
        const float* xr = x + row * n;
        if (short_rows) {
          const Bracket bracket = ShortRowSearch(xr, n, k, r, &keys[task * n]);
          emit(row, bracket);
          if (select) {
            Selection selection(bracket.lo, bracket.hi, k - bracket.above, values + row * k, indices + row * k);
            SelectFrom(xr, 0, n, bracket.lo, &selection);
          }
        } else {
          const Bracket bracket = searches[task].Search(xr, n, k, r, collect, serial);
          emit(row, bracket);
          if (select) searches[task].Write(xr, n, k, bracket, values + row * k, indices + row * k, serial);
        }
      }
    });
  } catch (const std::exception& e) {  // scratch allocation is the only thing that can throw
    return Status::ResourceExhausted(std::string("top-k kernel could not allocate its scratch: ") + e.what());
  }
  return Status();
}

}  // namespace topk_internal

// Exact top-k by magnitude of each row of x (rows x n, row-major): values and indices are
// rows x k, each row in ascending index order.
inline Status TopK(const float* x, int64_t rows, int64_t n, int64_t k, float* values, int32_t* indices,
                        const Parallel& parallel) {
  return topk_internal::SearchRows(x, rows, n, k, topk_internal::kKeyBits, parallel, values, indices, nullptr,
                                   nullptr);
}

// MSTopK bisection: per row, the lower threshold after `rounds` rounds and the number of
// entries whose magnitude key is at least that threshold's.
inline Status FindThreshold(const float* x, int64_t rows, int64_t n, int64_t k, int64_t rounds,
                                 float* threshold, int32_t* count, const Parallel& parallel) {
  return topk_internal::SearchRows(x, rows, n, k, rounds, parallel, nullptr, nullptr, threshold, count);
}

// Exactly k entries per row: every key >= the upper threshold, then the lowest-index keys in the
// bracket. Same output layout as TopK; equals it when rounds = 31.
inline Status ThresholdTopK(const float* x, int64_t rows, int64_t n, int64_t k, int64_t rounds, float* values,
                                 int32_t* indices, const Parallel& parallel) {
  return topk_internal::SearchRows(x, rows, n, k, rounds, parallel, values, indices, nullptr, nullptr);
}

}  // namespace jaxcomp
