// Randomized test of kernels/ (plain C++, no XLA), meant to run under -fsanitize=address,undefined
// (ci/sanitize.sh builds and runs it). Every case draws a size, k or rate, a thread count and
// values mixing ordinary floats with NaN, +-Inf, denormals, +-0 and exact ties, then compares the
// kernel with the simple reference below, written from docs/kernels.md:
//
//   * topk, find_threshold, threshold_topk: the bisection over magnitude keys, counted directly;
//     merge_runs on their indices (ascending runs, some disturbed) against std::sort;
//   * zfp_encode: the bit format step by step (block header, exact quantization, zfp's lifting,
//     negabinary, encode_few_ints), compared word for word;
//   * zfp_decode: random words (any bit pattern) and encoded words, decoded by the reference
//     decoder, compared bit for bit (any NaN equals any NaN);
//   * sign_pack, sign_unpack: signs bit by bit, scales by the halving tree over a zero-padded
//     buffer (the definition, not the kernel's lanes and bit-reversed walk), bit for bit;
//   * pack_error_fed: random leaf counts and sizes (empty leaves too), with and without residuals,
//     against the definition value by value (non-finite gradient values as 0, then + residual);
//   * scatter_leaves: random leaves, rows of distinct indices (some out of range), added or set,
//     dropped, scaled, silenced (then split_leaves, its dense form, into the same leaves), against a dense vector built row by row, bit for bit (its tasks
//     split vectors of 64 values and up here, so that short vectors exercise the split).
//
// Usage: kernels_fuzz [SECONDS] [SEED]   (default 30 s, seed 1; JAXCOMP_FUZZ_SECONDS also sets
// the time). Prints the number of cases per kernel; exits 1 at the first mismatch, naming it.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <vector>

#define JAXCOMP_SCATTER_TASK_VALUES 64
#include "kernels/merge.h"
#include "kernels/pack.h"
#include "kernels/scatter.h"
#include "kernels/sign.h"
#include "kernels/topk.h"
#include "kernels/zfp.h"

