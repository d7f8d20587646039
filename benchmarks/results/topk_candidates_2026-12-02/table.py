"""Prints the before/after table of passes_{before,after}_{1,2}.json (BENCHMARKS.md's rows)."""

import json
import sys

folder = sys.argv[1] if len(sys.argv) > 1 else "."
rows = {}
for side in ("before", "after"):
    for r in (1, 2):
        for row in json.load(open(f"{folder}/passes_{side}_{r}.json")):
            key = (row["method"], row["model"])
            rows.setdefault(key, {})[(side, r)] = (row["seconds"] * 1e3, row["passes"])
for (method, model), v in rows.items():
    b = [v[("before", r)] for r in (1, 2)]
    a = [v[("after", r)] for r in (1, 2)]
    speedup = min(x[0] for x in b) / min(x[0] for x in a)
    print(
        f"| {method} | {model} | {b[0][0]:.0f} / {b[1][0]:.0f} ({b[0][1]:.1f} / {b[1][1]:.1f}) "
        f"| {a[0][0]:.0f} / {a[1][0]:.0f} ({a[0][1]:.1f} / {a[1][1]:.1f}) | {speedup:.2f}x |"
    )
