#!/usr/bin/env bash
# CI without a GPU: compiles kernels/topk.cu, kernels/zfp.cu and kernels/sign.cu themselves as host C++ (the
# stand-in CUDA runtime and CUB of tests/native/cuda_host/ run every launch over its whole grid:
# threads as fibers, shared memory, barriers, warp collectives, atomics) and compares them bit
# for bit with the CPU kernels on tests/gpu_test.py's inputs plus multi-chunk rows, garbage-filled
# scratch and random words, and the top-k kernels on bfloat16/float16 input against the float32
# path on its upcast (tests/native/cuda_host_test.cc). UBSan is on: undefined behaviour in
# kernel code (a shift by 32, an overflow) fails the run. About two minutes on 2 cores.
#
#   bash ci/cuda_host.sh [SEED]     # SEED varies the block and thread orders (default 1)
set -euo pipefail
cd "$(dirname "$0")/.."
CXX="${CXX:-g++}"
OUT=build/cuda-host
mkdir -p "$OUT"
FLAGS=(-std=c++17 -O2 -g -fsanitize=undefined -fno-sanitize-recover=all -Wall -Wextra -Wno-unknown-pragmas
       -DJAXCOMP_CUDA_HOST_EMULATION -Itests/native/cuda_host -I.)
"$CXX" "${FLAGS[@]}" -x c++ -c kernels/topk.cu -o "$OUT/topk.o" &
"$CXX" "${FLAGS[@]}" -x c++ -c kernels/zfp.cu -o "$OUT/zfp.o" &
"$CXX" "${FLAGS[@]}" -x c++ -c kernels/sign.cu -o "$OUT/sign.o" &
"$CXX" "${FLAGS[@]}" -c tests/native/cuda_host_test.cc -o "$OUT/cuda_host_test.o" &
wait %1 && wait %2 && wait %3 && wait %4
"$CXX" -fsanitize=undefined "$OUT/topk.o" "$OUT/zfp.o" "$OUT/sign.o" "$OUT/cuda_host_test.o" -o "$OUT/cuda_host_test"
UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 "$OUT/cuda_host_test" "${1:-1}"