namespace {

using jaxcomp::Parallel;

// ----------------------------------------------------------------------------------------------
// Inputs

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t Key(float f) { return Bits(f) & 0x7FFFFFFFu; }

// A value of one of the awkward kinds, or an ordinary one; `pool` makes ties likely.
float Draw(std::mt19937_64& rng, const std::vector<float>& pool, int mix) {
  switch (rng() % 16) {
    case 0: return mix & 1 ? std::nanf("") : 1.0f;
    case 1: return mix & 1 ? -INFINITY : -2.0f;
    case 2: return mix & 2 ? INFINITY : 3.0f;
    case 3: return FromBits(static_cast<uint32_t>(rng() % 0x00800000u) | (rng() % 2 ? 0x80000000u : 0u));  // denormal
    case 4: return -0.0f;
    case 5: return 0.0f;
    case 6: case 7: return pool[rng() % pool.size()];  // ties
    case 8: return FromBits(static_cast<uint32_t>(rng()));  // any bit pattern
    case 9: return std::ldexp(static_cast<float>(rng() % 1000) - 500.0f, static_cast<int>(rng() % 60) - 130);
    default: return std::ldexp(static_cast<float>(rng() % 2000001) / 1e6f - 1.0f, static_cast<int>(rng() % 20) - 10);
  }
}

std::vector<float> DrawRow(std::mt19937_64& rng, int64_t n) {
  const int mix = static_cast<int>(rng() % 4);
  std::vector<float> pool(1 + rng() % 8);
  for (float& v : pool) v = std::ldexp(static_cast<float>(rng() % 100), -static_cast<int>(rng() % 8));
  // Some rows are all ordinary values: the kernels' fast paths see no special case.
  const bool plain = rng() % 4 == 0;
  std::vector<float> x(n);
  for (float& v : x) v = plain ? std::ldexp(static_cast<float>(rng() % 100000), -12) : Draw(rng, pool, mix);
  if (rng() % 8 == 0) std::fill(x.begin(), x.end(), pool[0]);  // one value everywhere
  return x;
}

int64_t DrawLength(std::mt19937_64& rng) {
  switch (rng() % 8) {
    case 0: return 1 + rng() % 8;
    case 1: return 1 + rng() % 40;
    case 2: return (int64_t{1} << 15) + static_cast<int64_t>(rng() % 3000) - 1500;  // short/long rows' edge
    case 3: return 40000 + rng() % 90000;  // long rows, split across threads
    default: return 1 + rng() % 3000;
  }
}

// A thread pool's contract (kernels/parallel.h): tasks run once each, in any order, on threads.
Parallel Threads(int64_t concurrency) {
  Parallel parallel;
  parallel.concurrency = concurrency;
  parallel.run = [concurrency](int64_t num_tasks, const jaxcomp::Task& task) {
    std::atomic<int64_t> next{0};
    auto work = [&] {
      for (int64_t i; (i = next.fetch_add(1)) < num_tasks;) task(num_tasks - 1 - i);  // reverse order
    };
    std::vector<std::thread> threads;
    for (int64_t t = 1; t < std::min(concurrency, num_tasks); ++t) threads.emplace_back(work);
    work();
    for (auto& t : threads) t.join();
  };
  return parallel;
}

[[noreturn]] void Fail(const std::string& what, uint64_t case_seed) {
  std::fprintf(stderr, "kernels_fuzz: MISMATCH in %s (case seed %llu)\n", what.c_str(),
               static_cast<unsigned long long>(case_seed));
  std::exit(1);
}

// ----------------------------------------------------------------------------------------------
// Top-k reference: docs/kernels.md's bisection, C(t) = #{i : key_i >= t}, counted directly.

struct RefBracket {
  uint32_t lo, hi;
};

RefBracket RefBisect(const std::vector<uint32_t>& keys, int64_t k, int rounds) {
  uint64_t lo = 0, hi = uint64_t{1} << 31;
  for (int r = 0; r < rounds; ++r) {
    const uint64_t mid = (lo + hi) / 2;
    int64_t count = 0;
    for (uint32_t key : keys) count += key >= mid;
    (count >= k ? lo : hi) = mid;
  }
  return {static_cast<uint32_t>(lo), static_cast<uint32_t>(hi)};
}

// Every key >= hi, then the lowest-index keys in [lo, hi) up to k, in index order.
void RefSelect(const std::vector<float>& x, const std::vector<uint32_t>& keys, int64_t k, RefBracket b,
               std::vector<float>* values, std::vector<int32_t>* indices) {
  int64_t above = 0;
  for (uint32_t key : keys) above += key >= b.hi;
  int64_t quota = k - above;
  values->clear();
  indices->clear();
  for (size_t i = 0; i < x.size(); ++i) {
    const bool take = keys[i] >= b.hi || (keys[i] >= b.lo && quota > 0 && (--quota, true));
    if (take) {
      values->push_back(x[i]);
      indices->push_back(static_cast<int32_t>(i));
    }
  }
}

bool SameBits(float a, float b) { return Bits(a) == Bits(b); }

// merge_runs on the rows' selections (ascending runs, as SPLIT gathers them), now and then with
// one entry moved out of order or a repeat planted, against std::sort and the repeat mask.
void FuzzMerge(std::mt19937_64& rng, std::vector<int32_t> runs, int64_t rows, int64_t k, uint64_t case_seed) {
  if (rng() % 3 == 0) runs[rng() % runs.size()] = runs[rng() % runs.size()];
  if (rng() % 3 == 0) std::swap(runs[rng() % runs.size()], runs[rng() % runs.size()]);
  const int32_t pad = static_cast<int32_t>(rng() % 1000) - 500;
  std::vector<int32_t> want = runs, out(runs.size());
  std::sort(want.begin(), want.end());
  for (size_t i = want.size() - 1; i > 0; --i) {
    if (want[i] == want[i - 1]) want[i] = pad;
  }
  const jaxcomp::Status status = jaxcomp::MergeRuns(runs.data(), rows, k, pad, out.data());
  if (!status.ok() || out != want) {
    Fail("merge_runs (runs=" + std::to_string(rows) + ", length=" + std::to_string(k) + ")", case_seed);
  }
}

void FuzzTopK(std::mt19937_64& rng, uint64_t case_seed) {
  const int64_t n = DrawLength(rng);
  const int64_t rows = n > 20000 ? 1 + rng() % 2 : 1 + rng() % 5;
  // k = n, a few hundred, or up to 5% of the row (long rows select from their candidates alone).
  const int64_t k = rng() % 4 == 0   ? n
                    : rng() % 3 == 0 ? 1 + static_cast<int64_t>(rng() % std::max<int64_t>(1, n / 20))
                                     : 1 + static_cast<int64_t>(rng() % std::min<int64_t>(n, 1 + rng() % 300));
  const int rounds = rng() % 3 == 0 ? 31 : 1 + static_cast<int>(rng() % 31);
  const Parallel parallel = Threads(1 + rng() % 8);
  std::vector<float> x;
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<float> row = DrawRow(rng, n);
    x.insert(x.end(), row.begin(), row.end());
  }
  std::vector<float> values(rows * k), tvalues(rows * k), threshold(rows);
  std::vector<int32_t> indices(rows * k), tindices(rows * k), count(rows);
  jaxcomp::Status status = jaxcomp::TopK(x.data(), rows, n, k, values.data(), indices.data(), parallel);
  if (status.ok()) status = jaxcomp::ThresholdTopK(x.data(), rows, n, k, rounds, tvalues.data(), tindices.data(), parallel);
  if (status.ok()) status = jaxcomp::FindThreshold(x.data(), rows, n, k, rounds, threshold.data(), count.data(), parallel);
  if (!status.ok()) Fail("top-k returned an error: " + status.message(), case_seed);
  std::vector<float> want_values;
  std::vector<int32_t> want_indices;
  for (int64_t r = 0; r < rows; ++r) {
    const std::vector<float> row(x.begin() + r * n, x.begin() + (r + 1) * n);
    std::vector<uint32_t> keys(n);
    for (int64_t i = 0; i < n; ++i) keys[i] = Key(row[i]);
    const std::string where = " (n=" + std::to_string(n) + ", k=" + std::to_string(k) + ", rounds=" +
                              std::to_string(rounds) + ", row " + std::to_string(r) + ")";
    RefSelect(row, keys, k, RefBisect(keys, k, 31), &want_values, &want_indices);
    for (int64_t j = 0; j < k; ++j) {
      if (indices[r * k + j] != want_indices[j] || !SameBits(values[r * k + j], want_values[j]))
        Fail("topk" + where, case_seed);
    }
    const RefBracket bracket = RefBisect(keys, k, rounds);
    int64_t at_least_lo = 0;
    for (uint32_t key : keys) at_least_lo += key >= bracket.lo;
    if (Bits(threshold[r]) != bracket.lo || count[r] != at_least_lo) Fail("find_threshold" + where, case_seed);
    RefSelect(row, keys, k, bracket, &want_values, &want_indices);
    for (int64_t j = 0; j < k; ++j) {
      if (tindices[r * k + j] != want_indices[j] || !SameBits(tvalues[r * k + j], want_values[j]))
        Fail("threshold_topk" + where, case_seed);
    }
  }
  FuzzMerge(rng, indices, rows, k, case_seed);
}

