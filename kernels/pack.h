// Packing gradient leaves into one flat error-fed vector in a single pass:
//   out[offset_i + j] = (g_i[j] finite ? g_i[j] : 0) + r_i[j]      (r_i optional)
// and, from the same pass, the statistics every compressed step needs (PackStats): the number of
// non-finite g values, the gradient's energy (the guardrail's) and the error-fed vector's energies
// (the compression gain's). This is what `compress(granularity="model")` does before every
// method; done by XLA it took a select-and-add loop per leaf plus a concatenate, two to three
// passes over fresh memory (docs/performance.md), and with at most 8 leaves an XLA:CPU fused
// concatenate that was 30x slower still; the energies were one and a half passes more. No XLA
// headers; the adapter is ffi/pack_cpu.cc.
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

// One leaf: its gradient, its residual (nullptr: none) and its number of values.
struct PackPart {
  const float* grad = nullptr;
  const float* residual = nullptr;
  int64_t size = 0;
};

// What one pass over the gradients learns besides the vector.
struct PackStats {
  double nonfinite = 0;      // non-finite gradient values (they count as 0)
  double gradient = 0;       // sum of g^2 over the finite g
  double fed = 0;            // sum of out^2 (infinite when a value of g + r overflowed)
  double fed_scaled = 0;     // sum of (out * energy_scale)^2 over the finite out
  double fed_nonfinite = 0;  // non-finite out values (g + r overflowed)

  PackStats& operator+=(const PackStats& o) {
    nonfinite += o.nonfinite;
    gradient += o.gradient;
    fed += o.fed;
    fed_scaled += o.fed_scaled;
    fed_nonfinite += o.fed_nonfinite;
    return *this;
  }
};

namespace pack_detail {

// Values per task: large enough that a task's start-up (a binary search) is nothing.
constexpr int64_t kTaskValues = int64_t{1} << 16;
// Independent accumulators per sum, so that the compiler keeps them in vector lanes.
constexpr int kLanes = 8;

// Values per block: the loops sum a block in float vector registers (at most kBlock / 4 adds a
// lane, a relative error of at most 256 float roundings, ~1.5e-5) and add each block's sums to
// Lanes in double, so a task's 64K values cost no more precision than one block's.
constexpr int64_t kBlock = 1024;

// Per-lane double sums of one task.
struct Lanes {
  double bad[kLanes] = {}, gradient[kLanes] = {}, fed[kLanes] = {}, scaled[kLanes] = {}, fed_bad[kLanes] = {};

  PackStats Sum() const {
    PackStats s;
    for (int l = 0; l < kLanes; ++l) {
      s.nonfinite += bad[l];
      s.gradient += gradient[l];
      s.fed += fed[l];
      s.fed_scaled += scaled[l];
      s.fed_nonfinite += fed_bad[l];
    }
    return s;
  }
};

// Four floats in one vector register (GCC/Clang vector extensions: SSE2 on any x86-64, NEON on
// arm64), and a mask of four lanes.
typedef float F4 __attribute__((vector_size(16)));
typedef int32_t I4 __attribute__((vector_size(16)));

// Whether x is finite, as a comparison (NaN compares false).
inline bool Finite(float x) { return std::fabs(x) <= std::numeric_limits<float>::max(); }

// All-ones lanes where x is finite, zeros elsewhere.
inline I4 Finite4(F4 x) {
  const I4 magnitude = reinterpret_cast<I4>(x) & 0x7fffffff;
  return magnitude < 0x7f800000;  // below the exponent of Inf/NaN
}

// The error-fed vector's sums over vectors of four values (sum v^2, sum over finite v of
// (v * scale)^2, non-finite v), and the same for one value at a time in a lane of Lanes.
struct FedSums4 {
  F4 fed = {0, 0, 0, 0}, scaled = {0, 0, 0, 0}, bad = {0, 0, 0, 0};

