// The XLA FFI handlers of the CUDA module _jaxcomp_cuda: the CPU module's targets but the
// Hadamard transform (ffi/handlers.h), run on XLA's CUDA stream. Defined in topk_cuda.cc,
// zfp_cuda.cc and sign_cuda.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompTopkCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompFindThresholdCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompThresholdTopkCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompZfpEncodeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompZfpDecodeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompSignPackCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompSignUnpackCuda);
