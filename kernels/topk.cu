// CUDA top-k and MSTopK threshold search as a radix select over the 31-bit magnitude key.
//
// The bisection of docs/kernels.md resolves one key bit per round, most significant first, so
// `rounds` rounds end with `lo` = the largest multiple of 2^(31 - rounds) with C(lo) >= k. A
// histogram of the next `width` key bits, restricted to the keys that share the bits resolved so
// far, evaluates `width` rounds at once: the new digit is the largest bin whose suffix count
// reaches the k still needed. Digits are 11 bits (a 2048-bin histogram fits in shared memory), so
// the default 16 rounds take 2 radix passes and exact top-k (31 rounds) takes 3.
//
// Candidate filtering, as in AIR top-k (RAFT's radix select_k, CUB's DeviceTopK): after the first
// pass every later pass and the selection only concern the keys >= lo of the first digit, C(lo)
// of them, known before the second pass. So the second pass (the filter pass) also writes those
// entries, values and indices, to a per-row candidate buffer (an eighth of the row, at least 256
// entries, within kCandidateBudget), and later passes read only them. A row whose C(lo) exceeds
// its buffer (many ties at the k-th magnitude, a large k) reads its values in every pass instead,
// as without filtering; rows of one launch may differ.
//
// Compaction to exactly k then keeps every key >= hi and the lowest-index keys in [lo, hi): an
// entry i lands at output position A_i + min(T_i, need), where A_i and T_i count the entries above
// and in the bracket before i. The last histogram pass keeps each tile's own histogram, which
// gives every tile its counts above and in the bracket once the last digit is chosen; a scan of
// those counts and one write pass then place every entry without any sort, in ascending index
// order. Each tile's candidates are in index order and every tile knows where they are, so the
// write pass reads a filtered row's candidates instead of its values.
//
// Input: float32, bfloat16 or float16. Every kernel that reads the input (or the candidates, kept
// in the input's type) is instantiated per element type and computes each entry's key straight
// from its bits: the key of its float32 upcast, so a 16-bit row selects exactly what its upcast
// does, and the selected values written are the input's own bits. No upcast pass, and a 16-bit
// row is half the bytes to read.
//
// Reads of the input (a row with candidates / a row whose candidates overflow):
//   exact top-k (31 rounds)              2 / 4   (passes 1-2 read it, pass 3 and the write read candidates)
//   threshold_topk, 12-22 rounds         2 / 3   (default 16)
//   threshold_topk, <= 11 rounds         2       (one pass and the write: nothing to filter)
//   find_threshold, 23-31 rounds         2 / 3
//   find_threshold, <= 22 rounds         1-2     (unchanged: no pass after the filter pass)
// plus writes of at most C(lo) <= n/8 candidates (8 bytes each) and their reads in the later
// passes. Rows too long for the per-tile histogram budget count their tiles in one more pass,
// over the candidates when they have them.

#include <cub/block/block_load.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>
#include <cstring>

#include "kernels/cuda_launch.h"
#include "kernels/topk_cuda.h"

