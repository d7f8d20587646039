"""Where a cast's step goes on the emulated cluster: a profile of each host's step, per op kind.

    jaxcomp cluster --hosts 4 --rate 1gbit -- profile.py [--model M] [--methods pmean,fp16,bf16]
    python profile.py --table        # the table of every profile-*.json here, and profile.png

Each host trains netbench's job (the zoo model, SGD after the mean, 2 rows a host) with each
method as netbench builds it (``netbench_worker._build_step``), times 5 steps after 5 untimed ones
(wall and this process's CPU seconds), then traces 2 steps with ``jax.profiler``. Every thunk of
the step is put in one kind by its HLO instruction (a fusion by what its computation runs):

* ``dot``: the forward and backward passes' dots (and fusions that run one);
* ``ring hop``: ``collective-permute`` (jaxcomp's 16-bit ring: a hop's send and receive, waits
  for the peer included);
* ``all-gather``: gloo's all-gather (the 16-bit ring's second half: every device's summed chunk);
* ``all-reduce``: gloo's sum (``pmean``'s, and the scalars');
* ``native``: jaxcomp's kernels (XLA FFI custom calls: the packing and its energies, the scale);
* ``cast``: fusions that convert to or from a 16-bit float (the pack, a hop's widen-add-round,
  the unpack);
* ``copy``, and ``other`` (the optimizer, the split into the leaves, the guards' reads).

Thunks that run others (``while``, ``conditional``, ``call``) are left out: their time is their
body's, counted there. It writes ``profile-<model>-<method>-rank<r>.json`` per host: the step's
wall and CPU seconds, per kind the thunks' summed milliseconds a step (thunks may run on several
threads at once), and the 25 costliest instructions.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ("dot", "ring hop", "all-gather", "all-reduce", "native", "cast", "copy", "other")
# Thunks that run others (a loop's body, a branch): their time is their body's, counted there.
ENCLOSING = ("while", "conditional", "call")
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+(?: \S+)*?) ([\w\-]+)\(", re.M)


def _kinds(hlo: str) -> dict:
    """Every instruction's name -> ``(kind, opcode)`` (a fusion's kind by what it runs)."""
    bodies = dict(re.findall(r"\n%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}", hlo, re.S))
    out = {}
    for body in bodies.values():
        for line in body.splitlines():
            m = INSTRUCTION.match(line)
            if not m:
                continue
            name, shape, op = m.groups()
            called = re.search(r"calls=%?([\w.\-]+)", line)
            inner = bodies.get(called.group(1), "") if called else ""
            target = re.search(r'custom_call_target="([^"]+)"', line)
            out[name] = (_kind(op, shape, inner), target.group(1) if target else op)
    return out


def _kind(op: str, shape: str, inner: str) -> str:
    if op in ENCLOSING:
        return "encloses"
    if op == "dot" or (op == "fusion" and " dot(" in inner):
        return "dot"
    if op.startswith("collective-permute"):
        return "ring hop"
    if op.startswith("all-reduce"):
        return "all-reduce"
    if op.startswith("all-gather"):
        return "all-gather"
    if op == "custom-call":
        return "native"
    if op == "copy":
        return "copy"
    half = re.search(r"\b(f16|bf16)\[", shape + inner)
    if op in ("fusion", "convert") and half:
        return "cast"
    return "other"


def _events(path: str) -> list:
    """The trace's thunks: complete events that name their HLO instruction."""
    files = sorted(glob.glob(os.path.join(path, "**", "*.trace.json.gz"), recursive=True))
    trace = json.load(gzip.open(files[-1]))
    return [
        e for e in trace["traceEvents"] if e.get("ph") == "X" and "hlo_op" in (e.get("args") or {})
    ]