// ----------------------------------------------------------------------------------------------
// ZFP reference, step by step from docs/kernels.md.

struct RefWriter {
  std::vector<uint32_t>* words;
  int64_t bit;
  void Put(uint32_t value, int count) {  // LSB first
    for (int i = 0; i < count; ++i, ++bit)
      if ((value >> i) & 1u) (*words)[bit / 32] |= uint32_t{1} << (bit % 32);
  }
};

struct RefReader {
  const uint32_t* words;
  int64_t bit;
  uint32_t Get(int count) {
    uint32_t value = 0;
    for (int i = 0; i < count; ++i, ++bit) value |= ((words[bit / 32] >> (bit % 32)) & 1u) << i;
    return value;
  }
};

bool Finite(float f) { return Key(f) < 0x7F800000u; }

int Emax(float max_magnitude) {
  int exponent;
  std::frexp(max_magnitude, &exponent);
  return exponent < -126 ? -126 : exponent;
}

// The block's 4 values with the partial-block padding of zfp's pad_block.
void BlockValues(const float* row, int64_t n, int64_t block, float f[4]) {
  const int64_t first = 4 * block;
  const int64_t m = std::min<int64_t>(4, n - first);
  for (int64_t i = 0; i < m; ++i) f[i] = row[first + i];
  if (m == 1) f[1] = f[0], f[2] = f[1], f[3] = f[0];
  if (m == 2) f[2] = f[1], f[3] = f[0];
  if (m == 3) f[3] = f[0];
}

// Steps 4-7: quantize with emax, lift, negabinary, embedded code of `bits` bits (then padding).
void RefCodeBlock(const float f[4], int emax, int bits, RefWriter* out) {
  int32_t q[4];
  for (int i = 0; i < 4; ++i) q[i] = static_cast<int32_t>(static_cast<double>(f[i]) * std::ldexp(1.0, 30 - emax));
  int32_t x = q[0], y = q[1], z = q[2], w = q[3];
  x += w; x >>= 1; w -= x;
  z += y; z >>= 1; y -= z;
  x += z; x >>= 1; z -= x;
  w += y; w >>= 1; y -= w;
  w += y >> 1; y -= w >> 1;
  const int32_t lifted[4] = {x, y, z, w};
  uint32_t u[4];
  for (int i = 0; i < 4; ++i) u[i] = (static_cast<uint32_t>(lifted[i]) + 0xAAAAAAAAu) ^ 0xAAAAAAAAu;
  // zfp 1.0's encode_few_ints (size 4, precision 32).
  const int64_t end = out->bit + bits;
  unsigned n = 0;
  for (int k = 32; bits > 0 && k-- > 0;) {
    uint64_t plane = 0;
    for (int i = 0; i < 4; ++i) plane |= static_cast<uint64_t>((u[i] >> k) & 1u) << i;
    const unsigned m = std::min<unsigned>(n, static_cast<unsigned>(bits));
    bits -= static_cast<int>(m);
    out->Put(static_cast<uint32_t>(plane), static_cast<int>(m));
    plane >>= m;
    for (; bits > 0 && n < 4; plane >>= 1, n++) {
      bits--;
      const bool any = plane != 0;
      out->Put(any, 1);
      if (!any) break;
      for (; bits > 0 && n < 3; plane >>= 1, n++) {
        bits--;
        const bool one = plane & 1u;
        out->Put(one, 1);
        if (one) break;
      }
    }
  }
  out->bit = end;  // zero padding (the words start zeroed)
}

