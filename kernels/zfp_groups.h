// Rates 3-16 on the CPU, one group of 8 blocks (`rate` whole words) at a time: the block
// transform runs across the group's blocks (kernels/zfp_lanes.h), and so do the bit-plane coders
// but for their table lookups (kernels/zfp_planes_encode.h, kernels/zfp_planes_decode.h). The
// words are those of zfp_block.h's encode_block / decode_block, bit for bit.
//
// kernels/zfp.h compiles the range functions for AVX2 and calls them where the CPU has it (the
// vectors' per-lane shifts need AVX2 to be fast); other CPUs take the per-block path.
#pragma once

#include <stdint.h>
#include <string.h>

#include "kernels/zfp_block.h"
#include "kernels/zfp_lanes.h"
#include "kernels/zfp_planes_decode.h"
#include "kernels/zfp_planes_encode.h"

namespace jaxcomp {
namespace zfp {

// Rates with a group path: every block has its own header and fits in 64 bits.
inline bool has_group_path(int rate) { return rate >= 3 && rate <= 16; }

// The 32 values of group `group` of a row of n values as bits; blocks past the row's end are
// zeros, a partial last block is padded like load_block.
JAXCOMP_CPU_INLINE int load_group(const float* row, int64_t n, int64_t group, uint32_t* value_bits) {
  const int64_t first_block = group * kLanes;
  if (first_block * 4 + 4 * kLanes <= n) {
    memcpy(value_bits, row + first_block * 4, 4 * kLanes * sizeof(float));
    return kLanes;
  }
  const int64_t blocks = (n + 3) / 4 - first_block;
  const int count = blocks < kLanes ? static_cast<int>(blocks) : kLanes;
  for (int j = 0; j < count; ++j) load_block(row, n, first_block + j, value_bits + 4 * j);
  for (int j = count * 4; j < 4 * kLanes; ++j) value_bits[j] = 0;
  return count;
}

// The blocks' headers from their largest magnitude keys (encode_block's cases, all at once):
// kNonFiniteHeader, 0 for a zero block, else the flag and the biased exponent emax + 127.
JAXCOMP_CPU_INLINE U32x8 block_headers(const U32x8& key) {
  const U32x8 finite = (U32x8)(key < kNonFiniteKey), nonzero = (U32x8)(key != 0u);
  const U32x8 coded = 2u * ((key >> 23) + 1u) + 1u;  // emax = (key >> 23) - 126
  return (coded & finite & nonzero) | (kNonFiniteHeader & ~finite);
}

// Stores a group's `count` blocks at group `group` of a row. Rates 8 and 16 (blocks of one or
// two whole words) store words directly; other rates go through a BitWriter.
JAXCOMP_CPU_INLINE void store_group_blocks(const uint64_t* blocks, int count, int block_bits, int64_t group,
                                           uint32_t* row_out) {
  uint32_t* words = row_out + group * kLanes * block_bits / 32;
  if (count == kLanes && block_bits == 32) {
    for (int j = 0; j < kLanes; ++j) words[j] = static_cast<uint32_t>(blocks[j]);
  } else if (count == kLanes && block_bits == 64) {
    for (int j = 0; j < kLanes; ++j) {
      words[2 * j] = static_cast<uint32_t>(blocks[j]);
      words[2 * j + 1] = static_cast<uint32_t>(blocks[j] >> 32);
    }
  } else {
    BitWriter out(words, 0);
    for (int j = 0; j < count; ++j) {
      out.write(static_cast<uint32_t>(blocks[j]), block_bits < 32 ? block_bits : 32);
      if (block_bits > 32) out.write(static_cast<uint32_t>(blocks[j] >> 32), block_bits - 32);
    }
    out.flush();  // a group ends on a word boundary, or is the row's last
  }
}

// Encodes groups [first, stop) of a row of n values into the row's words `row_out`.
JAXCOMP_CPU_INLINE void encode_group_range(const float* row, int64_t n, int64_t first, int64_t stop, int rate,
                                           uint32_t* row_out, const CodeTables& tables) {
  const int block_bits = 4 * rate;
  for (int64_t group = first; group < stop; ++group) {
    alignas(32) uint32_t value_bits[4 * kLanes];
    const int count = load_group(row, n, group, value_bits);
    U32x8 key, u[4];
    forward_transform_lanes(value_bits, &key, u);
    alignas(32) uint64_t codes[kLanes];
    encode_planes_lanes(u, block_bits - kHeaderBits, tables, codes);
    alignas(32) uint32_t headers[kLanes];
    store_lanes(block_headers(key), headers);
    alignas(32) uint64_t blocks[kLanes];
    for (int j = 0; j < kLanes; ++j) {  // a code follows flag 1 with a nonzero exponent field
      blocks[j] = headers[j] | ((headers[j] & 0x1FEu) ? codes[j] << kHeaderBits : 0u);
    }
    store_group_blocks(blocks, count, block_bits, group, row_out);
  }
}

// A group's blocks, each in the low bits of a 64-bit lane (lanes past `count` are 0).
JAXCOMP_CPU_INLINE void load_group_blocks(const uint32_t* row_in, int64_t row_words, int64_t group, int count,
                                          int block_bits, uint64_t* blocks) {
  const uint32_t* words = row_in + group * kLanes * block_bits / 32;
  if (count == kLanes && block_bits == 32) {
    for (int j = 0; j < kLanes; ++j) blocks[j] = words[j];
  } else if (count == kLanes && block_bits == 64) {
    for (int j = 0; j < kLanes; ++j) blocks[j] = words[2 * j] | static_cast<uint64_t>(words[2 * j + 1]) << 32;
  } else {
    for (int j = 0; j < kLanes; ++j) {
      blocks[j] = j < count ? BlockReader64(row_in, row_words, (group * kLanes + j) * block_bits).bits : 0;
    }
  }
}

// What decode_group_blocks found in each block, for the inverse transform.
struct GroupHeaders {
  U32x8 coefficients[4];  // vector i = coefficient i of each block
  I32x8 fast_emax;        // emax, or 0 where the lane's values are patched
  alignas(32) int32_t emax[kLanes];  // 0 for blocks without code
  alignas(32) int32_t nan[kLanes];   // -1: a block zfp never writes (flag 1, exponent field 0)
  uint32_t patched;                  // bit j: lane j is patched (patch_group_values)
};

// Reads the `count` blocks of group `group` of a row (rates 3-16); lanes past them are zeros.
JAXCOMP_CPU_INLINE void decode_group_blocks(const uint32_t* row_in, int64_t row_words, int64_t group, int count,
                                            int rate, const CodeTables& tables, GroupHeaders* g) {
  const int block_bits = 4 * rate;
  alignas(32) uint64_t blocks[kLanes];
  load_group_blocks(row_in, row_words, group, count, block_bits, blocks);
  U64x4 halves[2];
  memcpy(halves, blocks, sizeof halves);
  const U32x8 low = narrow_halves(halves[0], halves[1], false);
  const I32x8 flag = (low & 1u) != 0u, biased = (I32x8)((low >> 1) & 0xFFu);
  const I32x8 coded = flag & (biased != 0), nan = flag & (biased == 0);
  const I32x8 emax = (biased - 127) & coded, fast = emax >= kMinFastExponent;
  g->fast_emax = emax & fast;
  store_lanes((U32x8)emax, g->emax);
  store_lanes((U32x8)nan, g->nan);
  g->patched = lane_bits(nan | ~fast);
  alignas(32) uint64_t streams[kLanes];
  for (int half = 0; half < 2; ++half) {  // no bits: four zero coefficients
    const U64x4 stream = (halves[half] >> kHeaderBits) & widen_mask_half(coded, half);
    memcpy(streams + 4 * half, &stream, sizeof stream);
  }
  decode_planes_lanes(streams, block_bits - kHeaderBits, tables, g->coefficients);
}

// Lanes the vector inverse does not cover: NaN blocks, and exponents below kMinFastExponent
// (scaled with dequantize, as decode_coefficients does).
JAXCOMP_CPU_INLINE void patch_group_values(const GroupHeaders& g, float* values) {
  if (g.patched == 0) return;
  alignas(32) uint32_t coefficients[4][kLanes];
  for (int i = 0; i < 4; ++i) store_lanes(g.coefficients[i], coefficients[i]);
  for (int j = 0; j < kLanes; ++j) {
    if (g.nan[j]) {
      for (int i = 0; i < 4; ++i) values[4 * j + i] = bits_float(0x7FC00000u);
    } else if (g.emax[j] < kMinFastExponent) {
      int32_t q[4];
      for (int i = 0; i < 4; ++i) q[i] = from_negabinary(coefficients[i][j]);
      inverse_lift(q);
      for (int i = 0; i < 4; ++i) values[4 * j + i] = dequantize(q[i], g.emax[j]);
    }
  }
}

// Decodes groups [first, stop) of a row of n values from the row's words into `row`.
JAXCOMP_CPU_INLINE void decode_group_range(const uint32_t* row_in, int64_t row_words, int64_t n, int64_t first,
                                           int64_t stop, int rate, float* row, const CodeTables& tables) {
  const int64_t blocks = (n + 3) / 4;
  for (int64_t group = first; group < stop; ++group) {
    const int64_t left = blocks - group * kLanes;
    const int count = left < kLanes ? static_cast<int>(left) : kLanes;
    GroupHeaders g;
    decode_group_blocks(row_in, row_words, group, count, rate, tables, &g);
    alignas(32) float values[4 * kLanes];
    inverse_transform_lanes(g.coefficients, g.fast_emax, values);
    patch_group_values(g, values);
    const int64_t first_value = group * kLanes * 4;
    if (n - first_value >= 4 * kLanes) {
      memcpy(row + first_value, values, sizeof values);  // a fixed size: four vector stores
    } else {  // the row's last group
      memcpy(row + first_value, values, static_cast<size_t>(n - first_value) * sizeof(float));
    }
  }
}

}  // namespace zfp
}  // namespace jaxcomp
