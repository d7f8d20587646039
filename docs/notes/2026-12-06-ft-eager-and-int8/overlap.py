"""What the eager exchange hid on the cluster, and what a step would cost if the hosts only
computed: ``python overlap.py`` (reads the worker logs and the two result files).

For each worker of the eager run: its syncs, the seconds its exchanges took (``exchange_seconds``,
on the thread) and the seconds its rounds waited for them (``waited``). For both runs at step
3300 (where the synchronous run reached dp's loss): wall-clock a step, CPU a step of worker 0,
and the compute-only step (CPU a step x 4 hosts / 2 cores).
"""

import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "..", "..", "..", "benchmarks", "results")
RUNS = {
    "sync": "time_to_quality_cluster_small_4500_100mbit_ft_int8_2026-12-06.json",
    "eager": "time_to_quality_cluster_small_4500_100mbit_ft_int8_eager_2026-12-06.json",
}


def main():
    for path in sorted(glob.glob(os.path.join(HERE, "eager_logs", "worker*.jsonl"))):
        events = [json.loads(line) for line in open(path) if line.startswith("{")]
        syncs = [e for e in events if e["event"] == "sync"]
        took = [e["exchange_seconds"] for e in syncs]
        waited = [e["waited"] for e in syncs]
        name = os.path.basename(path)
        print(
            f"{name}: {len(syncs)} syncs; exchange median {statistics.median(took):.2f} s, "
            f"total {sum(took):.1f} s; waited median {statistics.median(waited):.2f} s, "
            f"total {sum(waited):.1f} s ({1 - sum(waited) / sum(took):.0%} hidden)"
        )
    for name, file in RUNS.items():
        data = json.load(open(os.path.join(RESULTS, file)))
        ((_, rows),) = data["panels"]
        row = next(r for r in rows if r["name"] != "dp")
        point = next(p for p in row["curve"] if p["step"] == 3300)
        wall, cpu = point["seconds"] / 3300, point["cpu"] / 3300
        print(
            f"{name}: at step 3300, {1000 * wall:.1f} ms a step, {1000 * cpu:.1f} ms CPU a step "
            f"a host, compute-only {1000 * cpu * 4 / 2:.1f} ms, loss {point['loss']:.4f}"
        )


if __name__ == "__main__":
    main()
