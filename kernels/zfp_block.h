// One block of the ZFP-style fixed-rate codec (docs/kernels.md): 4 floats <-> a fixed number of
// bits. Shared by the CPU row driver (kernels/zfp.h) and the CUDA kernels, so there are no std::
// calls, no exceptions and only fixed-size locals. Scaling by powers of two is integer code, or a
// float multiply only where it is exact: XLA may run handlers with denormals flushed, and the
// bits must not depend on that.
//
// Use: build the tables once (make_code_tables(), constexpr: on CUDA a __constant__ or shared
// copy). Rates >= 3: encode_block / decode_block, 4 * rate bits each; rates 1-2: the row header
// (row_header) then encode_coefficients / decode_coefficients with the row's exponent. Block b of
// a row starts at bit b * 4 * rate (+ 32 at rates 1-2), so blocks need no coordination: stream
// a run of blocks through BitWriter / BitReader, or (4 * rate <= 64) code one block in a
// register with BlockWriter64 / BlockReader64 and store its bits at its offset.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define JAXCOMP_HD __host__ __device__
#else
#define JAXCOMP_HD
#endif

// The per-block coders run once per 4 values: inlined into the caller's loop, the bit reader's
// and writer's state stays in registers.
#if defined(__CUDACC__)
#define JAXCOMP_HD_INLINE __host__ __device__ __forceinline__
#else
#define JAXCOMP_HD_INLINE inline __attribute__((always_inline))
#endif

namespace jaxcomp {
namespace zfp {

// Row layout: rates 1-2 keep the row's exponent in one header word in front of the blocks; the
// blocks follow, 4 * rate bits each, padded to a whole word per row.
JAXCOMP_HD inline int64_t header_words(int rate) { return rate <= 2 ? 1 : 0; }
JAXCOMP_HD inline int64_t row_words(int64_t n, int rate) {
  return header_words(rate) + ((n + 3) / 4 * 4 * rate + 31) / 32;
}

// Flag bit + 8-bit biased exponent in front of every block at rates >= 3.
constexpr int kHeaderBits = 9;
// Flag 1 with exponent field 0: a code zfp never writes, used for blocks holding NaN or +-Inf.
constexpr uint32_t kNonFiniteHeader = 1;
constexpr uint32_t kNegabinaryMask = 0xAAAAAAAAu;
// Magnitude keys at or above this are +-Inf or NaN.
constexpr uint32_t kNonFiniteKey = 0x7F800000u;
// Rates 1-2: the row header word for a row with NaN or +-Inf (exponents are 1..255, 0 = zero row).
constexpr uint32_t kNonFiniteRowHeader = 0x100;

JAXCOMP_HD inline uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  return u;
#endif
}

JAXCOMP_HD inline float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
#endif
}

JAXCOMP_HD inline int count_leading_zeros(uint32_t x) {  // x != 0
#if defined(__CUDA_ARCH__)
  return __clz(x);
#else
  return __builtin_clz(x);
#endif
}

JAXCOMP_HD inline int count_trailing_zeros(uint32_t x) {  // x != 0
#if defined(__CUDA_ARCH__)
  return __ffs(x) - 1;
#else
  return __builtin_ctz(x);
#endif
}

JAXCOMP_HD constexpr int min_int(int a, int b) { return a < b ? a : b; }

// ---------------------------------------------------------------------------------------------
// Bit I/O: LSB first, bit j of a stream is bit j % 32 of word j / 32.

// Writes whole words in order through a 64-bit window. It owns every bit from its start offset
// to the end of the last word it writes (flush() zero-fills the rest of that word).
struct BitWriter {
  uint32_t* next;
  uint64_t window;
  int fill;  // valid bits in window, always < 32 between calls

  // Keeps the bits below `bit_offset` in the first word (they belong to someone else).
  JAXCOMP_HD BitWriter(uint32_t* words, int64_t bit_offset)
      : next(words + (bit_offset >> 5)), window(0), fill(static_cast<int>(bit_offset & 31)) {
    if (fill) window = *next & ((1u << fill) - 1u);
  }