namespace jaxcomp::cuda {
namespace {

constexpr int kKeyBits = 31;
constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;
constexpr int kThreads = 512;
constexpr int kItemsPerThread = 16;
constexpr int64_t kTile = int64_t{kThreads} * kItemsPerThread;
// Tile-local counts of "above" and "in bracket" entries share one 32-bit word, 16 bits each.
static_assert(kTile < (1 << 16), "tile counts must fit in 16 bits");
static_assert(kItemsPerThread % 8 == 0, "whole tiles are read in 16-byte vectors (4 floats or 8 16-bit values)");
constexpr int kSelectThreads = 256;
constexpr int kBinsPerThread = kBins / kSelectThreads;
static_assert(kBins % kSelectThreads == 0, "bins must split evenly over the select block");
// Rows are processed in chunks to bound scratch: per-row histograms (8 KiB a row), at most
// kMaxRowsPerChunk rows (kernels/topk_cuda.h) and 2^28 values at a time, and per-tile histograms
// (up to 8 KiB per 32 KiB tile) within the caller's budget (kTileHistogramBudget): fewer rows per
// chunk, and a row too long for it alone counts its tiles in one more pass instead of keeping
// their histograms.
constexpr int64_t kMaxValuesPerChunk = int64_t{1} << 28;
constexpr size_t kScratchAlign = 256;

// Search state of one row, carried from pass to pass.
struct RowState {
  uint32_t prefix;      // the key bits resolved so far: lo >> (31 - resolved)
  uint32_t above;       // C(hi): keys above every key that shares the prefix (< k)
  uint32_t in_range;    // keys that share the prefix, so C(lo) = above + in_range
  uint32_t candidates;  // C(lo) after the first pass if the row's candidates fit, else kNoCandidates
  uint32_t filled;      // candidate slots handed out so far (the filter pass's tiles add to it)
};

// Candidate filtering (AIR top-k): once the first pass has fixed the first digit, every later
// pass and the selection only look at keys >= lo of that digit, C(lo) of them. The second pass
// (the filter pass) still reads the row but also writes those keys, with their indices, to the
// row's candidate buffer, each tile's in index order at a slot range it takes from `filled`;
// later passes and the write pass of that row read the tile's candidates instead of its
// values. C(lo) is known before the filter pass, so a row whose candidates would not fit its
// buffer (ties, a large k) is marked kNoCandidates and reads its values every pass, as without
// filtering; rows of one launch may differ.
constexpr uint32_t kNoCandidates = 0xFFFFFFFFu;

// Per row `capacity` slots of candidate values (in the input's type T) and indices (row *
// capacity + slot), and per tile of the chunk where its candidates start in the row's buffer and
// how many: start | count << 32. The slots are sized for float32 values whatever T is.
template <typename T>
struct Candidates {
  T* values;
  uint32_t* indices;
  uint64_t* tiles;
  int64_t capacity;
};

// What a histogram pass reads: the values (first pass, or every pass without filtering), the
// values while writing the candidates of rows that have a buffer (filter pass), or those rows'
// candidates (later passes).
enum Stage : int { kFromValues = 0, kFilter = 1, kFromCandidates = 2 };

// The element types of the input, and of the selected values: float, and bfloat16 and float16 as
// their bits (the kernels never convert a value, they only compute its key).
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

// The magnitude key: the float32 bits without the sign; for the 16-bit types those of the
// float32 upcast that the float32 path sees (XLA's convert), so keys of every type order the same
// way as the upcast's, bit for bit: bfloat16 is its bits shifted by 16 (NaN payloads kept as
// they are); float16 is the exact value, and a NaN keeps its payload but comes out quiet, as
// IEEE 754 widening (and XLA's f16 -> f32 convert) makes it. Checked for all 65536 patterns.
__device__ __forceinline__ uint32_t magnitude_key(float value) { return __float_as_uint(value) & 0x7FFFFFFFu; }
__device__ __forceinline__ uint32_t magnitude_key(Bf16 value) { return (uint32_t{value.bits} & 0x7FFFu) << 16; }
__device__ __forceinline__ uint32_t magnitude_key(F16 value) {
  const uint32_t bits = value.bits & 0x7FFFu;
  if (bits > 0x7C00u) return 0x7FC00000u | ((bits & 0x3FFu) << 13);  // NaN: quiet, the payload shifted
  if (bits == 0x7C00u) return 0x7F800000u;                             // Inf
  if (bits >= 0x0400u) return (bits << 13) + (uint32_t{127 - 15} << 23);  // normal: exponent rebiased
  return __float_as_uint(static_cast<float>(bits) * 0x1p-24f);  // zero, subnormal: bits * 2^-24, exact
}

// Entries of T in one 16-byte vector.
template <typename T>
constexpr int kPerVector = 16 / static_cast<int>(sizeof(T));

// The kPerVector<T> entries at p (16-byte aligned) with one 16-byte load.
template <typename T>
__device__ __forceinline__ void load_vector(const T* p, T* out) {
#if defined(JAXCOMP_CUDA_HOST_EMULATION)
  uint4 v;
  std::memcpy(&v, p, sizeof v);  // the host compiler's aliasing rules
#else
  const uint4 v = *reinterpret_cast<const uint4*>(p);
#endif
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    if constexpr (sizeof(T) == 4) {
      out[w] = __uint_as_float(words[w]);
    } else {  // little-endian: the lower address is the low half
      out[2 * w] = T{static_cast<uint16_t>(words[w] & 0xFFFFu)};
      out[2 * w + 1] = T{static_cast<uint16_t>(words[w] >> 16)};
    }
  }
}

// The filter pass over one tile of a row with a candidate buffer: `count`s every entry (the
// histogram) and writes the entries whose key prefix reaches `prefix` (key >= lo), with their
// indices, to the row's buffer, in index order, at slots the tile takes from the row's `filled`;
// the tile's range goes to candidates.tiles as start | count << 32. Blocked arrangement (CUB's
// BLOCK_LOAD_VECTORIZE): thread t holds entries [t * kItemsPerThread, (t + 1) * kItemsPerThread),
// as four 16-byte loads in whole, aligned tiles, so one block scan of the threads' counts places
// every candidate. Only the values and a mask of the kept ones stay live across the scan;
// pointers are formed after it (64 registers without spills).
template <typename T, typename Count>
__device__ __forceinline__ void filter_tile(const T* tile_x, int valid, uint32_t begin, int prefix_shift,
                                            uint32_t prefix, RowState* row_state, const Candidates<T>& candidates,
                                            int64_t row, Count& count) {
  using BlockScan = cub::BlockScan<uint32_t, kThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ uint32_t tile_start;
  const int first = static_cast<int>(threadIdx.x) * kItemsPerThread;  // this thread's first entry in the tile
  T values[kItemsPerThread];
  if (valid == kTile && reinterpret_cast<uintptr_t>(tile_x) % 16 == 0) {
#pragma unroll
    for (int j = 0; j < kItemsPerThread / kPerVector<T>; ++j) {
      load_vector(tile_x + first + j * kPerVector<T>, values + j * kPerVector<T>);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kItemsPerThread; ++i) values[i] = first + i < valid ? tile_x[first + i] : T{};
  }
  uint32_t kept = 0;  // bit i: values[i] is a candidate
  uint32_t thread_count = 0;
#pragma unroll
  for (int i = 0; i < kItemsPerThread; ++i) {
    if (first + i < valid) {
      count(values[i]);
      if ((magnitude_key(values[i]) >> prefix_shift) >= prefix) {
        kept |= 1u << i;
        ++thread_count;
      }
    }
  }
  uint32_t before, tile_total;
  BlockScan(scan_storage).ExclusiveSum(thread_count, before, tile_total);
  if (threadIdx.x == 0) {
    // The row's candidates number C(lo) <= its slots in all, so the slots never run out.
    tile_start = atomicAdd(&row_state->filled, tile_total);
    candidates.tiles[blockIdx.x] = uint64_t{tile_start} | (uint64_t{tile_total} << 32);
  }
  __syncthreads();
  if (kept == 0) return;
  const int64_t slot = row * candidates.capacity + tile_start + before;
  T* slot_values = candidates.values + slot;
  uint32_t* slot_indices = candidates.indices + slot;
  const uint32_t first_index = begin + static_cast<uint32_t>(first);
#pragma unroll
  for (int i = 0; i < kItemsPerThread; ++i) {
    if (kept & (1u << i)) {
      *slot_values++ = values[i];
      *slot_indices++ = first_index + i;
    }
  }
}

// Adds the keys of one tile that share the row's resolved prefix to the row's histogram of the
// next `width` key bits. In the last pass (`tile_histograms` not null) the tile also keeps its own
// histogram and the number of its keys above the prefix, (1 << width) + 1 words a tile: once the
// last digit is known, they give the tile's counts above and inside the final bracket without
// another pass over memory. One instance per Stage: in the filter pass a row with a candidate
// buffer also writes the tile's keys >= lo (key prefix >= the row's prefix) to it, in index
// order; in later passes such a row reads the tile's candidates instead of its values. The filter
// instance keeps its 16 values across a block scan: bounded to 64 registers (2 blocks an SM), and
// the others keep the plain pass's 32.
template <typename T, int kStage>
__global__ void __launch_bounds__(kThreads, kStage == kFilter ? 2 : 4)
    histogram_kernel(const T* __restrict__ x, int64_t n, int64_t tiles_per_row, RowState* __restrict__ state,
                     uint32_t* __restrict__ histograms, int resolved, int width,
                     uint32_t* __restrict__ tile_histograms, Candidates<T> candidates) {
  __shared__ uint32_t local[kBins];
  __shared__ uint32_t local_above;
  const int64_t row = blockIdx.x / tiles_per_row;
  const int64_t begin = (blockIdx.x % tiles_per_row) * kTile;
  const int64_t end = n < begin + kTile ? n : begin + kTile;
  const uint32_t bins = 1u << width;
  for (uint32_t b = threadIdx.x; b < bins; b += kThreads) local[b] = 0;
  if (threadIdx.x == 0) local_above = 0;
  __syncthreads();

  const uint32_t prefix = state[row].prefix;
  // The same on every thread of the block: filtering is decided per row.
  const bool filtered = kStage != kFromValues && state[row].candidates != kNoCandidates;
  const int prefix_shift = kKeyBits - resolved;  // in [1, 31]: resolved < rounds <= 31
  const int digit_shift = prefix_shift - width;  // >= 0
  uint32_t above = 0;
  auto count = [&](T value) {
    const uint32_t key = magnitude_key(value);
    const uint32_t key_prefix = key >> prefix_shift;
    if (key_prefix == prefix) atomicAdd(&local[(key >> digit_shift) & (bins - 1)], 1u);
    above += key_prefix > prefix ? 1u : 0u;
  };
  const T* tile_x = x + row * n + begin;
  bool counted = false;
  if constexpr (kStage == kFromCandidates) {
    if (filtered) {
      const uint64_t tile = candidates.tiles[blockIdx.x];
      const uint32_t size = static_cast<uint32_t>(tile >> 32);
      const T* tile_candidates = candidates.values + row * candidates.capacity + static_cast<uint32_t>(tile);
      for (uint32_t i = threadIdx.x; i < size; i += kThreads) count(tile_candidates[i]);
      counted = true;
    }
  }
  if constexpr (kStage == kFilter) {
    if (filtered) {
      filter_tile(tile_x, static_cast<int>(end - begin), static_cast<uint32_t>(begin), prefix_shift, prefix,
                  &state[row], candidates, row, count);
      counted = true;
    }
  }
  if (counted) {
  } else if (end - begin == kTile && reinterpret_cast<uintptr_t>(tile_x) % 16 == 0) {
    // Whole, aligned tile: 16-byte loads (4 floats or 8 16-bit values), all issued before any is
    // used, vector j * kThreads + t by thread t. Order does not matter to a histogram.
    T values[kItemsPerThread];
#pragma unroll
    for (int j = 0; j < kItemsPerThread / kPerVector<T>; ++j) {
      load_vector(tile_x + (int64_t{j} * kThreads + threadIdx.x) * kPerVector<T>, values + j * kPerVector<T>);
    }
#pragma unroll
    for (int i = 0; i < kItemsPerThread; ++i) count(values[i]);
  } else {
    for (int64_t i = threadIdx.x; i < end - begin; i += kThreads) count(tile_x[i]);
  }
  if (tile_histograms != nullptr) {
    above = __reduce_add_sync(0xFFFFFFFFu, above);
    if (threadIdx.x % 32 == 0 && above != 0) atomicAdd(&local_above, above);
  }
  __syncthreads();

  uint32_t* row_histogram = histograms + row * kBins;
  for (uint32_t b = threadIdx.x; b < bins; b += kThreads) {
    if (local[b] != 0) atomicAdd(&row_histogram[b], local[b]);
  }
  if (tile_histograms != nullptr) {
    uint32_t* tile_histogram = tile_histograms + int64_t{blockIdx.x} * (bins + 1);
    for (uint32_t b = threadIdx.x; b < bins; b += kThreads) tile_histogram[b] = local[b];
    if (threadIdx.x == 0) tile_histogram[bins] = local_above;
  }
}

// One block per row: picks the next digit (the largest bin whose suffix count reaches the k
// still needed), updates the row's state and zeroes the histogram for the next pass. After the
// first pass (`first`), also decides whether the row's candidates, C(lo) of them, fit its buffer
// of `capacity` slots (0: no filtering in this search).
__global__ void __launch_bounds__(kSelectThreads) select_digit_kernel(uint32_t* __restrict__ histograms,
                                                                      RowState* __restrict__ state, int64_t k,
                                                                      int width, bool first, int64_t capacity) {
  using BlockScan = cub::BlockScan<uint32_t, kSelectThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  const int64_t row = blockIdx.x;
  uint32_t* row_histogram = histograms + row * kBins;
  const uint32_t bins = 1u << width;
  const RowState current = state[row];
  const uint32_t need = static_cast<uint32_t>(k) - current.above;  // >= 1 by the invariant C(hi) < k
  __syncthreads();  // every thread has read state[row] before one of them overwrites it

  // Position j counts bin (bins - 1 - j): an inclusive prefix sum over j is a suffix sum over bins.
  uint32_t counts[kBinsPerThread];
  uint32_t thread_total = 0;
#pragma unroll
  for (int i = 0; i < kBinsPerThread; ++i) {
    const uint32_t j = threadIdx.x * kBinsPerThread + i;
    counts[i] = j < bins ? row_histogram[bins - 1 - j] : 0u;
    if (j < bins) row_histogram[bins - 1 - j] = 0;  // only this thread reads this bin
    thread_total += counts[i];
  }
  uint32_t before;
  BlockScan(scan_storage).ExclusiveSum(thread_total, before);
#pragma unroll
  for (int i = 0; i < kBinsPerThread; ++i) {
    // The first j whose inclusive suffix count reaches `need`: exactly one thread sees it.
    if (before < need && before + counts[i] >= need) {
      const uint32_t bin = bins - 1 - (threadIdx.x * kBinsPerThread + i);
      RowState next = current;
      next.prefix = (current.prefix << width) | bin;
      next.above = current.above + before;
      next.in_range = counts[i];
      if (first) {
        const uint32_t at_least_lo = next.above + next.in_range;  // C(lo) <= n < 2^31
        next.candidates = at_least_lo <= capacity ? at_least_lo : kNoCandidates;
        next.filled = 0;
      }
      state[row] = next;
    }
    before += counts[i];
  }
}

__global__ void write_threshold_kernel(const RowState* __restrict__ state, int64_t rows, int rounds,
                                       float* __restrict__ threshold, int32_t* __restrict__ count) {
  const int64_t row = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (row >= rows) return;
  const RowState s = state[row];
  threshold[row] = __uint_as_float(s.prefix << (kKeyBits - rounds));
  count[row] = static_cast<int32_t>(s.above + s.in_range);
}

struct Bracket {
  uint32_t lo, hi;  // keys >= hi are always selected, keys in [lo, hi) fill up to k
};

__device__ __forceinline__ Bracket bracket_of(const RowState& s, int rounds) {
  const int step_shift = kKeyBits - rounds;
  const uint32_t lo = s.prefix << step_shift;
  return {lo, lo + (1u << step_shift)};  // hi <= 2^31 fits in 32 bits
}

// Packs (key >= hi) in the low and (lo <= key < hi) in the high 16 bits of a tile count.
__device__ __forceinline__ uint32_t classify(uint32_t key, Bracket b) {
  return key >= b.hi ? 1u : (key >= b.lo ? (1u << 16) : 0u);
}

// Per tile, from its last-pass histogram: how many entries are above the final bracket and how
// many are in it, packed as (above) | (in bracket) << 32. One warp per tile.
__global__ void __launch_bounds__(kThreads) tile_counts_kernel(const uint32_t* __restrict__ tile_histograms,
                                                               int64_t tiles, int64_t tiles_per_row,
                                                               const RowState* __restrict__ state, int width,
                                                               uint64_t* __restrict__ tile_counts) {
  const int64_t tile = (int64_t{blockIdx.x} * kThreads + threadIdx.x) / 32;
  if (tile >= tiles) return;  // whole warps: `tile` is the same on every lane
  const int lane = threadIdx.x % 32;
  const uint32_t bins = 1u << width;
  const uint32_t digit = state[tile / tiles_per_row].prefix & (bins - 1);  // the last pass's digit
  const uint32_t* tile_histogram = tile_histograms + tile * (bins + 1);
  uint32_t above = 0;
  for (uint32_t b = digit + 1 + lane; b < bins; b += 32) above += tile_histogram[b];
  above = __reduce_add_sync(0xFFFFFFFFu, above);
  if (lane == 0) {
    above += tile_histogram[bins];  // keys already above the prefix before the last pass
    // Row-wide sums stay below 2^31 each, so (above, in bracket) pack into 32-bit halves.
    tile_counts[tile] = uint64_t{above} | (uint64_t{tile_histogram[digit]} << 32);
  }
}

// Per tile, straight from memory: the tile_counts_kernel result for rows whose per-tile
// histograms would not fit the scratch budget (one more read of the row instead). One block per
// tile; a tile holds fewer than 2^16 entries, so both counts share one 32-bit word until the end.
template <typename T>
__global__ void __launch_bounds__(kThreads) count_tiles_kernel(const T* __restrict__ x, int64_t n,
                                                               int64_t tiles_per_row,
                                                               const RowState* __restrict__ state, int rounds,
                                                               Candidates<T> candidates,
                                                               uint64_t* __restrict__ tile_counts) {
  __shared__ uint32_t tile_total;
  const int64_t row = blockIdx.x / tiles_per_row;
  const int64_t begin = (blockIdx.x % tiles_per_row) * kTile;
  const int64_t end = n < begin + kTile ? n : begin + kTile;
  const RowState s = state[row];
  const Bracket bracket = bracket_of(s, rounds);
  if (threadIdx.x == 0) tile_total = 0;
  __syncthreads();
  uint32_t packed = 0;
  if (s.candidates != kNoCandidates) {  // every key >= lo of the row is among the tile's candidates
    const uint64_t tile = candidates.tiles[blockIdx.x];
    const T* tile_candidates = candidates.values + row * candidates.capacity + static_cast<uint32_t>(tile);
    const uint32_t size = static_cast<uint32_t>(tile >> 32);
    for (uint32_t i = threadIdx.x; i < size; i += kThreads) packed += classify(magnitude_key(tile_candidates[i]), bracket);
  } else {
    const T* row_x = x + row * n;
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) packed += classify(magnitude_key(row_x[i]), bracket);
  }
  packed = __reduce_add_sync(0xFFFFFFFFu, packed);
  if (threadIdx.x % 32 == 0 && packed != 0) atomicAdd(&tile_total, packed);
  __syncthreads();
  if (threadIdx.x == 0) tile_counts[blockIdx.x] = uint64_t{tile_total & 0xFFFFu} | (uint64_t{tile_total >> 16} << 32);
}

