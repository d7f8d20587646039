// The 1-bit sign codec with one scale per chunk (docs/kernels.md): rows of `n` float32 values ->
// their signs packed 32 per uint32 word and the mean magnitude of every chunk of `chunk` values,
// and back to +-scale.
//
// The format, defined on the values' bits so that no float mode (flushed denormals) changes it:
//
// * bit i % 32 of word i / 32 is 1 ("+") when x[i] >= 0 (+0, -0, positive values, +Inf), 0 for
//   negative values (denormals included) and NaN; a row's last word is zero-padded;
// * scale q = (pairwise sum of |x[i]| over the chunk) * (1.0f / count), count the values in the
//   chunk (the row's last chunk may be shorter). Magnitudes below the smallest normal float
//   count as 0, a scale below it is written as +0, and NaN as 0x7FC00000;
// * the sum is the halving tree: the chunk zero-padded to P = the power of two >= chunk, then
//   v[i] += v[i + h] for h = P/2, P/4, ..., 1. That order is fixed, so the CPU kernel, the CUDA
//   kernel and jaxcomp/xla/sign.py give the same float bit for bit. Any L-lane split of it is the
//   same tree: lane l first sums the rows r*L + l (r = 0..P/L - 1) with the halving tree, then
//   the lanes halve; a lane walks its rows in bit-reversed order, merging like a binary counter,
//   so it needs log2(P/L) partial sums and no buffer of the chunk.
//
// The JAXCOMP_HD helpers are shared with kernels/sign.cu; the row drivers below are the CPU's.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define JAXCOMP_SIGN_HD __host__ __device__ __forceinline__
#else
#define JAXCOMP_SIGN_HD inline
#endif

namespace jaxcomp {
namespace sign {

constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kInfBits = 0x7F800000u;
constexpr uint32_t kSmallestNormalBits = 0x00800000u;
constexpr uint32_t kNanBits = 0x7FC00000u;
// Lanes of the CPU kernel's tree (a power of two; any gives the same sum).
constexpr int64_t kCpuLanes = 64;
// Levels of a lane's binary-counter stack: rows per lane are at most 2^31.
constexpr int kMaxLevels = 32;

JAXCOMP_SIGN_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  return u;
#endif
}

JAXCOMP_SIGN_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
#endif
}

JAXCOMP_SIGN_HD int64_t num_words(int64_t n) { return (n + 31) / 32; }
JAXCOMP_SIGN_HD int64_t num_chunks(int64_t n, int64_t chunk) { return (n + chunk - 1) / chunk; }

// The power of two the tree pads a chunk to.
JAXCOMP_SIGN_HD int64_t tree_size(int64_t chunk) {
  int64_t p = 1;
  while (p < chunk) p *= 2;
  return p;
}

// 1 for x >= 0 (either zero included), 0 for x < 0 and NaN.
JAXCOMP_SIGN_HD uint32_t sign_bit(float x) {
  const uint32_t u = float_bits(x), a = u & kAbsMask;
  return (a == 0 || (u >> 31 == 0 && a <= kInfBits)) ? 1u : 0u;
}

// |x|, with denormals as +0.
JAXCOMP_SIGN_HD float magnitude(float x) {
  const uint32_t a = float_bits(x) & kAbsMask;
  return bits_float(a < kSmallestNormalBits ? 0u : a);
}

// The scale from the chunk's tree sum and its value count.
JAXCOMP_SIGN_HD float scale_of(float sum, int64_t count) {
  const float mean = sum * (1.0f / static_cast<float>(count));
  const uint32_t a = float_bits(mean) & kAbsMask;
  if (a > kInfBits) return bits_float(kNanBits);
  return a < kSmallestNormalBits ? 0.0f : mean;
}

// x[r * lanes + l] of a chunk, or 0 past its `count` values.
JAXCOMP_SIGN_HD float chunk_value(const float* chunk_x, int64_t count, int64_t index) {
  return index < count ? magnitude(chunk_x[index]) : 0.0f;
}

// Bit-reversal of the low `bits` bits of j.
JAXCOMP_SIGN_HD int64_t reverse_bits(int64_t j, int bits) {
  int64_t r = 0;
  for (int b = 0; b < bits; ++b) r |= ((j >> b) & 1) << (bits - 1 - b);
  return r;
}

