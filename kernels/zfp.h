// Row drivers of the ZFP-style fixed-rate codec (docs/kernels.md): encode/decode `rows x n`
// float32 values to/from `rows x zfp_num_words(n, rate)` uint32 words, in parallel.
//
// Work is cut into groups of 8 blocks: 8 blocks x 4 * rate bits = `rate` whole words, so every
// task writes whole words that no other task touches.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <new>
#include <string>

#include "kernels/parallel.h"
#include "kernels/status.h"
#include "kernels/zfp_block.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(JAXCOMP_ZFP_BASELINE_ONLY)
#define JAXCOMP_ZFP_GROUPS 1
#include "kernels/zfp_groups.h"
#endif

namespace jaxcomp {

inline constexpr zfp::CodeTables kZfpCodeTables = zfp::make_code_tables();

// Blocks per group: one group is `rate` whole words.
constexpr int64_t kZfpGroupBlocks = 8;

// Words per row of `n` floats (the layout of kernels/zfp_block.h).
inline int64_t zfp_num_words(int64_t n, int rate) { return zfp::row_words(n, rate); }

namespace zfp_detail {

inline Status check(int64_t rows, int64_t n, int rate) {
  if (rate < 1 || rate > 32) return Status::InvalidArgument("rate must be in [1, 32], got " + std::to_string(rate));
  if (rows < 0) return Status::InvalidArgument("rows must be >= 0, got " + std::to_string(rows));
  if (n < 1 || n > INT32_MAX) return Status::InvalidArgument("n must be in [1, 2^31 - 1], got " + std::to_string(n));
  return Status();
}

// Runs body(row, first_group, end_group) over every row's groups, cut into tasks of about equal
// size (a task may span rows).
template <typename Body>
void for_each_group_range(int64_t rows, int64_t groups_per_row, const Parallel& parallel, const Body& body) {
  const int64_t total = rows * groups_per_row;
  if (total == 0) return;
  // Small inputs run on the caller: waking threads costs more than a few thousand blocks.
  constexpr int64_t kGroupsPerTask = 2048;
  const int64_t tasks = std::max<int64_t>(1, std::min(parallel.concurrency * 4, total / kGroupsPerTask));
  auto task = [&](int64_t t) {
    int64_t begin, end;
    split_range(total, tasks, t, 1, &begin, &end);
    while (begin < end) {
      const int64_t row = begin / groups_per_row;
      const int64_t first = begin - row * groups_per_row;
      const int64_t stop = std::min(groups_per_row, first + (end - begin));
      body(row, first, stop);
      begin += stop - first;
    }
  };
  parallel.run(tasks, task);
}

// Appends a block built in a register to the group's stream.
inline void append(const zfp::BlockWriter64& block, int block_bits, zfp::BitWriter& out) {
  const int low = block_bits < 32 ? block_bits : 32;
  out.write(static_cast<uint32_t>(block.bits), low);
  if (block_bits > 32) out.write(static_cast<uint32_t>(block.bits >> 32), block_bits - 32);
}

// Rates 3-16 on x86-64 CPUs with AVX2 take the group path (kernels/zfp_groups.h, 8 blocks at a
// time), compiled here for AVX2 and chosen at run time, so a wheel built for any x86-64 uses it
// where it can. Elsewhere, and at the other rates, the per-block path: without AVX2's per-lane
// shifts the group path's vectors are emulated and slower than that. (Defining
// JAXCOMP_ZFP_BASELINE_ONLY leaves the group path out; the sanitizer build tests the per-block
// path that way.)
#if defined(JAXCOMP_ZFP_GROUPS)
__attribute__((target("avx2"))) inline void encode_groups(const float* row, int64_t n, int64_t first, int64_t stop,
                                                           int rate, uint32_t* row_out) {
  zfp::encode_group_range(row, n, first, stop, rate, row_out, kZfpCodeTables);
}

__attribute__((target("avx2"))) inline void decode_groups(const uint32_t* row_in, int64_t row_words, int64_t n,
                                                           int64_t first, int64_t stop, int rate, float* row) {
  zfp::decode_group_range(row_in, row_words, n, first, stop, rate, row, kZfpCodeTables);
}

inline bool use_groups(int rate) {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2 && zfp::has_group_path(rate);
}
#endif

}  // namespace zfp_detail

// Encodes `rows` rows of `n` floats (row-major) into `rows * zfp_num_words(n, rate)` words.
inline Status zfp_encode(const float* x, int64_t rows, int64_t n, int rate, uint32_t* words,
                            const Parallel& parallel) {
  if (Status s = zfp_detail::check(rows, n, rate); !s.ok()) return s;
  const zfp::CodeTables& tables = kZfpCodeTables;
  const int64_t blocks = (n + 3) / 4;
  const int64_t groups = (blocks + kZfpGroupBlocks - 1) / kZfpGroupBlocks;
  const int64_t row_words = zfp_num_words(n, rate);
  const int block_bits = 4 * rate;

#if defined(JAXCOMP_ZFP_GROUPS)
  if (zfp_detail::use_groups(rate)) {
    zfp_detail::for_each_group_range(rows, groups, parallel, [&](int64_t row, int64_t first, int64_t stop) {
      zfp_detail::encode_groups(x + row * n, n, first, stop, rate, words + row * row_words);
    });
    return Status();
  }
#endif
  if (rate >= 3) {
    zfp_detail::for_each_group_range(rows, groups, parallel, [&](int64_t row, int64_t first, int64_t stop) {
      const float* values = x + row * n;
      zfp::BitWriter out(words + row * row_words, first * kZfpGroupBlocks * block_bits);
      const int64_t end_block = std::min(blocks, stop * kZfpGroupBlocks);
      uint32_t value_bits[4];
      for (int64_t b = first * kZfpGroupBlocks; b < end_block; ++b) {
        zfp::load_block(values, n, b, value_bits);
        if (block_bits <= 64) {
          zfp::BlockWriter64 block;
          zfp::encode_block(value_bits, block_bits, tables, block);
          zfp_detail::append(block, block_bits, out);
        } else {
          zfp::encode_block(value_bits, block_bits, tables, out);
        }
      }
      out.flush();
    });
    return Status();
  }

  // Rates 1-2: first every row's largest magnitude key (the row exponent), then the blocks.
  std::unique_ptr<std::atomic<uint32_t>[]> row_max(new (std::nothrow) std::atomic<uint32_t>[rows]);
  if (!row_max) return Status::ResourceExhausted("zfp_encode: out of memory for the row exponents");
  for (int64_t r = 0; r < rows; ++r) row_max[r].store(0, std::memory_order_relaxed);
  zfp_detail::for_each_group_range(rows, groups, parallel, [&](int64_t row, int64_t first, int64_t stop) {
    const float* values = x + row * n;
    const int64_t end = std::min(n, stop * kZfpGroupBlocks * 4);
    uint32_t local = 0;
    for (int64_t i = first * kZfpGroupBlocks * 4; i < end; ++i) {
      local = std::max(local, zfp::magnitude_key(zfp::float_bits(values[i])));
    }
    uint32_t seen = row_max[row].load(std::memory_order_relaxed);
    while (seen < local && !row_max[row].compare_exchange_weak(seen, local, std::memory_order_relaxed)) {
    }
  });
  zfp_detail::for_each_group_range(rows, groups, parallel, [&](int64_t row, int64_t first, int64_t stop) {
    const float* values = x + row * n;
    uint32_t* row_out = words + row * row_words;
    const uint32_t header = zfp::row_header(row_max[row].load(std::memory_order_relaxed));
    if (first == 0) row_out[0] = header;
    zfp::BitWriter out(row_out, 32 + first * kZfpGroupBlocks * block_bits);
    const int64_t end_block = std::min(blocks, stop * kZfpGroupBlocks);
    const int64_t first_block = first * kZfpGroupBlocks;
    if (header == 0 || header == zfp::kNonFiniteRowHeader) {
      for (int64_t b = first_block; b < end_block; ++b) out.pad(block_bits);
    } else {
      const int emax = static_cast<int>(header) - 127;
      uint32_t value_bits[4];
      for (int64_t b = first_block; b < end_block; ++b) {
        zfp::load_block(values, n, b, value_bits);
        zfp::BlockWriter64 block;
        zfp::encode_coefficients(value_bits, emax, block_bits, tables, block);
        zfp_detail::append(block, block_bits, out);
      }
    }
    out.flush();
  });
  return Status();
}

// Decodes `rows * zfp_num_words(n, rate)` words into `rows` rows of `n` floats.
inline Status zfp_decode(const uint32_t* words, int64_t rows, int64_t n, int rate, float* x,
                            const Parallel& parallel) {
  if (Status s = zfp_detail::check(rows, n, rate); !s.ok()) return s;
  const zfp::CodeTables& tables = kZfpCodeTables;
  const int64_t blocks = (n + 3) / 4;
  const int64_t groups = (blocks + kZfpGroupBlocks - 1) / kZfpGroupBlocks;
  const int64_t row_words = zfp_num_words(n, rate);
  const int block_bits = 4 * rate;
  const int64_t header_bits = 32 * zfp::header_words(rate);

#if defined(JAXCOMP_ZFP_GROUPS)
  if (zfp_detail::use_groups(rate)) {
    zfp_detail::for_each_group_range(rows, groups, parallel, [&](int64_t row, int64_t first, int64_t stop) {
      zfp_detail::decode_groups(words + row * row_words, row_words, n, first, stop, rate, x + row * n);
    });
    return Status();
  }
#endif
  zfp_detail::for_each_group_range(rows, groups, parallel, [&](int64_t row, int64_t first, int64_t stop) {
    const uint32_t* row_in = words + row * row_words;
    float* values = x + row * n;
    const int64_t first_block = first * kZfpGroupBlocks;
    const int64_t end_block = std::min(blocks, stop * kZfpGroupBlocks);
    float decoded[4];
    auto store = [&](int64_t b) {
      float* out = values + b * 4;
      if (b * 4 + 4 <= n) {
        for (int i = 0; i < 4; ++i) out[i] = decoded[i];
      } else {  // the row's partial last block
        for (int64_t i = 0; i < n - b * 4; ++i) out[i] = decoded[i];
      }
    };
    if (rate >= 3 && block_bits <= 64) {
      for (int64_t b = first_block; b < end_block; ++b) {
        zfp::BlockReader64 block(row_in, row_words, b * block_bits);
        zfp::decode_block(block, block_bits, tables, decoded);
        store(b);
      }
      return;
    }
    if (rate >= 3) {  // blocks over 64 bits: stream through the group
      zfp::BitReader in(row_in, row_words, first_block * block_bits);
      for (int64_t b = first_block; b < end_block; ++b) {
        zfp::decode_block(in, block_bits, tables, decoded);
        store(b);
      }
      return;
    }
    const uint32_t header = row_in[0];
    if (header == 0 || header > 0xFF) {
      const float fill = header == 0 ? 0.0f : zfp::bits_float(0x7FC00000u);
      for (int i = 0; i < 4; ++i) decoded[i] = fill;
      for (int64_t b = first_block; b < end_block; ++b) store(b);
      return;
    }
    const int emax = static_cast<int>(header) - 127;
    for (int64_t b = first_block; b < end_block; ++b) {
      zfp::BlockReader64 block(row_in, row_words, header_bits + b * block_bits);
      zfp::decode_coefficients(block, emax, block_bits, tables, decoded);
      store(b);
    }
  });
  return Status();
}

}  // namespace jaxcomp
