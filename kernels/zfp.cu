// CUDA ZFP-style fixed-rate codec: one block of 4 values per thread, on the block codec of
// kernels/zfp_block.h (the CPU codec's own code, so the words are bit-identical).
//
// Fixed rate gives block b of a row the bit offset header + b * 4 * rate, so blocks need no
// coordination. A warp takes 32 consecutive blocks: 32 * 4 * rate bits are exactly 4 * rate whole
// words, so each warp owns its words outright. Lanes assemble them in shared memory (only the
// word two neighbouring blocks share is contended, hence atomicOr) and the warp then moves them
// to or from global memory in coalesced runs; each lane reads or writes its 4 floats as one
// 16-byte access where the row's alignment allows.
#include <cstdint>

#include "kernels/cuda_launch.h"
#include "kernels/zfp_block.h"
#include "kernels/zfp_cuda.h"

namespace jaxcomp::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarp * kWarpsPerBlock;
constexpr int kMaxGroupWords = 4 * 32;  // 32 blocks x 4 values x rate 32 / 32 bits

// The code tables live in global memory, each direction's half in one 16-byte-aligned struct;
// every thread block copies its half into shared memory once, with 16-byte loads of consecutive
// addresses (the lanes of a warp read one contiguous 512-byte run), and then codes many groups
// (the kernels are persistent: grid-stride loops over a grid the GPU holds at once). From
// __constant__ memory, lanes reading different addresses were serialized by the constant cache.
__device__ const zfp::EncodeTables kEncodeTables = zfp::make_encode_tables();
__device__ const zfp::DecodeTables kDecodeTables = zfp::make_decode_tables();

template <typename Tables>
__device__ __forceinline__ void load_tables(const Tables& from, Tables& to) {
  const uint4* source = reinterpret_cast<const uint4*>(&from);
  uint4* target = reinterpret_cast<uint4*>(&to);
  for (int i = threadIdx.x; i < static_cast<int>(sizeof(Tables) / sizeof(uint4)); i += kThreads) target[i] = source[i];
}

// A zfp_block.h writer into a warp's zeroed shared words: ORs each completed word in, so the one
// word a neighbouring lane's block also touches stays correct. Zero words are skipped (padding).
struct SharedOrWriter {
  uint32_t* next;
  uint64_t window;
  int fill;

  __device__ SharedOrWriter(uint32_t* words, int bit_offset)
      : next(words + (bit_offset >> 5)), window(0), fill(bit_offset & 31) {}

  __device__ void write(uint32_t value, int count) {
    window |= static_cast<uint64_t>(value) << fill;
    fill += count;
    if (fill >= 32) {
      const uint32_t word = static_cast<uint32_t>(window);
      if (word != 0) atomicOr(next, word);
      ++next;
      window >>= 32;
      fill -= 32;
    }
  }

  __device__ void pad(int count) {
    for (; count > 32; count -= 32) write(0, 32);
    write(0, count);
  }

  __device__ void flush() {
    const uint32_t word = static_cast<uint32_t>(window);
    if (fill != 0 && word != 0) atomicOr(next, word);
  }
};

// Where a warp's 32 blocks live: row, first block, and the words they occupy.
struct Group {
  int64_t row;
  int64_t first_block;
  int64_t first_word;  // within the row, after the header word (if any)
  int words;           // words this group owns (fewer for a row's last group)
};

__device__ __forceinline__ Group group_at(int64_t group, int64_t blocks, int64_t groups_per_row, int rate) {
  Group g;
  g.row = group / groups_per_row;
  const int64_t index = group % groups_per_row;
  g.first_block = index * kWarp;
  g.first_word = index * 4 * rate;
  const int64_t block_words = (blocks * 4 * rate + 31) / 32;  // words of all the row's blocks
  const int64_t left = block_words - g.first_word;
  g.words = static_cast<int>(left < 4 * rate ? left : 4 * rate);
  return g;
}

// This warp's first group and the stride between its groups (a grid-stride loop over warps).
__device__ __forceinline__ int64_t first_group() { return (int64_t{blockIdx.x} * kThreads + threadIdx.x) / kWarp; }
__device__ __forceinline__ int64_t group_stride() { return int64_t{gridDim.x} * kWarpsPerBlock; }

// The 4 values of block `block` as bits, padded like zfp's pad_block for a partial last block.
__device__ __forceinline__ void load_values(const float* row_x, int64_t n, int64_t block, uint32_t* value_bits) {
  const float* first = row_x + block * 4;
  if (block * 4 + 4 <= n && reinterpret_cast<uintptr_t>(first) % 16 == 0) {
    const float4 v = *reinterpret_cast<const float4*>(first);
    value_bits[0] = __float_as_uint(v.x);
    value_bits[1] = __float_as_uint(v.y);
    value_bits[2] = __float_as_uint(v.z);
    value_bits[3] = __float_as_uint(v.w);
  } else {
    zfp::load_block(row_x, n, block, value_bits);
  }
}

