#!/usr/bin/env bash
# CI compile check of the CUDA module, on a machine without a GPU.
#
#   ci/compile_cuda.sh [VENV]      # VENV: a virtual environment (default .venv); one that does not
#                                  # exist yet is made, with jax in it
#
# Installs CUDA 13's nvcc, runtime headers/static cudart and CCCL (CUB) from PyPI into VENV, then
# configures and builds ONLY the _jaxcomp_cuda target, into build/ci-cuda: the module never lands
# in the source tree, so the default (CPU) install and the test suite are unchanged. Any compile
# error or nvcc warning fails the script. Then the adapters' scratch helper (ffi/cuda_common.h)
# runs against a stand-in of XLA's FFI allocator that keeps XLA's alignment rule
# (tests/native/cuda_scratch_test.cc): plain C++, no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
# CI gives it a venv of its own, so that it runs beside the tests rather than after them.
if [ ! -d "${1:-.venv}" ]; then
  python3 -m venv "${1:-.venv}"
  EXTRA=jax  # the XLA FFI headers
fi
# Absolute: CMake runs its compiler checks in other directories.
VENV="$(cd "${1:-.venv}" && pwd)"
PY="$VENV/bin/python"
BUILD=build/ci-cuda

"$PY" -m pip install --quiet "nvidia-cuda-nvcc==13.*" "nvidia-cuda-runtime==13.*" "nvidia-cuda-cccl==13.*" \
  "nanobind>=2.4" "cmake>=3.18" ninja ${EXTRA:-}

# The wheels unpack the toolkit under site-packages/nvidia/cu13 (bin/nvcc, include/, include/cccl,
# lib/libcudart_static.a).
CUDA_ROOT="$("$PY" -c '
import os, nvidia
print(next(os.path.join(p, "cu13") for p in nvidia.__path__ if os.path.exists(os.path.join(p, "cu13", "bin", "nvcc"))))
')"
NVCC="$CUDA_ROOT/bin/nvcc"
"$NVCC" --version | tail -n 2

rm -rf "$BUILD"
"$VENV/bin/cmake" -S . -B "$BUILD" -G Ninja \
  -DCMAKE_MAKE_PROGRAM="$VENV/bin/ninja" \
  -DPython_EXECUTABLE="$PY" \
  -DJAXCOMP_CUDA=ON \
  -DCMAKE_CUDA_COMPILER="$NVCC" \
  -DCUDAToolkit_ROOT="$CUDA_ROOT" \
  -DJAXCOMP_CUDA_OUTPUT_DIR="$PWD/$BUILD"
"$VENV/bin/cmake" --build "$BUILD" --target _jaxcomp_cuda
ls -l "$BUILD"/_jaxcomp_cuda*.so
echo "CUDA module compiled (sm_80, sm_90, compute_90 PTX)"

XLA_INCLUDE="$("$PY" -c 'import jax.ffi; print(jax.ffi.include_dir())')"
"${CXX:-g++}" -std=c++17 -O1 -g -Wall -Wextra -fsanitize=address,undefined -fno-sanitize-recover=all \
  -I. -isystem "$XLA_INCLUDE" tests/native/cuda_scratch_test.cc -o "$BUILD/cuda_scratch_test"
"$BUILD/cuda_scratch_test"