std::vector<uint32_t> RefEncode(const std::vector<float>& x, int64_t rows, int64_t n, int rate) {
  const int64_t row_words = jaxcomp::zfp_num_words(n, rate), blocks = (n + 3) / 4;
  const int block_bits = 4 * rate;
  std::vector<uint32_t> words(rows * row_words, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x.data() + r * n;
    RefWriter out{&words, r * row_words * 32};
    int row_emax = 0;
    if (rate <= 2) {
      bool finite = true;
      float max_magnitude = 0;
      for (int64_t i = 0; i < n; ++i) {
        finite = finite && Finite(row[i]);
        max_magnitude = std::max(max_magnitude, std::fabs(row[i]));
      }
      const uint32_t header = !finite ? 0x100u : max_magnitude == 0 ? 0u : static_cast<uint32_t>(Emax(max_magnitude) + 127);
      out.Put(header, 32);
      if (header == 0 || header > 0xFF) continue;  // the blocks stay zero
      row_emax = Emax(max_magnitude);
    }
    for (int64_t b = 0; b < blocks; ++b) {
      float f[4];
      BlockValues(row, n, b, f);
      const int64_t start = out.bit;
      if (rate <= 2) {
        RefCodeBlock(f, row_emax, block_bits, &out);
      } else {
        const bool finite = Finite(f[0]) && Finite(f[1]) && Finite(f[2]) && Finite(f[3]);
        const float m = std::max(std::max(std::fabs(f[0]), std::fabs(f[1])), std::max(std::fabs(f[2]), std::fabs(f[3])));
        if (!finite) {
          out.Put(1, 9);
        } else if (m == 0) {
          out.Put(0, 1);
        } else {
          const int emax = Emax(m);
          out.Put(static_cast<uint32_t>(2 * (emax + 127) + 1), 9);
          RefCodeBlock(f, emax, block_bits - 9, &out);
        }
      }
      out.bit = start + block_bits;
    }
  }
  return words;
}

// zfp's decode_few_ints, inverse negabinary, inv_lift (wrapping int32), scaling like ldexpf.
void RefDecodeBlock(RefReader* in, int emax, int bits, float f[4]) {
  const int64_t end = in->bit + bits;
  uint32_t u[4] = {0, 0, 0, 0};
  unsigned n = 0;
  for (int k = 32; bits > 0 && k-- > 0;) {
    const unsigned m = std::min<unsigned>(n, static_cast<unsigned>(bits));
    bits -= static_cast<int>(m);
    uint64_t plane = in->Get(static_cast<int>(m));
    for (; bits > 0 && n < 4;) {
      bits--;
      if (!in->Get(1)) break;
      for (; bits > 0 && n < 3;) {
        bits--;
        if (in->Get(1)) break;
        n++;
      }
      plane += uint64_t{1} << n;
      n++;
    }
    for (int i = 0; i < 4; ++i) u[i] |= static_cast<uint32_t>((plane >> i) & 1u) << k;
  }
  in->bit = end;
  uint32_t v[4];
  for (int i = 0; i < 4; ++i) v[i] = (u[i] ^ 0xAAAAAAAAu) - 0xAAAAAAAAu;
  // inv_lift in uint32 (wrapping), with arithmetic right shifts of the int32 values.
  auto shr = [](uint32_t a) { return static_cast<uint32_t>(static_cast<int32_t>(a) >> 1); };
  uint32_t x = v[0], y = v[1], z = v[2], w = v[3];
  y += shr(w); w -= shr(y);
  y += w; w <<= 1; w -= y;
  z += x; x <<= 1; x -= z;
  y += z; z <<= 1; z -= y;
  w += x; x <<= 1; x -= w;
  const uint32_t q[4] = {x, y, z, w};
  for (int i = 0; i < 4; ++i) f[i] = std::ldexp(static_cast<float>(static_cast<int32_t>(q[i])), emax - 30);
}

