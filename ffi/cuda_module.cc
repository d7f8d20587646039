// The nanobind module _jaxcomp_cuda: hands XLA the CUDA handlers under the same target names as
// _jaxcomp_cpu (jaxcomp/_ffi.py registers them for platform "CUDA").
#include "ffi/cuda_handlers.h"
#include "ffi/registrations.h"

NB_MODULE(_jaxcomp_cuda, m) {
  m.def("registrations", []() {
    return jaxcomp_ffi::Registrations(JaxcompTopkCuda, JaxcompFindThresholdCuda, JaxcompThresholdTopkCuda,
                                      JaxcompZfpEncodeCuda, JaxcompZfpDecodeCuda, JaxcompSignPackCuda,
                                      JaxcompSignUnpackCuda);
  });
}
