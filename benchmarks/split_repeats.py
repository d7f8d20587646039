"""How many of AR-Topk's SPLIT slots carry a repeated index, on the quality benchmark's char-LM.

    python benchmarks/split_repeats.py --row "ar_topk(0.01)" --steps 500
    python benchmarks/split_repeats.py --row "ar_topk(0.01) dgc warmup50 adam-b1=0 zfp-warmup"

Under SPLIT (:func:`jaxcomp.collectives.topk.split_indices`) every device picks its own top
``ceil(k / N)`` and an index two devices picked is sent once: its second slot is padding, sent
as a zero. So a step sums ``k`` less its repeats distinct values. This script trains one
``benchmarks/quality.py`` row (same model, data and options) and counts, on every step that runs
SPLIT, the slots marked as repeats (index ``n``): it wraps ``split_indices`` in this process with a
:func:`jax.debug.callback` of that count. It prints the mean and the largest count over windows of
the steps that ran SPLIT (a warm-up's steps run another method and are not counted), as a count
and as a share of the step's slots, and writes them as JSON with ``--json``.
"""

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WINDOWS = ((0, 50), (50, 100), (100, 200), (200, 500), (500, 1500))


def count_repeats(record):
    """Wraps ``jaxcomp.collectives.topk.split_indices`` so that every call reports
    ``(repeats, slots, device)`` to ``record`` (a callable) when it runs.

    Args:
      record: called with three ints on the host, once per device per step that runs SPLIT.

    Returns:
      The original function, to put back.

    Example:
      >>> seen = []
      >>> original = count_repeats(lambda *counts: seen.append(counts))
      >>> import jaxcomp.collectives.topk as topk; topk.split_indices = original  # put back
    """
    import jax
    import jax.numpy as jnp

    from jaxcomp.collectives import topk

    original = topk.split_indices

    def split_indices(x, k, axis_name, selector="exact"):
        shared = original(x, k, axis_name, selector)
        repeats = jnp.sum(shared == x.shape[0])
        device = jax.lax.axis_index(axis_name)
        jax.debug.callback(
            lambda r, d: record(int(r), int(shared.shape[0]), int(d)), repeats, device
        )
        return shared

    topk.split_indices = split_indices
    return original


def summarize(counts, slots):
    """``[{"steps": [lo, hi), "mean", "max", "share"}]`` over :data:`WINDOWS` of the SPLIT
    steps' repeat counts (``steps`` count SPLIT steps only; ``share``: the mean over ``slots``).

    Example:
      >>> summarize([2, 4], 8)[0]["mean"], summarize([2, 4], 8)[0]["share"]
      (3.0, 0.375)
    """
    out = []
    for lo, hi in WINDOWS:
        window = counts[lo:hi]
        if window:
            mean = sum(window) / len(window)
            out.append(
                {
                    "steps": [lo, min(hi, lo + len(window))],
                    "mean": mean,
                    "max": max(window),
                    "share": mean / slots,
                }
            )
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--row", default="ar_topk(0.01)", help="a quality.py row name")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--model", default="small", help="quality.py's --model")
    parser.add_argument("--quick", action="store_true", help="quality.py's tiny model (smoke test)")
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args(argv)
    import quality

    row = {r.name: r for r in quality.rows() + quality.variants()}.get(args.row)
    method = getattr(row, "method", None)
    if getattr(method, "collective", None) != "ar" or method.leader != "split":
        parser.error(
            f"--row must be a quality.py row of AR-Topk with SPLIT's leader (its default, e.g. "
            f"'ar_topk(0.01)'), got {args.row!r}"
        )

    counts, slots = [], [0]

    def record(repeats, n_slots, device):
        if device == 0:  # one device's count a step (every device sees the same indices)
            counts.append(repeats)
            slots[0] = n_slots

    count_repeats(record)

    out = tempfile.mkdtemp(prefix="split_repeats_")
    quality.main(
        [
            "--methods",
            args.row,
            "--steps",
            str(args.steps),
            "--model",
            args.model,
            "--no-progress",
            "--out",
            out,
            *(["--quick"] if args.quick else []),
        ]
    )
    summary = summarize(counts, slots[0])
    print(f"{args.row}, {args.model} model: {slots[0]:,} slots a step, {len(counts)} SPLIT steps")
    print("| SPLIT steps | repeats, mean | max | share of the slots |\n|---|---:|---:|---:|")
    for w in summary:
        print(
            f"| {w['steps'][0]}-{w['steps'][1]} | {w['mean']:.0f} | {w['max']} | {w['share']:.1%} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "row": args.row,
                    "model": args.model,
                    "slots": slots[0],
                    "counts": counts,
                    "summary": summary,
                },
                f,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
