// The XLA FFI handlers of the CPU module, one per op. Target names (see jaxcomp/_ffi.py) are
// "jaxcomp_" + the op name. Each is defined next to its kernel adapter (topk_cpu.cc, zfp_cpu.cc,
// hadamard_cpu.cc, sign_cpu.cc, pack_cpu.cc, scatter_cpu.cc, merge_cpu.cc).
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompTopkCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompFindThresholdCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompThresholdTopkCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompZfpEncodeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompZfpDecodeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompHadamardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompSignPackCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompSignUnpackCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompSignUnpackSumCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompPackCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompScatterLeavesCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompSplitLeavesCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompEnergiesCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompMergeIndicesCpu);
