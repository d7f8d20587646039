"""The summary's time-to-quality section: how soon each row reaches data-parallel dense's final
held-out loss on 4 emulated hosts, and what it sent until then."""

from __future__ import annotations

import os

from summary import common

#: The runs measured on another CPU than the others (an Intel Xeon, where every row takes 1.6 to
#: 1.8 times the CPU seconds a step): their rows compare with each other only.
XEON = (
    "time_to_quality_cluster_small_4500_100mbit_diloco_2026-12-05.json",
    "time_to_quality_cluster_small_4500_100mbit_ft_xeon_2026-12-05.json",
    "time_to_quality_cluster_small_4500_100mbit_ft_int8_xeon_2026-12-05.json",
    "time_to_quality_cluster_small_4500_100mbit_ft_int8_killservice_xeon_2026-12-05.json",
)
#: The runs, each a char-LM on 4 emulated hosts: the title says which model and batch.
FILES = tuple(
    common.result(name)
    for name in (
        "time_to_quality_cluster.json",
        "time_to_quality_cluster_onebit_100mbit.json",
        "time_to_quality_cluster_small_4500_1gbit.json",
        "time_to_quality_cluster_small_4500_100mbit.json",
        "time_to_quality_cluster_wide8x32_900_100mbit_2026-11-28.json",
        "time_to_quality_cluster_small_4500_100mbit_ft_2026-12-05.json",
        "time_to_quality_cluster_small_4500_100mbit_ft_int8_2026-12-06.json",
        "time_to_quality_cluster_small_4500_100mbit_ft_int8_eager_2026-12-06.json",
        *XEON,
    )
)
RATES = {"1gbit": "1 Gbit", "100mbit": "100 Mbit"}

STILL_SHORT = (
    "**Still short:** these runs predate the variance floor and SPLIT, AR-Topk's default "
    "leader; the codecs recommended for quality (ZFP 8, THC 4 bits, the bf16 cast) have not "
    "run to a loss on the cluster, and neither has `jaxcomp.adam` at 1 Gbit."
)


def rows(data) -> list:
    """``[(rate, name, sooner, bytes, loss)]`` of a run's panels against its ``dp`` row: dp's
    seconds to its own final loss over the row's (None: never reached), the bytes the row sent
    until then over dp's whole run's, and its final loss over dp's."""
    out = []
    for rate, curves in data["panels"]:
        dp = next(c["curve"] for c in curves if c["name"] == "dp")
        target, dp_seconds = dp[-1]["loss"], _reached(dp, dp[-1]["loss"])["seconds"]
        for c in curves:
            if c["name"] == "dp":
                continue
            reached = _reached(c["curve"], target)
            sooner = None if reached is None else dp_seconds / reached["seconds"]
            sent = None if reached is None else reached["bytes"] / dp[-1]["bytes"]
            out.append((rate, c["name"], sooner, sent, c["curve"][-1]["loss"] / target))
    return out


def _reached(curve, target):
    """The first evaluation after the start at or below ``target``, or None."""
    return next((p for p in curve[1:] if p["loss"] <= target), None)


def section() -> str:
    """The Markdown of the section."""
    lines = [
        "## How soon each reaches dense's loss",
        "",
        "Each row trains until it reaches the held-out loss data-parallel dense (`dp`) ends at; "
        "*sooner* is dp's wall-clock to that loss over the row's, *bytes* what the row sent "
        "until then over dp's whole run, *final* its last loss over dp's. The 4 emulated hosts "
        "share 2 cores. `diloco-hH-...`: DiLoCo syncing every H steps (`avg`: outer averaging, "
        "`int8`: 8-bit pseudo-gradients, `stream`: fragments); `adam-sign`: `jaxcomp.adam` "
        "with signs. `diloco-ft-...`: fault-tolerant DiLoCo (`jaxcomp.distributed.diloco_ft`, "
        "each worker a program of its own, dense float32 through the coordination service); "
        "`-kill2-restart60s`: worker 2 SIGKILLed mid-run and restarted 60 s later; their dp "
        "row is the small 4500-step run's at 100 Mbit (`--dp-from`), from another job on another "
        "day: their *sooner* is not side by side, their ratio to each other is. `-eager`: the "
        "outer step applied one round late (`diloco(eager=True)`; on a `diloco-ft` row, "
        "`diloco_ft(eager=True)`: each sync's exchange on a host thread beside the next round's "
        "inner steps); `-muon`: each worker trains "
        "with `jaxcomp.muon` (MuLoCo); `-topk2r02`: the top 2% of each pseudo-gradient in 2 bits "
        "with error feedback (SparseLoCo). A run marked *Xeon* ran on another CPU, where every "
        "row takes 1.6-1.8x the CPU seconds a step: compare its rows with each other only; the "
        "Xeon `diloco-ft` rows took the Xeon DiLoCo job's dp (`--dp-from`, the same machine "
        "and day), `-int8` there is `ft_codecs.Int8` (8 bits, error feedback), and "
        "`-killservice-restart30s` SIGKILLs the coordination service at mid-run and restarts it "
        "30 s later (the workers reconnect; its params end the same bits as the undisturbed "
        "`-int8` run's).",
        "",
        "Command: `sudo jaxcomp netbench --to-loss --hosts 4 --rates 1gbit,100mbit --model M "
        "--steps S --rows ...` (`benchmarks/time_to_quality.py`); the fault-tolerant rows: "
        "`sudo jaxcomp netbench --to-loss --fault-tolerant --hosts 4 --rate 100mbit --model "
        "small --steps 4500 ...` (the result file has the whole command).",
        "",
        "| run | rate | row | sooner | bytes | final |",
        "|---|---|---|---:|---:|---:|",
    ]
    for path in FILES:
        data = common.load(path)
        run = f"{data['title'].split(',')[1].strip()}, {data['config']['steps']} steps"
        run += ", Xeon" if os.path.basename(path) in XEON else ""
        for rate, name, sooner, sent, final in rows(data):
            shown = "never" if sooner is None else f"{sooner:.2f}x"
            told = "-" if sent is None else f"{sent:.3f}"
            lines.append(
                f"| {run} | {RATES.get(rate, rate)} | {name} | {shown} | {told} | {final:.3f} |"
            )
    lines += [
        "",
        f"Results: {common.sources(FILES)}.",
        "",
        "![DiLoCo and data-parallel, held-out loss against wall-clock, the small char-LM at "
        "100 Mbit](docs/img/time_to_quality_small_100mbit.png)",
        "",
        STILL_SHORT,
    ]
    return "\n".join(lines)
