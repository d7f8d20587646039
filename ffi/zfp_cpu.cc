// XLA FFI adapters of the ZFP-style codec on CPU: validate, then run kernels/zfp.h on XLA's
// intra-op thread pool.
#include <cstdint>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "ffi/common.h"
#include "ffi/handlers.h"
#include "ffi/thread_pool.h"
#include "kernels/zfp.h"

namespace ffi = xla::ffi;

namespace {

// Large results are written once, page by page: on Linux, asking for transparent huge pages
// first saves most of the page faults (a fresh 100 MB result costs ~25k of them, about a fifth
// of the decode time). Only whole pages inside the buffer are advised; failure is harmless.
void AdviseHugePages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr size_t kMinBytes = size_t{8} << 20;
  constexpr uintptr_t kPage = 4096;
  if (bytes < kMinBytes) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kPage - 1) & ~(kPage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kPage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

ffi::Error ZfpEncode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, int64_t rate, ffi::ResultBuffer<ffi::U32> words) {
  if (ffi::Error e = jaxcomp_ffi::CheckRange(rate, 1, 32, "rate"); e.failure()) return e;
  auto shape = jaxcomp_ffi::RowsOf(x.dimensions(), "x");
  if (shape.has_error()) return shape.error();
  const auto [rows, n] = shape.value();
  const int64_t row_words = jaxcomp::zfp_num_words(n, static_cast<int>(rate));
  if (ffi::Error e = jaxcomp_ffi::CheckResultShape(x.dimensions(), "x", words->dimensions(), "words (the result)",
                                                    {row_words, "zfp_num_words(n, rate)"});
      e.failure()) {
    return e;
  }
  AdviseHugePages(words->typed_data(), words->size_bytes());
  return jaxcomp_ffi::ToError(jaxcomp::zfp_encode(x.typed_data(), rows, n, static_cast<int>(rate), words->typed_data(),
                                           jaxcomp_ffi::PoolParallel(pool)));
}

ffi::Error ZfpDecode(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> words, int64_t n, int64_t rate,
                     ffi::ResultBuffer<ffi::F32> x) {
  if (ffi::Error e = jaxcomp_ffi::CheckRange(rate, 1, 32, "rate"); e.failure()) return e;
  if (ffi::Error e = jaxcomp_ffi::CheckRange(n, 1, INT32_MAX, "n"); e.failure()) return e;
  auto shape = jaxcomp_ffi::RowsOf(words.dimensions(), "words");
  if (shape.has_error()) return shape.error();
  const auto [rows, row_words] = shape.value();
  const int64_t expected = jaxcomp::zfp_num_words(n, static_cast<int>(rate));
  if (row_words != expected) {
    return ffi::Error::InvalidArgument("words must have " + std::to_string(expected) +
                                       " words in its last axis for n=" + std::to_string(n) +
                                       ", rate=" + std::to_string(rate) + ", got " + std::to_string(row_words));
  }
  if (ffi::Error e = jaxcomp_ffi::CheckResultShape(words.dimensions(), "words", x->dimensions(), "x (the result)",
                                                    {n, "n"});
      e.failure()) {
    return e;
  }
  AdviseHugePages(x->typed_data(), x->size_bytes());
  return jaxcomp_ffi::ToError(jaxcomp::zfp_decode(words.typed_data(), rows, n, static_cast<int>(rate), x->typed_data(),
                                           jaxcomp_ffi::PoolParallel(pool)));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompZfpEncodeCpu, ZfpEncode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x: rows of float32 values
                                  .Attr<int64_t>("rate")          // bits per value, 1..32
                                  .Ret<ffi::Buffer<ffi::U32>>());  // words: rows of zfp_num_words(n, rate)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompZfpDecodeCpu, ZfpDecode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()   // words: rows of zfp_num_words(n, rate)
                                  .Attr<int64_t>("n")             // values per row
                                  .Attr<int64_t>("rate")          // bits per value, 1..32
                                  .Ret<ffi::Buffer<ffi::F32>>());  // x: rows of n float32 values