  void Add(F4 v, F4 scale4) {
    const F4 one = {1, 1, 1, 1};
    const I4 finite = Finite4(v);
    const F4 vs = v * scale4;
    fed += v * v;
    scaled += reinterpret_cast<F4>(reinterpret_cast<I4>(vs * vs) & finite);
    bad += reinterpret_cast<F4>(reinterpret_cast<I4>(one) & ~finite);
  }

  void AddTo(Lanes& acc) const {
    for (int l = 0; l < 4; ++l) {
      acc.fed[l] += fed[l];
      acc.scaled[l] += scaled[l];
      acc.fed_bad[l] += bad[l];
    }
  }
};

inline void AddFed(float v, float scale, int l, Lanes& acc) {
  const bool finite = Finite(v);
  const float vs = v * scale;
  acc.fed[l] += v * v;
  acc.scaled[l] += finite ? vs * vs : 0.0f;
  acc.fed_bad[l] += finite ? 0.0f : 1.0f;
}

// o[0, count) from g (and r); lane l of `acc` sums the values l, l + kLanes, ... of the span.
// Four values at a time in vector registers: the loop is as fast as the memory, where the plain
// loop (a select, an add and five sums per value, which the compiler does not vectorize on its
// own) took 6 ns a value. The tail (at most 3 values) goes to lanes 4.. of `acc`.
template <bool kResidual>
inline void PackSpan(const float* g, const float* r, float* o, int64_t count, float scale, Lanes& acc) {
  const F4 zero = {0, 0, 0, 0}, one = {1, 1, 1, 1}, s4 = {scale, scale, scale, scale};
  int64_t j = 0;
  while (j + 4 <= count) {
    const int64_t block_end = std::min(count - count % 4, j + kBlock);
    F4 bad = zero, gradient = zero;
    FedSums4 sums;
    for (; j < block_end; j += 4) {
      F4 x, v;
      std::memcpy(&x, g + j, sizeof x);
      const I4 finite = Finite4(x);
      const F4 clean = reinterpret_cast<F4>(reinterpret_cast<I4>(x) & finite);
      v = clean;
      if (kResidual) {
        F4 res;
        std::memcpy(&res, r + j, sizeof res);
        v = clean + res;
      }
      std::memcpy(o + j, &v, sizeof v);
      bad += reinterpret_cast<F4>(reinterpret_cast<I4>(one) & ~finite);
      gradient += clean * clean;
      sums.Add(v, s4);
    }
    for (int l = 0; l < 4; ++l) {
      acc.bad[l] += bad[l];
      acc.gradient[l] += gradient[l];
    }
    sums.AddTo(acc);
  }
  for (int l = 4; j < count; ++j, ++l) {
    const float x = g[j];
    const bool finite = Finite(x);
    const float clean = finite ? x : 0.0f;
    const float v = kResidual ? clean + r[j] : clean;
    o[j] = v;
    acc.bad[l] += finite ? 0.0f : 1.0f;
    acc.gradient[l] += clean * clean;
    AddFed(v, scale, l, acc);
  }
}

// The fed sums of x[0, count) alone (no gradient, no output): vector_energies's loop.
inline void EnergySpan(const float* x, int64_t count, float scale, Lanes& acc) {
  const F4 s4 = {scale, scale, scale, scale};
  int64_t j = 0;
  while (j + 4 <= count) {
    const int64_t block_end = std::min(count - count % 4, j + kBlock);
    FedSums4 sums;
    for (; j < block_end; j += 4) {
      F4 v;
      std::memcpy(&v, x + j, sizeof v);
      sums.Add(v, s4);
    }
    sums.AddTo(acc);
  }
  for (int l = 4; j < count; ++j, ++l) AddFed(x[j], scale, l, acc);
}

// out[begin, end) of the flat vector, starting in part `part` at `offset` (its first value's
// position in the flat vector), its sums added to `acc`.
inline void PackRange(const PackPart* parts, int64_t num_parts, int64_t part, int64_t offset, int64_t begin,
                      int64_t end, float scale, float* out, Lanes& acc) {
  for (int64_t pos = begin; pos < end && part < num_parts; ++part) {
    const PackPart& p = parts[part];
    const int64_t stop = offset + p.size < end ? offset + p.size : end;
    const float* g = p.grad + (pos - offset);
    if (p.residual != nullptr) {
      PackSpan<true>(g, p.residual + (pos - offset), out + pos, stop - pos, scale, acc);
    } else {
      PackSpan<false>(g, nullptr, out + pos, stop - pos, scale, acc);
    }
    pos = stop;
    offset += p.size;
  }
}

// Runs span(begin, end, acc) over [0, n) in 64K-value tasks on `parallel` and adds the tasks'
// sums in task order: the result does not depend on the number of threads.
template <typename Span>
inline PackStats SumTasks(int64_t n, const Parallel& parallel, const Span& span) {
  const int64_t tasks = n == 0 ? 0 : (n + kTaskValues - 1) / kTaskValues;
  std::vector<PackStats> per_task(tasks);
  parallel.run(tasks, [&](int64_t t) {
    const int64_t begin = t * kTaskValues;
    const int64_t end = begin + kTaskValues < n ? begin + kTaskValues : n;
    Lanes acc;
    span(begin, end, acc);
    per_task[t] = acc.Sum();
  });
  PackStats total;
  for (const PackStats& s : per_task) total += s;
  return total;
}

}  // namespace pack_detail

