#!/usr/bin/env bash
# four_devices.py (the update of compress("ar_topk"/"allgather_topk", ratio=0.01) on mlp4096's
# shapes, 4 CPU devices in one process, each its own gradient: SPLIT's real all-gather and merge)
# with 7fb6bd0's jaxcomp and with this tree's, alternating, two rounds.
#   bash four_devices.sh OLD_TREE OLD_PYTHON
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
for round in 1 2; do
  echo "before"; PYTHONPATH="$1/src" "$2" "$here/four_devices.py" ar_topk allgather_topk 2>&1 | grep -v Warn
  echo "after"; "$here/../../../.venv/bin/python" "$here/four_devices.py" ar_topk allgather_topk 2>&1 | grep -v Warn
done
