// Small helpers shared by the CPU and CUDA adapters: row shapes and argument checks that
// return ffi::Error (handlers never throw).
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxcomp_ffi {

namespace ffi = xla::ffi;

// A buffer seen as `rows` independent rows of `n` values along its last axis.
struct Rows {
  int64_t rows = 0;
  int64_t n = 0;
};

template <typename Dims>
inline ffi::ErrorOr<Rows> RowsOf(const Dims& dims, const char* name) {
  if (dims.size() == 0) {
    return ffi::Unexpected<ffi::Error>(
        ffi::Error::InvalidArgument(std::string(name) + " must have at least one dimension"));
  }
  Rows r;
  r.n = dims.back();
  r.rows = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) r.rows *= dims[i];
  if (r.n < 1 || r.n > INT32_MAX) {
    return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(
        std::string(name) + "'s last dimension must be in [1, 2^31 - 1], got " + std::to_string(r.n)));
  }
  return r;
}

inline ffi::Error CheckRange(int64_t value, int64_t lo, int64_t hi, const char* name) {
  if (value < lo || value > hi) {
    return ffi::Error::InvalidArgument(std::string(name) + " must be in [" + std::to_string(lo) + ", " +
                                       std::to_string(hi) + "], got " + std::to_string(value));
  }
  return ffi::Error::Success();
}

// Checks that a result has exactly the shape of an operand.
template <typename Dims, typename ResultDims>
inline ffi::Error CheckSameShape(const Dims& dims, const ResultDims& result, const char* name) {
  bool ok = dims.size() == result.size();
  for (size_t i = 0; ok && i < dims.size(); ++i) ok = dims[i] == result[i];
  return ok ? ffi::Error::Success()
            : ffi::Error::InvalidArgument(std::string(name) + " must have the operand's shape");
}

}  // namespace jaxcomp_ffi
