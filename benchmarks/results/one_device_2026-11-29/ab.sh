#!/bin/bash
# Before (commit 6afa37f, a worktree at /tmp/before) and after (this change), alternating, one
# device, glibc's allocator: benchmarks/passes.py on three zoo models, 3 rounds each.
set -e
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/one_device_2026-11-29
for round in 1 2; do
  (cd /tmp/before && PYTHONPATH=/tmp/before/src /work/main/.venv/bin/python benchmarks/passes.py \
     --models mlp2041,mlp4096,resnet50 --repeats 3 --json /work/main/$OUT/before_$round.json) > $OUT/before_$round.md 2>&1
  PYTHONPATH=$PWD/src .venv/bin/python benchmarks/passes.py --models mlp2041,mlp4096,resnet50 \
     --repeats 3 --json $OUT/after_$round.json > $OUT/after_$round.md 2>&1
done