__device__ __forceinline__ void store_values(float* row_x, int64_t n, int64_t block, const float* values) {
  float* first = row_x + block * 4;
  if (block * 4 + 4 <= n && reinterpret_cast<uintptr_t>(first) % 16 == 0) {
    *reinterpret_cast<float4*>(first) = make_float4(values[0], values[1], values[2], values[3]);
  } else {
    const int64_t count = n - block * 4 < 4 ? n - block * 4 : 4;
    for (int i = 0; i < count; ++i) first[i] = values[i];
  }
}

// Rates 1-2, pass 1: the largest magnitude key of every row, atomicMax'ed into the row's (zeroed)
// header word.
__global__ void __launch_bounds__(kThreads) row_max_kernel(const float* __restrict__ x, int64_t n,
                                                           int64_t tiles_per_row, int64_t tile,
                                                           uint32_t* __restrict__ words, int64_t row_words) {
  const int64_t row = blockIdx.x / tiles_per_row;
  const int64_t begin = (blockIdx.x % tiles_per_row) * tile;
  const int64_t end = n < begin + tile ? n : begin + tile;
  const float* row_x = x + row * n;
  uint32_t local = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    local = max(local, zfp::magnitude_key(__float_as_uint(row_x[i])));
  }
  for (int offset = kWarp / 2; offset > 0; offset /= 2) local = max(local, __shfl_xor_sync(0xFFFFFFFFu, local, offset));
  if (threadIdx.x % kWarp == 0 && local != 0) atomicMax(&words[row * row_words], local);
}

__global__ void zero_headers_kernel(uint32_t* __restrict__ words, int64_t rows, int64_t row_words) {
  const int64_t row = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (row < rows) words[row * row_words] = 0;
}

// Rates 1-2, pass 3: the row's largest key -> the header word of docs/kernels.md.
__global__ void row_header_kernel(uint32_t* __restrict__ words, int64_t rows, int64_t row_words) {
  const int64_t row = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (row < rows) words[row * row_words] = zfp::row_header(words[row * row_words]);
}

// One block per lane, one group of 32 blocks per warp, warps striding over all groups. At rates
// 1-2 the header word holds the row's largest key here (row_header_kernel turns it into the
// header afterwards).
__global__ void __launch_bounds__(kThreads) encode_kernel(const float* __restrict__ x, int64_t rows, int64_t n,
                                                          int rate, uint32_t* __restrict__ words) {
  __shared__ zfp::EncodeTables tables;
  __shared__ uint32_t staged[kWarpsPerBlock][kMaxGroupWords];
  load_tables(kEncodeTables, tables);
  __syncthreads();

  const int lane = threadIdx.x % kWarp;
  uint32_t* group_words = staged[threadIdx.x / kWarp];
  const int64_t blocks = (n + 3) / 4;
  const int64_t groups_per_row = (blocks + kWarp - 1) / kWarp;
  const int64_t header = zfp::header_words(rate);
  const int64_t row_words = zfp::row_words(n, rate);
  const int block_bits = 4 * rate;
  // Uniform across a warp: every lane runs the same iterations.
  for (int64_t group = first_group(); group < rows * groups_per_row; group += group_stride()) {
    const Group g = group_at(group, blocks, groups_per_row, rate);
    for (int i = lane; i < 4 * rate; i += kWarp) group_words[i] = 0;
    __syncwarp();
    uint32_t* row_out = words + g.row * row_words;
    const int64_t block = g.first_block + lane;
    if (block < blocks) {
      uint32_t value_bits[4];
      load_values(x + g.row * n, n, block, value_bits);
      SharedOrWriter out(group_words, lane * block_bits);
      if (rate >= 3) {
        zfp::encode_block(value_bits, block_bits, tables, out);
      } else {
        const uint32_t row_header = zfp::row_header(row_out[0]);
        // A zero or non-finite row encodes every block as zero bits.
        if (row_header != 0 && row_header != zfp::kNonFiniteRowHeader) {
          zfp::encode_coefficients(value_bits, static_cast<int>(row_header) - 127, block_bits, tables, out);
        }
      }
      out.flush();
    }
    __syncwarp();
    for (int i = lane; i < g.words; i += kWarp) row_out[header + g.first_word + i] = group_words[i];
    __syncwarp();  // the words are read before the next group zeroes them
  }
}

