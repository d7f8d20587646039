// The CUDA kernels of kernels/topk.cu, kernels/zfp.cu and kernels/sign.cu, run on the host over their whole grids
// (tests/native/cuda_host/ stands in for the CUDA runtime and CUB), against the CPU kernels of
// kernels/topk.h, kernels/zfp.h and kernels/sign.h, bit for bit: the inputs of tests/gpu_test.py (every length
// around a zfp block, a warp of blocks and a top-k tile; rows of gradients, ties and special
// values; every rate; the rounds around each radix digit), rows in several chunks of the radix
// select's scratch (1250 x 7), a long row, and random words through the decoder. The top-k
// kernels also take bfloat16 and float16 input directly: those runs are compared with the float32
// path (the CPU kernel and the CUDA kernels' float32 instance) on the upcast, bit for bit
// (indices, thresholds, counts; values are the input's own bits, whose upcast is the float32
// path's value), on the same kinds of input plus every 16-bit pattern in one row. Scratch and
// results start out filled with garbage, so a slot the kernels never write, or state they
// forget to reset, shows up as a difference.
//
//   bash ci/cuda_host.sh          # builds this file with the .cu files and runs it (CI)
//
// Exits 1 at the first difference, naming the case; 2 if a kernel breaks the programming model
// (divergent barriers: see tests/native/cuda_host/cuda_runtime_api.h).
// This file holds main(): it also defines the emulator's fiber switch.
#define CUDA_HOST_MAIN

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/sign.h"
#include "kernels/sign_cuda.h"
#include "kernels/topk.h"
#include "kernels/topk_cuda.h"
#include "kernels/zfp.h"
#include "kernels/zfp_cuda.h"

namespace {

using Rows = std::vector<float>;

constexpr unsigned char kGarbage = 0xA5;


[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "FAIL %s\n", what.c_str());
  std::exit(1);
}

template <typename T>
std::vector<T> Garbage(size_t count) {
  std::vector<T> v(count);
  std::memset(v.data(), kGarbage, count * sizeof(T));
  return v;
}

template <typename T>
void ExpectSame(const std::vector<T>& cpu, const std::vector<T>& gpu, const std::string& what) {
  if (cpu.size() != gpu.size()) Fail(what + ": sizes differ");
  if (std::memcmp(cpu.data(), gpu.data(), cpu.size() * sizeof(T)) == 0) return;
  size_t i = 0;
  while (std::memcmp(&cpu[i], &gpu[i], sizeof(T)) == 0) ++i;
  size_t differ = 0;
  for (size_t j = 0; j < cpu.size(); ++j) differ += std::memcmp(&cpu[j], &gpu[j], sizeof(T)) != 0;
  uint64_t a = 0, b = 0;
  std::memcpy(&a, &cpu[i], sizeof(T));
  std::memcpy(&b, &gpu[i], sizeof(T));
  Fail(what + ": " + std::to_string(differ) + " of " + std::to_string(cpu.size()) + " entries differ, first at " +
       std::to_string(i) + " (cpu bits 0x" + [](uint64_t v) {
         char s[32];
         std::snprintf(s, sizeof s, "%llx", static_cast<unsigned long long>(v));
         return std::string(s);
       }(a) + ", gpu bits 0x" + [](uint64_t v) {
         char s[32];
         std::snprintf(s, sizeof s, "%llx", static_cast<unsigned long long>(v));
         return std::string(s);
       }(b) + ")");
}

// tests/gpu_test.py's kinds of row: well spread gradients, ties (few magnitudes, signed zeros),
// and normal values with NaN, +-Inf, denormals, 0 and FLT_MAX-ish planted.
Rows Row(int64_t n, uint64_t seed, int kind) {
  std::mt19937_64 rng(seed);
  Rows x(n);
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> uniform(-6.0, 0.0);
  std::chi_squared_distribution<double> chi(3.0);
  if (kind == 0) {
    for (auto& v : x) v = static_cast<float>(normal(rng) / std::sqrt(chi(rng) / 3.0) * std::pow(10.0, uniform(rng)));
  } else if (kind == 1) {
    const float choices[] = {-2.0f, -1.0f, 0.0f, -0.0f, 1.0f, 2.0f, 0.5f};
    for (auto& v : x) v = choices[rng() % 7];
  } else {
    for (auto& v : x) v = static_cast<float>(normal(rng));
    const float specials[] = {NAN, INFINITY, -INFINITY, 1e-40f, -1e-45f, 0.0f, 3.4e38f};
    for (int s = 0; s < 7 && s < n; ++s) x[rng() % n] = specials[s];
  }
  return x;
}

