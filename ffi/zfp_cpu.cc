// PLACEHOLDER until the zfp kernels land: every handler reports Unimplemented.
#include "ffi/handlers.h"

namespace ffi = xla::ffi;

static ffi::Error NotYet(ffi::AnyBuffer) { return ffi::Error(ffi::ErrorCode::kUnimplemented, "not built yet"); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompZfpEncodeCpu, NotYet, ffi::Ffi::Bind().Arg<ffi::AnyBuffer>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompZfpDecodeCpu, NotYet, ffi::Ffi::Bind().Arg<ffi::AnyBuffer>());
