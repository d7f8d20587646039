// XLA FFI adapters of the CUDA sign codec (kernels/sign.cu). The kernels need no scratch and never
// touch the host, so XLA may capture them into a CUDA graph (command-buffer compatible).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "ffi/common.h"
#include "ffi/cuda_common.h"
#include "ffi/cuda_handlers.h"
#include "kernels/sign.h"
#include "kernels/sign_cuda.h"

namespace ffi = xla::ffi;
using jaxcomp_ffi::CheckRange;
using jaxcomp_ffi::CheckResultShape;
using jaxcomp_ffi::Rows;
using jaxcomp_ffi::RowsOf;
using jaxcomp_ffi::ToError;

namespace {

ffi::Error SignPack(cudaStream_t stream, ffi::Buffer<ffi::F32> x, int64_t chunk, ffi::ResultBuffer<ffi::U32> words,
                    ffi::ResultBuffer<ffi::F32> scales) {
  if (ffi::Error e = CheckRange(chunk, 1, INT32_MAX, "chunk"); e.failure()) return e;
  ffi::ErrorOr<Rows> rows = RowsOf(x.dimensions(), "x");
  if (rows.has_error()) return rows.error();
  if (ffi::Error e = CheckResultShape(x.dimensions(), "x", words->dimensions(), "words (the result)",
                                      {jaxcomp::sign::num_words(rows->n), "ceil(n / 32)"});
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckResultShape(x.dimensions(), "x", scales->dimensions(), "scales (the result)",
                                      {jaxcomp::sign::num_chunks(rows->n, chunk), "ceil(n / chunk)"});
      e.failure()) {
    return e;
  }
  return ToError(jaxcomp::cuda::sign_pack(x.typed_data(), rows->rows, rows->n, chunk, words->typed_data(),
                                          scales->typed_data(), stream));
}

ffi::Error SignUnpack(cudaStream_t stream, ffi::Buffer<ffi::U32> words, ffi::Buffer<ffi::F32> scales, int64_t n,
                      int64_t chunk, ffi::ResultBuffer<ffi::F32> x) {
  if (ffi::Error e = CheckRange(n, 1, INT32_MAX, "n"); e.failure()) return e;
  if (ffi::Error e = CheckRange(chunk, 1, INT32_MAX, "chunk"); e.failure()) return e;
  ffi::ErrorOr<Rows> rows = RowsOf(words.dimensions(), "words");
  if (rows.has_error()) return rows.error();
  if (rows->n != jaxcomp::sign::num_words(n)) {
    return ffi::Error::InvalidArgument("words must have ceil(n / 32) = " + std::to_string(jaxcomp::sign::num_words(n)) +
                                       " words in its last axis for n=" + std::to_string(n) + ", got " +
                                       std::to_string(rows->n));
  }
  if (ffi::Error e = CheckResultShape(words.dimensions(), "words", scales.dimensions(), "scales",
                                      {jaxcomp::sign::num_chunks(n, chunk), "ceil(n / chunk)"});
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckResultShape(words.dimensions(), "words", x->dimensions(), "x (the result)", {n, "n"});
      e.failure()) {
    return e;
  }
  return ToError(jaxcomp::cuda::sign_unpack(words.typed_data(), scales.typed_data(), rows->rows, n, chunk,
                                            x->typed_data(), stream));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompSignPackCuda, SignPack,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x: rows of n float32 values
                                  .Attr<int64_t>("chunk")         // values per scale
                                  .Ret<ffi::Buffer<ffi::U32>>()   // words: rows of ceil(n / 32)
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // scales: rows of ceil(n / chunk)
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompSignUnpackCuda, SignUnpack,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()   // words: rows of ceil(n / 32)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scales: rows of ceil(n / chunk)
                                  .Attr<int64_t>("n")             // values per row
                                  .Attr<int64_t>("chunk")         // values per scale
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // x: rows of n float32 values
                              {ffi::Traits::kCmdBufferCompatible});