// [3, n]: one row of each kind.
Rows EveryKind(int64_t n, uint64_t seed) {
  Rows x;
  for (int kind = 0; kind < 3; ++kind) {
    Rows row = Row(n, seed + kind, kind);
    x.insert(x.end(), row.begin(), row.end());
  }
  return x;
}

const jaxcomp::Parallel kSerial;

void CheckStatus(const jaxcomp::Status& status, const std::string& what) {
  if (!status.ok()) Fail(what + " returned an error: " + status.message());
}

// How select_topk's rows went: candidates kept after the first digit (filtered), candidates
// that did not fit their buffer (overflowed: the row reads its values every pass), or no
// filtering in that call (one radix pass, or no candidate budget).
struct Filtering {
  int64_t filtered = 0, overflowed = 0, unfiltered = 0;
  void operator+=(const Filtering& o) {
    filtered += o.filtered;
    overflowed += o.overflowed;
    unfiltered += o.unfiltered;
  }
};
Filtering total_filtering;

// The rows' fate in select_topk, from the data: a row keeps its candidates when C(lo) after the
// first 11-bit digit (the keys whose top 11 bits reach the k-th key's) fits its slots.
Filtering FilteringOf(const Rows& x, int64_t rows, int64_t n, int64_t k, int rounds, size_t budget,
                      size_t candidate_budget) {
  Filtering f;
  const int64_t slots = jaxcomp::cuda::select_candidate_slots(rows, n, rounds, budget, candidate_budget);
  if (slots == 0) {
    f.unfiltered = rows;
    return f;
  }
  std::vector<uint32_t> keys(n);
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t i = 0; i < n; ++i) keys[i] = jaxcomp::topk_internal::MagnitudeKey(x[row * n + i]);
    std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<uint32_t>());
    const uint32_t first_digit = keys[k - 1] >> 20;
    int64_t candidates = 0;
    for (int64_t i = 0; i < n; ++i) candidates += (jaxcomp::topk_internal::MagnitudeKey(x[row * n + i]) >> 20) >= first_digit;
    (candidates <= slots ? f.filtered : f.overflowed) += 1;
  }
  return f;
}

// select_topk (rounds = 31: exact top-k; fewer: threshold_topk) against the CPU kernel.
// `budget`: scratch for per-tile histograms (small ones force short chunks or the count pass);
// `candidate_budget`: scratch for candidate buffers (small ones force the overflow fallback).
// The CPU kernel's selection, the reference.
struct CpuSelection {
  std::vector<float> values;
  std::vector<int32_t> indices;
};

// Rows per chunk of the radix select's scratch (1024 in this emulation build, 4096 on a GPU):
// kTwoChunks rows go through two chunks.
constexpr int64_t kChunkRows = jaxcomp::cuda::kMaxRowsPerChunk;
constexpr int64_t kTwoChunks = kChunkRows + 226;

// Returns how the rows were filtered; `cpu_out`, when given, receives the CPU kernel's selection
// (the reference Select16 compares the 16-bit instances with).
Filtering Select(const Rows& x, int64_t rows, int64_t n, int64_t k, int rounds,
                 size_t budget = jaxcomp::cuda::kTileHistogramBudget,
                 size_t candidate_budget = jaxcomp::cuda::kCandidateBudget, CpuSelection* cpu_out = nullptr) {
  const std::string what = "select rows=" + std::to_string(rows) + " n=" + std::to_string(n) +
                           " k=" + std::to_string(k) + " rounds=" + std::to_string(rounds) +
                           " budget=" + std::to_string(budget) + " candidate_budget=" +
                           std::to_string(candidate_budget);
  std::vector<float> cpu_values(rows * k);
  std::vector<int32_t> cpu_indices(rows * k);
  CheckStatus(jaxcomp::ThresholdTopK(x.data(), rows, n, k, rounds, cpu_values.data(), cpu_indices.data(), kSerial),
              what + " (cpu)");
  auto values = Garbage<float>(rows * k);
  auto indices = Garbage<int32_t>(rows * k);
  auto scratch =
      Garbage<unsigned char>(jaxcomp::cuda::select_scratch_bytes(rows, n, rounds, budget, candidate_budget));
  CheckStatus(jaxcomp::cuda::select_topk(x.data(), rows, n, k, rounds, values.data(), indices.data(), scratch.data(),
                                         nullptr, budget, candidate_budget),
              what);
  ExpectSame(cpu_indices, indices, what + " indices");
  ExpectSame(cpu_values, values, what + " values");
  const Filtering f = FilteringOf(x, rows, n, k, rounds, budget, candidate_budget);
  total_filtering += f;
  if (cpu_out != nullptr) *cpu_out = {std::move(cpu_values), std::move(cpu_indices)};
  return f;
}

