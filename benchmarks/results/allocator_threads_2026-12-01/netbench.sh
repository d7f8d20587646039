#!/usr/bin/env bash
# jaxcomp netbench on 4 emulated hosts at 1 Gbit, glibc's defaults then the tuned allocator (the
# hosts started with jaxcomp.ops.allocator.ENVIRONMENT, MALLOC_ARENA_MAX=1 included), one job each,
# one after the other, nothing else running. As root (network namespaces).
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=benchmarks/results/allocator_threads_2026-12-01
models=${MODELS:-mlp4096}
for allocator in glibc tuned; do
  .venv/bin/jaxcomp netbench --hosts 4 --rates 1gbit --model "$models" \
    --methods pmean,ar_topk,allgather_topk,bf16,powersgd,zfp --steps 5 --warmup 1 --optimizer sgd \
    --allocator "$allocator" --json "$out/netbench_$allocator.json" | tee "$out/netbench_$allocator.out"
done
