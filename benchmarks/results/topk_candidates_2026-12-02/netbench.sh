#!/usr/bin/env bash
# jaxcomp netbench on 4 emulated hosts at 1 Gbit, the tuned allocator, before this change (a
# checkout of 7fb6bd0 built in place, run by a copy of the venv without the editable install)
# and after, interleaved, two rounds; nothing else running. As root (network namespaces).
#   bash netbench.sh OLD_TREE OLD_PYTHON   (e.g. /tmp/old_tree /tmp/oldvenv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=$PWD/benchmarks/results/topk_candidates_2026-12-02
args=(netbench --hosts 4 --rates 1gbit --model mlp4096 --methods pmean,ar_topk,allgather_topk,randomk
      --steps 5 --warmup 3 --optimizer sgd --allocator tuned)
for round in 1 2; do
  echo "== before (7fb6bd0), round $round"
  (cd "$1" && PYTHONPATH="$1/src" "$2" -m jaxcomp "${args[@]}" --json "$here/netbench_before_$round.json")
  echo "== after, round $round"
  .venv/bin/python -m jaxcomp "${args[@]}" --json "$here/netbench_after_$round.json"
done