  // `value` must have no bits at or above `count` (count <= 32).
  JAXCOMP_HD void write(uint32_t value, int count) {
    window |= static_cast<uint64_t>(value) << fill;
    fill += count;
    if (fill >= 32) {
      *next++ = static_cast<uint32_t>(window);
      window >>= 32;
      fill -= 32;
    }
  }

  JAXCOMP_HD void pad(int count) {
    for (; count > 32; count -= 32) write(0, 32);
    write(0, count);
  }

  JAXCOMP_HD void flush() {
    if (fill) {
      *next++ = static_cast<uint32_t>(window);
      window = 0;
      fill = 0;
    }
  }
};

// Reads through a 64-bit window holding at least 32 unread bits; never reads at or past `end`
// (bits there read as zeros).
struct BitReader {
  const uint32_t* next;
  const uint32_t* end;
  uint64_t window;
  int avail;  // valid bits in window, >= 32 between calls

  JAXCOMP_HD BitReader(const uint32_t* words, int64_t num_words, int64_t bit_offset)
      : next(words + (bit_offset >> 5)), end(words + num_words), window(0), avail(0) {
    refill();
    refill();
    consume(static_cast<int>(bit_offset & 31));
  }

  JAXCOMP_HD void refill() {
    if (next < end) window |= static_cast<uint64_t>(*next++) << avail;
    avail += 32;
  }

  // The next 32 bits of the stream, without consuming them.
  JAXCOMP_HD uint32_t peek() const { return static_cast<uint32_t>(window); }

  JAXCOMP_HD void consume(int count) {  // count <= 32
    window >>= count;
    avail -= count;
    if (avail < 32) refill();
  }

  JAXCOMP_HD uint32_t read(int count) {  // count <= 32
    const uint32_t value = count == 32 ? peek() : peek() & ((1u << count) - 1u);
    consume(count);
    return value;
  }

  JAXCOMP_HD void skip(int64_t count) {
    for (; count > 32; count -= 32) consume(32);
    consume(static_cast<int>(count));
  }
};

// One block of at most 64 bits (rates <= 16) in a register: writes and pads need no memory and
// no branches; the caller stores the block's bits at its offset.
struct BlockWriter64 {
  uint64_t bits = 0;
  int pos = 0;

  // `value` must have no bits at or above `count`; the block's bits never exceed 64.
  JAXCOMP_HD void write(uint32_t value, int count) {
    bits |= static_cast<uint64_t>(value) << pos;
    pos += count;
  }
  JAXCOMP_HD void pad(int count) { pos += count; }
};

// Reads one block of at most 64 bits held in a register (bits past the block read as whatever
// follows it in `bits`, zeros at the end).
struct BlockReader64 {
  uint64_t bits;

  // The 64 bits at `bit_offset` of words[0, num_words) (zeros past the end).
  JAXCOMP_HD BlockReader64(const uint32_t* words, int64_t num_words, int64_t bit_offset) {
    const int64_t index = bit_offset >> 5;
    const int shift = static_cast<int>(bit_offset & 31);
    const uint64_t w0 = words[index];
    const uint64_t w1 = index + 1 < num_words ? words[index + 1] : 0u;
    const uint64_t w2 = index + 2 < num_words ? words[index + 2] : 0u;
    bits = (w0 | w1 << 32) >> shift;
    if (shift) bits |= w2 << (64 - shift);
  }

  // A block already in a register.
  JAXCOMP_HD explicit BlockReader64(uint64_t block) : bits(block) {}

  JAXCOMP_HD uint32_t peek() const { return static_cast<uint32_t>(bits); }
  JAXCOMP_HD void consume(int count) { bits >>= count; }  // count <= 32
  JAXCOMP_HD void skip(int64_t) {}  // nothing follows within the block
};

