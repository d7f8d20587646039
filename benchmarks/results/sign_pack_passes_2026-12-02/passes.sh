#!/usr/bin/env bash
# sign's update (and PowerSGD's, float32 and float16 factors) in passes, before and after the
# sign_pack change (51bde08), in one job: benchmarks/passes.py from a checkout of 681b575 (built
# in place, `make dev`) and from this tree, twice each, interleaved; the tuned allocator.
#   bash passes.sh OLD_TREE PYTHON   (e.g. /tmp/old_tree .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=$PWD/benchmarks/results/sign_pack_passes_2026-12-02
py=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")  # absolute, the venv's own (not resolved)
args=(--models mlp4096,resnet50,gpt2 --repeats 2 --allocator tuned)
for round in 1 2; do
  echo "== before (681b575), round $round"
  (cd "$1" && PYTHONPATH="$1/src" "$py" benchmarks/passes.py "${args[@]}" \
     --methods dense,sign,powersgd --json "$here/passes_before_$round.json" 2>&1 | grep -v Warning)
  echo "== after, round $round"
  PYTHONPATH=$PWD/src "$py" benchmarks/passes.py "${args[@]}" --methods dense,sign,powersgd,powersgd_fp16 \
    --json "$here/passes_after_$round.json" 2>&1 | grep -v Warning
done
