#!/usr/bin/env bash
# kernels_bench.py with 7fb6bd0's jaxcomp and with this tree's, alternating, two rounds.
#   bash kernels.sh OLD_TREE OLD_PYTHON   (e.g. /tmp/old_tree /tmp/oldvenv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=benchmarks/results/topk_candidates_2026-12-02
for round in 1 2; do
  echo "== before (7fb6bd0), round $round"
  PYTHONPATH="$1/src" "$2" "$here/kernels_bench.py" 2>&1 | grep -v Warning
  echo "== after, round $round"
  .venv/bin/python "$here/kernels_bench.py" 2>&1 | grep -v Warning
done
