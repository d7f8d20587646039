# The CUDA module _jaxcomp_cuda (included by CMakeLists.txt when JAXCOMP_CUDA=ON, after a CUDA
# compiler was found). The FFI targets of _jaxcomp_cpu but the Hadamard transform; jaxcomp/_ffi.py registers them for
# platform "CUDA".

# Real code for A100 (sm_80) and H100/H200 (sm_90), plus sm_90 PTX that newer GPUs JIT-compile.
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES "80-real;90-real;90-virtual")
endif()
# A static CUDA runtime: the module then needs only the driver (libcuda), which every GPU machine
# has, and not a libcudart matching the toolkit it was compiled with.
set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
enable_language(CUDA)
message(STATUS "jaxcomp CUDA module: nvcc ${CMAKE_CUDA_COMPILER_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES}")

nanobind_add_module(_jaxcomp_cuda NB_STATIC
  ffi/cuda_module.cc
  ffi/topk_cuda.cc
  ffi/zfp_cuda.cc
  ffi/sign_cuda.cc
  kernels/topk.cu
  kernels/zfp.cu
  kernels/sign.cu)
target_include_directories(_jaxcomp_cuda SYSTEM PRIVATE "${XLA_INCLUDE_DIR}")
target_include_directories(_jaxcomp_cuda PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}")
# The C++ adapters include cuda_runtime_api.h. Headers and the static runtime come from the
# toolkit of the CUDA compiler itself rather than from find_package(CUDAToolkit), which insists
# on a shared libcudart.so that the PyPI wheels (nvidia-cuda-runtime) do not ship.
target_include_directories(_jaxcomp_cuda SYSTEM PRIVATE ${CMAKE_CUDA_TOOLKIT_INCLUDE_DIRECTORIES})
set_target_properties(_jaxcomp_cuda PROPERTIES CUDA_RUNTIME_LIBRARY Static CUDA_VISIBILITY_PRESET hidden)
target_compile_options(_jaxcomp_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CXX>:-O3 -Wall -Wextra>
  # Any nvcc warning fails the build; ptxas reports register spills of the kernels.
  $<$<COMPILE_LANGUAGE:CUDA>:-O3 --Werror all-warnings -Xptxas=-warn-spills -Xcompiler=-Wall>)

# Where a non-pip build puts the module: next to the Python sources (like `make dev`), or, for the
# CI compile check (ci/compile_cuda.sh), in its build folder so the source tree stays CPU-only.
set(JAXCOMP_CUDA_OUTPUT_DIR "${CMAKE_CURRENT_SOURCE_DIR}/src/jaxcomp" CACHE PATH
    "Folder for _jaxcomp_cuda in builds outside pip (SKBUILD installs it into the jaxcomp package)")
if(SKBUILD)
  install(TARGETS _jaxcomp_cuda LIBRARY DESTINATION jaxcomp)
else()
  set_target_properties(_jaxcomp_cuda PROPERTIES LIBRARY_OUTPUT_DIRECTORY "${JAXCOMP_CUDA_OUTPUT_DIR}")
endif()
