// Host stand-in for cub::BlockLoad (see ../../cuda_runtime_api.h): the blocked arrangement CUB
// produces (thread t holds items [t * kItems, (t + 1) * kItems)), guarded loads filled with
// `oob_default` past `valid_items`. The transposing algorithms' shared storage is kept (and
// written), so callers must still separate its reuse by a barrier.
#pragma once

#include "cuda_runtime_api.h"

namespace cub {

enum BlockLoadAlgorithm { BLOCK_LOAD_DIRECT, BLOCK_LOAD_WARP_TRANSPOSE };

template <typename T, int kBlockThreads, int kItems, BlockLoadAlgorithm kAlgorithm>
class BlockLoad {
 public:
  struct TempStorage {
    T staged[kBlockThreads * kItems];
  };

  explicit BlockLoad(TempStorage& storage) : storage_(storage) {}

  void Load(const T* source, T (&items)[kItems]) { Load(source, items, kBlockThreads * kItems, T()); }

  void Load(const T* source, T (&items)[kItems], int valid_items, T oob_default) {
    // CUB's warp transpose: each warp loads its part of the tile into its region of the shared
    // storage, synchronizes the warp, and each lane reads its items back. The read comes after
    // the warp barrier here too, so a caller that reuses the storage (a scan) before every
    // thread has read back, without __syncthreads() in between, corrupts items in some order.
    const int first = static_cast<int>(threadIdx.x) * kItems;
    for (int i = 0; i < kItems; ++i) storage_.staged[first + i] = first + i < valid_items ? source[first + i] : oob_default;
    __syncwarp();
    for (int i = 0; i < kItems; ++i) items[i] = storage_.staged[first + i];
  }

 private:
  TempStorage& storage_;
};

}  // namespace cub
