#!/usr/bin/env bash
# Native hardening: builds tests/native/kernels_fuzz.cc (kernels/ only, no XLA) with AddressSanitizer
# and UndefinedBehaviorSanitizer and runs it: random sizes, k, rates, chunks and bit patterns (NaN,
# Inf, denormals, -0, ties) against the test's reference, random words through the zfp and sign
# decoders, and the packing, scatter_leaves and split_leaves kernels against their definitions.
#
#   bash ci/sanitize.sh            # 30 s, seed 1 (what CI runs)
#   bash ci/sanitize.sh 600 7      # longer, another seed (JAXCOMP_FUZZ_SECONDS works too)
set -euo pipefail
cd "$(dirname "$0")/.."
CXX="${CXX:-g++}"
mkdir -p build/sanitize
FLAGS=(-std=c++17 -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all
       -Wall -Wextra -I. -pthread)
# The CPU zfp kernels take an AVX2 path where the CPU has it; the second binary runs the
# per-block path the others take.
"$CXX" "${FLAGS[@]}" tests/native/kernels_fuzz.cc -o build/sanitize/kernels_fuzz &
"$CXX" "${FLAGS[@]}" -DJAXCOMP_ZFP_BASELINE_ONLY tests/native/kernels_fuzz.cc -o build/sanitize/kernels_fuzz_baseline &
wait %1 && wait %2
SECONDS_TOTAL="${1:-${JAXCOMP_FUZZ_SECONDS:-30}}"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
build/sanitize/kernels_fuzz "$SECONDS_TOTAL" "${2:-1}"
build/sanitize/kernels_fuzz_baseline "$(awk "BEGIN { print $SECONDS_TOTAL / 3 }")" "${2:-1}"