// ---------------------------------------------------------------------------------------------
// Bit-plane code tables. A bit plane is 4 bits (bit i = bit k of coefficient i); `n` coefficients
// are already significant. zfp's encode_few_ints writes a plane as its low n bits verbatim, then
// a unary run-length code of the rest; its decode_few_ints mirrors it. A plane's code is at most
// 7 bits, so one lookup codes a plane (or two, in the pair tables). Planes cut short by the bit
// budget are the prefix of their full code (zfp writes bit by bit and stops when the budget is
// spent). About 19 KB in all; CUDA blocks copy the half they use (EncodeTables, DecodeTables).

struct CodeTables {
  // [n * 16 + plane]: code | length << 16 | next_n << 24.
  uint32_t encode_single[5 * 16];
  // [n * 128 + next 7 stream bits]: plane | length << 4 | next_n << 8.
  uint16_t decode[5 * 128];
  // Once n == 4 every plane is 4 verbatim bits, so 8 planes move at once between the four
  // coefficients' bytes and 8 nibbles (the highest plane first):
  // [byte]: bit 4 * m set where bit 7 - m of byte is (a coefficient's byte -> nibble bits).
  uint32_t to_nibbles[256];
  // [two nibbles]: for coefficient i, bit 1 of byte i = bit i of the low nibble, bit 0 = bit i
  // of the high nibble (two planes -> two bits of each coefficient's byte).
  uint32_t from_nibbles[256];
  // [n * 256 + plane k | plane k - 1 << 4]: both planes' codes, code | length << 16 | next_n << 24.
  uint32_t encode_pair[5 * 256];
  // [n * 1024 + next 10 stream bits]: two planes decoded at once, planes | length << 8 |
  // next_n << 12; length 0 where their codes take more than 10 bits.
  uint16_t decode_pair[5 * 1024];
};

// Bits [0, count) of value, count in 0..32.
JAXCOMP_HD inline uint32_t low_bits(uint32_t value, int count) {
  return count >= 32 ? value : value & ((1u << count) - 1u);
}

// Bits [0, count) of a 64-bit value, count in 0..63.
JAXCOMP_HD inline uint64_t low_bits64(uint64_t value, int count) { return value & ((uint64_t{1} << count) - 1u); }

// zfp's run-length code of the plane's bits above the n significant ones (no budget).
JAXCOMP_HD constexpr void encode_plane_full(uint32_t plane, int n, uint32_t* code, int* length, int* next_n) {
  uint32_t bits = plane & ((1u << n) - 1u);
  int len = n;
  uint32_t x = plane >> n;
  for (; n < 4; x >>= 1, ++n) {
    bits |= (x != 0 ? 1u : 0u) << len++;
    if (x == 0) break;
    for (; n < 3; x >>= 1, ++n) {
      bits |= (x & 1u) << len++;
      if (x & 1u) break;
    }
  }
  *code = bits;
  *length = len;
  *next_n = n;
}

// zfp's decoding of one plane from `stream` (LSB = next bit) with `budget` bits left.
JAXCOMP_HD constexpr uint32_t decode_plane(uint32_t stream, int n, int budget, int* length, int* next_n) {
  const int verbatim = min_int(n, budget);
  uint32_t plane = stream & ((1u << verbatim) - 1u);
  int len = verbatim;
  budget -= verbatim;
  for (; budget > 0 && n < 4; ++n) {
    --budget;
    if (!((stream >> len++) & 1u)) break;
    for (; budget > 0 && n < 3; ++n) {
      --budget;
      if ((stream >> len++) & 1u) break;
    }
    plane |= 1u << n;
  }
  *length = len;
  *next_n = n;
  return plane;
}