JAXCOMP_SIGN_HD int log2_exact(int64_t p) {
  int bits = 0;
  while ((int64_t{1} << bits) < p) ++bits;
  return bits;
}

// Lane `lane` of a chunk split into `lanes` lanes: the halving tree over its rows r*lanes + lane,
// r = 0..rows - 1 (rows a power of two), in the order docs/kernels.md defines.
JAXCOMP_SIGN_HD float lane_sum(const float* chunk_x, int64_t count, int64_t lanes, int64_t rows, int64_t lane) {
  const int levels = log2_exact(rows);
  float stack[kMaxLevels + 1];
  for (int64_t j = 0; j < rows; ++j) {
    float v = chunk_value(chunk_x, count, reverse_bits(j, levels) * lanes + lane);
    int level = 0;
    while ((j >> level) & 1) {
      v = stack[level] + v;
      ++level;
    }
    stack[level] = v;
  }
  return stack[levels];
}

}  // namespace sign
}  // namespace jaxcomp

// ---- CPU row drivers -----------------------------------------------------------------------------
#include <algorithm>
#include <cstring>
#include <string>

#include "kernels/parallel.h"
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#include "kernels/status.h"

namespace jaxcomp {

namespace sign_detail {

inline Status check(int64_t rows, int64_t n, int64_t chunk) {
  if (rows < 0) return Status::InvalidArgument("rows must be >= 0, got " + std::to_string(rows));
  if (n < 1 || n > INT32_MAX) return Status::InvalidArgument("n must be in [1, 2^31 - 1], got " + std::to_string(n));
  if (chunk < 1 || chunk > INT32_MAX) {
    return Status::InvalidArgument("chunk must be in [1, 2^31 - 1], got " + std::to_string(chunk));
  }
  return Status();
}

// Runs body(row, begin, end) over [0, per_row) of every row, cut into tasks of at least
// `min_per_task` items (small inputs run on the caller).
template <typename Body>
void for_each_range(int64_t rows, int64_t per_row, int64_t min_per_task, const Parallel& parallel, const Body& body) {
  const int64_t total = rows * per_row;
  if (total == 0) return;
  const int64_t tasks = std::max<int64_t>(1, std::min(parallel.concurrency * 4, total / min_per_task));
  parallel.run(tasks, [&](int64_t t) {
    int64_t begin, end;
    split_range(total, tasks, t, 1, &begin, &end);
    while (begin < end) {
      const int64_t row = begin / per_row;
      const int64_t first = begin - row * per_row;
      const int64_t stop = std::min(per_row, first + (end - begin));
      body(row, first, stop);
      begin += stop - first;
    }
  });
}

// The scale of one chunk of `count` values, with kCpuLanes lanes (or fewer for small chunks):
// the lanes' binary-counter stacks advance together, so every step adds two runs of contiguous
// floats, which the compiler vectorizes.
inline float chunk_scale(const float* chunk_x, int64_t count, int64_t chunk) {
  const int64_t p = sign::tree_size(chunk);
  const int64_t lanes = std::min(p, sign::kCpuLanes);
  const int64_t rows = p / lanes;
  const int levels = sign::log2_exact(rows);
  float stack[sign::kMaxLevels + 1][sign::kCpuLanes];
  float v[sign::kCpuLanes];
  for (int64_t j = 0; j < rows; ++j) {
    const int64_t first = sign::reverse_bits(j, levels) * lanes;
    if (first + lanes <= count) {
      for (int64_t l = 0; l < lanes; ++l) v[l] = sign::magnitude(chunk_x[first + l]);
    } else {
      for (int64_t l = 0; l < lanes; ++l) v[l] = sign::chunk_value(chunk_x, count, first + l);
    }
    int level = 0;
    while ((j >> level) & 1) {
      for (int64_t l = 0; l < lanes; ++l) v[l] = stack[level][l] + v[l];
      ++level;
    }
    std::copy(v, v + lanes, stack[level]);
  }
  float* lane = stack[levels];
  for (int64_t h = lanes / 2; h >= 1; h /= 2) {
    for (int64_t l = 0; l < h; ++l) lane[l] = lane[l] + lane[l + h];
  }
  return sign::scale_of(lane[0], count);
}

// The sign masks of the 8 values one byte of a word stands for, XORed into the scale's bits: a set
// bit keeps +scale, a clear one flips the sign bit (-scale, exactly what negation does, NaN too).
struct ByteSigns {
  uint32_t flip[256][8];
  ByteSigns() {
    for (int v = 0; v < 256; ++v) {
      for (int b = 0; b < 8; ++b) flip[v][b] = (v >> b) & 1 ? 0u : 0x80000000u;
    }
  }
};

inline const ByteSigns& byte_signs() {
  static const ByteSigns table;
  return table;
}

// Calls emit(first, values, count) for consecutive runs of at most 32 decoded values covering
// [begin, end) of one row. A whole word inside one chunk decodes through the byte table, 8 values
// at a time in vector registers (the bit-by-bit select took ~2.5 ns a value); the edges of words
// and chunks go bit by bit.
template <typename Emit>
inline void decode_range(const uint32_t* row_words, const float* row_scales, int64_t chunk, int64_t begin,
                         int64_t end, const Emit& emit) {
  const ByteSigns& table = byte_signs();
  float values[32];
  for (int64_t i = begin; i < end;) {
    const int64_t q = i / chunk;
    const float plus = row_scales[q];
    uint32_t plus_bits;
    std::memcpy(&plus_bits, &plus, sizeof plus_bits);
    const int64_t chunk_end = std::min(end, (q + 1) * chunk);
    while (i < chunk_end) {
      if ((i & 31) == 0 && i + 32 <= chunk_end) {
        const uint32_t word = row_words[i >> 5];
        uint32_t bits[32];
        for (int byte = 0; byte < 4; ++byte) {
          const uint32_t* flip = table.flip[(word >> (8 * byte)) & 0xFFu];
          for (int b = 0; b < 8; ++b) bits[byte * 8 + b] = plus_bits ^ flip[b];
        }
        std::memcpy(values, bits, sizeof bits);
        emit(i, values, 32);
        i += 32;
      } else {
        const int64_t stop = std::min(chunk_end, (i | 31) + 1);
        for (int64_t k = i; k < stop; ++k) values[k - i] = (row_words[k >> 5] >> (k & 31)) & 1u ? plus : -plus;
        emit(i, values, stop - i);
        i = stop;
      }
    }
  }
}

// The sign bits (sign::sign_bit) of `count` <= 32 values as one word. A whole word with SSE2
// (every x86-64) goes four at a time from the integer form of sign_bit, so no float compare sees a
// denormal (a thread that flushes denormals to zero would call -1e-40 >= 0 true); the scalar loop
// took ~1.6 ns a value.
inline uint32_t word_of(const float* x, int64_t count) {
#if defined(__SSE2__)
  if (count == 32) {
    const __m128i abs_mask = _mm_set1_epi32(0x7FFFFFFF), zero = _mm_setzero_si128();
    const __m128i above_inf = _mm_set1_epi32(static_cast<int32_t>(sign::kInfBits + 1));
    const __m128i minus_one = _mm_set1_epi32(-1);
    uint32_t word = 0;
    for (int g = 0; g < 8; ++g) {
      const __m128i u = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 4 * g));
      // a == 0, or u >= 0 (as int32: the sign bit clear) and u <= the bits of +Inf.
      const __m128i zeros = _mm_cmpeq_epi32(_mm_and_si128(u, abs_mask), zero);
      const __m128i plus = _mm_and_si128(_mm_cmpgt_epi32(u, minus_one), _mm_cmpgt_epi32(above_inf, u));
      const int bits = _mm_movemask_ps(_mm_castsi128_ps(_mm_or_si128(zeros, plus)));
      word |= static_cast<uint32_t>(bits) << (4 * g);
    }
    return word;
  }
#endif
  uint32_t word = 0;
  for (int64_t b = 0; b < count; ++b) word |= sign::sign_bit(x[b]) << b;
  return word;
}

}  // namespace sign_detail

