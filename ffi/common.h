// Small helpers shared by the CPU and CUDA adapters: row shapes, argument checks, the one check
// of result shapes and the one mapping of a kernel's jaxcomp::Status to ffi::Error (handlers
// never throw).
#pragma once

#include <cstdint>
#include <string>

#include "kernels/status.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomp_ffi {

namespace ffi = xla::ffi;

// A kernel's status as the ffi::Error XLA reports to the user: the only place kernels/' status
// codes meet XLA's.
inline ffi::Error ToError(const jaxcomp::Status& status) {
  switch (status.code()) {
    case jaxcomp::StatusCode::kOk:
      return ffi::Error::Success();
    case jaxcomp::StatusCode::kInvalidArgument:
      return ffi::Error::InvalidArgument(status.message());
    case jaxcomp::StatusCode::kResourceExhausted:
      return ffi::Error(ffi::ErrorCode::kResourceExhausted, status.message());
    case jaxcomp::StatusCode::kInternal:
      break;
  }
  return ffi::Error::Internal(status.message());
}

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

// What follows the operand's leading dimensions in a result: a row of `length` values, named
// `name` in messages (k, n, words per row), or nothing (one value per row).
struct RowAxis {
  int64_t length = -1;  // -1: no row axis
  const char* name = "";
};
inline RowAxis NoRowAxis() { return RowAxis{}; }

// The one result-shape check of every handler: `result` must be the operand's leading
// dimensions followed by `row` (XLA allocates results from the shapes Python declared, so this
// guards direct ffi_calls that bypass the Python checks).
template <typename OperandDims, typename ResultDims>
inline ffi::Error CheckResultShape(const OperandDims& operand, const char* operand_name, const ResultDims& result,
                                   const char* name, RowAxis row) {
  const size_t batch = operand.size() - 1;  // operands have at least one dimension (RowsOf)
  bool ok = result.size() == batch + (row.length >= 0 ? 1 : 0);
  for (size_t i = 0; ok && i < batch; ++i) ok = result[i] == operand[i];
  if (ok && row.length >= 0) ok = result[batch] == row.length;
  if (ok) return ffi::Error::Success();
  std::string got;
  for (size_t i = 0; i < result.size(); ++i) got += (i ? ", " : "") + std::to_string(result[i]);
  return ffi::Error::InvalidArgument(
      std::string(name) + " must have " + operand_name + "'s leading dimensions" +
      (row.length >= 0 ? std::string(" followed by ") + row.name + " = " + std::to_string(row.length) : "") +
      ", got shape [" + got + "]");
}

}  // namespace jaxcomp_ffi