__global__ void __launch_bounds__(kThreads) decode_kernel(const uint32_t* __restrict__ words, int64_t rows,
                                                          int64_t n, int rate, float* __restrict__ x) {
  __shared__ zfp::DecodeTables tables;
  __shared__ uint32_t staged[kWarpsPerBlock][kMaxGroupWords];
  load_tables(kDecodeTables, tables);
  __syncthreads();

  const int lane = threadIdx.x % kWarp;
  uint32_t* group_words = staged[threadIdx.x / kWarp];
  const int64_t blocks = (n + 3) / 4;
  const int64_t groups_per_row = (blocks + kWarp - 1) / kWarp;
  const int64_t header = zfp::header_words(rate);
  const int64_t row_words = zfp::row_words(n, rate);
  const int block_bits = 4 * rate;
  for (int64_t group = first_group(); group < rows * groups_per_row; group += group_stride()) {
    const Group g = group_at(group, blocks, groups_per_row, rate);
    const uint32_t* row_in = words + g.row * row_words;
    for (int i = lane; i < g.words; i += kWarp) group_words[i] = row_in[header + g.first_word + i];
    __syncwarp();
    const int64_t block = g.first_block + lane;
    if (block < blocks) {
      zfp::BitReader in(group_words, g.words, lane * block_bits);
      float values[4];
      if (rate >= 3) {
        zfp::decode_block(in, block_bits, tables, values);
      } else {
        const uint32_t row_header = row_in[0];
        if (row_header == 0 || row_header > 0xFF) {
          const float fill = row_header == 0 ? 0.0f : __uint_as_float(0x7FC00000u);
          for (int i = 0; i < 4; ++i) values[i] = fill;
        } else {
          zfp::decode_coefficients(in, static_cast<int>(row_header) - 127, block_bits, tables, values);
        }
      }
      store_values(x + g.row * n, n, block, values);
    }
    __syncwarp();  // the staged words are read before the next group overwrites them
  }
}

// Thread blocks for the coders: enough to cover every row's groups of 32 zfp blocks, at most
// what the GPU keeps resident at once (the kernels loop over the rest); 0 if nothing to do.
cudaError_t group_grid(int64_t rows, int64_t n, unsigned* grid) {
  const int64_t groups = rows * (((n + 3) / 4 + kWarp - 1) / kWarp);
  const int64_t thread_blocks = (groups + kWarpsPerBlock - 1) / kWarpsPerBlock;
  int device = 0, processors = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&processors, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  // 2048 resident threads per multiprocessor on sm_80/sm_90; shared memory (at most 16.3 KB a
  // block) allows as many blocks.
  constexpr int64_t kBlocksPerProcessor = 2048 / kThreads;
  const int64_t resident = int64_t{processors} * kBlocksPerProcessor;
  *grid = static_cast<unsigned>(thread_blocks < resident ? thread_blocks : resident);
  return cudaSuccess;
}

cudaError_t encode_rows(const float* x, int64_t rows, int64_t n, int rate, uint32_t* words, cudaStream_t stream) {
  unsigned grid = 0;
  cudaError_t err = group_grid(rows, n, &grid);
  if (err != cudaSuccess || grid == 0) return err;
  const int64_t row_words = zfp::row_words(n, rate);
  const unsigned row_blocks = static_cast<unsigned>((rows + kThreads - 1) / kThreads);
  if (rate <= 2) {
    // Header words (one per row, row_words apart) start at 0 for the atomicMax.
    err = launch(zero_headers_kernel, row_blocks, kThreads, stream, words, rows, row_words);
    if (err != cudaSuccess) return err;
    constexpr int64_t kTile = int64_t{kThreads} * 16;
    const int64_t tiles_per_row = (n + kTile - 1) / kTile;
    if (rows * tiles_per_row > INT32_MAX) return cudaErrorInvalidConfiguration;
    err = launch(row_max_kernel, static_cast<unsigned>(rows * tiles_per_row), kThreads, stream, x, n, tiles_per_row,
                 kTile, words, row_words);
    if (err != cudaSuccess) return err;
  }
  err = launch(encode_kernel, grid, kThreads, stream, x, rows, n, rate, words);
  if (err != cudaSuccess || rate > 2) return err;
  return launch(row_header_kernel, row_blocks, kThreads, stream, words, rows, row_words);
}

cudaError_t decode_rows(const uint32_t* words, int64_t rows, int64_t n, int rate, float* x, cudaStream_t stream) {
  unsigned grid = 0;
  cudaError_t err = group_grid(rows, n, &grid);
  if (err != cudaSuccess || grid == 0) return err;
  return launch(decode_kernel, grid, kThreads, stream, words, rows, n, rate, x);
}

}  // namespace

int64_t zfp_num_words(int64_t n, int rate) { return zfp::row_words(n, rate); }

Status zfp_encode(const float* x, int64_t rows, int64_t n, int rate, uint32_t* words, cudaStream_t stream) {
  return StatusOf(encode_rows(x, rows, n, rate, words, stream), "jaxcomp zfp_encode kernels");
}

Status zfp_decode(const uint32_t* words, int64_t rows, int64_t n, int rate, float* x, cudaStream_t stream) {
  return StatusOf(decode_rows(words, rows, n, rate, x, stream), "jaxcomp zfp_decode kernels");
}

}  // namespace jaxcomp::cuda
