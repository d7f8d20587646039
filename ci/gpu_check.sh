#!/usr/bin/env bash
# The GPU checks in one script, for a CUDA machine with jax[cuda13], nvcc, cmake, ninja and
# nanobind already installed (no internet needed). CI never runs it: CI has no GPU.
#
#   ci/gpu_check.sh [OUT] [STAGES]
#
# OUT (default out/gpu) receives one log per stage; a stage that fails or runs out of time does not
# stop the next. STAGES (default "env build tests kernels passes") picks some of:
#   env      nvidia-smi, the Python, jax, nvcc and cmake versions
#   build    an in-place build of _jaxcomp_cpu and _jaxcomp_cuda (src/jaxcomp/), for the GPU's own
#            architecture only (JAXCOMP_CUDA_ARCHS, default 90-real: H100/H200), to save minutes
#   tests    tests/gpu_test.py (CUDA kernels vs CPU kernels bit for bit, every method training on
#            one GPU like on the CPU) and tests/cuda_module_test.py
#   kernels  benchmarks/kernels.py on the GPU (docs/gpu.md's targets), then the portable XLA path
#   passes   benchmarks/passes.py on the GPU: each method's local work in passes over the gradient
#            (PASSES_MODELS: the zoo models, default mlp4096,mlp2041,gpt2,resnet50)
# Each stage's time limit is STAGE_SECONDS_<stage> (defaults below); the whole run is about 8 min
# on an H200 with 16 cores.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-out/gpu}"
STAGES="${2:-env build tests kernels passes}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export PY="${PYTHON:-python3}" ARCHS="${JAXCOMP_CUDA_ARCHS:-90-real}"

stage() {  # stage NAME SECONDS COMMAND...: run it, log to $OUT/NAME.log, print its end
  local name=$1 seconds=$2
  shift 2
  local start=$SECONDS
  timeout "$seconds" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - start)) s (limit $seconds s)"
  tail -n "${TAIL_LINES:-25}" "$OUT/$name.log"
}

env_report() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  "$PY" -c 'import sys, jax, jaxlib; print(sys.version); print("jax", jax.__version__, "jaxlib", jaxlib.__version__); print(jax.devices())'
  command -v nvcc && nvcc --version | tail -n 2
  cmake --version | head -n 1
  nproc
}

build() {
  local nvcc
  nvcc="${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
  cmake -S . -B build/gpu-check -G Ninja -DJAXCOMP_CUDA=ON \
    -DPython_EXECUTABLE="$(command -v "$PY")" -DCMAKE_CUDA_COMPILER="$nvcc" \
    -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" &&
    cmake --build build/gpu-check &&
    "$PY" -c 'import jaxcomp.ops._ffi as f; assert f.HAS_CUDA, "no _jaxcomp_cuda"; print("HAS_CUDA", f.HAS_CUDA)'
}

export -f env_report build  # timeout runs programs: the stages run them through bash -c

for s in $STAGES; do
  case $s in
    env) stage env 60 bash -c env_report ;;
    build) stage build "${STAGE_SECONDS_build:-240}" bash -c build ;;
    tests)
      stage tests "${STAGE_SECONDS_tests:-240}" "$PY" -m pytest -p no:cacheprovider -n 0 -q \
        -rs --durations=10 tests/gpu_test.py tests/cuda_module_test.py
      ;;
    kernels)
      stage kernels "${STAGE_SECONDS_kernels:-120}" "$PY" benchmarks/kernels.py --device gpu \
        --sizes 1e6,25e6,100e6 --ratios 0.01,0.001 --rates 8,16 --markdown
      stage kernels_portable "${STAGE_SECONDS_kernels:-120}" "$PY" benchmarks/kernels.py \
        --device gpu --portable --sizes 1e6,100e6 --markdown
      ;;
    passes)
      stage passes "${STAGE_SECONDS_passes:-150}" "$PY" benchmarks/passes.py \
        --models "${PASSES_MODELS:-mlp4096,mlp2041,gpt2,resnet50}" --repeats 3 \
        --json "$OUT/passes_gpu.json"
      ;;
    *) echo "unknown stage $s (env build tests kernels passes)" >&2 && exit 2 ;;
  esac
done