std::vector<float> RefDecode(const std::vector<uint32_t>& words, int64_t rows, int64_t n, int rate) {
  const int64_t row_words = jaxcomp::zfp_num_words(n, rate), blocks = (n + 3) / 4;
  const int block_bits = 4 * rate;
  std::vector<float> x(rows * n);
  for (int64_t r = 0; r < rows; ++r) {
    RefReader in{words.data() + r * row_words, 0};
    float* row = x.data() + r * n;
    int row_emax = 0;
    if (rate <= 2) {
      const uint32_t header = in.Get(32);
      if (header == 0 || header > 0xFF) {
        std::fill(row, row + n, header == 0 ? 0.0f : std::nanf(""));
        continue;
      }
      row_emax = static_cast<int>(header) - 127;
    }
    for (int64_t b = 0; b < blocks; ++b) {
      float f[4];
      const int64_t start = in.bit;
      if (rate <= 2) {
        RefDecodeBlock(&in, row_emax, block_bits, f);
      } else if (!in.Get(1)) {
        f[0] = f[1] = f[2] = f[3] = 0.0f;
      } else {
        const uint32_t e = in.Get(8);
        if (e == 0) {
          f[0] = f[1] = f[2] = f[3] = std::nanf("");
        } else {
          RefDecodeBlock(&in, static_cast<int>(e) - 127, block_bits - 9, f);
        }
      }
      in.bit = start + block_bits;
      for (int64_t i = 0; i < 4 && 4 * b + i < n; ++i) row[4 * b + i] = f[i];
    }
  }
  return x;
}

bool SameValue(float a, float b) { return SameBits(a, b) || (std::isnan(a) && std::isnan(b)); }

void FuzzZfp(std::mt19937_64& rng, uint64_t case_seed) {
  const int64_t n = rng() % 4 == 0 ? 1 + rng() % 9 : 1 + rng() % (rng() % 8 == 0 ? 70000 : 600);
  const int64_t rows = 1 + rng() % 4;
  const int rate = 1 + static_cast<int>(rng() % 32);
  const Parallel parallel = Threads(1 + rng() % 8);
  const std::string where = " (n=" + std::to_string(n) + ", rows=" + std::to_string(rows) + ", rate=" +
                            std::to_string(rate) + ")";
  std::vector<float> x;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> row = DrawRow(rng, n);
    if (rate <= 2 && rng() % 2) {  // rows without NaN/Inf, or the whole row decodes to NaN
      for (float& v : row) v = Finite(v) ? v : 0.5f;
    }
    x.insert(x.end(), row.begin(), row.end());
  }
  const int64_t total_words = rows * jaxcomp::zfp_num_words(n, rate);
  std::vector<uint32_t> words(total_words, 0xDEADBEEFu);  // the kernel must write every word
  if (!jaxcomp::zfp_encode(x.data(), rows, n, rate, words.data(), parallel).ok())
    Fail("zfp_encode returned an error" + where, case_seed);
  if (words != RefEncode(x, rows, n, rate)) Fail("zfp_encode" + where, case_seed);

  // Decode the encoded words, then words with arbitrary bits.
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) {
      for (uint32_t& word : words) word = static_cast<uint32_t>(rng());
    }
    std::vector<float> decoded(rows * n, -12345.0f);
    if (!jaxcomp::zfp_decode(words.data(), rows, n, rate, decoded.data(), parallel).ok())
      Fail("zfp_decode returned an error" + where, case_seed);
    const std::vector<float> want = RefDecode(words, rows, n, rate);
    for (int64_t i = 0; i < rows * n; ++i) {
      if (!SameValue(decoded[i], want[i]))
        Fail(std::string(pass ? "zfp_decode of random words" : "zfp_decode") + where + " at value " +
                 std::to_string(i),
             case_seed);
    }
  }
}

// ----------------------------------------------------------------------------------------------
// Sign codec reference: docs/kernels.md, on a buffer.

std::vector<uint32_t> RefSignWords(const std::vector<float>& x, int64_t rows, int64_t n) {
  const int64_t row_words = (n + 31) / 32;
  std::vector<uint32_t> words(rows * row_words, 0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < n; ++i) {
      // IEEE's compare (this test runs without flushed denormals): -0 is +, NaN is -.
      const bool bit = x[r * n + i] >= 0.0f;
      if (bit) words[r * row_words + i / 32] |= 1u << (i % 32);
    }
  }
  return words;
}

float RefScale(const float* chunk_x, int64_t count, int64_t chunk) {
  int64_t p = 1;
  while (p < chunk) p *= 2;
  std::vector<float> v(p, 0.0f);
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t a = Key(chunk_x[i]);
    v[i] = a < 0x00800000u ? 0.0f : FromBits(a);
  }
  for (int64_t h = p / 2; h >= 1; h /= 2) {
    for (int64_t i = 0; i < h; ++i) v[i] = v[i] + v[i + h];
  }
  const float mean = v[0] * (1.0f / static_cast<float>(count));
  if (std::isnan(mean)) return FromBits(0x7FC00000u);
  return Key(mean) < 0x00800000u ? 0.0f : mean;
}

