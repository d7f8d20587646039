#!/usr/bin/env bash
# Top-k's update before and after this change, in one job: benchmarks/passes.py run from a
# checkout of 7fb6bd0 (built in place, `make dev`, run by a copy of the venv without the editable
# install) and from this tree, twice each, interleaved; the tuned allocator.
#   bash passes.sh OLD_TREE OLD_PYTHON   (e.g. /tmp/old_tree /tmp/oldvenv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=$PWD/benchmarks/results/topk_candidates_2026-12-02
args=(--models mlp2041,mlp4096,resnet50,gpt2 --methods dense,ar_topk,allgather_topk,randomk
      --repeats 2 --allocator tuned)
for round in 1 2; do
  echo "== before (7fb6bd0), round $round"
  (cd "$1" && PYTHONPATH="$1/src" "$2" benchmarks/passes.py "${args[@]}" \
     --json "$here/passes_before_$round.json" 2>&1 | grep -v Warning)
  echo "== after, round $round"
  .venv/bin/python benchmarks/passes.py "${args[@]}" --json "$here/passes_after_$round.json" 2>&1 \
    | grep -v Warning
done
