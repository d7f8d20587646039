// XLA FFI adapters of the CPU top-k kernels (kernels/topk.h): decode and check buffers and
// attributes, run the kernel on XLA's intra-op thread pool.
#include <string>

#include "ffi/common.h"
#include "ffi/handlers.h"
#include "ffi/thread_pool.h"
#include "kernels/topk.h"

namespace ffi = xla::ffi;

namespace {

using jaxcomp_ffi::CheckRange;
using jaxcomp_ffi::CheckResultShape;
using jaxcomp_ffi::NoRowAxis;
using jaxcomp_ffi::RowAxis;
using jaxcomp_ffi::Rows;
using jaxcomp_ffi::ToError;

// Shared checks of the selecting ops; returns the row shape through `rows`.
ffi::Error CheckSelection(ffi::Buffer<ffi::F32> x, int64_t k, ffi::Result<ffi::Buffer<ffi::F32>> values,
                          ffi::Result<ffi::Buffer<ffi::S32>> indices, Rows* rows) {
  auto shape = jaxcomp_ffi::RowsOf(x.dimensions(), "x");
  if (shape.has_error()) return shape.error();
  *rows = shape.value();
  if (auto error = CheckRange(k, 1, rows->n, "k"); error.failure()) return error;
  if (auto error = CheckResultShape(x.dimensions(), "x", values->dimensions(), "values", RowAxis{k, "k"});
      error.failure()) {
    return error;
  }
  return CheckResultShape(x.dimensions(), "x", indices->dimensions(), "indices", RowAxis{k, "k"});
}

ffi::Error TopkImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, int64_t k, ffi::Result<ffi::Buffer<ffi::F32>> values,
                    ffi::Result<ffi::Buffer<ffi::S32>> indices) {
  Rows rows;
  if (auto error = CheckSelection(x, k, values, indices, &rows); error.failure()) return error;
  return ToError(jaxcomp::TopK(x.typed_data(), rows.rows, rows.n, k, values->typed_data(),
                                   indices->typed_data(), jaxcomp_ffi::PoolParallel(pool)));
}

ffi::Error FindThresholdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, int64_t k, int64_t rounds,
                             ffi::Result<ffi::Buffer<ffi::F32>> threshold, ffi::Result<ffi::Buffer<ffi::S32>> count) {
  auto shape = jaxcomp_ffi::RowsOf(x.dimensions(), "x");
  if (shape.has_error()) return shape.error();
  const Rows rows = shape.value();
  if (auto error = CheckRange(k, 1, rows.n, "k"); error.failure()) return error;
  if (auto error = CheckRange(rounds, 1, 31, "rounds"); error.failure()) return error;
  if (auto error = CheckResultShape(x.dimensions(), "x", threshold->dimensions(), "threshold", NoRowAxis());
      error.failure()) {
    return error;
  }
  if (auto error = CheckResultShape(x.dimensions(), "x", count->dimensions(), "count", NoRowAxis()); error.failure()) {
    return error;
  }
  return ToError(jaxcomp::FindThreshold(x.typed_data(), rows.rows, rows.n, k, rounds, threshold->typed_data(),
                                            count->typed_data(), jaxcomp_ffi::PoolParallel(pool)));
}

ffi::Error ThresholdTopkImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, int64_t k, int64_t rounds,
                             ffi::Result<ffi::Buffer<ffi::F32>> values, ffi::Result<ffi::Buffer<ffi::S32>> indices) {
  Rows rows;
  if (auto error = CheckSelection(x, k, values, indices, &rows); error.failure()) return error;
  if (auto error = CheckRange(rounds, 1, 31, "rounds"); error.failure()) return error;
  return ToError(jaxcomp::ThresholdTopK(x.typed_data(), rows.rows, rows.n, k, rounds, values->typed_data(),
                                            indices->typed_data(), jaxcomp_ffi::PoolParallel(pool)));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompTopkCpu, TopkImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()          // pool: XLA's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x: f32[..., n]
                                  .Attr<int64_t>("k")              // k: entries kept per row
                                  .Ret<ffi::Buffer<ffi::F32>>()    // values: f32[..., k]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // indices: s32[..., k]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompFindThresholdCpu, FindThresholdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()          // pool: XLA's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x: f32[..., n]
                                  .Attr<int64_t>("k")              // k: entries the threshold must keep
                                  .Attr<int64_t>("rounds")         // rounds: bisection rounds, 1..31
                                  .Ret<ffi::Buffer<ffi::F32>>()    // threshold: f32[...]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // count: s32[...]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompThresholdTopkCpu, ThresholdTopkImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()          // pool: XLA's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x: f32[..., n]
                                  .Attr<int64_t>("k")              // k: entries kept per row
                                  .Attr<int64_t>("rounds")         // rounds: bisection rounds, 1..31
                                  .Ret<ffi::Buffer<ffi::F32>>()    // values: f32[..., k]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // indices: s32[..., k]