void FuzzSign(std::mt19937_64& rng, uint64_t case_seed) {
  const int64_t n = DrawLength(rng);
  const int64_t rows = 1 + rng() % 3;
  const int64_t chunk = rng() % 4 == 0 ? 1 + rng() % 40 : rng() % 4 == 0 ? n + rng() % 100 : 1 + rng() % 5000;
  const Parallel parallel = Threads(1 + rng() % 8);
  const std::string where = " (n=" + std::to_string(n) + ", rows=" + std::to_string(rows) + ", chunk=" +
                            std::to_string(chunk) + ")";
  std::vector<float> x;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> row = DrawRow(rng, n);
    x.insert(x.end(), row.begin(), row.end());
  }
  const int64_t row_words = (n + 31) / 32, row_chunks = (n + chunk - 1) / chunk;
  std::vector<uint32_t> words(rows * row_words, 0xDEADBEEFu);  // the kernel must write every word
  std::vector<float> scales(rows * row_chunks, -12345.0f);
  if (!jaxcomp::sign_pack(x.data(), rows, n, chunk, words.data(), scales.data(), parallel).ok())
    Fail("sign_pack returned an error" + where, case_seed);
  if (words != RefSignWords(x, rows, n)) Fail("sign_pack words" + where, case_seed);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t q = 0; q < row_chunks; ++q) {
      const float want = RefScale(x.data() + r * n + q * chunk, std::min(chunk, n - q * chunk), chunk);
      if (!SameBits(scales[r * row_chunks + q], want))
        Fail("sign_pack scale " + std::to_string(q) + " of row " + std::to_string(r) + where, case_seed);
    }
  }
  // Decode the packed words, then arbitrary ones (scales stay the packed ones: any float decodes).
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) {
      for (uint32_t& word : words) word = static_cast<uint32_t>(rng());
    }
    std::vector<float> decoded(rows * n, -12345.0f);
    if (!jaxcomp::sign_unpack(words.data(), scales.data(), rows, n, chunk, decoded.data(), parallel).ok())
      Fail("sign_unpack returned an error" + where, case_seed);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < n; ++i) {
        const float scale = scales[r * row_chunks + i / chunk];
        const float want = (words[r * row_words + i / 32] >> (i % 32)) & 1u ? scale : -scale;
        if (!SameBits(decoded[r * n + i], want))
          Fail(std::string(pass ? "sign_unpack of random words" : "sign_unpack") + where + " at value " +
                   std::to_string(i),
               case_seed);
      }
    }
    // The rows' sum, row after row from 0 (NaN's sign and payload are IEEE's choice when both
    // operands of an add are NaN: compared as NaN only).
    std::vector<float> sum(n, -12345.0f);
    if (!jaxcomp::sign_unpack_sum(words.data(), scales.data(), rows, n, chunk, sum.data(), parallel).ok())
      Fail("sign_unpack_sum returned an error" + where, case_seed);
    for (int64_t i = 0; i < n; ++i) {
      float want = 0.0f;
      for (int64_t r = 0; r < rows; ++r) want = want + decoded[r * n + i];
      const bool same = std::isnan(want) ? std::isnan(sum[i]) : SameBits(sum[i], want);
      if (!same) Fail("sign_unpack_sum" + where + " at value " + std::to_string(i), case_seed);
    }
  }
}