JAXCOMP_HD constexpr CodeTables make_code_tables() {
  CodeTables t{};
  for (int n = 0; n <= 4; ++n) {
    for (uint32_t plane = 0; plane < 16; ++plane) {
      uint32_t code = 0;
      int length = 0, next_n = 0;
      encode_plane_full(plane, n, &code, &length, &next_n);
      t.encode_single[n * 16 + plane] = code | static_cast<uint32_t>(length) << 16 | static_cast<uint32_t>(next_n) << 24;
    }
    for (uint32_t stream = 0; stream < 128; ++stream) {
      int length = 0, next_n = 0;
      const uint32_t plane = decode_plane(stream, n, 7, &length, &next_n);
      t.decode[n * 128 + stream] = static_cast<uint16_t>(plane | length << 4 | next_n << 8);
    }
  }
  for (int n = 0; n <= 4; ++n) {
    for (uint32_t pair = 0; pair < 256; ++pair) {
      uint32_t first = 0, second = 0;
      int first_length = 0, second_length = 0, after_first = 0, after_second = 0;
      encode_plane_full(pair & 0xFu, n, &first, &first_length, &after_first);
      encode_plane_full(pair >> 4, after_first, &second, &second_length, &after_second);
      t.encode_pair[n * 256 + pair] = (first | second << first_length) |
                                      static_cast<uint32_t>(first_length + second_length) << 16 |
                                      static_cast<uint32_t>(after_second) << 24;
    }
  }
  for (int n = 0; n <= 4; ++n) {
    for (uint32_t stream = 0; stream < 1024; ++stream) {
      // A budget beyond the 10 bits: codes that fit are decoded whatever follows them.
      int first_length = 0, after_first = 0, second_length = 0, after_second = 0;
      const uint32_t first = decode_plane(stream, n, 20, &first_length, &after_first);
      const uint32_t second = decode_plane(stream >> first_length, after_first, 20, &second_length, &after_second);
      const int length = first_length + second_length;
      t.decode_pair[n * 1024 + stream] =
          length <= 10 ? static_cast<uint16_t>(first | second << 4 | length << 8 | after_second << 12) : 0;
    }
  }
  for (uint32_t byte = 0; byte < 256; ++byte) {
    uint32_t nibbles = 0, bits = 0;
    for (int m = 0; m < 8; ++m) nibbles |= ((byte >> (7 - m)) & 1u) << (4 * m);
    for (int i = 0; i < 4; ++i) bits |= (((byte >> i) & 1u) << 1 | ((byte >> (4 + i)) & 1u)) << (8 * i);
    t.to_nibbles[byte] = nibbles;
    t.from_nibbles[byte] = bits;
  }
  return t;
}

// The coders take any `Tables` with the members they read: the encoder encode_single,
// encode_pair and to_nibbles, the decoder decode, decode_pair and from_nibbles. A CUDA block
// copies only its direction's half into shared memory (6.3 KB to encode, 12.3 KB to decode,
// both whole 16-byte vectors).
struct alignas(16) EncodeTables {
  uint32_t encode_single[5 * 16];
  uint32_t encode_pair[5 * 256];
  uint32_t to_nibbles[256];
};
struct alignas(16) DecodeTables {
  uint16_t decode[5 * 128];
  uint16_t decode_pair[5 * 1024];
  uint32_t from_nibbles[256];
};
static_assert(sizeof(EncodeTables) % 16 == 0 && sizeof(DecodeTables) % 16 == 0, "tables copy as 16-byte vectors");

JAXCOMP_HD constexpr EncodeTables make_encode_tables() {
  const CodeTables all = make_code_tables();
  EncodeTables t{};
  for (int i = 0; i < 5 * 16; ++i) t.encode_single[i] = all.encode_single[i];
  for (int i = 0; i < 5 * 256; ++i) t.encode_pair[i] = all.encode_pair[i];
  for (int i = 0; i < 256; ++i) t.to_nibbles[i] = all.to_nibbles[i];
  return t;
}

JAXCOMP_HD constexpr DecodeTables make_decode_tables() {
  const CodeTables all = make_code_tables();
  DecodeTables t{};
  for (int i = 0; i < 5 * 128; ++i) t.decode[i] = all.decode[i];
  for (int i = 0; i < 5 * 1024; ++i) t.decode_pair[i] = all.decode_pair[i];
  for (int i = 0; i < 256; ++i) t.from_nibbles[i] = all.from_nibbles[i];
  return t;
}

