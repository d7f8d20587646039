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

// Alignment of the scratch the kernels get (they carve it into pieces at this alignment).
inline constexpr size_t kScratchAlignment = 256;

// XLA's FFI allocator refuses alignments above 16 bytes ("Unsupported alignment",
// kMaxAlignment in xla/ffi/ffi_api.cc), so ask for kScratchAlignment - 1 more bytes at 16 and
// round the address up inside them.
inline constexpr size_t kXlaScratchAlignment = 16;

// `bytes` of device scratch from XLA's allocator, kScratchAlignment-aligned (freed when the
// handler returns; the work it enqueued on XLA's stream is ordered before any later reuse of that
// memory).
inline ffi::ErrorOr<void*> AllocateScratch(ffi::ScratchAllocator& scratch, size_t bytes) {
  std::optional<void*> memory =
      scratch.Allocate(bytes + kScratchAlignment - 1, kXlaScratchAlignment);
  if (!memory.has_value() || *memory == nullptr) {
    return ffi::Unexpected<ffi::Error>(ffi::Error(
        ffi::ErrorCode::kResourceExhausted,
        "jaxcomp could not allocate " + std::to_string(bytes) + " bytes of GPU scratch memory"));
  }
  const uintptr_t address = reinterpret_cast<uintptr_t>(*memory);
  const uintptr_t mask = static_cast<uintptr_t>(kScratchAlignment - 1);
  return reinterpret_cast<void*>((address + mask) & ~mask);
}

}  // namespace jaxcomp_ffi