// One block per row: tile counts -> exclusive prefix over the row's tiles, in place.
__global__ void __launch_bounds__(kThreads) scan_tiles_kernel(uint64_t* __restrict__ tile_counts,
                                                              int64_t tiles_per_row) {
  using BlockScan = cub::BlockScan<uint64_t, kThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  uint64_t* row_counts = tile_counts + blockIdx.x * tiles_per_row;
  uint64_t running = 0;
  for (int64_t base = 0; base < tiles_per_row; base += kThreads) {
    const int64_t t = base + threadIdx.x;
    const uint64_t value = t < tiles_per_row ? row_counts[t] : 0;
    uint64_t before, chunk_total;
    BlockScan(scan_storage).ExclusiveSum(value, before, chunk_total);
    if (t < tiles_per_row) row_counts[t] = running + before;
    running += chunk_total;
    __syncthreads();  // scan_storage is reused by the next chunk
  }
}

// Writes the selected entries of one tile at position A_i + min(T_i, need). Two blocks per
// multiprocessor (at most 64 registers a thread): left to itself nvcc took 71, so only one block
// of 512 threads fit and the SM idled through every block's load and scan.
// Two instances: kFromCandidates reads the tile's candidates (rows that kept them; also in index
// order, holding every entry the tile selects, with their indices), the other the tile's values
// (every other row); each skips the other's rows. One kernel for both spilled registers.
constexpr int kSelectionBlocksPerProcessor = 2;
template <typename T, bool kFromCandidates>
__global__ void __launch_bounds__(kThreads, kSelectionBlocksPerProcessor) write_selection_kernel(
    const T* __restrict__ x, int64_t n, int64_t k, int64_t tiles_per_row, const RowState* __restrict__ state,
    int rounds, const uint64_t* __restrict__ tile_offsets, Candidates<T> candidates, T* __restrict__ values,
    int32_t* __restrict__ indices) {
  using BlockLoad = cub::BlockLoad<T, kThreads, kItemsPerThread, cub::BLOCK_LOAD_WARP_TRANSPOSE>;
  using BlockScan = cub::BlockScan<uint32_t, kThreads>;
  __shared__ union {
    typename BlockLoad::TempStorage load;
    typename BlockScan::TempStorage scan;
  } storage;
  const int64_t row = blockIdx.x / tiles_per_row;
  const int64_t begin = (blockIdx.x % tiles_per_row) * kTile;
  const RowState s = state[row];
  if ((s.candidates != kNoCandidates) != kFromCandidates) return;  // the whole block: the other instance's row
  const T* tile_x;
  int valid;
  if constexpr (kFromCandidates) {
    const uint64_t tile = candidates.tiles[blockIdx.x];
    tile_x = candidates.values + row * candidates.capacity + static_cast<uint32_t>(tile);
    valid = static_cast<int>(tile >> 32);
  } else {
    tile_x = x + row * n + begin;
    valid = static_cast<int>(n < begin + kTile ? n - begin : kTile);
  }
  const Bracket bracket = bracket_of(s, rounds);
  const uint32_t need = static_cast<uint32_t>(k) - s.above;
  const uint64_t tile_offset = tile_offsets[blockIdx.x];
  const uint32_t above_before_tile = static_cast<uint32_t>(tile_offset);
  const uint32_t bracket_before_tile = static_cast<uint32_t>(tile_offset >> 32);
  // 32 bits: every index of a tile is below n <= 2^31 - 1 (one register less than 64-bit indices).
  const uint32_t first_index = static_cast<uint32_t>(begin) + threadIdx.x * kItemsPerThread;

  // Blocked arrangement: thread t holds tile entries [t * kItemsPerThread, (t + 1) * kItemsPerThread).
  T items[kItemsPerThread];
  if (valid == kTile) {
    BlockLoad(storage.load).Load(tile_x, items);
  } else {
    BlockLoad(storage.load).Load(tile_x, items, valid, T{});
  }
  __syncthreads();  // storage.load is reused by the scan

  // Classes are recomputed below rather than kept: 16 more live registers would spill.
  auto class_of = [&](int i) {
    const bool in_tile = static_cast<int>(threadIdx.x) * kItemsPerThread + i < valid;
    return in_tile ? classify(magnitude_key(items[i]), bracket) : 0u;
  };
  uint32_t thread_total = 0;
#pragma unroll
  for (int i = 0; i < kItemsPerThread; ++i) thread_total += class_of(i);
  uint32_t before;
  BlockScan(storage.scan).ExclusiveSum(thread_total, before);

  T* row_values = values + row * k;
  int32_t* row_indices = indices + row * k;
  // Formed after the scan, not kept across it: a 64-bit pointer more spilled registers.
  const uint32_t* tile_indices = nullptr;
  if constexpr (kFromCandidates) {
    tile_indices = candidates.indices + row * candidates.capacity + static_cast<uint32_t>(candidates.tiles[blockIdx.x]);
  }
#pragma unroll
  for (int i = 0; i < kItemsPerThread; ++i) {
    const uint32_t above = above_before_tile + (before & 0xFFFFu);
    const uint32_t in_bracket = bracket_before_tile + (before >> 16);
    const uint32_t item_class = class_of(i);
    const bool selected = item_class == 1u || (item_class == (1u << 16) && in_bracket < need);
    const uint32_t position = above + (in_bracket < need ? in_bracket : need);
    if (selected && position < static_cast<uint32_t>(k)) {  // position < k always holds; the check guards memory anyway
      row_values[position] = items[i];
      if constexpr (kFromCandidates) {
        row_indices[position] = static_cast<int32_t>(tile_indices[threadIdx.x * kItemsPerThread + i]);
      } else {
        row_indices[position] = static_cast<int32_t>(first_index + i);
      }
    }
    before += item_class;
  }
}

