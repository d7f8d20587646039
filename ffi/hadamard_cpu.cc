// XLA FFI adapter of the CPU Walsh-Hadamard kernel (kernels/hadamard.h).
#include <string>

#include "ffi/common.h"
#include "ffi/handlers.h"
#include "ffi/thread_pool.h"
#include "kernels/hadamard.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error HadamardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto shape = jaxcomp_ffi::RowsOf(x.dimensions(), "x");
  if (shape.has_error()) return shape.error();
  const jaxcomp_ffi::Rows rows = shape.value();
  if (!jaxcomp::IsPowerOfTwo(rows.n)) {
    return ffi::Error::InvalidArgument("x's last dimension must be a power of two, got " + std::to_string(rows.n));
  }
  if (auto error = jaxcomp_ffi::CheckResultShape(x.dimensions(), "x", out->dimensions(), "out", {rows.n, "n"});
      error.failure()) {
    return error;
  }
  return jaxcomp_ffi::ToError(
      jaxcomp::Hadamard(x.typed_data(), rows.rows, rows.n, out->typed_data(), jaxcomp_ffi::PoolParallel(pool)));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompHadamardCpu, HadamardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()          // pool: XLA's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x: f32[..., n], n a power of two
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out: f32[..., n]