// x: [rows, n] float32 -> words: [rows, ceil(n / 32)] uint32 and scales: [rows, ceil(n / chunk)]
// float32 (the format at the top of this file).
inline Status sign_pack(const float* x, int64_t rows, int64_t n, int64_t chunk, uint32_t* words, float* scales,
                        const Parallel& parallel) {
  if (Status s = sign_detail::check(rows, n, chunk); !s.ok()) return s;
  const int64_t row_words = sign::num_words(n);
  const int64_t row_chunks = sign::num_chunks(n, chunk);
  const int64_t chunks_per_task = std::max<int64_t>(1, (int64_t{1} << 19) / chunk);
  // The row's words [begin, end) (each one the signs of 32 values, the last word maybe fewer).
  auto write_words = [&](int64_t row, int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      words[row * row_words + w] = sign_detail::word_of(x + row * n + w * 32, std::min<int64_t>(32, n - w * 32));
    }
  };
  // With chunks of whole words, no word straddles two chunks: each chunk's words are written
  // right after its scale, from the cache, so the row is read once.
  const bool fused = chunk % 32 == 0;
  if (!fused) sign_detail::for_each_range(rows, row_words, 1 << 14, parallel, write_words);
  sign_detail::for_each_range(rows, row_chunks, chunks_per_task, parallel,
                              [&](int64_t row, int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const int64_t first = q * chunk, count = std::min(chunk, n - first);
      scales[row * row_chunks + q] = sign_detail::chunk_scale(x + row * n + first, count, chunk);
      if (fused) write_words(row, first / 32, (first + count + 31) / 32);
    }
  });
  return Status();
}