void Expect(bool condition, const std::string& what) {
  if (!condition) Fail(what);
}

// ---- bfloat16 and float16 input ----

using jaxcomp::cuda::Element;
using Bits = std::vector<uint16_t>;  // bfloat16 or float16 bit patterns

const char* NameOf(Element type) { return type == Element::kBF16 ? "bf16" : "f16"; }

uint32_t BitsOf(float value) {
  uint32_t u;
  std::memcpy(&u, &value, sizeof u);
  return u;
}
float FloatOf(uint32_t u) {
  float value;
  std::memcpy(&value, &u, sizeof value);
  return value;
}

// The float32 upcast of a 16-bit pattern as XLA's convert makes it, what the float32 path sees
// (written from the formats' definitions, independently of kernels/topk.cu's keys): bfloat16
// shifted by 16 (NaN payloads kept as they are); float16 exact, a NaN keeping its payload and
// coming out quiet (IEEE 754 widening; XLA's CPU convert does the same for all 65536 patterns).
float Upcast(Element type, uint16_t bits) {
  if (type == Element::kBF16) return FloatOf(uint32_t{bits} << 16);
  const uint32_t sign = uint32_t{bits & 0x8000u} << 16;
  const uint32_t exponent = (bits >> 10) & 0x1Fu, mantissa = bits & 0x3FFu;
  if (exponent == 0x1F && mantissa != 0) return FloatOf(sign | 0x7FC00000u | (mantissa << 13));  // NaN
  if (exponent == 0x1F) return FloatOf(sign | 0x7F800000u);  // Inf
  if (exponent == 0) return FloatOf(sign | BitsOf(std::ldexp(static_cast<float>(mantissa), -24)));
  return FloatOf(sign | ((exponent - 15 + 127) << 23) | (mantissa << 13));
}

Rows UpcastRows(Element type, const Bits& x) {
  Rows up(x.size());
  for (size_t i = 0; i < x.size(); ++i) up[i] = Upcast(type, x[i]);
  return up;
}

