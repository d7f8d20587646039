// XLA FFI adapters of the CPU kernels that write an aggregate into the update's leaves, sparse or
// dense (kernels/scatter.h): validate, then run on XLA's intra-op thread pool.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "ffi/common.h"
#include "ffi/handlers.h"
#include "ffi/thread_pool.h"
#include "kernels/scatter.h"

namespace ffi = xla::ffi;

namespace {

// The results: one float32 leaf each, any shape.
ffi::ErrorOr<std::vector<jaxcomp::ScatterLeaf>> DecodeLeaves(const ffi::RemainingRets& rets) {
  std::vector<jaxcomp::ScatterLeaf> leaves(rets.size());
  for (size_t l = 0; l < rets.size(); ++l) {
    auto leaf = rets.get<ffi::Buffer<ffi::F32>>(l);
    if (leaf.has_error()) return ffi::Unexpected<ffi::Error>(leaf.error());
    leaves[l].data = leaf.value()->typed_data();
    leaves[l].size = static_cast<int64_t>(leaf.value()->element_count());
  }
  return leaves;
}

ffi::Error ScatterLeaves(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F32> values,
                         ffi::Buffer<ffi::S32> silenced, float scale, int64_t add, int64_t drop,
                         ffi::RemainingRets rets) {
  if (ffi::Error e = jaxcomp_ffi::CheckRange(add, 0, 1, "add"); e.failure()) return e;
  if (ffi::Error e = jaxcomp_ffi::CheckRange(drop, 0, 1, "drop"); e.failure()) return e;
  if (!std::isfinite(scale) || !(scale > 0)) {
    return ffi::Error::InvalidArgument("scale must be finite and > 0, got " + std::to_string(scale));
  }
  const auto dims = indices.dimensions();
  if (dims.size() != 2 || values.dimensions().size() != 2 || values.dimensions()[0] != dims[0] ||
      values.dimensions()[1] != dims[1]) {
    return ffi::Error::InvalidArgument("indices and values must be 2-D of one shape (rows, pairs per row)");
  }
  if (silenced.element_count() != 1) return ffi::Error::InvalidArgument("silenced must be a scalar");
  if (!add && dims[0] > 1) {
    return ffi::Error::InvalidArgument("add=0 (set) takes one row, got " + std::to_string(dims[0]));
  }
  auto leaves = DecodeLeaves(rets);
  if (leaves.has_error()) return leaves.error();
  jaxcomp::ScatterRows rows{indices.typed_data(), values.typed_data(), static_cast<int64_t>(dims[0]),
                            static_cast<int64_t>(dims[1])};
  jaxcomp::ScatterOptions options{scale, add != 0, drop != 0, silenced.typed_data()[0] != 0};
  const auto& l = leaves.value();
  return jaxcomp_ffi::ToError(jaxcomp::scatter_leaves(rows, l.data(), static_cast<int64_t>(l.size()), options,
                                                      jaxcomp_ffi::PoolParallel(pool)));
}

ffi::Error SplitLeaves(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> dense, ffi::Buffer<ffi::S32> silenced,
                       float scale, int64_t drop, ffi::RemainingRets rets) {
  if (dense.dimensions().size() != 1) return ffi::Error::InvalidArgument("dense must be 1-D");
  if (silenced.element_count() != 1) return ffi::Error::InvalidArgument("silenced must be a scalar");
  if (ffi::Error e = jaxcomp_ffi::CheckRange(drop, 0, 1, "drop"); e.failure()) return e;
  auto leaves = DecodeLeaves(rets);
  if (leaves.has_error()) return leaves.error();
  const auto& l = leaves.value();
  return jaxcomp_ffi::ToError(jaxcomp::split_leaves(dense.typed_data(), static_cast<int64_t>(dense.element_count()),
                                                    l.data(), static_cast<int64_t>(l.size()), scale,
                                                    silenced.typed_data()[0] != 0, jaxcomp_ffi::PoolParallel(pool),
                                                    drop != 0));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompSplitLeavesCpu, SplitLeaves,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()          // pool: XLA's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()    // dense: 1-D, the leaves end to end
                                  .Arg<ffi::Buffer<ffi::S32>>()    // silenced: a scalar, nonzero: all 0
                                  .Attr<float>("scale")            // every value's factor
                                  .Attr<int64_t>("drop")           // 1: non-finite values become 0
                                  .RemainingRets());               // the leaves, float32, any shapes

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompScatterLeavesCpu, ScatterLeaves,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()          // pool: XLA's intra-op threads
                                  .Arg<ffi::Buffer<ffi::S32>>()    // indices: (rows, pairs per row)
                                  .Arg<ffi::Buffer<ffi::F32>>()    // values: the same shape
                                  .Arg<ffi::Buffer<ffi::S32>>()    // silenced: a scalar, nonzero: all 0
                                  .Attr<float>("scale")            // every sum's factor
                                  .Attr<int64_t>("add")            // 1: add rows in order; 0: set (one row)
                                  .Attr<int64_t>("drop")           // 1: non-finite sums become 0
                                  .RemainingRets());               // the leaves, float32, any shapes
