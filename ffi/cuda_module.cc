// The nanobind module _jaxcomp_cuda: hands XLA the CUDA handlers as PyCapsules, under the same
// target names as _jaxcomp_cpu (jaxcomp/_ffi.py registers them for platform "CUDA").
#include <nanobind/nanobind.h>

#include <type_traits>

#include "ffi/cuda_handlers.h"

namespace nb = nanobind;

namespace {
template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_jaxcomp_cuda, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["jaxcomp_topk"] = EncapsulateFfiHandler(JaxcompTopkCuda);
    targets["jaxcomp_find_threshold"] = EncapsulateFfiHandler(JaxcompFindThresholdCuda);
    targets["jaxcomp_threshold_topk"] = EncapsulateFfiHandler(JaxcompThresholdTopkCuda);
    targets["jaxcomp_zfp_encode"] = EncapsulateFfiHandler(JaxcompZfpEncodeCuda);
    targets["jaxcomp_zfp_decode"] = EncapsulateFfiHandler(JaxcompZfpDecodeCuda);
    return targets;
  });
}
