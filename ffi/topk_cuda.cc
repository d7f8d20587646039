// XLA FFI adapters of the CUDA top-k and threshold kernels (kernels/topk.cu).
//
// x may be float32, bfloat16 or float16: the kernels read 16-bit input directly (no upcast pass)
// and write the selected values in x's type. Any other type is an InvalidArgument error.
//
// They use ScratchAllocator, so they are not marked command-buffer compatible: scratch handed
// out while XLA captures a CUDA graph is freed when the handler returns, yet the graph would keep
// using it on every replay.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "ffi/common.h"
#include "ffi/cuda_common.h"
#include "ffi/cuda_handlers.h"
#include "kernels/topk_cuda.h"

namespace ffi = xla::ffi;
using jaxcomp_ffi::AllocateScratch;
using jaxcomp_ffi::CheckRange;
using jaxcomp_ffi::CheckResultShape;
using jaxcomp_ffi::NoRowAxis;
using jaxcomp_ffi::RowAxis;
using jaxcomp_ffi::Rows;
using jaxcomp_ffi::RowsOf;
using jaxcomp_ffi::ToError;

namespace {

// Exact top-k is the bisection run to the last key bit (docs/kernels.md: rounds = 31).
constexpr int64_t kExactRounds = 31;

using jaxcomp::cuda::Element;

const char* TypeName(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::S32: return "int32";
    default: return nullptr;
  }
}

std::string TypeString(ffi::DataType type) {
  const char* name = TypeName(type);
  return name != nullptr ? name : "XLA FFI data type " + std::to_string(static_cast<int>(type));
}

// The kernels' element type for x: float32, bfloat16 or float16.
ffi::ErrorOr<Element> ElementOf(const ffi::AnyBuffer& x) {
  switch (x.element_type()) {
    case ffi::DataType::F32: return Element::kF32;
    case ffi::DataType::BF16: return Element::kBF16;
    case ffi::DataType::F16: return Element::kF16;
    default:
      return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(
          "x must be float32, bfloat16 or float16, got " + TypeString(x.element_type())));
  }
}

ffi::Error CheckType(const ffi::AnyBuffer& result, ffi::DataType want, const char* name) {
  if (result.element_type() == want) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(name) + " must be " + TypeString(want) + ", got " +
                                     TypeString(result.element_type()));
}

ffi::Error SelectImpl(cudaStream_t stream, ffi::ScratchAllocator& scratch, ffi::AnyBuffer x,
                      ffi::Result<ffi::AnyBuffer> values, ffi::ResultBuffer<ffi::S32> indices, int64_t k,
                      int64_t rounds) {
  ffi::ErrorOr<Element> type = ElementOf(x);
  if (type.has_error()) return type.error();
  // The selected values keep x's type (the kernels copy the input's bits).
  if (ffi::Error e = CheckType(*values, x.element_type(), "values (x's type)"); e.failure()) return e;
  ffi::ErrorOr<Rows> rows = RowsOf(x.dimensions(), "x");
  if (rows.has_error()) return rows.error();
  if (ffi::Error e = CheckRange(k, 1, rows->n, "k"); e.failure()) return e;
  if (ffi::Error e = CheckRange(rounds, 1, kExactRounds, "rounds"); e.failure()) return e;
  if (ffi::Error e = CheckResultShape(x.dimensions(), "x", values->dimensions(), "values", RowAxis{k, "k"});
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckResultShape(x.dimensions(), "x", indices->dimensions(), "indices", RowAxis{k, "k"});
      e.failure()) {
    return e;
  }
  if (rows->rows == 0) return ffi::Error::Success();
  const size_t scratch_bytes = jaxcomp::cuda::select_scratch_bytes(rows->rows, rows->n, static_cast<int>(rounds));
  ffi::ErrorOr<void*> work = AllocateScratch(scratch, scratch_bytes);
  if (work.has_error()) return work.error();
  return ToError(jaxcomp::cuda::select_topk(*type, x.untyped_data(), rows->rows, rows->n, k, static_cast<int>(rounds),
                                            values->untyped_data(), indices->typed_data(), *work, stream));
}

ffi::Error TopkImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                    ffi::Result<ffi::AnyBuffer> values, ffi::ResultBuffer<ffi::S32> indices, int64_t k) {
  return SelectImpl(stream, scratch, x, values, indices, k, kExactRounds);
}

ffi::Error ThresholdTopkImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                             ffi::Result<ffi::AnyBuffer> values, ffi::ResultBuffer<ffi::S32> indices, int64_t k,
                             int64_t rounds) {
  return SelectImpl(stream, scratch, x, values, indices, k, rounds);
}

ffi::Error FindThresholdImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                             ffi::ResultBuffer<ffi::F32> threshold, ffi::ResultBuffer<ffi::S32> count, int64_t k,
                             int64_t rounds) {
  ffi::ErrorOr<Element> type = ElementOf(x);
  if (type.has_error()) return type.error();
  ffi::ErrorOr<Rows> rows = RowsOf(x.dimensions(), "x");
  if (rows.has_error()) return rows.error();
  if (ffi::Error e = CheckRange(k, 1, rows->n, "k"); e.failure()) return e;
  if (ffi::Error e = CheckRange(rounds, 1, kExactRounds, "rounds"); e.failure()) return e;
  if (ffi::Error e = CheckResultShape(x.dimensions(), "x", threshold->dimensions(), "threshold", NoRowAxis());
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckResultShape(x.dimensions(), "x", count->dimensions(), "count", NoRowAxis()); e.failure()) {
    return e;
  }
  if (rows->rows == 0) return ffi::Error::Success();
  const size_t scratch_bytes = jaxcomp::cuda::threshold_scratch_bytes(rows->rows, rows->n, static_cast<int>(rounds));
  ffi::ErrorOr<void*> work = AllocateScratch(scratch, scratch_bytes);
  if (work.has_error()) return work.error();
  return ToError(jaxcomp::cuda::find_threshold(*type, x.untyped_data(), rows->rows, rows->n, k, static_cast<int>(rounds),
                                               threshold->typed_data(), count->typed_data(), *work, stream));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompTopkCuda, TopkImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()  // x: float32, bfloat16 or float16
                                  .Ret<ffi::AnyBuffer>()  // values: x's type
                                  .Ret<ffi::Buffer<ffi::S32>>()  // indices
                                  .Attr<int64_t>("k"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompThresholdTopkCuda, ThresholdTopkImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()  // x: float32, bfloat16 or float16
                                  .Ret<ffi::AnyBuffer>()  // values: x's type
                                  .Ret<ffi::Buffer<ffi::S32>>()  // indices
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("rounds"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompFindThresholdCuda, FindThresholdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()  // x: float32, bfloat16 or float16
                                  .Ret<ffi::Buffer<ffi::F32>>()  // threshold
                                  .Ret<ffi::Buffer<ffi::S32>>()  // count
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("rounds"));
