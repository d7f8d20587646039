// The nanobind module _jaxcomp_cpu: hands XLA the CPU handlers as PyCapsules.
#include <nanobind/nanobind.h>

#include "ffi/handlers.h"

namespace nb = nanobind;

namespace {
template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_jaxcomp_cpu, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["jaxcomp_topk"] = EncapsulateFfiHandler(JaxcompTopkCpu);
    targets["jaxcomp_find_threshold"] = EncapsulateFfiHandler(JaxcompFindThresholdCpu);
    targets["jaxcomp_threshold_topk"] = EncapsulateFfiHandler(JaxcompThresholdTopkCpu);
    targets["jaxcomp_zfp_encode"] = EncapsulateFfiHandler(JaxcompZfpEncodeCpu);
    targets["jaxcomp_zfp_decode"] = EncapsulateFfiHandler(JaxcompZfpDecodeCpu);
    return targets;
  });
}