// float32 to the 16-bit type, rounding to nearest even (NaN stays NaN, sign kept).
uint16_t Downcast(Element type, float value) {
  if (type == Element::kF16) {
    const _Float16 h = static_cast<_Float16>(value);
    uint16_t bits;
    std::memcpy(&bits, &h, sizeof bits);
    return bits;
  }
  const uint32_t u = BitsOf(value);
  if (std::isnan(value)) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Row() of `kind`, in the 16-bit type; the special row also gets the type's own specials: quiet
// and signalling NaNs of both signs with payloads, +-Inf, the smallest and largest denormals,
// -0 and the largest finite value.
Bits Row16(Element type, int64_t n, uint64_t seed, int kind) {
  const Rows x = Row(n, seed, kind);
  Bits bits(n);
  for (int64_t i = 0; i < n; ++i) bits[i] = Downcast(type, x[i]);
  if (kind == 2) {
    const bool bf16 = type == Element::kBF16;
    const uint16_t specials[] = {
        static_cast<uint16_t>(bf16 ? 0x7FC0 : 0x7E00), static_cast<uint16_t>(bf16 ? 0xFFC1 : 0xFE01),  // quiet NaNs
        static_cast<uint16_t>(bf16 ? 0x7F81 : 0x7C01), static_cast<uint16_t>(bf16 ? 0x7FBF : 0x7DFF),  // signalling
        static_cast<uint16_t>(bf16 ? 0x7F80 : 0x7C00), static_cast<uint16_t>(bf16 ? 0xFF80 : 0xFC00),  // +-Inf
        0x0001, 0x8001, static_cast<uint16_t>(bf16 ? 0x807F : 0x83FF), 0x8000,  // denormals, -0
        static_cast<uint16_t>(bf16 ? 0x7F7F : 0x7BFF)};  // the largest finite value
    std::mt19937_64 rng(seed ^ 0x16);
    for (uint16_t special : specials) bits[rng() % n] = special;
  }
  return bits;
}

// [3, n]: one row of each kind.
Bits EveryKind16(Element type, int64_t n, uint64_t seed) {
  Bits x;
  for (int kind = 0; kind < 3; ++kind) {
    Bits row = Row16(type, n, seed + kind, kind);
    x.insert(x.end(), row.begin(), row.end());
  }
  return x;
}

// select_topk on 16-bit input against the float32 path on its upcast: the CPU kernel and the
// CUDA kernels' float32 instance (same indices; values: the input's bits at those indices, whose
// upcast is the float32 path's value, bit for bit).
Filtering Select16(Element type, const Bits& x, int64_t rows, int64_t n, int64_t k, int rounds,
                   size_t budget = jaxcomp::cuda::kTileHistogramBudget,
                   size_t candidate_budget = jaxcomp::cuda::kCandidateBudget) {
  const std::string what = std::string(NameOf(type)) + " select rows=" + std::to_string(rows) + " n=" +
                           std::to_string(n) + " k=" + std::to_string(k) + " rounds=" + std::to_string(rounds) +
                           " budget=" + std::to_string(budget) + " candidate_budget=" +
                           std::to_string(candidate_budget);
  const Rows up = UpcastRows(type, x);
  CpuSelection cpu;
  // CUDA float32 vs CPU, which also gives the CPU kernel's selection on the upcast.
  const Filtering f = Select(up, rows, n, k, rounds, budget, candidate_budget, &cpu);
  const std::vector<float>& cpu_values = cpu.values;
  const std::vector<int32_t>& cpu_indices = cpu.indices;
  auto values = Garbage<uint16_t>(rows * k);
  auto indices = Garbage<int32_t>(rows * k);
  auto scratch =
      Garbage<unsigned char>(jaxcomp::cuda::select_scratch_bytes(rows, n, rounds, budget, candidate_budget));
  CheckStatus(jaxcomp::cuda::select_topk(type, x.data(), rows, n, k, rounds, values.data(), indices.data(),
                                         scratch.data(), nullptr, budget, candidate_budget),
              what);
  ExpectSame(cpu_indices, indices, what + " indices");
  Bits expected(rows * k);
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t j = 0; j < k; ++j) expected[row * k + j] = x[row * n + cpu_indices[row * k + j]];
  }
  ExpectSame(expected, values, what + " values (the input's bits)");
  ExpectSame(cpu_values, UpcastRows(type, values), what + " upcast values");
  return f;
}

void Threshold16(Element type, const Bits& x, int64_t rows, int64_t n, int64_t k, int rounds) {
  const std::string what = std::string(NameOf(type)) + " find_threshold rows=" + std::to_string(rows) + " n=" +
                           std::to_string(n) + " k=" + std::to_string(k) + " rounds=" + std::to_string(rounds);
  const Rows up = UpcastRows(type, x);
  std::vector<float> cpu_threshold(rows);
  std::vector<int32_t> cpu_count(rows);
  CheckStatus(jaxcomp::FindThreshold(up.data(), rows, n, k, rounds, cpu_threshold.data(), cpu_count.data(), kSerial),
              what + " (cpu)");
  auto threshold = Garbage<float>(rows);
  auto count = Garbage<int32_t>(rows);
  auto scratch = Garbage<unsigned char>(jaxcomp::cuda::threshold_scratch_bytes(rows, n, rounds));
  CheckStatus(jaxcomp::cuda::find_threshold(type, x.data(), rows, n, k, rounds, threshold.data(), count.data(),
                                            scratch.data(), nullptr),
              what);
  ExpectSame(cpu_count, count, what + " count");
  ExpectSame(cpu_threshold, threshold, what + " threshold");
}

// Upcast() against the compiler's float16 conversion (IEEE 754 widening), for all 65536 patterns.
void CheckUpcast() {
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    const uint16_t bits = static_cast<uint16_t>(b);
    _Float16 h;
    std::memcpy(&h, &bits, sizeof h);
    Expect(BitsOf(Upcast(Element::kF16, bits)) == BitsOf(static_cast<float>(h)),
           "float16 upcast of 0x" + std::to_string(b));
    Expect(BitsOf(Upcast(Element::kBF16, bits)) == b << 16, "bfloat16 upcast");
  }
}