int64_t tiles_per_row_of(int64_t n) { return (n + kTile - 1) / kTile; }

size_t align_up(size_t bytes) { return (bytes + kScratchAlign - 1) / kScratchAlign * kScratchAlign; }

// Width of the last radix pass: rounds are resolved kDigitBits at a time, the rest at the end.
int last_width(int rounds) { return rounds - kDigitBits * ((rounds - 1) / kDigitBits); }

// Radix passes of a search with `rounds` rounds.
int passes_of(int rounds) { return (rounds + kDigitBits - 1) / kDigitBits; }

// Candidate buffers: an eighth of the row (at least 256 entries, at most the row), within the
// caller's candidate budget (8 bytes a slot: value and index) for the whole chunk.
constexpr int64_t kCandidateFraction = 8;
constexpr int64_t kMinCandidates = 256;
constexpr int64_t kCandidateSlotBytes = sizeof(float) + sizeof(uint32_t);

// Scratch layout for a chunk of `chunk_rows` rows: histograms | states | tile histograms | tile
// counts | tile candidate ranges | candidate values | candidate indices.
struct ScratchLayout {
  uint32_t* histograms;
  RowState* states;
  uint32_t* tile_histograms;
  uint64_t* tile_counts;
  Candidates<float> candidates;  // values: float-sized slots, seen as T by candidates_of<T>
};

