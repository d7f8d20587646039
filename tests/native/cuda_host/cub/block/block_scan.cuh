// Host stand-in for cub::BlockScan (see ../../cuda_runtime_api.h): the same results as CUB's
// ExclusiveSum, computed through shared storage between two barriers, so a caller that reuses the
// storage without its own __syncthreads() reads another scan's values in some thread order.
#pragma once

#include "cuda_runtime_api.h"

namespace cub {

template <typename T, int kBlockThreads>
class BlockScan {
 public:
  struct TempStorage {
    T lanes[kBlockThreads];
    T before[kBlockThreads];
    T total;
    unsigned long long scanned_at;  // the emulator's barrier count when `before` was computed
  };

  explicit BlockScan(TempStorage& storage) : storage_(storage) {}

  void ExclusiveSum(T input, T& output) {
    T aggregate;
    ExclusiveSum(input, output, aggregate);
  }

  void ExclusiveSum(T input, T& output, T& aggregate) {
    const unsigned t = threadIdx.x;
    storage_.lanes[t] = input;
    __syncthreads();
    // Threads run one at a time: the first to wake after the barrier scans for all of them.
    const unsigned long long now = ::cuda_host::machine().barriers;
    if (storage_.scanned_at != now) {
      T total = T(0);
      for (int i = 0; i < kBlockThreads; ++i) {
        storage_.before[i] = total;
        total += storage_.lanes[i];
      }
      storage_.total = total;
      storage_.scanned_at = now;
    }
    output = storage_.before[t];
    aggregate = storage_.total;
  }

 private:
  TempStorage& storage_;
};

}  // namespace cub
