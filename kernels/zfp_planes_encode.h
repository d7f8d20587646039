// The bit-plane encoder of zfp_block.h (encode_planes) for the 8 blocks of a group at rates 3-16
// (blocks of at most 64 bits), CPU only. It rests on two facts about zfp's embedded code:
//   * a fixed-rate block is the first `bits` bits of the block's unbounded code, and
//   * once all 4 coefficients are significant (n == 4), every plane is its 4 bits verbatim,
// which holds after two planes for 2/3 of real blocks and after eight for 99 in 100. So planes
// k .. k - 15 are moved into nibbles (plane k in the low nibble) by a fixed bit permutation, the
// first eight are coded with four pair-table lookups whatever they hold (the n == 4 rows of the
// table are the verbatim code), and the next eight follow verbatim. Only the table lookups go
// block by block; no step branches on the data. The few blocks that need more go through
// encode_planes.
#pragma once

#include <stdint.h>
#include <string.h>

#include "kernels/zfp_block.h"
#include "kernels/zfp_lanes.h"

namespace jaxcomp {
namespace zfp {

// Pair lookups every block takes (8 planes).
constexpr int kEncodePairSteps = 4;

// Nibble j = plane k - 8 * chunk - j of each block (bit i = coefficient i), from the coefficients
// shifted so that plane k is bit 31.
JAXCOMP_CPU_INLINE U32x8 plane_nibbles_lanes(const U32x8* top, int chunk) {
  const int shift = 8 * chunk;  // byte i = coefficient i's bits of the chunk's planes
  const U32x8 bytes = ((top[0] << shift) >> 24) | (((top[1] << shift) >> 16) & 0xFF00u) |
                      (((top[2] << shift) >> 8) & 0xFF0000u) | ((top[3] << shift) & 0xFF000000u);
  return coefficients_to_planes(bytes);
}

// Block by block: the pair-table entries of planes k .. k - 7 (from `nibbles`), each pair from the
// n the one before leaves.
JAXCOMP_CPU_INLINE void lookup_plane_pairs(const U32x8& nibbles, const CodeTables& tables,
                                           uint32_t (*pairs)[kLanes]) {
  alignas(32) uint32_t planes[kLanes];
  store_lanes(nibbles, planes);
  for (int j = 0; j < kLanes; ++j) {
    uint32_t n = 0;
    for (int step = 0; step < kEncodePairSteps; ++step) {
      const uint32_t entry = tables.encode_pair[n * 256 + ((planes[j] >> (8 * step)) & 0xFFu)];
      pairs[step][j] = entry;
      n = entry >> 24;
    }
  }
}

// The blocks whose code the pairs and the verbatim planes do not cover (bit j of `lanes`), with
// encode_planes. (Not inlined: vectors go by pointer, as the ABI of a vector argument depends on
// the ISA each side is compiled for.)
inline void encode_rare_codes(const U32x8* u, int bits, uint32_t lanes, const CodeTables& tables, uint64_t* codes) {
  alignas(32) uint32_t coefficients[4][kLanes];
  for (int i = 0; i < 4; ++i) store_lanes(u[i], coefficients[i]);
  for (int j = 0; j < kLanes; ++j) {
    if (!(lanes >> j & 1u)) continue;
    const uint32_t block[4] = {coefficients[0][j], coefficients[1][j], coefficients[2][j], coefficients[3][j]};
    BlockWriter64 general;
    encode_planes(block, bits, tables, general);
    codes[j] = general.bits;
  }
}

// encode_planes(u, bits) of the 8 blocks (u[i] = coefficient i of each block), bits <= 64 -
// kHeaderBits: codes[j] = block j's code in its low `bits` bits.
JAXCOMP_CPU_INLINE void encode_planes_lanes(const U32x8* u, int bits, const CodeTables& tables, uint64_t* codes) {
  const U32x8 any = u[0] | u[1] | u[2] | u[3];
  const I32x8 zeros = leading_zeros_lanes(any) & (any != 0u);  // planes above k: one 0 bit each
  U32x8 top[4];
  for (int i = 0; i < 4; ++i) top[i] = u[i] << (U32x8)zeros;
  const U32x8 first = plane_nibbles_lanes(top, 0), second = plane_nibbles_lanes(top, 1);
  alignas(32) uint32_t pairs[kEncodePairSteps][kLanes];
  lookup_plane_pairs(first, tables, pairs);
  // Each pair's code after the ones before it, then planes k - 8 .. k - 15 verbatim.
  U32x8 length = {};
  U64x4 code[2] = {};
  for (int step = 0; step < kEncodePairSteps; ++step) {
    const U32x8 entry = load_lanes(pairs[step]);
    for (int half = 0; half < 2; ++half) code[half] |= widen_half(entry & 0xFFFFu, half) << widen_half(length, half);
    length += (entry >> 16) & 0xFFu;
  }
  const uint64_t mask = low_bits64(~uint64_t{0}, bits);
  for (int half = 0; half < 2; ++half) {
    code[half] |= widen_half(second, half) << widen_half(length, half);  // length <= 56
    code[half] = (code[half] << widen_half((U32x8)zeros, half)) & mask;
  }
  memcpy(codes, code, sizeof code);
  // Still testing groups after 8 planes, or 8 verbatim planes too few for the budget.
  const I32x8 n = (I32x8)(load_lanes(pairs[kEncodePairSteps - 1]) >> 24), budget = bits - zeros;
  const I32x8 rare = (any != 0u) & ((I32x8)length < budget) & ((n < 4) | ((I32x8)length + 32 < budget));
  const uint32_t rare_lanes = lane_bits(rare);
  if (rare_lanes != 0) encode_rare_codes(u, bits, rare_lanes, tables, codes);
}

}  // namespace zfp
}  // namespace jaxcomp
