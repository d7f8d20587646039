"""python summ.py OUTDIR [N]: the N thunks of a 3-step trace with the most time, ms a step."""

import collections
import glob
import gzip
import json
import sys

path = sorted(glob.glob(sys.argv[1] + "/**/*.trace.json.gz", recursive=True))[-1]
events = json.load(gzip.open(path))["traceEvents"]
total, count = collections.Counter(), collections.Counter()
for event in events:
    if event.get("ph") == "X":
        total[event["name"]] += event["dur"]
        count[event["name"]] += 1
for name, us in total.most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 30):
    print(f"{us / 3e3:9.1f} ms/step  x{count[name] // 3:4d}  {name[:110]}")