// ---------------------------------------------------------------------------------------------
// Block transform.

// Magnitude key of a float (bits without the sign): integer order is magnitude order.
JAXCOMP_HD inline uint32_t magnitude_key(uint32_t bits) { return bits & 0x7FFFFFFFu; }

// frexp exponent of a finite nonzero magnitude key, clamped to >= -126: E - 126 for biased
// exponent E (denormals, E = 0, give -126).
JAXCOMP_HD inline int block_exponent(uint32_t max_key) { return static_cast<int>(max_key >> 23) - 126; }

// Block exponents from which dequantize can multiply by a normal float power of two:
// 2^(emax - 30) >= 2^-126.
constexpr int kMinFastExponent = -96;

// (int32)(f * 2^(30 - emax)) with C truncation, exactly, for |f| < 2^emax.
JAXCOMP_HD inline int32_t quantize(uint32_t bits, int emax) {
  const uint32_t biased = (bits >> 23) & 0xFFu;
  const uint32_t mantissa = biased ? (bits & 0x7FFFFFu) | 0x800000u : bits & 0x7FFFFFu;
  // f = mantissa * 2^(max(biased, 1) - 150); the shift is at most 7 because |f| < 2^emax.
  const int shift = static_cast<int>(biased ? biased : 1u) - 120 - emax;
  uint32_t magnitude;
  if (shift >= 0) {
    magnitude = mantissa << shift;
  } else {
    magnitude = shift > -32 ? mantissa >> -shift : 0u;
  }
  return static_cast<int32_t>((bits >> 31) ? 0u - magnitude : magnitude);
}

// (float)q * 2^(emax - 30), correctly rounded like ldexpf (denormal results included) without
// touching the FPU's denormal modes.
JAXCOMP_HD inline float dequantize(int32_t q, int emax) {
  if (q == 0) return 0.0f;
  const uint32_t bits = float_bits(static_cast<float>(q));  // exact or round-to-nearest-even
  const uint32_t sign = bits & 0x80000000u;
  const int exponent = static_cast<int>((bits >> 23) & 0xFFu) + emax - 30;
  if (exponent >= 255) return bits_float(sign | 0x7F800000u);
  if (exponent >= 1) return bits_float(sign | static_cast<uint32_t>(exponent) << 23 | (bits & 0x7FFFFFu));
  // Denormal result: shift the 24-bit significand right, rounding half to even.
  const int shift = 1 - exponent;
  if (shift > 25) return bits_float(sign);
  const uint32_t significand = (bits & 0x7FFFFFu) | 0x800000u;
  uint32_t result = significand >> shift;
  const uint32_t rest = significand & ((1u << shift) - 1u), half = 1u << (shift - 1);
  if (rest > half || (rest == half && (result & 1u))) ++result;  // may carry into the smallest normal
  return bits_float(sign | result);
}

// zfp's forward lifting transform (1-D fwd_lift); no overflow for |q| < 2^30.
JAXCOMP_HD inline void forward_lift(int32_t* q) {
  int32_t x = q[0], y = q[1], z = q[2], w = q[3];
  x += w; x >>= 1; w -= x;
  z += y; z >>= 1; y -= z;
  x += z; x >>= 1; z -= x;
  w += y; w >>= 1; y -= w;
  w += y >> 1; y -= w >> 1;
  q[0] = x; q[1] = y; q[2] = z; q[3] = w;
}

