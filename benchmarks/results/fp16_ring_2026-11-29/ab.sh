#!/bin/bash
# A/B: the code before (gloo's float16 psum; one message by default) and after (the ring;
# buckets by default), alternating. Rows: one message, and 25 MiB buckets.
cd /work/main
for round in 1 2; do
for tree in old new; do
  if [ $tree = old ]; then src=/tmp/old/src; rows=fp16,fp16_bucket; else src=/tmp/new/src; rows=fp16_nobucket,fp16; fi
  PYTHONPATH=$src timeout 1500 .venv/bin/python -m jaxcomp netbench --hosts 4 --rates 1gbit --model mlp4096,mlp2041 --methods $rows --steps 5 --warmup 1 --optimizer sgd --json /tmp/nb/ab_${tree}_${round}.json --log /tmp/nb/ab_${tree}_${round}.log > /tmp/nb/ab_${tree}_${round}.out 2>&1
done
done
