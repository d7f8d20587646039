// The bit-plane decoder of zfp_block.h (decode_planes) for the 8 blocks of a group at rates 3-16
// (blocks of at most 64 bits), CPU only; the mirror of kernels/zfp_planes_encode.h. The first
// four or six planes are decoded with two or three pair-table lookups; once n == 4 the rest of
// the block is plane nibbles verbatim, which a fixed bit permutation turns into the
// coefficients' bits. Table lookups go block by block, everything else on all 8 blocks at once
// (8-lane vectors, as in kernels/zfp_lanes.h), and no step but the rare one branches on the
// data. Blocks still testing groups after the pairs, or whose group-testing codes the budget
// cuts, continue one plane at a time (exactly as decode_plane does at the budget's end, from a
// table).
#pragma once

#include <stdint.h>
#include <string.h>

#include "kernels/zfp_block.h"
#include "kernels/zfp_lanes.h"

namespace jaxcomp {
namespace zfp {

// A block's decoding state: planes k, k - 1, ... decoded so far.
struct PlaneDecode {
  uint64_t stream;   // the block's coefficient bits after the planes above k (all zero bits)
  uint64_t nibbles;  // the decoded planes, plane k in nibble 0
  int zeros;         // 31 - k
  int budget;        // bits of `stream` that belong to the block
  int position;      // bits of `stream` read
  int planes;        // planes decoded
  int n;             // significant coefficients
};

// decode_plane for every n, budget `left` below 8 (7 holds any plane's code) and next 7 stream
// bits: plane | length << 4 | next_n << 8. 10 KB.
struct PlaneDecodeTable {
  uint16_t entry[5 * 8 * 128];
};

constexpr PlaneDecodeTable make_plane_decode_table() {
  PlaneDecodeTable t{};
  for (int n = 0; n <= 4; ++n) {
    for (int left = 0; left < 8; ++left) {
      for (uint32_t stream = 0; stream < 128; ++stream) {
        int length = 0, next_n = 0;
        const uint32_t plane = decode_plane(stream, n, left, &length, &next_n);
        t.entry[(n * 8 + left) * 128 + stream] = static_cast<uint16_t>(plane | length << 4 | next_n << 8);
      }
    }
  }
  return t;
}

inline constexpr PlaneDecodeTable kPlaneDecodeTable = make_plane_decode_table();

// Decodes planes one at a time, exactly as decode_planes reads them at the budget's end, until
// n == 4 or the budget is spent. False where that takes more than 14 planes (the caller then
// uses decode_planes).
inline bool finish_group_planes(PlaneDecode* d) {
  while (d->n < 4 && d->position < d->budget) {
    if (d->planes >= 14) return false;
    const int left = d->budget - d->position;
    const uint32_t stream = static_cast<uint32_t>(d->stream >> d->position) & 0x7Fu;
    const uint32_t entry = kPlaneDecodeTable.entry[(d->n * 8 + (left < 7 ? left : 7)) * 128 + stream];
    d->nibbles |= static_cast<uint64_t>(entry & 0xFu) << (4 * d->planes);
    d->planes += 1;
    d->position += (entry >> 4) & 0xF;
    d->n = static_cast<int>(entry >> 8);
  }
  return true;
}

// Pair lookups every block takes: n == 4 after four planes for 9 of 10 real blocks, after six for
// 19 of 20. Above 24 bits (rates 9-16) three pairs; at rate 8 a third rarely fits the budget and
// costs more than it saves.
constexpr int kMaxPairSteps = 3;
inline int pair_steps(int bits) { return bits > 24 ? 3 : 2; }

// The 8 blocks' states (lane j = block j), as arrays the vector steps load whole.
struct DecodeLanes {
  alignas(32) uint64_t stream[kLanes];   // PlaneDecode::stream
  alignas(32) uint64_t nibbles[kLanes];  // PlaneDecode::nibbles
  alignas(32) uint32_t pairs[kMaxPairSteps][kLanes];  // pair-table entries of planes k - 2s, k - 2s - 1
  alignas(32) int32_t zeros[kLanes];     // PlaneDecode::zeros (64 where the stream is all zeros)
  alignas(32) int32_t budget[kLanes];
  alignas(32) int32_t position[kLanes];
  alignas(32) int32_t planes[kLanes];
  alignas(32) int32_t n[kLanes];
  alignas(32) int32_t rare[kLanes];     // -1: n < 4 after the pair lookups
  alignas(32) int32_t empty[kLanes];    // -1: no plane within the budget, all coefficients 0
};

// Step 1, block by block: the planes above k, then `steps` pair lookups, each where the one
// before leaves the stream.
JAXCOMP_CPU_INLINE void lookup_first_planes(const uint64_t* streams, int steps, const CodeTables& tables,
                                            DecodeLanes* d) {
  for (int j = 0; j < kLanes; ++j) {
    const int zeros = streams[j] ? __builtin_ctzll(streams[j]) : 64;  // planes above k: 0 bits
    const uint64_t stream = streams[j] >> (zeros < 32 ? zeros : 0);
    d->zeros[j] = zeros;
    d->stream[j] = stream;
    uint32_t n = 0;
    int position = 0;
    for (int step = 0; step < steps; ++step) {
      const uint32_t entry = tables.decode_pair[n * 1024 + ((stream >> position) & 0x3FFu)];
      d->pairs[step][j] = entry;
      n = entry >> 12;
      position += (entry >> 8) & 0xF;
    }
  }
}

// Step 2, all blocks at once: a pair counts where the ones before it count and leave n < 4 (else
// verbatim follows) and its code lies within the budget (else the rare step redoes it).
JAXCOMP_CPU_INLINE void keep_first_planes(int bits, int steps, DecodeLanes* d) {
  const I32x8 zeros_in = (I32x8)load_lanes(d->zeros);
  const I32x8 empty = (zeros_in >= 32) | (zeros_in >= bits);
  const I32x8 zeros = zeros_in & ~empty, budget = (bits - zeros) & ~empty;
  I32x8 taken = ~empty, nibbles = {}, position = {}, planes = {}, n = {};
  for (int step = 0; step < steps; ++step) {
    const I32x8 entry = (I32x8)load_lanes(d->pairs[step]);
    const I32x8 length = (entry >> 8) & 0xF;
    taken &= (n < 4) & (length != 0) & (position + length <= budget);
    nibbles |= (entry & 0xFF) << (8 * step) & taken;
    position += length & taken;
    planes += 2 & taken;
    n = (n & ~taken) | ((entry >> 12) & taken);
  }
  store_lanes((U32x8)zeros, d->zeros);
  store_lanes((U32x8)budget, d->budget);
  store_lanes((U32x8)position, d->position);
  store_lanes((U32x8)planes, d->planes);
  store_lanes((U32x8)n, d->n);
  store_lanes((U32x8)(~empty & (n < 4)), d->rare);
  store_lanes((U32x8)empty, d->empty);
  for (int half = 0; half < 2; ++half) {
    const U64x4 wide = widen_half((U32x8)nibbles, half);
    memcpy(d->nibbles + 4 * half, &wide, sizeof wide);
  }
}

// Step 3, the rare blocks one by one. Returns a mask of the blocks left to decode_planes.
JAXCOMP_CPU_INLINE uint32_t finish_rare_lanes(DecodeLanes* d) {
  uint32_t general = 0;
  for (int j = 0; j < kLanes; ++j) {
    if (!d->rare[j]) continue;
    PlaneDecode p = {d->stream[j], d->nibbles[j], d->zeros[j], d->budget[j], d->position[j], d->planes[j], d->n[j]};
    if (!finish_group_planes(&p)) general |= 1u << j;
    d->nibbles[j] = p.nibbles;
    d->position[j] = p.position;
    d->planes[j] = p.planes;
  }
  return general;
}

// Step 4, all blocks at once: the rest of the budget is verbatim planes, down to plane 0 (zfp
// skips what the budget holds beyond it); the first 16 planes go through
// planes_to_coefficients, 8 at a time. Returns a mask of the blocks with more planes (or planes
// below 0), left to decode_planes.
JAXCOMP_CPU_INLINE uint32_t verbatim_lanes(const DecodeLanes& d, U32x8* u) {
  const I32x8 zeros = (I32x8)load_lanes(d.zeros), planes = (I32x8)load_lanes(d.planes);
  const I32x8 empty = (I32x8)load_lanes(d.empty);
  const I32x8 room = 4 * (32 - zeros - planes), rest = (I32x8)load_lanes(d.budget) - (I32x8)load_lanes(d.position);
  const I32x8 fits = rest < room;
  I32x8 verbatim = (rest & fits) | (room & ~fits);
  verbatim &= verbatim > 0;
  const I32x8 total = planes + ((verbatim + 3) >> 2);
  const I32x8 general = ~empty & ((total > 16) | (planes > 32 - zeros));
  U64x4 low[2];
  for (int half = 0; half < 2; ++half) {
    U64x4 stream, nibbles;
    memcpy(&stream, d.stream + 4 * half, sizeof stream);
    memcpy(&nibbles, d.nibbles + 4 * half, sizeof nibbles);
    const U64x4 one = {1, 1, 1, 1};
    const U64x4 bits = (stream >> widen_half(load_lanes(d.position), half)) & ((one << widen_half((U32x8)verbatim, half)) - 1);
    low[half] = nibbles | bits << widen_half((U32x8)(4 * planes), half);
  }
  const U32x8 first = planes_to_coefficients(narrow_halves(low[0], low[1], false));
  const U32x8 second = planes_to_coefficients(narrow_halves(low[0], low[1], true));
  // Coefficient i's bits of plane j at bit 31 - j, then shifted to bit k - j.
  for (int i = 0; i < 4; ++i) {
    const U32x8 top = ((first >> (8 * i)) & 0xFFu) << 24 | ((second >> (8 * i)) & 0xFFu) << 16;
    u[i] = (top >> (U32x8)zeros) & (U32x8)~empty;
  }
  return lane_bits(general);
}

// decode_planes(bits) of the 8 blocks whose coefficient bits are streams[j] (bit 0 first; bits at
// and past `bits` are ignored), bits <= 64 - kHeaderBits: u[i] = coefficient i of each block.
JAXCOMP_CPU_INLINE void decode_planes_lanes(const uint64_t* streams, int bits, const CodeTables& tables, U32x8* u) {
  DecodeLanes d;
  const int steps = pair_steps(bits);
  lookup_first_planes(streams, steps, tables, &d);
  keep_first_planes(bits, steps, &d);
  const uint32_t general = finish_rare_lanes(&d) | verbatim_lanes(d, u);
  if (general == 0) return;
  alignas(32) uint32_t lanes[4][kLanes];
  for (int i = 0; i < 4; ++i) store_lanes(u[i], lanes[i]);
  for (int j = 0; j < kLanes; ++j) {
    if (!(general >> j & 1u)) continue;
    BlockReader64 in(streams[j]);
    uint32_t block[4];
    decode_planes(in, bits, tables, block);
    for (int i = 0; i < 4; ++i) lanes[i][j] = block[i];
  }
  for (int i = 0; i < 4; ++i) u[i] = load_lanes(lanes[i]);
}

}  // namespace zfp
}  // namespace jaxcomp