// The candidate buffers for input of type T (slots sized for floats hold any T).
template <typename T>
Candidates<T> candidates_of(const ScratchLayout& s) {
  return {reinterpret_cast<T*>(s.candidates.values), s.candidates.indices, s.candidates.tiles, s.candidates.capacity};
}

size_t histogram_bytes(int64_t chunk_rows) { return align_up(chunk_rows * kBins * sizeof(uint32_t)); }
size_t state_bytes(int64_t chunk_rows) { return align_up(chunk_rows * sizeof(RowState)); }
size_t tile_histogram_bytes(int64_t tiles, int rounds) {
  return align_up(tiles * ((int64_t{1} << last_width(rounds)) + 1) * sizeof(uint32_t));
}
size_t tile_count_bytes(int64_t tiles) { return align_up(tiles * sizeof(uint64_t)); }

// How the rows go through scratch: `chunk_rows` at a time; for a selection, whether its per-tile
// counts come from the last pass's per-tile histograms (kept in scratch) or from one more pass
// over the chunk (count_tiles_kernel), which rows too long for the budget take; and the candidate
// slots per row (0: no filtering, when no pass or selection would read the candidates).
struct Plan {
  int64_t chunk_rows;
  bool select;
  bool keep_tiles;
  int64_t candidates;
};

