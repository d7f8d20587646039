// What kernels/*.cu share on the host side: kernel launches and CUDA errors as jaxcomp::Status.
//
// Every launch goes through launch() rather than `<<<...>>>`, so that the .cu files also compile
// as plain C++ for ci/cuda_host.sh: there tests/native/cuda_host/ stands in for the CUDA headers
// and runs each launched kernel over its whole grid on the host (threads, shared memory,
// barriers, warp collectives and atomics emulated), and the result is compared bit for bit with
// the CPU kernels. JAXCOMP_CUDA_HOST_EMULATION selects that build.
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <utility>

#include "kernels/status.h"

namespace jaxcomp::cuda {

// A CUDA error from enqueueing work, as the status the FFI adapter reports (kInternal).
inline Status StatusOf(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status();
  return Status::Internal(std::string(what) + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
}

#if defined(JAXCOMP_CUDA_HOST_EMULATION)
using cuda_host::launch;  // tests/native/cuda_host/cuda_runtime_api.h
#else
// kernel<<<grid, threads, 0, stream>>>(args...), then the launch's error.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), unsigned grid, unsigned threads, cudaStream_t stream, Args&&... args) {
  kernel<<<grid, threads, 0, stream>>>(std::forward<Args>(args)...);
  return cudaGetLastError();
}
#endif

}  // namespace jaxcomp::cuda
