"""The runs of ``jaxcomp demo``: one row of its table per method (or ``compress_auto``'s
candidates), grouped in families, each with its optimizer pairing and what it trades.

The random-k rows with error feedback run the optimizer without momentum (:mod:`jaxcomp.cli.demo`
says why), each with its documented trade-off in its ``note``:

* ``randomk`` (random-k at ``--density``): stable, but random entries carry less than the
  largest, so it ends a few points below dense;
* ``randomk_10x`` (10 times ``--density``): as good as dense, for a tenth of dense's bytes at the
  default density;
* ``randomk_noef`` (no error feedback, the default optimizer: no bursts, so momentum is
  harmless): stable and slow, since most of every gradient is dropped.

The step ``lr / (1 - 0.9)`` is momentum SGD's, not one tuned for random-k. The other
error-feedback rows keep the optimizer users write (and DGC's setting), SGD with momentum.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxcomp.methods import Dense

#: The families of methods, one column of panels each in the plot, in the table's order.
TOPK, CODECS, SPARSE_AND_LOW_RANK, AUTO = (
    "top-k",
    "quantizers & casts",
    "random-k, sign & low rank",
    "auto",
)
FAMILIES = (TOPK, CODECS, SPARSE_AND_LOW_RANK, AUTO)


@dataclasses.dataclass(frozen=True)
class Run:
    """One line of the demo's table: a method (or, for ``compress_auto``, its candidates) and
    options, its family (the plot's panel), its optimizer pairing and what the row trades."""

    name: str
    method: Any  # a jaxcomp.methods object, or a tuple of them: compress_auto's candidates
    options: dict = dataclasses.field(default_factory=dict)
    axis_name: str | tuple = "data"
    family: str = ""  # one of FAMILIES; "" for dense, drawn in every panel
    momentum_free: bool = False  # the optimizer after compress runs without momentum
    note: str = ""  # its documented setting or trade-off, in the verdict table


#: The run every other is compared with: the dense all-reduce.
DENSE = Dense().label

_NO_MOMENTUM = "optimizer without momentum"


def runs(density: float) -> dict[str, Run]:
    """The demo's runs by name, top-k and random-k ones at ``density`` (fraction of entries sent),
    family by family, each with a note on what it sends and trades."""
    from jaxcomp.methods import Cast, PowerSGD, Quantized, Sign, TopK, Zfp

    share = f"{100 * density:.3g}%"
    table = [Run(DENSE, Dense(), note="the reference: every value, all-reduced")]
    for method, note in (
        (TopK(density), f"each device's top {share}, values and indices all-gathered"),
        (TopK(density, collective="ar"), f"each device picks {share} / N of the shared indices"),
        (TopK(density, collective="hierarchical"), "top-k of each shard in a node, then across"),
    ):
        axis_name = ("node", "device") if method.axes_needed == 2 else "data"
        table.append(Run(method.label, method, {}, axis_name, TOPK, note=note))
        if axis_name == "data":  # top-k without error feedback too
            noef = {"error_feedback": False}
            note = "no error feedback: what is not sent is lost"
            table.append(Run(f"{method.label}_noef", method, noef, family=TOPK, note=note))
    for method, note in (
        (Zfp(8), "8 bits a value (ZFP fixed rate)"),
        (Quantized(4), "4-bit codes on a shared grid (THC)"),
        (Cast("bfloat16"), "16 bits a value, no error feedback (its default)"),
    ):
        table.append(Run(method.label, method, family=CODECS, note=note))
    table += _randomk_runs(density)
    for method, note in (
        (Sign(), "1 bit a value and a scale a chunk"),
        (PowerSGD(4), "rank-4 factors"),
    ):
        table.append(Run(method.label, method, family=SPARSE_AND_LOW_RANK, note=note))
    table += _auto_runs(density)
    return {run.name: run for run in table}


def _randomk_runs(density: float) -> list[Run]:
    """Random-k with error feedback and the optimizer without momentum (:mod:`jaxcomp.cli.demo`
    says why), at ``density`` and at 10 times it; and without error feedback."""
    from jaxcomp.methods import RandomK

    method, wider = RandomK(density), RandomK(min(1.0, 10 * density))
    family = SPARSE_AND_LOW_RANK
    return [
        Run(
            method.label,
            method,
            family=family,
            momentum_free=True,
            note=f"{_NO_MOMENTUM}; random entries carry less than the top ones",
        ),
        Run(
            f"{method.label}_10x",
            wider,
            family=family,
            momentum_free=True,
            note=f"{_NO_MOMENTUM}; 10x the density and the bytes",
        ),
        Run(
            f"{method.label}_noef",
            method,
            {"error_feedback": False},
            family=family,
            note=f"no error feedback: {100 * (1 - density):.3g}% of each gradient dropped",
        ),
    ]


def _auto_runs(density: float) -> list[Run]:
    """``compress_auto`` on the probed devices, and on a simulated slow link."""
    from jaxcomp.methods import candidates
    from jaxcomp.optim.auto import RatioSearch

    return [
        # Chooses from the probed network (here 8 in-memory devices) and the cost model.
        Run(
            "auto",
            candidates(ratio=density, rate=8),
            family=AUTO,
            note="the cost model's choice for the probed devices",
        ),
        # The same choice on a simulated slow link, with the ratio chosen as well (paper 000 §3-E).
        Run(
            "auto_adaptive_100mbit",
            candidates(ratio=density),
            {"ratio_search": RatioSearch(), "network": "1ms/100mbit"},
            family=AUTO,
            note="the same on a 1 ms, 100 Mbit/s link; density searched",
        ),
    ]