Plan plan_of(bool select, int64_t rows, int64_t n, int rounds, size_t tile_histogram_budget,
             size_t candidate_budget) {
  int64_t chunk = kMaxValuesPerChunk / n;
  chunk = chunk < 1 ? 1 : (chunk > kMaxRowsPerChunk ? kMaxRowsPerChunk : chunk);
  chunk = rows < chunk ? rows : chunk;
  Plan plan{chunk, select, false, 0};
  if (select) {
    const int64_t row_tile_bytes =
        tiles_per_row_of(n) * ((int64_t{1} << last_width(rounds)) + 1) * static_cast<int64_t>(sizeof(uint32_t));
    const int64_t fitting = static_cast<int64_t>(tile_histogram_budget) / row_tile_bytes;
    plan.keep_tiles = fitting >= 1;
    plan.chunk_rows = fitting < 1 ? 1 : (chunk < fitting ? chunk : fitting);
  }
  // The filter pass is the second: candidates pay when a third pass or the selection follows it.
  if (passes_of(rounds) >= (select ? 2 : 3)) {
    int64_t slots = (n + kCandidateFraction - 1) / kCandidateFraction;
    const int64_t least = n < kMinCandidates ? n : kMinCandidates;
    slots = slots < least ? least : slots;
    const int64_t affordable =
        static_cast<int64_t>(candidate_budget / kCandidateSlotBytes) / plan.chunk_rows;
    plan.candidates = slots < affordable ? slots : affordable;
  }
  return plan;
}

