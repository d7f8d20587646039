"""The before/after table of BENCHMARKS.md's "sign_pack in the update" from the four JSON files:
each cell the best of the two rounds (update ms, and passes against that round's copy)."""

import json
import pathlib

here = pathlib.Path(__file__).parent


def rows(side):
    best = {}
    for round_ in (1, 2):
        data = json.loads((here / f"passes_{side}_{round_}.json").read_text())
        for r in data:
            key = (r["model"], r["method"])
            if key not in best or r["seconds"] < best[key]["seconds"]:
                best[key] = r
    return best


before, after = rows("before"), rows("after")
print("| model | method | before: update ms (passes) | after | before / after |")
print("|---|---|---:|---:|---:|")
for (model, method), a in after.items():
    b = before.get((model, method))
    was = f"{1e3 * b['seconds']:.1f} ({b['passes']:.1f})" if b else ""
    ratio = f"{b['seconds'] / a['seconds']:.2f}x" if b else ""
    now = f"{1e3 * a['seconds']:.1f} ({a['passes']:.1f})"
    print(f"| {model} | {method} | {was} | {now} | {ratio} |")
