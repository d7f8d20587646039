// XLA FFI adapters of the CPU sign codec (kernels/sign.h): validate, then run on XLA's intra-op
// thread pool.
#include <cstdint>
#include <string>

#include "ffi/common.h"
#include "ffi/handlers.h"
#include "ffi/thread_pool.h"
#include "kernels/sign.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error SignPack(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, int64_t chunk, ffi::ResultBuffer<ffi::U32> words,
                    ffi::ResultBuffer<ffi::F32> scales) {
  if (ffi::Error e = jaxcomp_ffi::CheckRange(chunk, 1, INT32_MAX, "chunk"); e.failure()) return e;
  auto shape = jaxcomp_ffi::RowsOf(x.dimensions(), "x");
  if (shape.has_error()) return shape.error();
  const auto [rows, n] = shape.value();
  if (ffi::Error e = jaxcomp_ffi::CheckResultShape(x.dimensions(), "x", words->dimensions(), "words (the result)",
                                                    {jaxcomp::sign::num_words(n), "ceil(n / 32)"});
      e.failure()) {
    return e;
  }
  if (ffi::Error e = jaxcomp_ffi::CheckResultShape(x.dimensions(), "x", scales->dimensions(), "scales (the result)",
                                                    {jaxcomp::sign::num_chunks(n, chunk), "ceil(n / chunk)"});
      e.failure()) {
    return e;
  }
  return jaxcomp_ffi::ToError(jaxcomp::sign_pack(x.typed_data(), rows, n, chunk, words->typed_data(),
                                                 scales->typed_data(), jaxcomp_ffi::PoolParallel(pool)));
}

ffi::Error SignUnpack(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> words, ffi::Buffer<ffi::F32> scales, int64_t n,
                      int64_t chunk, ffi::ResultBuffer<ffi::F32> x) {
  if (ffi::Error e = jaxcomp_ffi::CheckRange(n, 1, INT32_MAX, "n"); e.failure()) return e;
  if (ffi::Error e = jaxcomp_ffi::CheckRange(chunk, 1, INT32_MAX, "chunk"); e.failure()) return e;
  auto shape = jaxcomp_ffi::RowsOf(words.dimensions(), "words");
  if (shape.has_error()) return shape.error();
  const auto [rows, row_words] = shape.value();
  if (row_words != jaxcomp::sign::num_words(n)) {
    return ffi::Error::InvalidArgument("words must have ceil(n / 32) = " + std::to_string(jaxcomp::sign::num_words(n)) +
                                       " words in its last axis for n=" + std::to_string(n) + ", got " +
                                       std::to_string(row_words));
  }
  if (ffi::Error e = jaxcomp_ffi::CheckResultShape(words.dimensions(), "words", scales.dimensions(), "scales",
                                                    {jaxcomp::sign::num_chunks(n, chunk), "ceil(n / chunk)"});
      e.failure()) {
    return e;
  }
  if (ffi::Error e = jaxcomp_ffi::CheckResultShape(words.dimensions(), "words", x->dimensions(), "x (the result)",
                                                    {n, "n"});
      e.failure()) {
    return e;
  }
  return jaxcomp_ffi::ToError(jaxcomp::sign_unpack(words.typed_data(), scales.typed_data(), rows, n, chunk,
                                                   x->typed_data(), jaxcomp_ffi::PoolParallel(pool)));
}

// Sums the rows of words and scales as they decode (kernels/sign.h's sign_unpack_sum): x is [n].
ffi::Error SignUnpackSum(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> words, ffi::Buffer<ffi::F32> scales, int64_t n,
                         int64_t chunk, ffi::ResultBuffer<ffi::F32> x) {
  if (ffi::Error e = jaxcomp_ffi::CheckRange(n, 1, INT32_MAX, "n"); e.failure()) return e;
  if (ffi::Error e = jaxcomp_ffi::CheckRange(chunk, 1, INT32_MAX, "chunk"); e.failure()) return e;
  if (words.dimensions().size() != 2 || scales.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("words and scales must be 2-D [rows, ...] to sum their rows");
  }
  const int64_t rows = words.dimensions()[0];
  if (rows < 1 || words.dimensions()[1] != jaxcomp::sign::num_words(n)) {
    return ffi::Error::InvalidArgument("words must be [rows >= 1, ceil(n / 32) = " +
                                       std::to_string(jaxcomp::sign::num_words(n)) + "] for n=" + std::to_string(n));
  }
  if (scales.dimensions()[0] != rows || scales.dimensions()[1] != jaxcomp::sign::num_chunks(n, chunk)) {
    return ffi::Error::InvalidArgument("scales must be [rows, ceil(n / chunk) = " +
                                       std::to_string(jaxcomp::sign::num_chunks(n, chunk)) + "]");
  }
  if (x->dimensions().size() != 1 || x->dimensions()[0] != n) {
    return ffi::Error::InvalidArgument("x (the result) must be [n] = [" + std::to_string(n) + "]");
  }
  return jaxcomp_ffi::ToError(jaxcomp::sign_unpack_sum(words.typed_data(), scales.typed_data(), rows, n, chunk,
                                                       x->typed_data(), jaxcomp_ffi::PoolParallel(pool)));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompSignPackCpu, SignPack,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()          // pool: XLA's intra-op threads
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x: rows of n float32 values
                                  .Attr<int64_t>("chunk")          // values per scale
                                  .Ret<ffi::Buffer<ffi::U32>>()    // words: rows of ceil(n / 32)
                                  .Ret<ffi::Buffer<ffi::F32>>());  // scales: rows of ceil(n / chunk)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompSignUnpackCpu, SignUnpack,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()          // pool: XLA's intra-op threads
                                  .Arg<ffi::Buffer<ffi::U32>>()    // words: rows of ceil(n / 32)
                                  .Arg<ffi::Buffer<ffi::F32>>()    // scales: rows of ceil(n / chunk)
                                  .Attr<int64_t>("n")              // values per row
                                  .Attr<int64_t>("chunk")          // values per scale
                                  .Ret<ffi::Buffer<ffi::F32>>());  // x: rows of n float32 values

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompSignUnpackSumCpu, SignUnpackSum,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()          // pool: XLA's intra-op threads
                                  .Arg<ffi::Buffer<ffi::U32>>()    // words: [rows, ceil(n / 32)]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // scales: [rows, ceil(n / chunk)]
                                  .Attr<int64_t>("n")              // values per row
                                  .Attr<int64_t>("chunk")          // values per scale
                                  .Ret<ffi::Buffer<ffi::F32>>());  // x: [n], the rows' sum
