"""What an eager round overlaps on XLA:CPU: a profiler trace of one step, per device.

    python trace.py            # writes trace.json (the figures) and trace.png (the timeline)
    jaxcomp cluster --hosts 2 --rate 100mbit -- trace.py --cluster [--dense]   # as root

``--cluster``: one worker per emulated host (gloo between them), trace-cluster*.json and .png
from host 0; ``--dense``: dense pseudo-gradients (a ``psum``) instead of 8-bit codes.

4 workers on 4 of 8 virtual CPU devices train a 3-layer MLP (2.1M params) with Adam inside,
8-bit pseudo-gradients (``jaxcomp.Quantized(8)``), H = 4, one fragment, ``worker_metrics=True``
(no loss all-reduce between syncs). For ``eager=True`` and for the synchronous round
(``eager=False``), the step that runs the round is traced with ``jax.profiler`` after warm-up
steps. Every thunk event carries its device and HLO op: the round is the conditional whose
branches hold the collectives, the compute is the dots (XLA:CPU's ``ynn_fusion`` s). Per device
the script reports the round's span, the dots' time, and how much of the dots' time lies inside
the round's span (the overlap).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
COLLECTIVE = re.compile(r"= [^=]*\b(all-reduce|all-gather|reduce-scatter|all-to-all)\(")


def _run(eager: bool, cluster: bool = False, dense: bool = False):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh

    import jaxcomp

    def loss(p, x):
        h = jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"])
        return jnp.mean((h @ p["w3"]) ** 2)

    rng = np.random.default_rng(0)
    shapes = {"w1": (512, 1024), "w2": (1024, 1024), "w3": (1024, 512)}
    params = {n: rng.normal(size=s).astype(np.float32) * 0.03 for n, s in shapes.items()}
    devices = jax.devices() if cluster else jax.devices()[:4]
    run = jaxcomp.diloco(
        loss, optax.adam(1e-3), mesh=Mesh(np.array(devices), ("workers",)),
        sync_every=4, compress=None if dense else jaxcomp.Quantized(8),
        eager=eager, worker_metrics=True,
    )  # fmt: skip
    rows = 64 * len(devices) // jax.process_count()
    batch = run.shard_batch(rng.normal(size=(rows, 512)).astype(np.float32))
    return run, run.init(params if cluster else jax.tree.map(jnp.asarray, params)), batch


def _dots(hlo: str) -> set:
    """The entry's dots and the fusions whose own computation runs one."""
    bodies = dict(re.findall(r"\n%(\S+) [^\n]*\{\n(.*?)\n\}", hlo, re.S))
    entry = hlo[hlo.index("\nENTRY") :]
    found = set()
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = .*? (dot|fusion)\(", line)
        if not m:
            continue
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if m.group(2) == "dot" or (called and " dot(" in bodies.get(called.group(1), "")):
            found.add(m.group(1))
    return found


def _round_ops(hlo: str) -> tuple:
    """``(name, ops)``: the entry's conditional whose branches hold the collectives (the round),
    and the names of every instruction its branches run (transitively)."""
    bodies = dict(re.findall(r"\n%(\S+) [^\n]*\{\n(.*?)\n\}", hlo, re.S))

    def called(text):
        names = re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", text)
        for group in re.findall(r"branch_computations=\{([^}]*)\}", text):
            names += [b.strip().lstrip("%") for b in group.split(",")]
        return names

    def reach(roots):
        seen, todo = set(), list(roots)
        while todo:
            name = todo.pop()
            if name not in seen and name in bodies:
                seen.add(name)
                todo += called(bodies[name])
        return seen

    entry = hlo[hlo.index("\nENTRY") :]
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = .* conditional\(", line)
        computations = reach(called(line)) if m else set()
        if any(COLLECTIVE.search(bodies[c]) for c in computations):
            ops = {
                n
                for c in computations
                for n in re.findall(r"^\s*(?:ROOT )?%(\S+) =", bodies[c], re.M)
            }
            return m.group(1), ops | {m.group(1)}
    raise RuntimeError("no conditional with collectives in the step")


def _events(path: str) -> list:
    files = sorted(glob.glob(os.path.join(path, "**", "*.trace.json.gz"), recursive=True))
    trace = json.load(gzip.open(files[-1]))
    return [
        e for e in trace["traceEvents"]
        if e.get("ph") == "X" and (e.get("args") or {}).get("hlo_module") == "jit__step"
    ]  # fmt: skip


def _profile(eager: bool, cluster: bool = False, dense: bool = False) -> dict:
    """One traced step that runs the round: per device, the round's span and the dots."""
    import jax

    run, state, batch = _run(eager, cluster, dense)
    # The round due after step 4 runs in step 4 (synchronous) or step 5 (eager).
    for _ in range(4 if eager else 3):
        state, _ = run.step(state, batch)
    jax.block_until_ready(state)
    hlo = run.step.lower(state, batch).compile().as_text()
    (round_op, round_ops), dots = _round_ops(hlo), _dots(hlo)
    with tempfile.TemporaryDirectory() as path:
        with jax.profiler.trace(path, create_perfetto_trace=True):
            state, metrics = run.step(state, batch)
            jax.block_until_ready(state)
        events = _events(path)
    assert bool(metrics["synced"])
    start = min(e["ts"] for e in events)
    devices = {}
    for e in events:
        device = devices.setdefault(int(e["args"]["device_ordinal"]), {"round": [], "dots": []})
        span = (e["ts"] - start, e["ts"] - start + e["dur"])
        if e["args"]["hlo_op"] in round_ops:
            device["round"].append(span)
        elif e["args"]["hlo_op"] in dots:
            device["dots"].append(span)
    return {"round_op": round_op, "devices": devices}


def _union(spans) -> list:
    merged = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def _overlap(device) -> dict:
    """The round's busy time (the union of its thunks), the dots', and their intersection."""
    rounds, dots = _union(device["round"]), _union(device["dots"])
    inside = sum(max(0.0, min(b, d) - max(a, c)) for a, b in rounds for c, d in dots)
    busy = sum(b - a for a, b in rounds)
    total = sum(b - a for a, b in dots)
    return dict(
        round_ms=busy / 1e3, dots_ms=total / 1e3, dots_inside_round_ms=inside / 1e3,
        share_of_dots_inside=inside / total if total else 0.0,
    )  # fmt: skip


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 5), sharex=False)
    for ax, (mode, result) in zip(axes, results.items()):
        for d, device in sorted(result["devices"].items()):
            spans = [(a / 1e3, (b - a) / 1e3) for a, b in _union(device["round"])]
            ax.broken_barh(spans, (d - 0.4, 0.35), color="tab:orange")
            bars = [(a / 1e3, (b - a) / 1e3) for a, b in device["dots"]]
            ax.broken_barh(bars, (d + 0.05, 0.35), color="tab:blue")
        ax.set_yticks(sorted(result["devices"]), [f"device {d}" for d in sorted(result["devices"])])
        ax.set_title(f"{mode}: the round's thunks ({result['round_op']}, orange), the dots (blue)")
        ax.set_xlabel("ms from the step's first thunk")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cluster = "--cluster" in argv  # under `jaxcomp cluster`: one device per host
    dense = "--dense" in argv  # dense pseudo-gradients (a psum) instead of 8-bit codes
    if cluster:
        sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "src"))
        from jaxcomp.distributed import launch

        if launch.initialize() != 0:
            _profile(True, True, dense), _profile(False, True, dense)  # the others take part
            return 0
    else:
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    results = {m: _profile(m == "eager", cluster, dense) for m in ("eager", "synchronous")}
    summary = {
        mode: {
            "round_op": r["round_op"],
            **{str(d): _overlap(v) for d, v in sorted(r["devices"].items())},
        }
        for mode, r in results.items()
    }
    name = "trace" + ("-cluster" if cluster else "") + ("-dense" if dense else "")
    with open(os.path.join(HERE, f"{name}.json"), "w") as f:
        json.dump({"summary": summary, "timelines": results}, f, indent=1)
    _plot(results, os.path.join(HERE, f"{name}.png"))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