// zfp's inv_lift. Decoded words may be arbitrary, so additions wrap (unsigned arithmetic) and
// right shifts are arithmetic.
JAXCOMP_HD inline void inverse_lift(int32_t* q) {
  uint32_t x = static_cast<uint32_t>(q[0]), y = static_cast<uint32_t>(q[1]);
  uint32_t z = static_cast<uint32_t>(q[2]), w = static_cast<uint32_t>(q[3]);
  auto half = [](uint32_t v) { return static_cast<uint32_t>(static_cast<int32_t>(v) >> 1); };
  y += half(w); w -= half(y);
  y += w; w <<= 1; w -= y;
  z += x; x <<= 1; x -= z;
  y += z; z <<= 1; z -= y;
  w += x; x <<= 1; x -= w;
  q[0] = static_cast<int32_t>(x); q[1] = static_cast<int32_t>(y);
  q[2] = static_cast<int32_t>(z); q[3] = static_cast<int32_t>(w);
}

JAXCOMP_HD inline uint32_t to_negabinary(int32_t q) {
  return (static_cast<uint32_t>(q) + kNegabinaryMask) ^ kNegabinaryMask;
}

JAXCOMP_HD inline int32_t from_negabinary(uint32_t u) {
  return static_cast<int32_t>((u ^ kNegabinaryMask) - kNegabinaryMask);
}

// ---------------------------------------------------------------------------------------------
// Coefficients: steps 4-7 of docs/kernels.md. Writes/reads exactly `bits` bits.

// Step 7 alone: the bit planes of the negabinary coefficients u[0..3].
template <typename Tables, typename Writer>
JAXCOMP_HD_INLINE void encode_planes(const uint32_t* u, int bits, const Tables& tables, Writer& out) {
  const uint32_t any = u[0] | u[1] | u[2] | u[3];
  if (any == 0) {
    out.pad(bits);
    return;
  }
  // Planes above the highest set bit cost one 0 bit each (nothing is significant yet).
  int k = 31 - count_leading_zeros(any);
  int zeros = min_int(31 - k, bits);
  out.pad(zeros);
  bits -= zeros;
  // Planes go 8 at a time as nibbles (plane k in the low nibble): zfp's run-length code, two
  // planes per lookup, while fewer than 4 coefficients are significant; then 4 bits a plane.
  int n = 0;
  while (k >= 0 && bits > 0) {
    const int planes = min_int(8, k + 1);
    // Each coefficient's byte of planes k (bit 7) down to k - 7 (planes below 0 read as 0).
    const int up = k >= 7 ? 0 : 7 - k, down = k >= 7 ? k - 7 : 0;
    const uint32_t nibbles = tables.to_nibbles[((u[0] << up) >> down) & 0xFFu] |
                             tables.to_nibbles[((u[1] << up) >> down) & 0xFFu] << 1 |
                             tables.to_nibbles[((u[2] << up) >> down) & 0xFFu] << 2 |
                             tables.to_nibbles[((u[3] << up) >> down) & 0xFFu] << 3;
    int plane = 0;
    while (plane < planes && n < 4 && bits > 0) {
      const bool two = plane + 1 < planes;
      const uint32_t entry = two ? tables.encode_pair[n * 256 + ((nibbles >> (4 * plane)) & 0xFFu)]
                                 : tables.encode_single[n * 16 + ((nibbles >> (4 * plane)) & 0xFu)];
      const int length = (entry >> 16) & 0xFF;
      if (length >= bits) {  // the budget ends inside these planes: write the prefix
        out.write(entry & ((1u << bits) - 1u), bits);
        bits = 0;
        break;
      }
      out.write(entry & 0xFFFFu, length);
      bits -= length;
      n = entry >> 24;
      plane += two ? 2 : 1;
    }
    if (plane < planes && bits > 0) {  // n == 4: the rest of the chunk verbatim
      const int length = min_int(4 * (planes - plane), bits);
      out.write(low_bits(nibbles >> (4 * plane), length), length);
      bits -= length;
    }
    k -= planes;
  }
  out.pad(bits);
}

template <typename Tables, typename Writer>
JAXCOMP_HD_INLINE void encode_coefficients(const uint32_t* value_bits, int emax, int bits, const Tables& tables,
                                           Writer& out) {
  int32_t q[4];
  for (int i = 0; i < 4; ++i) q[i] = quantize(value_bits[i], emax);
  forward_lift(q);
  uint32_t u[4];
  for (int i = 0; i < 4; ++i) u[i] = to_negabinary(q[i]);
  encode_planes(u, bits, tables, out);
}

