#!/usr/bin/env bash
# PowerSGD rank 4 with float32 and with float16 factors on 4 emulated hosts (network namespaces,
# tbf), at 1 Gbit and 100 Mbit, the tuned allocator, plain SGD, pmean beside; nothing else
# running. As root.   bash netbench.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=$PWD/benchmarks/results/powersgd_fp16_cluster_2026-12-02
PYTHONPATH=$PWD/src .venv/bin/python -m jaxcomp netbench --hosts 4 --rates 1gbit,100mbit \
  --model mlp4096 --methods pmean,powersgd,powersgd_fp16 --steps 5 --warmup 3 --optimizer sgd \
  --allocator tuned --json "$here/netbench.json"
