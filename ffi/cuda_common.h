// Helpers shared by the CUDA adapters: launch errors and scratch as ffi::Error, result shapes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "ffi/common.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomp_ffi {

// A CUDA error from enqueueing kernels, as the ffi::Error XLA reports to the user.
inline ffi::Error FromCuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

// `bytes` of device scratch from XLA's allocator (freed when the handler returns; the work it
// enqueued on XLA's stream is ordered before any later reuse of that memory).
inline ffi::ErrorOr<void*> AllocateScratch(ffi::ScratchAllocator& scratch, size_t bytes) {
  std::optional<void*> memory = scratch.Allocate(bytes, /*alignment=*/256);
  if (!memory.has_value() || *memory == nullptr) {
    return ffi::Unexpected<ffi::Error>(ffi::Error(
        ffi::ErrorCode::kResourceExhausted,
        "jaxcomp could not allocate " + std::to_string(bytes) + " bytes of GPU scratch memory"));
  }
  return *memory;
}

// Checks that a result is [rows..., last] with the same leading dimensions as the operand.
template <typename OperandDims, typename ResultDims>
inline ffi::Error CheckResultDims(const OperandDims& operand, const ResultDims& result, int64_t last,
                                  const char* name) {
  bool ok = result.size() == operand.size();
  for (size_t i = 0; ok && i + 1 < operand.size(); ++i) ok = result[i] == operand[i];
  if (ok && result.size() > 0) ok = result.back() == last;
  if (!ok) {
    return ffi::Error::InvalidArgument(std::string(name) + " must have the operand's leading dimensions and " +
                                       std::to_string(last) + " in its last");
  }
  return ffi::Error::Success();
}

// Like CheckResultDims for a result with the operand's leading dimensions only ([rows...]).
template <typename OperandDims, typename ResultDims>
inline ffi::Error CheckRowResultDims(const OperandDims& operand, const ResultDims& result, const char* name) {
  bool ok = result.size() + 1 == operand.size();
  for (size_t i = 0; ok && i < result.size(); ++i) ok = result[i] == operand[i];
  if (!ok) return ffi::Error::InvalidArgument(std::string(name) + " must have the operand's leading dimensions");
  return ffi::Error::Success();
}

}  // namespace jaxcomp_ffi