// words: [rows, ceil(n / 32)], scales: [rows, ceil(n / chunk)] -> x: [rows, n] float32, +scale
// where the bit is 1 and -scale where it is 0.
inline Status sign_unpack(const uint32_t* words, const float* scales, int64_t rows, int64_t n, int64_t chunk,
                          float* x, const Parallel& parallel) {
  if (Status s = sign_detail::check(rows, n, chunk); !s.ok()) return s;
  const int64_t row_words = sign::num_words(n), row_chunks = sign::num_chunks(n, chunk);
  sign_detail::for_each_range(rows, row_words, 1 << 13, parallel, [&](int64_t row, int64_t begin, int64_t end) {
    float* row_x = x + row * n;
    sign_detail::decode_range(words + row * row_words, scales + row * row_chunks, chunk, begin * 32,
                              std::min(n, end * 32), [&](int64_t first, const float* values, int64_t count) {
                                std::memcpy(row_x + first, values, count * sizeof(float));
                              });
  });
  return Status();
}

// words: [rows, ceil(n / 32)], scales: [rows, ceil(n / chunk)] -> x: [n] float32, the sum of the
// rows' decoded values, added row after row from 0 (bit for bit `total = total + decode(row)` in a
// loop over the rows): what an all-gather of every device's signs adds up. One write of x, where
// decoding each row and adding it wrote and read a vector per row; each chunk is summed over the
// rows while it is in cache.
inline Status sign_unpack_sum(const uint32_t* words, const float* scales, int64_t rows, int64_t n, int64_t chunk,
                              float* x, const Parallel& parallel) {
  if (Status s = sign_detail::check(rows, n, chunk); !s.ok()) return s;
  if (rows < 1) return Status::InvalidArgument("rows must be >= 1 to sum, got " + std::to_string(rows));
  const int64_t row_words = sign::num_words(n), row_chunks = sign::num_chunks(n, chunk);
  sign_detail::for_each_range(1, row_words, 1 << 13, parallel, [&](int64_t, int64_t begin, int64_t end) {
    const int64_t stop = std::min(n, end * 32);
    // Spans of at most one chunk and 4096 values: every row's part stays in cache.
    for (int64_t i = begin * 32; i < stop;) {
      const int64_t span_end = std::min({stop, (i / chunk + 1) * chunk, i + 4096});
      for (int64_t row = 0; row < rows; ++row) {
        sign_detail::decode_range(words + row * row_words, scales + row * row_chunks, chunk, i, span_end,
                                  [&](int64_t first, const float* values, int64_t count) {
                                    float* out = x + first;
                                    if (row == 0) {
                                      for (int64_t k = 0; k < count; ++k) out[k] = 0.0f + values[k];
                                    } else {
                                      for (int64_t k = 0; k < count; ++k) out[k] = out[k] + values[k];
                                    }
                                  });
      }
      i = span_end;
    }
  });
  return Status();
}

}  // namespace jaxcomp
