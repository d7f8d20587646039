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
    T before = T(0), total = T(0);
    for (int i = 0; i < kBlockThreads; ++i) {
      if (static_cast<unsigned>(i) == t) before = total;
      total += storage_.lanes[i];
    }
    output = before;
    aggregate = total;
  }

 private:
  TempStorage& storage_;
};

}  // namespace cub