def _profile(job, label: str, traced: int = 2) -> dict:
    import jax

    from jaxcomp.distributed import netbench
    from jaxcomp.distributed.netbench_worker import _build_step

    method, options, shard = netbench.METHODS[label]
    run, state, _ = _build_step(job, method, options, shard)
    step = run.step
    wall, cpu = [], []
    for i in range(10):
        start, start_cpu = time.perf_counter(), time.process_time()
        state, metrics = step(state, job.global_batch(i))[:2]
        jax.block_until_ready(metrics["loss"])
        if i >= 5:
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    batch = job.global_batch(0)
    lowered = run._step.lower(*state, batch) if label == "pmean" else run.step.lower(state, batch)
    hlo = lowered.compile().as_text()
    with tempfile.TemporaryDirectory() as path:
        with jax.profiler.trace(path):
            for i in range(traced):
                state, metrics = step(state, job.global_batch(i))[:2]
                jax.block_until_ready(metrics["loss"])
        events = _events(path)
    kinds, ms, ops = _kinds(hlo), dict.fromkeys(KINDS, 0.0), {}
    unknown = 0
    for e in events:
        name = e["args"]["hlo_op"]
        kind, op = kinds.get(name, (None, "?"))
        unknown += kind is None
        if kind == "encloses":
            continue
        ms[kind or "other"] += e["dur"] / 1e3 / traced
        key = f"{kind or 'other'}: {op} {name}"
        ops[key] = ops.get(key, 0.0) + e["dur"] / 1e3 / traced
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:25]
    return {
        "top_ops_ms": [[k, round(v, 2)] for k, v in top],
        "method": label, "rank": jax.process_index(), "hosts": jax.process_count(),
        "step_s": statistics.median(wall), "cpu_s": statistics.median(cpu),
        "thunk_ms": ms, "events": len(events), "unmatched_events": unknown,
    }  # fmt: skip


def _table() -> None:
    rows = {}
    for path in sorted(glob.glob(os.path.join(HERE, "profile-*.json"))):
        r = json.load(open(path))
        rows.setdefault((r["model"], r["method"]), []).append(r)
    print("| model | method | step s (host 0) | CPU s a step (mean of hosts) | "
          + " | ".join(f"{k} ms" for k in KINDS) + " |")  # fmt: skip
    print("|---|---|---:|---:|" + "---:|" * len(KINDS))
    for (model, method), hosts in rows.items():
        zero = next(h for h in hosts if h["rank"] == 0)
        cpu = statistics.mean(h["cpu_s"] for h in hosts)
        kinds = " | ".join(f"{zero['thunk_ms'][k]:.0f}" for k in KINDS)
        print(f"| {model} | {method} | {zero['step_s']:.3f} | {cpu:.3f} | {kinds} |")
    _plot(rows, os.path.join(HERE, "profile.png"))


def _plot(rows: dict, path: str) -> None:
    """Per method, host 0's thunk milliseconds a step stacked by kind, beside its wall step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{model}\n{method}" for model, method in rows]
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(rows), 4.5))
    bottom = [0.0] * len(rows)
    for kind in KINDS:
        values = [
            next(h for h in hosts if h["rank"] == 0)["thunk_ms"][kind] for hosts in rows.values()
        ]
        ax.bar(labels, values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    steps = [1e3 * next(h for h in hs if h["rank"] == 0)["step_s"] for hs in rows.values()]
    ax.scatter(labels, steps, color="black", marker="_", s=900, label="wall step", zorder=3)
    ax.set_ylabel("ms a step (host 0)")
    ax.set_title("where host 0's step goes: its thunks by kind, and the step's wall time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--table" in argv:
        _table()
        return 0
    model = argv[argv.index("--model") + 1] if "--model" in argv else "mlp4096"
    methods = argv[argv.index("--methods") + 1] if "--methods" in argv else "pmean,fp16,bf16"
    from jaxcomp.distributed import netbench
    from jaxcomp.distributed.netbench_worker import _start_job

    params = float(argv[argv.index("--params") + 1]) if "--params" in argv else 25e6
    model = None if "--params" in argv else model  # the MLP of that many params (a smoke test)
    spec = netbench.Spec(params, (), 5, 5, 2, 6, "", 1e9, model=model, optimizer="sgd")
    job = _start_job(spec)
    for label in methods.split(","):
        result = dict(_profile(job, label), model=model or job.about["model"])
        name = f"profile-{result['model']}-{label}-rank{result['rank']}.json"
        with open(os.path.join(HERE, name), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
