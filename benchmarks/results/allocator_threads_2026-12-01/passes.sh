#!/usr/bin/env bash
# benchmarks/passes.py three times in one job, one after the other, nothing else running:
# glibc's defaults, tune_host_allocator() as it was before 2026-12-01 (no M_ARENA_MAX: XLA:CPU's
# worker threads keep arenas of their own), and as it is now (every thread on the main heap).
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=benchmarks/results/allocator_threads_2026-12-01
models=${MODELS:-mlp2041,mlp4096,resnet50}
args=(--models "$models" --repeats 3)
.venv/bin/python benchmarks/passes.py "${args[@]}" --json "$out/passes_glibc.json" | tee "$out/passes_glibc.md"
.venv/bin/python -c "
import runpy, sys
from jaxcomp.ops import allocator
allocator.SETTINGS.pop('M_ARENA_MAX')  # the settings before 2026-12-01
sys.argv = ['benchmarks/passes.py', *sys.argv[1:]]
runpy.run_path('benchmarks/passes.py', run_name='__main__')
" "${args[@]}" --allocator tuned --json "$out/passes_tuned_before.json" | tee "$out/passes_tuned_before.md"
.venv/bin/python benchmarks/passes.py "${args[@]}" --allocator tuned --json "$out/passes_tuned.json" | tee "$out/passes_tuned.md"