void Threshold(const Rows& x, int64_t rows, int64_t n, int64_t k, int rounds) {
  const std::string what = "find_threshold rows=" + std::to_string(rows) + " n=" + std::to_string(n) +
                           " k=" + std::to_string(k) + " rounds=" + std::to_string(rounds);
  std::vector<float> cpu_threshold(rows);
  std::vector<int32_t> cpu_count(rows);
  CheckStatus(jaxcomp::FindThreshold(x.data(), rows, n, k, rounds, cpu_threshold.data(), cpu_count.data(), kSerial),
              what + " (cpu)");
  auto threshold = Garbage<float>(rows);
  auto count = Garbage<int32_t>(rows);
  auto scratch = Garbage<unsigned char>(jaxcomp::cuda::threshold_scratch_bytes(rows, n, rounds));
  CheckStatus(jaxcomp::cuda::find_threshold(x.data(), rows, n, k, rounds, threshold.data(), count.data(),
                                            scratch.data(), nullptr),
              what);
  ExpectSame(cpu_count, count, what + " count");
  ExpectSame(cpu_threshold, threshold, what + " threshold");
}

void Zfp(const Rows& x, int64_t rows, int64_t n, int rate) {
  const std::string what = "zfp rows=" + std::to_string(rows) + " n=" + std::to_string(n) + " rate=" +
                           std::to_string(rate);
  const int64_t row_words = jaxcomp::zfp_num_words(n, rate);
  std::vector<uint32_t> cpu_words(rows * row_words);
  CheckStatus(jaxcomp::zfp_encode(x.data(), rows, n, rate, cpu_words.data(), kSerial), what + " encode (cpu)");
  auto words = Garbage<uint32_t>(rows * row_words);
  CheckStatus(jaxcomp::cuda::zfp_encode(x.data(), rows, n, rate, words.data(), nullptr), what + " encode");
  ExpectSame(cpu_words, words, what + " words");
  std::vector<float> cpu_x(rows * n);
  CheckStatus(jaxcomp::zfp_decode(cpu_words.data(), rows, n, rate, cpu_x.data(), kSerial), what + " decode (cpu)");
  auto decoded = Garbage<float>(rows * n);
  CheckStatus(jaxcomp::cuda::zfp_decode(cpu_words.data(), rows, n, rate, decoded.data(), nullptr), what + " decode");
  ExpectSame(cpu_x, decoded, what + " decoded");
}

// Any bit pattern is a valid stream: random words reach every plane-decoding path.
void ZfpRandomWords(int64_t rows, int64_t n, int rate, uint64_t seed) {
  const std::string what = "zfp_decode of random words rows=" + std::to_string(rows) + " n=" + std::to_string(n) +
                           " rate=" + std::to_string(rate);
  const int64_t row_words = jaxcomp::zfp_num_words(n, rate);
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> words(rows * row_words);
  for (auto& w : words) w = static_cast<uint32_t>(rng());
  if (rate <= 2) words[0] &= 0xFF;  // a valid row exponent in one row's header
  std::vector<float> cpu_x(rows * n);
  CheckStatus(jaxcomp::zfp_decode(words.data(), rows, n, rate, cpu_x.data(), kSerial), what + " (cpu)");
  auto decoded = Garbage<float>(rows * n);
  CheckStatus(jaxcomp::cuda::zfp_decode(words.data(), rows, n, rate, decoded.data(), nullptr), what);
  ExpectSame(cpu_x, decoded, what);
}