// Packs `parts` into `out` (their sizes summed) and stores what the pass learned in `*stats`
// (`energy_scale`: the factor of PackStats::fed_scaled). The sums are taken per 64K-value task
// and then added in order, so they do not depend on the number of threads.
inline Status pack_error_fed(const PackPart* parts, int64_t num_parts, float energy_scale, float* out,
                             PackStats* stats, const Parallel& parallel) {
  if (num_parts < 0) return Status::InvalidArgument("num_parts must be >= 0, got " + std::to_string(num_parts));
  if (stats == nullptr) return Status::InvalidArgument("stats must not be null");
  std::vector<int64_t> offsets(num_parts + 1, 0);
  for (int64_t i = 0; i < num_parts; ++i) {
    if (parts[i].size < 0 || (parts[i].size > 0 && parts[i].grad == nullptr)) {
      return Status::InvalidArgument("part " + std::to_string(i) + " has no gradient or a negative size");
    }
    offsets[i + 1] = offsets[i] + parts[i].size;
  }
  const int64_t n = offsets[num_parts];
  *stats = pack_detail::SumTasks(n, parallel, [&](int64_t begin, int64_t end, pack_detail::Lanes& acc) {
    // The part holding `begin`: the last offset <= begin among non-empty parts.
    int64_t lo = 0, hi = num_parts;  // offsets[lo] <= begin < offsets[hi]
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      (offsets[mid] <= begin ? lo : hi) = mid;
    }
    pack_detail::PackRange(parts, num_parts, lo, offsets[lo], begin, end, energy_scale, out, acc);
  });
  return Status();
}

// The energies of one float32 vector, as PackStats' fed fields: sum x^2 (infinite once a value
// or the sum overflows), sum over the finite x of (x * energy_scale)^2, and the non-finite values.
// One read, in vector registers, split into 64K-value tasks and added in task order (so the result
// does not depend on the number of threads). What the metrics sum of each device's sent vector.
inline Status vector_energies(const float* x, int64_t n, float energy_scale, PackStats* stats,
                              const Parallel& parallel) {
  if (n < 0) return Status::InvalidArgument("n must be >= 0, got " + std::to_string(n));
  if (stats == nullptr) return Status::InvalidArgument("stats must not be null");
  *stats = pack_detail::SumTasks(n, parallel, [&](int64_t begin, int64_t end, pack_detail::Lanes& acc) {
    pack_detail::EnergySpan(x + begin, end - begin, energy_scale, acc);
  });
  return Status();
}

}  // namespace jaxcomp
