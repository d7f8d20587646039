"""How much sooner than dp any row of a time-to-quality job could reach dp's loss on this machine.

For each row: the step at which it first reached dp's final held-out loss, its wall-clock and CPU
seconds a step (worker 0's process: one host's), and the wall-clock a step would take if the
hosts only computed: CPU seconds a step per host x hosts / cores (the hosts share the cores). The
ceiling is dp's time to its loss over that compute-only time to the row's step: what the row
would gain if its communication cost nothing. The job's ceiling takes the fewest steps any row
needed at the cheapest compute of any row: no mix of the measured rows gains more.

  python docs/notes/2026-12-05-diloco-15x-ceiling/ceiling.py RESULT.json [...] [--cores 2]
"""

import argparse
import json
import os

from jaxcomp.training.to_loss_loop import summarize


def _hosts(command) -> int:
    words = command.split() if isinstance(command, str) else command
    return int(words[words.index("--hosts") + 1])


def rows(path, cores):
    """One dict per row (dp's too) of the job in ``path``."""
    with open(path) as f:
        record = json.load(f)
    hosts, steps = _hosts(record["command"]), record["config"]["steps"]
    for rate, results in record["panels"]:
        dp = next(r for r in results if r["name"] == "dp")
        target = dp["curve"][-1]["loss"]
        dp_time = summarize(dp, target, steps)["to_target"]
        for result in results:
            figures = summarize(result, target, steps)
            reached = next((p for p in result["curve"][1:] if p["loss"] <= target), None)
            compute = figures["step_cpu"] * hosts / cores
            yield dict(
                rate=rate,
                row=result["name"],
                sooner=None if reached is None else dp_time / figures["to_target"],
                step=None if reached is None else reached["step"],
                step_s=figures["step_seconds"],
                cpu_s=figures["step_cpu"],
                compute_s=compute,
                ceiling=None if reached is None else dp_time / (reached["step"] * compute),
            )


def _cell(value, form, unit=""):
    return "-" if value is None else format(value, form) + unit


def job_ceiling(found) -> float:
    """dp's time to its loss over the fewest steps any row needed times the cheapest compute."""
    dp = next(r for r in found if r["row"] == "dp")
    steps = min(r["step"] for r in found if r["step"] is not None and r["row"] != "dp")
    compute = min(r["compute_s"] for r in found if r["row"] != "dp")
    return dp["ceiling"] * dp["step"] * dp["compute_s"] / (steps * compute)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results", nargs="+")
    parser.add_argument("--cores", type=int, default=2)
    args = parser.parse_args()
    head = "| rate | row | sooner | step at dp's loss | s / step | CPU s / step / host "
    print(head + "| compute-only s / step | ceiling |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    ceilings = []
    for path in args.results:
        found = list(rows(path, args.cores))
        for r in found:
            cells = [r["rate"], r["row"], _cell(r["sooner"], ".2f", "x"), _cell(r["step"], "d")]
            cells += [f"{r['step_s']:.4f}", f"{r['cpu_s']:.4f}", f"{r['compute_s']:.4f}"]
            print("| " + " | ".join(cells + [_cell(r["ceiling"], ".1f", "x")]) + " |")
        for rate in dict.fromkeys(r["rate"] for r in found):
            panel = [r for r in found if r["rate"] == rate]
            ceilings.append(f"{os.path.basename(path)} at {rate}: {job_ceiling(panel):.1f}x")
    print("\nThe jobs' ceilings: " + "; ".join(ceilings))


if __name__ == "__main__":
    main()
