// XLA FFI adapters of the CUDA ZFP-style codec (kernels/zfp.cu). The kernels need no scratch and
// never touch the host, so XLA may capture them into a CUDA graph (command-buffer compatible).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "ffi/common.h"
#include "ffi/cuda_common.h"
#include "ffi/cuda_handlers.h"
#include "kernels/zfp_cuda.h"

namespace ffi = xla::ffi;
using jaxcomp_ffi::CheckRange;
using jaxcomp_ffi::CheckResultShape;
using jaxcomp_ffi::ToError;
using jaxcomp_ffi::Rows;
using jaxcomp_ffi::RowsOf;

namespace {

ffi::Error ZfpEncode(cudaStream_t stream, ffi::Buffer<ffi::F32> x, int64_t rate, ffi::ResultBuffer<ffi::U32> words) {
  if (ffi::Error e = CheckRange(rate, 1, 32, "rate"); e.failure()) return e;
  ffi::ErrorOr<Rows> rows = RowsOf(x.dimensions(), "x");
  if (rows.has_error()) return rows.error();
  const int64_t row_words = jaxcomp::cuda::zfp_num_words(rows->n, static_cast<int>(rate));
  if (ffi::Error e = CheckResultShape(x.dimensions(), "x", words->dimensions(), "words (the result)",
                                      {row_words, "zfp_num_words(n, rate)"});
      e.failure()) {
    return e;
  }
  return ToError(jaxcomp::cuda::zfp_encode(x.typed_data(), rows->rows, rows->n, static_cast<int>(rate),
                                           words->typed_data(), stream));
}

ffi::Error ZfpDecode(cudaStream_t stream, ffi::Buffer<ffi::U32> words, int64_t n, int64_t rate,
                     ffi::ResultBuffer<ffi::F32> x) {
  if (ffi::Error e = CheckRange(rate, 1, 32, "rate"); e.failure()) return e;
  if (ffi::Error e = CheckRange(n, 1, INT32_MAX, "n"); e.failure()) return e;
  ffi::ErrorOr<Rows> rows = RowsOf(words.dimensions(), "words");
  if (rows.has_error()) return rows.error();
  const int64_t expected = jaxcomp::cuda::zfp_num_words(n, static_cast<int>(rate));
  if (rows->n != expected) {
    return ffi::Error::InvalidArgument("words must have " + std::to_string(expected) +
                                       " words in its last axis for n=" + std::to_string(n) +
                                       ", rate=" + std::to_string(rate) + ", got " + std::to_string(rows->n));
  }
  if (ffi::Error e = CheckResultShape(words.dimensions(), "words", x->dimensions(), "x (the result)", {n, "n"});
      e.failure()) {
    return e;
  }
  return ToError(jaxcomp::cuda::zfp_decode(words.typed_data(), rows->rows, n, static_cast<int>(rate),
                                           x->typed_data(), stream));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompZfpEncodeCuda, ZfpEncode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x: rows of float32 values
                                  .Attr<int64_t>("rate")          // bits per value, 1..32
                                  .Ret<ffi::Buffer<ffi::U32>>(),  // words: rows of zfp_num_words(n, rate)
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompZfpDecodeCuda, ZfpDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()   // words: rows of zfp_num_words(n, rate)
                                  .Attr<int64_t>("n")             // values per row
                                  .Attr<int64_t>("rate")          // bits per value, 1..32
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // x: rows of n float32 values
                              {ffi::Traits::kCmdBufferCompatible});
