"""DiLoCo on a two-level mesh: what ``exchange="split"`` and ``shard="optimizer"`` save.

    python benchmarks/diloco_two_level.py [--mesh 4x2] [--models mlp4096,gpt2,resnet50]
                                          [--time-model mlp2041] [--time-mesh 2x2]
                                          [--repeats 5] [--json out.json]

Three settings of ``jaxcomp.diloco`` (the paper's inner AdamW and outer Nesterov, int8
pseudo-gradients with error feedback) on a ``workers x inner`` mesh of in-process CPU devices:

* ``whole``: ``exchange="whole"``, ``shard=None``: every device of a worker's row sends the whole
  pseudo-gradient over the outer axis and keeps the whole inner optimizer state;
* ``split``: ``exchange="split"`` (the default with ``inner_axis``): each device sends its
  ``1/inner`` block and keeps that block's residual;
* ``split+zero``: ``split`` and ``shard="optimizer"``: each device also keeps only its shards'
  inner optimizer state.

For every zoo model of ``--models``, per device, without allocating anything (from
``state_shapes`` and the step compiled from the abstract state): the bytes of the state it holds,
of them the inner optimizer state and the outer compress state, and XLA's ``memory_analysis`` of
the compiled step (arguments and temporaries of one device's program).

For ``--time-model`` on ``--time-mesh`` it also trains with a sync every second step: the bytes
one device sent per sync (``metrics["bytes_sent"]``, what the slow axis carries per device) and
the best of ``--repeats`` times of a step without and with a sync, the settings interleaved in
every round (one process: the ratio is fair; the devices share this machine's cores and the
"network" is memory, so the time shows the local work, not a slow link).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

SETTINGS = {
    "whole": dict(exchange="whole", shard=None),
    "split": dict(exchange="split", shard=None),
    "split+zero": dict(exchange="split", shard="optimizer"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", default="4x2", help="workers x inner devices (default 4x2)")
    parser.add_argument("--models", default="mlp4096,gpt2,resnet50")
    parser.add_argument("--time-model", default="mlp2041", help="'' to skip the timing")
    parser.add_argument("--time-mesh", default="2x2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    mesh, time_mesh = _mesh_shape(args.mesh), _mesh_shape(args.time_mesh)
    import jax

    jax.config.update("jax_num_cpu_devices", max(math.prod(mesh), math.prod(time_mesh)))
    results = {"mesh": args.mesh, "memory": {}, "time_mesh": args.time_mesh}
    for name in [m for m in args.models.split(",") if m]:
        print(f"{name}: compiling the three steps from the abstract state ...", flush=True)
        results["memory"][name] = memory_rows(name, *mesh)
    if args.time_model:
        print(f"{args.time_model}: training, {args.repeats} rounds ...", flush=True)
        results["time"] = {args.time_model: time_rows(args.time_model, *time_mesh, args.repeats)}
    print_tables(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _mesh_shape(text):
    try:
        workers, inner = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"a mesh is WORKERSxINNER, e.g. 4x2; got {text!r}") from None
    return workers, inner


def build_run(model, workers, inner, setting, sync_every=50):
    """A DiLoCo run of the zoo ``model`` on a ``workers x inner`` mesh (int8 exchanges)."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh

    import jaxcomp

    devices = np.array(jax.devices()[: workers * inner]).reshape(workers, inner)
    return jaxcomp.diloco(
        model.loss_fn,
        optax.adamw(4e-4, weight_decay=0.1),
        mesh=Mesh(devices, ("w", "d")),
        sync_every=sync_every,
        compress=jaxcomp.Quantized(8),
        outer_axis="w",
        inner_axis="d",
        **SETTINGS[setting],
    )


def memory_rows(name, workers, inner):
    """Per-device bytes of the state and of the compiled step, for every setting."""
    import jax
    import numpy as np

    from jaxcomp.training import zoo

    model = zoo.build(name, abstract=True)
    batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
        model.make_batch(np.random.default_rng(0), 2 * workers * inner),
    )
    rows = {"params": model.n_params}
    for setting in SETTINGS:
        run = build_run(model, workers, inner, setting)
        state = run.state_shapes(model.params)
        analysis = run.step.lower(state, batch).compile().memory_analysis()
        rows[setting] = {
            "state": device_bytes(state),
            "inner_state": device_bytes(state.inner_state),
            "compress_state": device_bytes(state.compress_state),
            "step": analysis.argument_size_in_bytes + analysis.temp_size_in_bytes,
        }
    return rows


def device_bytes(tree) -> int:
    """Bytes one device holds of ``tree``'s ``ShapeDtypeStruct`` leaves (their shard shapes)."""
    import jax
    import numpy as np

    return sum(
        math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        for leaf in jax.tree.leaves(tree)
    )


def time_rows(name, workers, inner, repeats):
    """Per setting: bytes one device sent per sync, the best plain and sync step seconds."""
    import jax
    import numpy as np

    from jaxcomp.training import zoo

    model = zoo.build(name)
    batch = model.make_batch(np.random.default_rng(0), 2 * workers * inner)
    runs = {s: build_run(model, workers, inner, s, sync_every=2) for s in SETTINGS}
    states = {s: run.init(model.params) for s, run in runs.items()}
    best = {s: {"step_s": math.inf, "sync_step_s": math.inf, "bytes_per_sync": 0.0} for s in runs}
    for _ in range(2 * (repeats + 1)):  # the first two steps compile and warm up
        for setting, run in runs.items():
            start = time.perf_counter()
            states[setting], metrics = run.step(states[setting], run.shard_batch(batch))
            jax.block_until_ready(metrics["loss"])
            seconds, row = time.perf_counter() - start, best[setting]
            key = "sync_step_s" if bool(metrics["synced"]) else "step_s"
            row[key] = min(row[key], seconds)
            row["bytes_per_sync"] = max(row["bytes_per_sync"], float(metrics["bytes_sent"]))
    return best


def print_tables(results):
    mib = 2**20
    print(f"\nper device, mesh {results['mesh']} (workers x inner), MiB:")
    print("| model | params | setting | state | inner state | compress state | step memory |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name, rows in results["memory"].items():
        for setting in SETTINGS:
            r = rows[setting]
            print(
                f"| {name} | {rows['params'] / 1e6:.1f}M | {setting} | {r['state'] / mib:.0f} | "
                f"{r['inner_state'] / mib:.0f} | {r['compress_state'] / mib:.0f} | "
                f"{r['step'] / mib:.0f} |"
            )
    for name, rows in results.get("time", {}).items():
        print(f"\n{name} on {results['time_mesh']}, a sync every 2nd step (best of the rounds):")
        print("| setting | MB one device sends per sync | step s | step with sync s |")
        print("|---|---:|---:|---:|")
        for setting, r in rows.items():
            print(
                f"| {setting} | {r['bytes_per_sync'] / 1e6:.2f} | {r['step_s']:.3f} | "
                f"{r['sync_step_s']:.3f} |"
            )


if __name__ == "__main__":
    sys.exit(main())