// Step 7 alone: reads the bit planes into the negabinary coefficients u[0..3].
template <typename Tables, typename Reader>
JAXCOMP_HD_INLINE void decode_planes(Reader& in, int bits, const Tables& tables, uint32_t* u) {
  // Four scalars rather than an array: the compiler keeps them in registers.
  uint32_t u0 = 0, u1 = 0, u2 = 0, u3 = 0;
  int n = 0, k = 31;
  // Leading all-zero planes: one 0 bit each.
  {
    const uint32_t stream = in.peek();
    const int zeros = min_int(stream ? count_trailing_zeros(stream) : 32, bits);
    in.consume(zeros);
    bits -= zeros;
    k -= zeros;
  }
  // Planes come 8 at a time as nibbles (plane k in the low nibble), as encode_coefficients
  // writes them; then each coefficient's byte of the 8 planes goes in at once.
  while (k >= 0 && bits > 0) {
    const int planes = min_int(8, k + 1);
    uint32_t nibbles = 0;
    int plane = 0;
    for (; plane < planes && n < 4 && bits > 0; ++plane) {
      const uint32_t stream = in.peek();
      if (plane + 1 < planes) {  // two planes at once where their codes are short
        const uint32_t pair = tables.decode_pair[n * 1024 + (stream & 0x3FFu)];
        const int length = (pair >> 8) & 0xF;
        if (length != 0 && length <= bits) {
          in.consume(length);
          bits -= length;
          n = pair >> 12;
          nibbles |= (pair & 0xFFu) << (4 * plane);
          ++plane;
          continue;
        }
      }
      const uint32_t entry = tables.decode[n * 128 + (stream & 0x7Fu)];
      int length = (entry >> 4) & 0xF;
      uint32_t bits_of_plane = entry & 0xFu;
      if (length > bits) {  // the budget ends inside this plane
        int next_n = 0;
        bits_of_plane = decode_plane(stream, n, bits, &length, &next_n);
      }
      in.consume(length);
      bits -= length;
      n = entry >> 8;
      nibbles |= bits_of_plane << (4 * plane);
    }
    if (plane < planes && bits > 0) {  // n == 4: the rest of the chunk is verbatim
      const int length = min_int(4 * (planes - plane), bits);
      nibbles |= low_bits(in.peek(), length) << (4 * plane);
      in.consume(length);
      bits -= length;
    }
    // Byte i holds coefficient i's bits of planes k (bit 7) down to k - 7 (bit 0).
    const uint32_t bytes = tables.from_nibbles[nibbles & 0xFFu] << 6 | tables.from_nibbles[(nibbles >> 8) & 0xFFu] << 4 |
                           tables.from_nibbles[(nibbles >> 16) & 0xFFu] << 2 | tables.from_nibbles[nibbles >> 24];
    if (k >= 7) {
      u0 |= (bytes & 0xFFu) << (k - 7);
      u1 |= ((bytes >> 8) & 0xFFu) << (k - 7);
      u2 |= ((bytes >> 16) & 0xFFu) << (k - 7);
      u3 |= (bytes >> 24) << (k - 7);
    } else {
      u0 |= (bytes & 0xFFu) >> (7 - k);
      u1 |= ((bytes >> 8) & 0xFFu) >> (7 - k);
      u2 |= ((bytes >> 16) & 0xFFu) >> (7 - k);
      u3 |= (bytes >> 24) >> (7 - k);
    }
    k -= planes;
  }
  in.skip(bits);
  u[0] = u0;
  u[1] = u1;
  u[2] = u2;
  u[3] = u3;
}