void Sign(const Rows& x, int64_t rows, int64_t n, int64_t chunk) {
  const std::string what = "sign rows=" + std::to_string(rows) + " n=" + std::to_string(n) + " chunk=" +
                           std::to_string(chunk);
  const int64_t row_words = jaxcomp::sign::num_words(n), row_chunks = jaxcomp::sign::num_chunks(n, chunk);
  std::vector<uint32_t> cpu_words(rows * row_words);
  std::vector<float> cpu_scales(rows * row_chunks);
  CheckStatus(jaxcomp::sign_pack(x.data(), rows, n, chunk, cpu_words.data(), cpu_scales.data(), kSerial),
              what + " pack (cpu)");
  auto words = Garbage<uint32_t>(rows * row_words);
  auto scales = Garbage<float>(rows * row_chunks);
  CheckStatus(jaxcomp::cuda::sign_pack(x.data(), rows, n, chunk, words.data(), scales.data(), nullptr), what + " pack");
  ExpectSame(cpu_words, words, what + " words");
  ExpectSame(cpu_scales, scales, what + " scales");
  std::vector<float> cpu_x(rows * n);
  CheckStatus(jaxcomp::sign_unpack(cpu_words.data(), cpu_scales.data(), rows, n, chunk, cpu_x.data(), kSerial),
              what + " unpack (cpu)");
  auto decoded = Garbage<float>(rows * n);
  CheckStatus(jaxcomp::cuda::sign_unpack(cpu_words.data(), cpu_scales.data(), rows, n, chunk, decoded.data(), nullptr),
              what + " unpack");
  ExpectSame(cpu_x, decoded, what + " decoded");
}