void FuzzPack(std::mt19937_64& rng, uint64_t case_seed) {
  const int64_t num_parts = 1 + rng() % 12;
  const bool with_residual = rng() % 2 == 0;
  const Parallel parallel = Threads(1 + rng() % 8);
  std::vector<std::vector<float>> grads(num_parts), residuals(num_parts);
  std::vector<jaxcomp::PackPart> parts(num_parts);
  int64_t n = 0;
  for (int64_t i = 0; i < num_parts; ++i) {
    const int64_t size = rng() % 5 == 0 ? 0 : DrawLength(rng);  // empty leaves are valid
    grads[i] = DrawRow(rng, size);
    residuals[i] = DrawRow(rng, size);
    for (float& r : residuals[i]) r = std::isfinite(r) ? r : 0.5f;  // residuals are always finite
    parts[i] = {grads[i].data(), with_residual ? residuals[i].data() : nullptr, size};
    n += size;
  }
  const std::string where = " (parts=" + std::to_string(num_parts) + ", n=" + std::to_string(n) +
                            (with_residual ? ", residual" : "") + ")";
  std::vector<float> out(n, -12345.0f);
  const float scale = rng() % 2 == 0 ? 1.0f : std::ldexp(1.0f, -80);
  jaxcomp::PackStats stats;
  if (!jaxcomp::pack_error_fed(parts.data(), num_parts, scale, out.data(), &stats, parallel).ok())
    Fail("pack_error_fed returned an error" + where, case_seed);
  int64_t pos = 0, bad = 0, fed_bad = 0;
  double gradient = 0, fed = 0, fed_scaled = 0, magnitude = 0;
  for (int64_t i = 0; i < num_parts; ++i) {
    for (size_t j = 0; j < grads[i].size(); ++j, ++pos) {
      const float g = grads[i][j];
      bad += !std::isfinite(g);
      const float clean = std::isfinite(g) ? g : 0.0f;
      const float want = with_residual ? clean + residuals[i][j] : clean;
      if (!SameBits(out[pos], want)) Fail("pack_error_fed at value " + std::to_string(pos) + where, case_seed);
      gradient += double(clean) * clean;
      fed += double(want) * want;
      magnitude += double(want) * want + double(clean) * clean;
      if (std::isfinite(want)) fed_scaled += double(want * scale) * double(want * scale);
      fed_bad += !std::isfinite(want);
    }
  }
  if (stats.nonfinite != double(bad)) Fail("pack_error_fed's non-finite count" + where, case_seed);
  if (stats.fed_nonfinite != double(fed_bad)) Fail("pack_error_fed's fed non-finite count" + where, case_seed);
  // Float sums per lane: within a float's rounding of the sum of magnitudes (infinite: both).
  // The kernel sums blocks of 256 values a lane in float, then the blocks in double: at most 255
  // float roundings, a relative error of 1.5e-5 (3e-5 allowed). A float block may overflow where
  // the double sum does not: infinite is right once the sum of magnitudes nears float's largest.
  auto close = [&](double got, double want, double bound) {
    if (std::isinf(got)) return !std::isfinite(want) || bound > 1e37;
    return std::isfinite(want) && std::fabs(got - want) <= 3e-5 * bound + 1e-30;
  };
  if (!close(stats.gradient, gradient, magnitude)) Fail("pack_error_fed's gradient energy" + where, case_seed);
  if (!close(stats.fed, fed, magnitude)) Fail("pack_error_fed's fed energy" + where, case_seed);
  if (!close(stats.fed_scaled, fed_scaled, magnitude * double(scale) * scale))
    Fail("pack_error_fed's scaled fed energy" + where, case_seed);
  // The same sums of the packed vector alone (what the metrics take of a sent vector).
  jaxcomp::PackStats alone;
  if (!jaxcomp::vector_energies(out.data(), n, scale, &alone, parallel).ok())
    Fail("vector_energies returned an error" + where, case_seed);
  if (alone.fed_nonfinite != double(fed_bad) || !close(alone.fed, fed, magnitude) ||
      !close(alone.fed_scaled, fed_scaled, magnitude * double(scale) * scale))
    Fail("vector_energies" + where, case_seed);
}


