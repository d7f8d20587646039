#!/bin/bash
# benchmarks/passes.py with the tuned allocator, without and with glibc's hugetlb tunable (the
# heap madvised for transparent huge pages), alternating, two rounds each; hugetlb_passes.out.
cd "$(dirname "$0")/../../.."
for mode in tuned hugetuned tuned hugetuned; do
  if [ $mode = hugetuned ]; then export GLIBC_TUNABLES=glibc.malloc.hugetlb=1; else unset GLIBC_TUNABLES; fi
  echo "== $mode"
  .venv/bin/python benchmarks/passes.py --models mlp2041,mlp4096 \
    --methods dense,ar_topk,randomk,sign,bf16,powersgd,zfp --repeats 2 --allocator tuned 2>&1 \
    | grep -v Warning | tail -14
done
