// Helpers of the CUDA adapters: device scratch from XLA as ffi::Error (launch errors come back
// from kernels/ as a jaxcomp::Status, mapped by ToError in ffi/common.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "ffi/common.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomp_ffi {

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

}  // namespace jaxcomp_ffi
