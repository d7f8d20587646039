#!/bin/bash
# The training step on one device: benchmarks/one_device.py (this checkout's script) with the
# code before this session (commit 6afa37f's src, a worktree at /tmp/before) and after,
# alternating twice; the plain jitted step is timed in every job.
set -e
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/one_device_2026-11-29
for round in 1 2; do
  PYTHONPATH=/tmp/before/src .venv/bin/python benchmarks/one_device.py --models mlp2041,mlp4096 \
     --repeats 3 --json $OUT/steps_before_$round.json > $OUT/steps_before_$round.md 2>&1
  PYTHONPATH=$PWD/src .venv/bin/python benchmarks/one_device.py --models mlp2041,mlp4096 \
     --repeats 3 --json $OUT/steps_after_$round.json > $OUT/steps_after_$round.md 2>&1
done