ScratchLayout layout_of(void* scratch, const Plan& plan, int64_t n, int rounds) {
  const int64_t tiles = plan.chunk_rows * tiles_per_row_of(n);
  char* at = static_cast<char*>(scratch);
  ScratchLayout layout{};
  layout.histograms = reinterpret_cast<uint32_t*>(at);
  at += histogram_bytes(plan.chunk_rows);
  layout.states = reinterpret_cast<RowState*>(at);
  at += state_bytes(plan.chunk_rows);
  if (plan.keep_tiles) {
    layout.tile_histograms = reinterpret_cast<uint32_t*>(at);
    at += tile_histogram_bytes(tiles, rounds);
  }
  if (plan.select) {
    layout.tile_counts = reinterpret_cast<uint64_t*>(at);
    at += tile_count_bytes(tiles);
  }
  layout.candidates.capacity = plan.candidates;
  if (plan.candidates > 0) {
    layout.candidates.tiles = reinterpret_cast<uint64_t*>(at);
    at += align_up(tiles * sizeof(uint64_t));
    layout.candidates.values = reinterpret_cast<float*>(at);
    at += align_up(plan.chunk_rows * plan.candidates * sizeof(float));
    layout.candidates.indices = reinterpret_cast<uint32_t*>(at);
  }
  return layout;
}

size_t scratch_bytes(const Plan& plan, int64_t n, int rounds) {
  const int64_t tiles = plan.chunk_rows * tiles_per_row_of(n);
  size_t bytes = histogram_bytes(plan.chunk_rows) + state_bytes(plan.chunk_rows);
  if (plan.keep_tiles) bytes += tile_histogram_bytes(tiles, rounds);
  if (plan.select) bytes += tile_count_bytes(tiles);
  if (plan.candidates > 0) {
    bytes += align_up(tiles * sizeof(uint64_t)) + 2 * align_up(plan.chunk_rows * plan.candidates * sizeof(float));
  }
  return bytes;
}

// Runs the radix passes for `chunk_rows` rows starting at `x`, leaving each row's state final,
// the rows' candidates in scratch (those that fit), and, if `keep_tiles`, the last pass's
// per-tile histograms in scratch.
template <typename T>
cudaError_t search(const T* x, int64_t chunk_rows, int64_t n, int64_t k, int rounds, bool keep_tiles,
                   const ScratchLayout& s, cudaStream_t stream) {
  // Zeroed histograms and states: prefix 0 and above 0 are the state before any round. Two
  // memsets: the states sit after histograms sized for the largest chunk, so in a last, smaller
  // chunk one memset from the histograms would stop short of them (issue 12).
  cudaError_t err = cudaMemsetAsync(s.histograms, 0, histogram_bytes(chunk_rows), stream);
  if (err != cudaSuccess) return err;
  err = cudaMemsetAsync(s.states, 0, state_bytes(chunk_rows), stream);
  if (err != cudaSuccess) return err;
  const int64_t tiles = tiles_per_row_of(n);
  const bool filtering = s.candidates.capacity > 0;
  int pass = 0;
  for (int resolved = 0; resolved < rounds; ++pass) {
    const int width = rounds - resolved < kDigitBits ? rounds - resolved : kDigitBits;
    const bool last = resolved + width == rounds;
    const int stage = !filtering || pass == 0 ? kFromValues : (pass == 1 ? kFilter : kFromCandidates);
    auto* kernel = stage == kFromValues ? histogram_kernel<T, kFromValues>
                   : stage == kFilter   ? histogram_kernel<T, kFilter>
                                        : histogram_kernel<T, kFromCandidates>;
    err = launch(kernel, static_cast<unsigned>(chunk_rows * tiles), kThreads, stream, x, n, tiles, s.states,
                 s.histograms, resolved, width, last && keep_tiles ? s.tile_histograms : nullptr,
                 candidates_of<T>(s));
    if (err != cudaSuccess) return err;
    err = launch(select_digit_kernel, static_cast<unsigned>(chunk_rows), kSelectThreads, stream, s.histograms,
                 s.states, k, width, pass == 0, s.candidates.capacity);
    if (err != cudaSuccess) return err;
    resolved += width;
  }
  return cudaSuccess;
}

}  // namespace

size_t select_scratch_bytes(int64_t rows, int64_t n, int rounds, size_t tile_histogram_budget,
                            size_t candidate_budget) {
  return scratch_bytes(plan_of(true, rows, n, rounds, tile_histogram_budget, candidate_budget), n, rounds);
}

size_t threshold_scratch_bytes(int64_t rows, int64_t n, int rounds, size_t candidate_budget) {
  return scratch_bytes(plan_of(false, rows, n, rounds, 0, candidate_budget), n, rounds);
}

int64_t select_candidate_slots(int64_t rows, int64_t n, int rounds, size_t tile_histogram_budget,
                               size_t candidate_budget) {
  return plan_of(true, rows, n, rounds, tile_histogram_budget, candidate_budget).candidates;
}