template <typename Tables, typename Reader>
JAXCOMP_HD_INLINE void decode_coefficients(Reader& in, int emax, int bits, const Tables& tables, float* values) {
  uint32_t u[4];
  decode_planes(in, bits, tables, u);
  int32_t q[4] = {from_negabinary(u[0]), from_negabinary(u[1]), from_negabinary(u[2]), from_negabinary(u[3])};
  inverse_lift(q);
  if (emax >= kMinFastExponent) {
    // 2^(emax - 30) is a normal float and (float)q * 2^(emax - 30) is normal (or overflows to
    // inf): the product rounds exactly like ldexpf.
    const float scale = bits_float(static_cast<uint32_t>(emax - 30 + 127) << 23);
    for (int i = 0; i < 4; ++i) values[i] = static_cast<float>(q[i]) * scale;
  } else {
    for (int i = 0; i < 4; ++i) values[i] = dequantize(q[i], emax);
  }
}

// ---------------------------------------------------------------------------------------------
// Whole blocks.

// Loads block `block` of a row of n values as bits, padded like zfp's 1-D pad_block.
JAXCOMP_HD inline void load_block(const float* row, int64_t n, int64_t block, uint32_t* value_bits) {
  const int64_t first = block * 4;
  const int64_t valid = n - first;
  if (valid >= 4) {
    for (int i = 0; i < 4; ++i) value_bits[i] = float_bits(row[first + i]);
    return;
  }
  value_bits[0] = float_bits(row[first]);
  value_bits[1] = valid >= 2 ? float_bits(row[first + 1]) : value_bits[0];
  value_bits[2] = valid >= 3 ? float_bits(row[first + 2]) : value_bits[1];
  value_bits[3] = value_bits[0];
}

// Largest magnitude key of a block (>= kNonFiniteKey if it holds NaN or +-Inf).
JAXCOMP_HD inline uint32_t max_key(const uint32_t* value_bits) {
  uint32_t m = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t key = magnitude_key(value_bits[i]);
    m = key > m ? key : m;
  }
  return m;
}

// Rates >= 3: a block with its own 9-bit header, `block_bits` = 4 * rate bits in all.
template <typename Tables, typename Writer>
JAXCOMP_HD_INLINE void encode_block(const uint32_t* value_bits, int block_bits, const Tables& tables,
                                    Writer& out) {
  const uint32_t key = max_key(value_bits);
  if (key >= kNonFiniteKey) {
    out.write(kNonFiniteHeader, kHeaderBits);
    out.pad(block_bits - kHeaderBits);
  } else if (key == 0) {
    out.write(0, 1);
    out.pad(block_bits - 1);
  } else {
    const int emax = block_exponent(key);
    out.write(2u * static_cast<uint32_t>(emax + 127) + 1u, kHeaderBits);
    encode_coefficients(value_bits, emax, block_bits - kHeaderBits, tables, out);
  }
}

template <typename Tables, typename Reader>
JAXCOMP_HD_INLINE void decode_block(Reader& in, int block_bits, const Tables& tables, float* values) {
  const uint32_t header = in.peek();
  if (!(header & 1u)) {
    in.skip(block_bits);
    for (int i = 0; i < 4; ++i) values[i] = 0.0f;
    return;
  }
  const int biased = static_cast<int>((header >> 1) & 0xFFu);
  in.consume(kHeaderBits);
  if (biased == 0) {
    in.skip(block_bits - kHeaderBits);
    for (int i = 0; i < 4; ++i) values[i] = bits_float(0x7FC00000u);
    return;
  }
  decode_coefficients(in, biased - 127, block_bits - kHeaderBits, tables, values);
}

// Rates 1-2: the row's header word from the row's largest magnitude key.
JAXCOMP_HD inline uint32_t row_header(uint32_t row_max_key) {
  if (row_max_key >= kNonFiniteKey) return kNonFiniteRowHeader;
  if (row_max_key == 0) return 0;
  return static_cast<uint32_t>(block_exponent(row_max_key) + 127);
}

}  // namespace zfp
}  // namespace jaxcomp
