import sys, glob, gzip, json, collections
f = sorted(glob.glob(sys.argv[1] + "/**/*.trace.json.gz", recursive=True))[-1]
d = json.load(gzip.open(f))
tot = collections.Counter(); cnt = collections.Counter()
for e in d["traceEvents"]:
    if e.get("ph") == "X":
        tot[e["name"]] += e["dur"]; cnt[e["name"]] += 1
for k, v in tot.most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 30):
    print(f"{v/3e3:9.1f} ms/step  x{cnt[k]//3:4d}  {k[:110]}")
