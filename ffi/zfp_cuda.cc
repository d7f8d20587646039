// PLACEHOLDER until the CUDA zfp kernels land: both handlers report Unimplemented.
#include "ffi/cuda_handlers.h"

namespace ffi = xla::ffi;

static ffi::Error NotYet(ffi::AnyBuffer) { return ffi::Error(ffi::ErrorCode::kUnimplemented, "not built yet"); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompZfpEncodeCuda, NotYet, ffi::Ffi::Bind().Arg<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompZfpDecodeCuda, NotYet, ffi::Ffi::Bind().Arg<ffi::AnyBuffer>());
