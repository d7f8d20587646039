#!/bin/bash
# The all-gathers on one device (sign's gathered sum, the top-ks' gathers): before (commit
# 6afa37f, a worktree at /tmp/before) and after, alternating twice, one device, glibc's allocator.
set -e
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/one_device_2026-11-29
M=sign,allgather_topk,ar_topk,randomk
for round in 1 2; do
  (cd /tmp/before && PYTHONPATH=/tmp/before/src /work/main/.venv/bin/python benchmarks/passes.py \
     --models mlp2041,mlp4096,resnet50 --methods $M --repeats 3 \
     --json /work/main/$OUT/gathers_before_$round.json) > $OUT/gathers_before_$round.md 2>&1
  PYTHONPATH=$PWD/src .venv/bin/python benchmarks/passes.py --models mlp2041,mlp4096,resnet50 \
     --methods $M --repeats 3 --json $OUT/gathers_after_$round.json > $OUT/gathers_after_$round.md 2>&1
done
