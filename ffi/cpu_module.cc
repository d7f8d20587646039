// The nanobind module _jaxcomp_cpu: hands XLA the CPU handlers (jaxcomp/_ffi.py registers them).
#include "ffi/handlers.h"
#include "ffi/registrations.h"

NB_MODULE(_jaxcomp_cpu, m) {
  m.def("registrations", []() {
    return jaxcomp_ffi::Registrations(JaxcompTopkCpu, JaxcompFindThresholdCpu, JaxcompThresholdTopkCpu,
                                      JaxcompZfpEncodeCpu, JaxcompZfpDecodeCpu, JaxcompSignPackCpu,
                                      JaxcompSignUnpackCpu, JaxcompHadamardCpu, JaxcompPackCpu,
                                      JaxcompSignUnpackSumCpu, JaxcompEnergiesCpu,
                                      JaxcompScatterLeavesCpu, JaxcompSplitLeavesCpu,
                                      JaxcompMergeIndicesCpu);
  });
}
