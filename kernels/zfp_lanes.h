// The block transform of kernels/zfp_block.h on eight blocks at once (CPU only): a group of 8
// blocks is loaded as four 8-lane vectors, lane j holding block j and vector i the blocks' value
// i, so the exponent search, quantization, lifting and negabinary steps run across the blocks
// (GCC/Clang vector extensions, compiled inside kernels/zfp.h's AVX2 functions). Every
// lane computes exactly what the scalar functions of zfp_block.h compute for its block; lanes of
// blocks that take another path (zero, NaN or +-Inf, tiny exponents) compute harmless garbage
// that the caller ignores.
#pragma once

#include <stdint.h>
#include <string.h>

#include "kernels/zfp_block.h"

// Everything here runs once per group inside the caller's loop. Always inlined, so no vector
// crosses a call, whose ABI would depend on the ISA each side is compiled for. (Vector arguments
// go by const reference all the same, and -Wpsabi's warning about returned vectors is off:
// neither says anything about inlined code.)
#define JAXCOMP_CPU_INLINE inline __attribute__((always_inline))
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace jaxcomp {
namespace zfp {

constexpr int kLanes = 8;

typedef uint32_t U32x8 __attribute__((vector_size(32)));
typedef int32_t I32x8 __attribute__((vector_size(32)));
typedef float F32x8 __attribute__((vector_size(32)));
typedef uint32_t U32x4 __attribute__((vector_size(16)));
typedef uint64_t U64x4 __attribute__((vector_size(32)));

#if defined(__clang__)
#define JAXCOMP_SHUFFLE8(a, b, i0, i1, i2, i3, i4, i5, i6, i7) \
  __builtin_shufflevector(a, b, i0, i1, i2, i3, i4, i5, i6, i7)
#else
#define JAXCOMP_SHUFFLE8(a, b, i0, i1, i2, i3, i4, i5, i6, i7) \
  __builtin_shuffle(a, b, I32x8{i0, i1, i2, i3, i4, i5, i6, i7})
#endif

// The four values of 8 consecutive blocks (32 words, block-major) -> vector i = value i of each
// block; transpose_to_blocks is its inverse.
JAXCOMP_CPU_INLINE void transpose_to_lanes(const uint32_t* words, U32x8* v) {
  U32x8 a[4];
  memcpy(a, words, sizeof a);
  // t0: value 0 of blocks 0-3 then value 1 of blocks 0-3, t1: values 2 and 3; t2, t3: blocks 4-7.
  const U32x8 t0 = JAXCOMP_SHUFFLE8(a[0], a[1], 0, 4, 8, 12, 1, 5, 9, 13);
  const U32x8 t1 = JAXCOMP_SHUFFLE8(a[0], a[1], 2, 6, 10, 14, 3, 7, 11, 15);
  const U32x8 t2 = JAXCOMP_SHUFFLE8(a[2], a[3], 0, 4, 8, 12, 1, 5, 9, 13);
  const U32x8 t3 = JAXCOMP_SHUFFLE8(a[2], a[3], 2, 6, 10, 14, 3, 7, 11, 15);
  v[0] = JAXCOMP_SHUFFLE8(t0, t2, 0, 1, 2, 3, 8, 9, 10, 11);
  v[1] = JAXCOMP_SHUFFLE8(t0, t2, 4, 5, 6, 7, 12, 13, 14, 15);
  v[2] = JAXCOMP_SHUFFLE8(t1, t3, 0, 1, 2, 3, 8, 9, 10, 11);
  v[3] = JAXCOMP_SHUFFLE8(t1, t3, 4, 5, 6, 7, 12, 13, 14, 15);
}

// Vector i = value i of each block -> 32 words, block-major.
JAXCOMP_CPU_INLINE void transpose_to_blocks(const U32x8* v, void* words) {
  U32x8 a[4];
  // t0: value 0 and 1 of blocks 0-3 interleaved pairwise, as in transpose_to_lanes backwards.
  const U32x8 t0 = JAXCOMP_SHUFFLE8(v[0], v[1], 0, 8, 1, 9, 2, 10, 3, 11);   // b0v0 b0v1 b1v0 b1v1 ...
  const U32x8 t1 = JAXCOMP_SHUFFLE8(v[2], v[3], 0, 8, 1, 9, 2, 10, 3, 11);   // b0v2 b0v3 b1v2 b1v3 ...
  const U32x8 t2 = JAXCOMP_SHUFFLE8(v[0], v[1], 4, 12, 5, 13, 6, 14, 7, 15);  // blocks 4-7
  const U32x8 t3 = JAXCOMP_SHUFFLE8(v[2], v[3], 4, 12, 5, 13, 6, 14, 7, 15);
  a[0] = JAXCOMP_SHUFFLE8(t0, t1, 0, 1, 8, 9, 2, 3, 10, 11);
  a[1] = JAXCOMP_SHUFFLE8(t0, t1, 4, 5, 12, 13, 6, 7, 14, 15);
  a[2] = JAXCOMP_SHUFFLE8(t2, t3, 0, 1, 8, 9, 2, 3, 10, 11);
  a[3] = JAXCOMP_SHUFFLE8(t2, t3, 4, 5, 12, 13, 6, 7, 14, 15);
  memcpy(words, a, sizeof a);
}

// Array lanes <-> vectors (memcpy: any alignment, no aliasing questions).
template <typename T>
JAXCOMP_CPU_INLINE U32x8 load_lanes(const T* lanes) {
  static_assert(sizeof(T) == 4, "8 lanes of 32 bits");
  U32x8 v;
  memcpy(&v, lanes, sizeof v);
  return v;
}

template <typename T>
JAXCOMP_CPU_INLINE void store_lanes(const U32x8& v, T* lanes) {
  static_assert(sizeof(T) == 4, "8 lanes of 32 bits");
  memcpy(lanes, &v, sizeof v);
}

// Bit j set where lane j of `mask` (lanes 0 or -1) is -1. (Lanes are never read as v[j] in a
// loop: GCC 12's -fsanitize=bounds miscompiles that.)
JAXCOMP_CPU_INLINE uint32_t lane_bits(const I32x8& mask) {
  U32x8 v = (U32x8)mask & U32x8{1, 2, 4, 8, 16, 32, 64, 128};
  v |= JAXCOMP_SHUFFLE8(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v |= JAXCOMP_SHUFFLE8(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v |= JAXCOMP_SHUFFLE8(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
  uint32_t bits;
  memcpy(&bits, &v, sizeof bits);
  return bits;
}

// Lanes 4 * half .. 4 * half + 3 of 8 32-bit lanes, zero-extended to 64 bits. (An interleave
// with zeros: GCC compiles it better than __builtin_convertvector of the half.)
JAXCOMP_CPU_INLINE U64x4 widen_half(const U32x8& v, int half) {
  const U32x8 zero = {};
  return (U64x4)(half ? JAXCOMP_SHUFFLE8(v, zero, 4, 8, 5, 8, 6, 8, 7, 8) : JAXCOMP_SHUFFLE8(v, zero, 0, 8, 1, 8, 2, 8, 3, 8));
}

// Lanes 4 * half .. 4 * half + 3 of a mask (lanes 0 or -1), sign-extended to 64 bits.
JAXCOMP_CPU_INLINE U64x4 widen_mask_half(const I32x8& mask, int half) {
  typedef int32_t I32x4 __attribute__((vector_size(16)));
  typedef int64_t I64x4 __attribute__((vector_size(32)));
  I32x4 part;
  memcpy(&part, reinterpret_cast<const char*>(&mask) + 16 * half, sizeof part);
  return (U64x4)__builtin_convertvector(part, I64x4);
}

// The low (`high` false) or high 32 bits of 8 64-bit lanes held as two vectors.
JAXCOMP_CPU_INLINE U32x8 narrow_halves(const U64x4& first, const U64x4& second, bool high) {
  const U32x8 a = (U32x8)first, b = (U32x8)second;
  return high ? JAXCOMP_SHUFFLE8(a, b, 1, 3, 5, 7, 9, 11, 13, 15) : JAXCOMP_SHUFFLE8(a, b, 0, 2, 4, 6, 8, 10, 12, 14);
}

// 31 - (index of the highest set bit) of every nonzero lane (lanes of 0 give garbage): the
// highest set bit alone converts to float exactly, and its exponent is the index.
JAXCOMP_CPU_INLINE I32x8 leading_zeros_lanes(const U32x8& lanes) {
  U32x8 x = lanes | lanes >> 1;
  x |= x >> 2;
  x |= x >> 4;
  x |= x >> 8;
  x |= x >> 16;
  const U32x8 top = x ^ (x >> 1);
  const U32x8 exponent = ((U32x8)__builtin_convertvector((I32x8)top, F32x8) >> 23) & 0xFFu;  // 2^31 reads as -2^31
  return 31 - ((I32x8)exponent - 127);
}

// Exchanges the bits at positions p and p + delta of every lane for the p in `mask`.
JAXCOMP_CPU_INLINE U32x8 delta_swap(const U32x8& x, int delta, uint32_t mask) {
  const U32x8 t = ((x >> delta) ^ x) & mask;
  return x ^ t ^ (t << delta);
}

// Reverses the order of the 8 nibbles of every lane.
JAXCOMP_CPU_INLINE U32x8 reverse_nibbles(const U32x8& lanes) {
  U32x8 x = (lanes >> 16) | (lanes << 16);
  x = ((x >> 8) & 0x00FF00FFu) | ((x & 0x00FF00FFu) << 8);
  return ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
}

// 8 bit planes of 4 coefficients, lane by lane: nibble j = plane j (bit i = coefficient i) ->
// byte i = coefficient i's bits (plane j at bit 7 - j). The index of a bit, 4j + i, becomes
// 8i + 7 - j: reverse the nibbles (j -> 7 - j), then four exchanges of index bits (4 <-> 1,
// 3 <-> 0, 2 <-> 1, 1 <-> 0) turn (j2 j1 j0 i1 i0) into (i1 i0 j2 j1 j0).
JAXCOMP_CPU_INLINE U32x8 planes_to_coefficients(const U32x8& nibbles) {
  U32x8 x = reverse_nibbles(nibbles);
  x = delta_swap(x, 14, 0x0000CCCCu);
  x = delta_swap(x, 7, 0x00AA00AAu);
  x = delta_swap(x, 2, 0x0C0C0C0Cu);
  return delta_swap(x, 1, 0x22222222u);
}

// The inverse of planes_to_coefficients: byte i = coefficient i's bits of 8 planes (the first at
// bit 7) -> nibble j = plane j.
JAXCOMP_CPU_INLINE U32x8 coefficients_to_planes(const U32x8& bytes) {
  U32x8 x = delta_swap(bytes, 1, 0x22222222u);
  x = delta_swap(x, 2, 0x0C0C0C0Cu);
  x = delta_swap(x, 7, 0x00AA00AAu);
  x = delta_swap(x, 14, 0x0000CCCCu);
  return reverse_nibbles(x);
}

// zfp_block.h's quantize, lane by lane; shift counts are kept in 0..31 so no lane shifts by 32.
JAXCOMP_CPU_INLINE I32x8 quantize_lanes(const U32x8& bits, const I32x8& emax) {
  const U32x8 biased = (bits >> 23) & 0xFFu;
  const U32x8 normal = (U32x8)(biased != 0u);
  const U32x8 mantissa = (bits & 0x7FFFFFu) | (normal & 0x800000u);
  const I32x8 shift = (I32x8)(biased | (~normal & 1u)) - 120 - emax;
  const U32x8 left = (mantissa << (U32x8)(shift & 31)) & (U32x8)((shift >= 0) & (shift < 32));
  const I32x8 down = -shift;
  const U32x8 right = (mantissa >> (U32x8)(down & 31)) & (U32x8)((down > 0) & (down < 32));
  const I32x8 magnitude = (I32x8)(left | right);
  const I32x8 sign = (I32x8)bits >> 31;  // -1 for negative values
  return (magnitude ^ sign) - sign;
}

// zfp_block.h's forward_lift, lane by lane.
JAXCOMP_CPU_INLINE void forward_lift_lanes(I32x8* q) {
  I32x8 x = q[0], y = q[1], z = q[2], w = q[3];
  x += w; x >>= 1; w -= x;
  z += y; z >>= 1; y -= z;
  x += z; x >>= 1; z -= x;
  w += y; w >>= 1; y -= w;
  w += y >> 1; y -= w >> 1;
  q[0] = x; q[1] = y; q[2] = z; q[3] = w;
}

// zfp_block.h's inverse_lift, lane by lane (wrapping additions, arithmetic shifts).
JAXCOMP_CPU_INLINE void inverse_lift_lanes(U32x8* q) {
  U32x8 x = q[0], y = q[1], z = q[2], w = q[3];
  y += (U32x8)((I32x8)w >> 1); w -= (U32x8)((I32x8)y >> 1);
  y += w; w <<= 1; w -= y;
  z += x; x <<= 1; x -= z;
  y += z; z <<= 1; z -= y;
  w += x; x <<= 1; x -= w;
  q[0] = x; q[1] = y; q[2] = z; q[3] = w;
}

// Steps 1-6 of docs/kernels.md for 8 blocks: the values' bits (32 words, block-major) ->
// each block's largest magnitude key and its negabinary coefficients (vector i = coefficient i).
// Blocks whose key is 0 or >= kNonFiniteKey get garbage coefficients.
JAXCOMP_CPU_INLINE void forward_transform_lanes(const uint32_t* value_bits, U32x8* key, U32x8* u) {
  U32x8 v[4];
  transpose_to_lanes(value_bits, v);
  U32x8 m = v[0] & 0x7FFFFFFFu;
  for (int i = 1; i < 4; ++i) {
    const U32x8 k = v[i] & 0x7FFFFFFFu;
    m = k > m ? k : m;
  }
  *key = m;
  const I32x8 emax = (I32x8)(m >> 23) - 126;
  I32x8 q[4];
  for (int i = 0; i < 4; ++i) q[i] = quantize_lanes(v[i], emax);
  forward_lift_lanes(q);
  for (int i = 0; i < 4; ++i) u[i] = ((U32x8)q[i] + kNegabinaryMask) ^ kNegabinaryMask;
}

// The decoder's inverse for 8 blocks: negabinary coefficients (vector i = coefficient i) and
// block exponents -> 32 floats, block-major. Exact (like decode_coefficients) for lanes with
// emax >= kMinFastExponent; the caller redoes the others with dequantize.
JAXCOMP_CPU_INLINE void inverse_transform_lanes(const U32x8* u, const I32x8& emax, float* values) {
  U32x8 q[4];
  for (int i = 0; i < 4; ++i) q[i] = (u[i] ^ kNegabinaryMask) - kNegabinaryMask;
  inverse_lift_lanes(q);
  // 2^(emax - 30) as a float; the caller keeps emax in [kMinFastExponent, 128] (so it is normal).
  const F32x8 scale = (F32x8)((U32x8)(emax + (127 - 30)) << 23);
  U32x8 out[4];
  for (int i = 0; i < 4; ++i) out[i] = (U32x8)(__builtin_convertvector((I32x8)q[i], F32x8) * scale);
  transpose_to_blocks(out, values);
}

}  // namespace zfp
}  // namespace jaxcomp
