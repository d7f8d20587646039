"""What compress_auto's per-step switch costs beside the fixed method it runs (issue 22, item 6),
and the same update with the branch compiled as a static choice (what data_parallel runs).

    python benchmarks/auto_switch.py --model mlp4096 --repeats 3

One CPU device, random gradients of a jaxcomp.training.zoo model's shapes: the update of
``compress(method)`` against ``compress_auto([method, ...])`` with ``method`` first. With no
network known, compress_auto runs its first candidate, so every row runs the same method; the
only difference is auto's path (the decision, the lax.switch over the candidates, dense totals
and sents). Best of --repeats interleaved rounds of 2 calls each; results go to BENCHMARKS.md.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import passes  # noqa: E402  (the zoo's gradients, the one-device update)

import jaxcomp  # noqa: E402
from jaxcomp.methods import Cast, Dense, PowerSGD, Quantized, RandomK, Sign, TopK, Zfp  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp4096", help="a jaxcomp.training.zoo model")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def transformations():
    """``{label: (fixed or auto transformation)}``, random-k 1% first in every auto."""
    rk = RandomK(0.01)
    others = (TopK(0.01), TopK(0.01, collective="ar"), Zfp(8), Quantized(4))
    others += (Cast("bfloat16"), Sign(), PowerSGD(4))
    return {
        "compress(randomk)": jaxcomp.compress(rk),
        "compress(randomk, guardrail=False)": jaxcomp.compress(rk, guardrail=False),
        "compress_auto([randomk])": jaxcomp.compress_auto([rk]),
        "compress_auto([randomk], guardrail=False)": jaxcomp.compress_auto([rk], guardrail=False),
        "compress_auto([randomk, dense])": jaxcomp.compress_auto([rk, Dense()]),
        "compress_auto(9 candidates, netbench's)": jaxcomp.compress_auto([rk, Dense(), *others]),
    }


def update_call(tx, grads, branch=None):
    """A no-argument call of ``tx``'s jitted update on one device, and the branch it ran
    (``branch``: compiled as a static choice, as data_parallel's steps are)."""
    step, state = passes.transformation_update(tx, grads, branch)
    ran = int(step(grads, state)[1].metrics.method)
    return (lambda: step(grads, state)), ran


def main(argv=None):
    args = parse_args(argv)
    grads = passes.gradients(args.model)
    calls = {label: update_call(tx, grads) for label, tx in transformations().items()}
    # data_parallel's step: the branch the device chose, compiled as a static choice.
    for label, tx in transformations().items():
        if label.startswith("compress_auto"):
            calls[f"{label}, branch picked on the host"] = update_call(tx, grads, 0)
    best = passes.best_of_rounds({label: call for label, (call, _) in calls.items()}, args.repeats)
    fixed = best["compress(randomk)"]
    print(f"{args.model}, one CPU device, best of {args.repeats} rounds")
    print("| update | ms | vs compress(randomk) | branch that ran |")
    print("|---|---:|---:|---:|")
    for label, (_, ran) in calls.items():
        print(f"| `{label}` | {best[label] * 1e3:.1f} | {best[label] / fixed:.2f}x | {ran} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