template <typename Body>
void Section(const char* name, Body body) {
  const auto start = std::chrono::steady_clock::now();
  body();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("  %-58s ok (%.1f s)\n", name, seconds);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t seed = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1;
  cuda_host::seed(seed);
  const int64_t lengths[] = {1, 3, 4, 5, 127, 129, 1000, 8191, 8193, 3 * 8192 + 5};
  std::printf("CUDA kernels on the host against the CPU kernels (seed %llu)\n", static_cast<unsigned long long>(seed));

  Section("top-k: every length x {1, n/100, n/3, n}, 3 kinds of row", [&] {
    for (int64_t n : lengths) {
      const Rows x = EveryKind(n, n);
      for (int64_t k : {int64_t{1}, std::max<int64_t>(1, n / 100), std::max<int64_t>(1, n / 3), n}) Select(x, 3, n, k, 31);
    }
  });
  Section("threshold: rounds around every digit x k in {1, 97, n/2, n}", [&] {
    const int64_t n = 3 * 8192 + 5;
    for (int rounds : {1, 5, 11, 12, 16, 22, 23, 31}) {
      const Rows x = EveryKind(n, rounds);
      for (int64_t k : {int64_t{1}, int64_t{97}, n / 2, n}) {
        Threshold(x, 3, n, k, rounds);
        Select(x, 3, n, k, rounds);
      }
    }
  });
  Section("many short rows in two chunks of scratch (1250 x 7)", [&] {
    const Rows x = Row(kTwoChunks * 7, 3, 1);
    Select(x, kTwoChunks, 7, 3, 31);
    Threshold(x, kTwoChunks, 7, 3, 9);
    Select(x, kTwoChunks, 7, 3, 16);
  });
  Section("a long row (2^20 values, k = 2^13)", [&] {
    const int64_t n = int64_t{1} << 20;
    const Rows x = Row(n, 11, 0);
    Select(x, 1, n, n >> 7, 31);
    Select(x, 1, n, n >> 7, 16);
  });
  Section("top-k scratch budgets: short chunks, tiles counted in a pass", [&] {
    const Rows rows = Row(700 * 33, 4, 1);
    Select(rows, 700, 33, 5, 31, 16 << 10);   // 7 rows a chunk
    Select(rows, 700, 33, 5, 22, 16 << 10);   // an 11-bit last digit: 1 row a chunk
    const int64_t n = 5 * 8192 + 3;
    const Rows x = EveryKind(n, 8);
    for (int rounds : {9, 16, 31}) Select(x, 3, n, 700, rounds, 1024);  // every row counts its tiles
  });
  Section("candidates: kept, overflowed, and both in one launch", [&] {
    using jaxcomp::cuda::kTileHistogramBudget;
    const int64_t n = 5 * 8192 + 3;  // odd: rows after the first start unaligned (scalar loads)
    // Spread rows, small k: every row keeps its candidates, at every pass count that filters.
    const Rows spread = Row(3 * n, 21, 0);
    for (int rounds : {12, 16, 22, 23, 31}) {
      const Filtering f = Select(spread, 3, n, 97, rounds);
      Expect(f.filtered == 3, "spread rows, k = 97: every row should keep its candidates");
    }
    // Ties: two sevenths of the row share the top magnitude, more than the slots (n / 8).
    const Rows ties = Row(3 * n, 22, 1);
    for (int64_t k : {int64_t{1}, n / 3}) {
      const Filtering f = Select(ties, 3, n, k, 31);
      Expect(f.overflowed == 3, "rows of ties: every row's candidates should overflow");
    }
    // One launch, both kinds of row (spread, ties, normal with NaN/Inf/denormals).
    const Rows mixed = EveryKind(n, 23);
    for (int rounds : {16, 31}) {
      const Filtering f = Select(mixed, 3, n, 97, rounds);
      Expect(f.filtered >= 1 && f.overflowed >= 1, "mixed rows: some rows should filter and some overflow");
    }
    // Small candidate budgets: 100 slots a row, then none (no filtering at all).
    Filtering small;
    for (int64_t k : {int64_t{1}, int64_t{40}, int64_t{97}, int64_t{400}}) small += Select(spread, 3, n, k, 31, kTileHistogramBudget, 3 * 8 * 100);
    Expect(small.filtered >= 1 && small.overflowed >= 1, "100 slots: some calls should filter and some overflow");
    Expect(Select(spread, 3, n, 97, 31, kTileHistogramBudget, 0).unfiltered == 3, "no budget: no filtering");
    // Candidates counted by count_tiles_kernel (per-tile histograms over budget).
    for (int rounds : {16, 31}) {
      Expect(Select(mixed, 3, n, 97, rounds, 1024).filtered >= 1, "count pass: some rows should filter");
    }
    // Signed zeros, NaN and Inf among the candidates (a row of 200 keeps all 200).
    Rows zeros(2 * 200, 0.0f);
    for (int i = 0; i < 400; i += 3) zeros[i] = -0.0f;
    zeros[7] = NAN;
    zeros[250] = -INFINITY;
    zeros[251] = -NAN;
    zeros[399] = 1e-45f;
    for (int64_t k : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{150}, int64_t{200}}) {
      Expect(Select(zeros, 2, 200, k, 31).filtered == 2, "signed zeros: both rows should filter");
    }
    // Many rows in two chunks, 3 slots a row: rows of ties mostly overflow, the others filter.
    const Rows short_rows = Row(kTwoChunks * 7, 24, 1);
    const Filtering chunks =
        Select(short_rows, kTwoChunks, 7, 2, 31, kTileHistogramBudget, kChunkRows * 8 * 3);
    Expect(chunks.filtered >= 1 && chunks.overflowed >= 1, "two chunks, 3 slots: both kinds of row");
  });
  for (Element type : {Element::kBF16, Element::kF16}) {
    const std::string name = NameOf(type);
    Section((name + " top-k: every length x {1, n/100, n/3, n}, 3 kinds of row").c_str(), [&] {
      CheckUpcast();
      for (int64_t n : lengths) {
        const Bits x = EveryKind16(type, n, n);
        for (int64_t k : {int64_t{1}, std::max<int64_t>(1, n / 100), std::max<int64_t>(1, n / 3), n}) {
          Select16(type, x, 3, n, k, 31);
        }
      }
    });
    Section((name + " threshold: rounds around every digit x k in {1, 97, n/2}").c_str(), [&] {
      const int64_t n = 3 * 8192 + 5;
      for (int rounds : {1, 11, 12, 16, 22, 23, 31}) {
        const Bits x = EveryKind16(type, n, rounds);
        for (int64_t k : {int64_t{1}, int64_t{97}, n / 2}) {
          Threshold16(type, x, 3, n, k, rounds);
          Select16(type, x, 3, n, k, rounds);
        }
      }
    });
    Section((name + ": rows in two chunks (1250 x 7), scratch budgets, candidates").c_str(), [&] {
      using jaxcomp::cuda::kTileHistogramBudget;
      const Bits short_rows = Row16(type, kTwoChunks * 7, 3, 1);
      Select16(type, short_rows, kTwoChunks, 7, 3, 31);
      Threshold16(type, short_rows, kTwoChunks, 7, 3, 9);
      Select16(type, short_rows, kTwoChunks, 7, 3, 16);
      Select16(type, short_rows, kTwoChunks, 7, 2, 31, kTileHistogramBudget, kChunkRows * 8 * 3);  // 3 slots a row
      const int64_t n = 5 * 8192 + 3;  // odd: rows after the first start unaligned (scalar loads)
      const Bits spread = Row16(type, 3 * n, 21, 0);
      for (int rounds : {16, 23, 31}) {
        Expect(Select16(type, spread, 3, n, 97, rounds).filtered == 3, "16-bit spread rows should filter");
      }
      const Bits ties = Row16(type, 3 * n, 22, 1);
      Expect(Select16(type, ties, 3, n, n / 3, 31).overflowed == 3, "16-bit rows of ties should overflow");
      const Bits mixed = EveryKind16(type, n, 23);
      const Filtering f = Select16(type, mixed, 3, n, 97, 31);
      Expect(f.filtered >= 1 && f.overflowed >= 1, "16-bit mixed rows: some should filter and some overflow");
      for (int rounds : {16, 31}) Select16(type, mixed, 3, n, 97, rounds, 1024);  // tiles counted in a pass
      Select16(type, spread, 3, n, 40, 31, kTileHistogramBudget, 3 * 8 * 100);     // 100 slots a row
      Select16(type, spread, 3, n, 97, 31, kTileHistogramBudget, 0);               // no filtering
    });
    Section((name + ": every 16-bit pattern in a row (65536, 2 orders)").c_str(), [&] {
      // Two shuffles of all 65536 patterns: every NaN payload, both Infs and zeros, every
      // denormal. Thresholds at rounds = 31 read the k-th key exactly, for k across the range.
      const int64_t n = 65536;
      Bits x(2 * n);
      std::mt19937_64 rng(65536);
      for (int64_t row = 0; row < 2; ++row) {
        for (int64_t i = 0; i < n; ++i) x[row * n + i] = static_cast<uint16_t>(i);
        std::shuffle(x.begin() + row * n, x.begin() + (row + 1) * n, rng);
      }
      for (int64_t k = 1; k <= n; k += 2731) Threshold16(type, x, 2, n, k, 31);
      for (int64_t k : {int64_t{1}, int64_t{300}, int64_t{2000}, n / 2, n - 1000, n - 100, n}) {
        Threshold16(type, x, 2, n, k, 31);
        Select16(type, x, 2, n, k, 31);
        Select16(type, x, 2, n, k, 16);
      }
    });
  }
  Section("zfp: rates 1-32 x every length, 3 kinds of row", [&] {
    for (int rate : {1, 2, 3, 4, 5, 7, 8, 12, 16, 21, 31, 32}) {
      for (int64_t n : lengths) Zfp(EveryKind(n, n + rate), 3, n, rate);
    }
  });
  Section("zfp: rows of zeros, NaN, -Inf, denormals", [&] {
    Rows x(4 * 300, 0.0f);
    x[300 + 17] = NAN;
    x[600 + 299] = -INFINITY;
    for (int i = 0; i < 300; ++i) x[900 + i] = -1e-38f + 2e-38f * i / 299;
    for (int rate : {1, 2, 3, 8, 32}) Zfp(x, 4, 300, rate);
  });
  Section("zfp: a long row (2^20 values, rate 8) and many rows", [&] {
    const int64_t n = int64_t{1} << 20;
    Zfp(Row(n, 5, 0), 1, n, 8);
    Zfp(Row(2000 * 33, 6, 2), 2000, 33, 5);
  });
  Section("zfp_decode of random words, every rate", [&] {
    for (int rate = 1; rate <= 32; ++rate) ZfpRandomWords(3, 203, rate, rate);
  });
  Section("sign: every length x chunk {1, 3, 32, 1000, 4096, n}, 3 kinds", [&] {
    for (int64_t n : lengths) {
      const Rows x = EveryKind(n, n + 7);
      for (int64_t chunk : {int64_t{1}, int64_t{3}, int64_t{32}, int64_t{1000}, int64_t{4096}, n}) {
        if (chunk < 32 && n > 1000) continue;  // a thread block per chunk: long to emulate
        Sign(x, 3, n, chunk);
      }
    }
  });
  Section("sign: a long row in one chunk (2^20 values) and many rows", [&] {
    const int64_t n = int64_t{1} << 20;
    Sign(Row(n, 9, 0), 1, n, n);
    Sign(Row(2000 * 33, 10, 2), 2000, 33, 16);
  });
  std::printf("top-k rows: %lld kept their candidates, %lld overflowed (read their values again), %lld unfiltered\n",
              static_cast<long long>(total_filtering.filtered), static_cast<long long>(total_filtering.overflowed),
              static_cast<long long>(total_filtering.unfiltered));
  const cuda_host::Machine& m = cuda_host::machine();
  std::printf("all match: %llu launches, %llu blocks, %llu block barriers emulated\n", m.launches, m.blocks,
              m.barriers);
  return 0;
}