void FuzzScatter(std::mt19937_64& rng, uint64_t case_seed) {
  const int64_t num_leaves = 1 + rng() % 12;
  const Parallel parallel = Threads(1 + rng() % 8);
  std::vector<std::vector<float>> leaves(num_leaves);
  std::vector<jaxcomp::ScatterLeaf> views(num_leaves);
  int64_t n = 0;
  for (int64_t l = 0; l < num_leaves; ++l) {
    leaves[l].assign(rng() % 5 == 0 ? 0 : DrawLength(rng) / 4 + 1, -12345.0f);  // empty leaves too
    views[l] = {leaves[l].data(), static_cast<int64_t>(leaves[l].size())};
    n += static_cast<int64_t>(leaves[l].size());
  }
  jaxcomp::ScatterOptions o;
  o.add = rng() % 4 != 0;
  o.drop = rng() % 2 == 0;
  o.silenced = rng() % 8 == 0;
  const float scales[] = {1.0f, 0.25f, 1.0f / 3.0f, 0.125f};
  o.scale = scales[rng() % 4];
  const int64_t rows = o.add ? 1 + rng() % 5 : 1;
  const int64_t per_row = std::min<int64_t>(n + 4, rng() % 200);
  // Each row: distinct indices in [-2, n + 2) (outside [0, n): dropped), ordinary and awkward values.
  std::vector<int32_t> indices(rows * per_row);
  std::vector<float> values(rows * per_row);
  const std::vector<float> pool = {1.0f, -2.5f, 3.0f};
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<int32_t> all(n + 4);
    for (int64_t i = 0; i < n + 4; ++i) all[i] = static_cast<int32_t>(i - 2);
    std::shuffle(all.begin(), all.end(), rng);
    for (int64_t j = 0; j < per_row; ++j) {
      indices[r * per_row + j] = all[j];
      values[r * per_row + j] = Draw(rng, pool, static_cast<int>(rng() % 4));
    }
  }
  const std::string where = " (leaves=" + std::to_string(num_leaves) + ", n=" + std::to_string(n) +
                            ", rows=" + std::to_string(rows) + ", pairs=" + std::to_string(per_row) +
                            (o.add ? ", add" : ", set") + (o.drop ? ", drop" : "") +
                            (o.silenced ? ", silenced" : "") + ")";
  const jaxcomp::ScatterRows sparse{indices.data(), values.data(), rows, per_row};
  if (!jaxcomp::scatter_leaves(sparse, views.data(), num_leaves, o, parallel).ok())
    Fail("scatter_leaves returned an error" + where, case_seed);
  // The definition: a dense vector, the rows in order, then every entry finished.
  std::vector<float> want(n, 0.0f);
  if (!o.silenced) {
    for (int64_t e = 0; e < rows * per_row; ++e) {
      const int64_t i = indices[e];
      if (i >= 0 && i < n) want[i] = o.add ? want[i] + values[e] : values[e];
    }
    for (float& w : want) w = (o.drop && !std::isfinite(w) ? 0.0f : w) * o.scale;
  }
  int64_t pos = 0;
  for (int64_t l = 0; l < num_leaves; ++l) {
    for (size_t j = 0; j < leaves[l].size(); ++j, ++pos) {
      if (!SameValue(leaves[l][j], want[pos])) Fail("scatter_leaves at value " + std::to_string(pos) + where, case_seed);
    }
  }
  // split_leaves, the dense form, into the same leaves: a vector of n values and some padding.
  std::vector<float> dense(n + rng() % 3);
  for (float& d : dense) d = Draw(rng, pool, static_cast<int>(rng() % 4));
  if (!jaxcomp::split_leaves(dense.data(), static_cast<int64_t>(dense.size()), views.data(), num_leaves, o.scale,
                             o.silenced, parallel, o.drop)
           .ok())
    Fail("split_leaves returned an error" + where, case_seed);
  pos = 0;
  for (int64_t l = 0; l < num_leaves; ++l) {
    for (size_t j = 0; j < leaves[l].size(); ++j, ++pos) {
      const float kept = o.drop && !std::isfinite(dense[pos]) ? 0.0f : dense[pos];
      const float expect = o.silenced ? 0.0f : kept * o.scale;
      if (!SameValue(leaves[l][j], expect)) Fail("split_leaves at value " + std::to_string(pos) + where, case_seed);
    }
  }
  if (n > 0 && jaxcomp::split_leaves(dense.data(), n - 1, views.data(), num_leaves, 1.0f, false, parallel).ok())
    Fail("split_leaves took a vector shorter than its leaves" + where, case_seed);
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 30;
  if (const char* env = std::getenv("JAXCOMP_FUZZ_SECONDS")) seconds = std::atof(env);
  if (argc > 1) seconds = std::atof(argv[1]);
  const uint64_t seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1;
  if (!(seconds > 0)) {
    std::fprintf(stderr, "usage: kernels_fuzz [SECONDS > 0] [SEED]\n");
    return 2;
  }
  std::mt19937_64 seeds(seed);
  const auto stop = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  int64_t topk_cases = 0, zfp_cases = 0, sign_cases = 0, pack_cases = 0, scatter_cases = 0;
  // Alternate the kernels until the time is spent. Each case draws from its own seed (printed on
  // failure); the sequence of case seeds, and so a whole run, is fixed by SEED.
  while (std::chrono::steady_clock::now() < stop) {
    const uint64_t case_seed = seeds();
    std::mt19937_64 rng(case_seed);
    const int64_t cases = topk_cases + zfp_cases + sign_cases + pack_cases + scatter_cases;
    if (cases % 5 == 0) {
      FuzzTopK(rng, case_seed);
      ++topk_cases;
    } else if (cases % 5 == 1) {
      FuzzZfp(rng, case_seed);
      ++zfp_cases;
    } else if (cases % 5 == 2) {
      FuzzSign(rng, case_seed);
      ++sign_cases;
    } else if (cases % 5 == 3) {
      FuzzPack(rng, case_seed);
      ++pack_cases;
    } else {
      FuzzScatter(rng, case_seed);
      ++scatter_cases;
    }
  }
  std::printf("kernels_fuzz: seed %llu, %.0f s: %lld top-k cases (topk, find_threshold, threshold_topk, merge_runs) and "
              "%lld zfp cases (encode, decode, decode of random words), %lld sign cases (pack, unpack, unpack_sum) and %lld "
              "pack_error_fed (and vector_energies) cases and %lld scatter_leaves (and split_leaves) cases match the reference\n",
              static_cast<unsigned long long>(seed), seconds, static_cast<long long>(topk_cases),
              static_cast<long long>(zfp_cases), static_cast<long long>(sign_cases),
              static_cast<long long>(pack_cases), static_cast<long long>(scatter_cases));
  return 0;
}
