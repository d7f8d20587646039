// XLA FFI adapter of the CPU merge of sorted index runs (kernels/merge.h).
#include <string>

#include "ffi/common.h"
#include "ffi/handlers.h"
#include "kernels/merge.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error MergeIndicesImpl(ffi::Buffer<ffi::S32> runs, int64_t pad, ffi::Result<ffi::Buffer<ffi::S32>> out) {
  auto shape = jaxcomp_ffi::RowsOf(runs.dimensions(), "runs");
  if (shape.has_error()) return shape.error();
  const jaxcomp_ffi::Rows rows = shape.value();
  if (runs.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("runs must be 2-D (runs x length), got " +
                                       std::to_string(runs.dimensions().size()) + " dimensions");
  }
  if (auto error = jaxcomp_ffi::CheckRange(pad, INT32_MIN, INT32_MAX, "pad"); error.failure()) return error;
  if (out->element_count() != rows.rows * rows.n || out->dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("out must be 1-D with runs' " + std::to_string(rows.rows * rows.n) +
                                       " entries");
  }
  return jaxcomp_ffi::ToError(jaxcomp::MergeRuns(runs.typed_data(), rows.rows, rows.n, static_cast<int32_t>(pad),
                                                 out->typed_data()));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompMergeIndicesCpu, MergeIndicesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()    // runs: s32[runs, length]
                                  .Attr<int64_t>("pad")            // pad: what each repeat becomes
                                  .Ret<ffi::Buffer<ffi::S32>>());  // out: s32[runs * length]