namespace {

template <typename T>
cudaError_t select_chunks(const T* x, int64_t rows, int64_t n, int64_t k, int rounds, T* values,
                          int32_t* indices, void* scratch, cudaStream_t stream, size_t tile_histogram_budget,
                          size_t candidate_budget) {
  const Plan plan = plan_of(true, rows, n, rounds, tile_histogram_budget, candidate_budget);
  const ScratchLayout s = layout_of(scratch, plan, n, rounds);
  const Candidates<T> candidates = candidates_of<T>(s);
  const int64_t tiles_per_row = tiles_per_row_of(n);
  for (int64_t first = 0; first < rows; first += plan.chunk_rows) {
    const int64_t chunk_rows = rows - first < plan.chunk_rows ? rows - first : plan.chunk_rows;
    const T* chunk_x = x + first * n;
    const int64_t tiles = chunk_rows * tiles_per_row;
    if (tiles > INT32_MAX) return cudaErrorInvalidConfiguration;
    cudaError_t err = search(chunk_x, chunk_rows, n, k, rounds, plan.keep_tiles, s, stream);
    if (err != cudaSuccess) return err;
    if (plan.keep_tiles) {
      constexpr int64_t kTilesPerBlock = kThreads / 32;
      err = launch(tile_counts_kernel, static_cast<unsigned>((tiles + kTilesPerBlock - 1) / kTilesPerBlock),
                   kThreads, stream, s.tile_histograms, tiles, tiles_per_row, s.states, last_width(rounds),
                   s.tile_counts);
    } else {
      err = launch(count_tiles_kernel<T>, static_cast<unsigned>(tiles), kThreads, stream, chunk_x, n, tiles_per_row,
                   s.states, rounds, candidates, s.tile_counts);
    }
    if (err != cudaSuccess) return err;
    err = launch(scan_tiles_kernel, static_cast<unsigned>(chunk_rows), kThreads, stream, s.tile_counts, tiles_per_row);
    if (err != cudaSuccess) return err;
    err = launch(write_selection_kernel<T, false>, static_cast<unsigned>(tiles), kThreads, stream, chunk_x, n, k,
                 tiles_per_row, s.states, rounds, s.tile_counts, candidates, values + first * k, indices + first * k);
    if (err != cudaSuccess) return err;
    if (plan.candidates > 0) {
      err = launch(write_selection_kernel<T, true>, static_cast<unsigned>(tiles), kThreads, stream, chunk_x, n, k,
                   tiles_per_row, s.states, rounds, s.tile_counts, candidates, values + first * k,
                   indices + first * k);
      if (err != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

template <typename T>
cudaError_t threshold_chunks(const T* x, int64_t rows, int64_t n, int64_t k, int rounds, float* threshold,
                             int32_t* count, void* scratch, cudaStream_t stream, size_t candidate_budget) {
  const Plan plan = plan_of(false, rows, n, rounds, 0, candidate_budget);
  const ScratchLayout s = layout_of(scratch, plan, n, rounds);
  for (int64_t first = 0; first < rows; first += plan.chunk_rows) {
    const int64_t chunk_rows = rows - first < plan.chunk_rows ? rows - first : plan.chunk_rows;
    if (chunk_rows * tiles_per_row_of(n) > INT32_MAX) return cudaErrorInvalidConfiguration;
    cudaError_t err = search(x + first * n, chunk_rows, n, k, rounds, /*keep_tiles=*/false, s, stream);
    if (err != cudaSuccess) return err;
    constexpr int kRowThreads = 256;
    err = launch(write_threshold_kernel, static_cast<unsigned>((chunk_rows + kRowThreads - 1) / kRowThreads),
                 kRowThreads, stream, s.states, chunk_rows, rounds, threshold + first, count + first);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

Status select_topk(Element type, const void* x, int64_t rows, int64_t n, int64_t k, int rounds, void* values,
                   int32_t* indices, void* scratch, cudaStream_t stream, size_t tile_histogram_budget,
                   size_t candidate_budget) {
  cudaError_t err = cudaErrorInvalidValue;
  switch (type) {
    case Element::kF32:
      err = select_chunks(static_cast<const float*>(x), rows, n, k, rounds, static_cast<float*>(values), indices,
                          scratch, stream, tile_histogram_budget, candidate_budget);
      break;
    case Element::kBF16:
      err = select_chunks(static_cast<const Bf16*>(x), rows, n, k, rounds, static_cast<Bf16*>(values), indices,
                          scratch, stream, tile_histogram_budget, candidate_budget);
      break;
    case Element::kF16:
      err = select_chunks(static_cast<const F16*>(x), rows, n, k, rounds, static_cast<F16*>(values), indices,
                          scratch, stream, tile_histogram_budget, candidate_budget);
      break;
  }
  return StatusOf(err, "jaxcomp top-k kernels");
}

Status select_topk(const float* x, int64_t rows, int64_t n, int64_t k, int rounds, float* values, int32_t* indices,
                   void* scratch, cudaStream_t stream, size_t tile_histogram_budget, size_t candidate_budget) {
  return select_topk(Element::kF32, x, rows, n, k, rounds, values, indices, scratch, stream, tile_histogram_budget,
                     candidate_budget);
}

Status find_threshold(Element type, const void* x, int64_t rows, int64_t n, int64_t k, int rounds, float* threshold,
                      int32_t* count, void* scratch, cudaStream_t stream, size_t candidate_budget) {
  cudaError_t err = cudaErrorInvalidValue;
  switch (type) {
    case Element::kF32:
      err = threshold_chunks(static_cast<const float*>(x), rows, n, k, rounds, threshold, count, scratch, stream,
                             candidate_budget);
      break;
    case Element::kBF16:
      err = threshold_chunks(static_cast<const Bf16*>(x), rows, n, k, rounds, threshold, count, scratch, stream,
                             candidate_budget);
      break;
    case Element::kF16:
      err = threshold_chunks(static_cast<const F16*>(x), rows, n, k, rounds, threshold, count, scratch, stream,
                             candidate_budget);
      break;
  }
  return StatusOf(err, "jaxcomp threshold kernels");
}

Status find_threshold(const float* x, int64_t rows, int64_t n, int64_t k, int rounds, float* threshold,
                      int32_t* count, void* scratch, cudaStream_t stream, size_t candidate_budget) {
  return find_threshold(Element::kF32, x, rows, n, k, rounds, threshold, count, scratch, stream, candidate_budget);
}

}  // namespace jaxcomp::cuda
