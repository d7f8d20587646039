"""What ``data_parallel(donate=True)`` saves: the step's memory with and without donating the state.

    python benchmarks/donation.py [--models mlp4096,mlp2041,resnet50,gpt2,many_small]
        [--methods dense,ar_topk,powersgd] [--steps 3] [--diloco] [--json out.json]

For every zoo model (:mod:`jaxcomp.training.zoo`) and method, a fresh process trains
``optax.chain(jaxcomp.compress(method), optax.adam(1e-4))`` through ``jaxcomp.data_parallel`` on
one CPU device, once without donation and once with (with ``--diloco``: ``jaxcomp.diloco``, one
worker, the default inner AdamW and outer Nesterov, ``method`` compressing the pseudo-gradient
every 50 steps), and reports

- the compiled step's own accounting (``compiled.memory_analysis()``): the bytes of its
  arguments (the state and the batch), its outputs, the outputs written over donated arguments
  (``alias``) and its temporaries; **XLA peak** is ``arguments + outputs - alias + temporaries``,
  what the step needs at once;
- the process's **peak resident memory during the steps**: the kernel's high-water mark
  (``VmHWM``), reset after the first (compiling) step by writing ``5`` to
  ``/proc/self/clear_refs``, read after ``--steps`` more; and the **state** itself (params,
  optimizer state, residuals).

Each configuration runs in its own process, one after another, so that one's freed heap is not
another's peak. glibc's allocator as it is (``jaxcomp.tune_host_allocator`` not called).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

METHODS = {
    "dense": {},
    "ar_topk": {"ratio": 0.01},
    "powersgd": {"rank": 4},
    "zfp": {"rate": 8},
    "quantized": {"bits": 8},
}
_MB = 1e6


def _high_water_mb() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024 / _MB


def _reset_high_water() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def _trainer(model, method: str, donate: bool, diloco: bool):
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh

    import jaxcomp

    compress = jaxcomp.compress(method, **METHODS[method])
    if diloco:
        mesh = Mesh(np.array(jax.devices()[:1]), ("workers",))
        compress = jaxcomp.compress(method, axis_name="workers", **METHODS[method])
        return jaxcomp.diloco(
            model.loss_fn, mesh=mesh, sync_every=50, compress=compress, donate=donate
        )
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    tx = optax.chain(compress, optax.adam(1e-4))
    return jaxcomp.data_parallel(model.loss_fn, tx, mesh, donate=donate)


def measure_one(model_name: str, method: str, donate: bool, steps: int, diloco=False) -> dict:
    """One configuration, in this process: the compiled step's memory and the steps' peak RSS."""
    import jax
    import numpy as np

    from jaxcomp.training import zoo

    model = zoo.build(model_name)
    dp = _trainer(model, method, donate, diloco)
    state = dp.init(model.params)
    rng = np.random.default_rng(0)
    batches = [model.make_batch(rng, 2) for _ in range(steps + 1)]
    stats = dp.step.lower(state, batches[0]).compile().memory_analysis()
    state, _ = dp.step(state, batches[0])  # compiles (again: jit's own cache) and warms up
    jax.block_until_ready(state)
    _reset_high_water()
    for batch in batches[1:]:
        state, metrics = dp.step(state, batch)
    jax.block_until_ready((state, metrics))
    mb = lambda n: round(n / _MB, 1)  # noqa: E731
    return dict(
        model=model_name,
        method=("diloco " if diloco else "") + method,
        donate=donate,
        state_mb=mb(sum(x.nbytes for x in jax.tree.leaves(state))),
        arguments_mb=mb(stats.argument_size_in_bytes),
        outputs_mb=mb(stats.output_size_in_bytes),
        alias_mb=mb(stats.alias_size_in_bytes),
        temp_mb=mb(stats.temp_size_in_bytes),
        xla_peak_mb=mb(
            stats.argument_size_in_bytes
            + stats.output_size_in_bytes
            - stats.alias_size_in_bytes
            + stats.temp_size_in_bytes
        ),
        step_rss_mb=round(_high_water_mb(), 1),
    )


def _in_a_process(model: str, method: str, donate: bool, steps: int, diloco: bool) -> dict:
    command = [sys.executable, __file__, "--one", f"{model},{method},{int(donate)}"]
    command += ["--steps", str(steps)] + (["--diloco"] if diloco else [])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{model} {method} donate={donate} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(rows) -> str:
    lines = [
        "| model | method | state MB | XLA peak MB: kept | donated | saved | step RSS MB: kept "
        "| donated | saved |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kept, donated in zip(rows[::2], rows[1::2]):
        lines.append(
            f"| {kept['model']} | {kept['method']} | {kept['state_mb']:.0f} "
            f"| {kept['xla_peak_mb']:.0f} | {donated['xla_peak_mb']:.0f} "
            f"| {kept['xla_peak_mb'] - donated['xla_peak_mb']:.0f} "
            f"| {kept['step_rss_mb']:.0f} | {donated['step_rss_mb']:.0f} "
            f"| {kept['step_rss_mb'] - donated['step_rss_mb']:.0f} |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    from jaxcomp.training import zoo

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp4096,mlp2041,resnet50,gpt2,many_small")
    parser.add_argument("--methods", default="dense,ar_topk,powersgd")
    parser.add_argument("--steps", type=int, default=3, help="steps after the first (default 3)")
    parser.add_argument("--diloco", action="store_true", help="jaxcomp.diloco's step instead")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # MODEL,METHOD,DONATE
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.methods = [m for m in args.methods.split(",") if m]
    for name in args.models:
        if name not in zoo.NAMES:
            parser.error(f"--models: {name!r} is not a zoo model ({', '.join(zoo.NAMES)})")
    for name in args.methods:
        if name not in METHODS:
            parser.error(f"--methods: {name!r} is not one of {', '.join(METHODS)}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        model, method, donate = args.one.split(",")
        print(json.dumps(measure_one(model, method, donate == "1", args.steps, args.diloco)))
        return
    rows = []
    total = len(args.models) * len(args.methods) * 2
    for model in args.models:
        for method in args.methods:
            for donate in (False, True):
                print(f"[{len(rows) + 1}/{total}] {model} {method} donate={donate}", flush=True)
                rows.append(_in_a_process(model, method, donate, args.steps, args.diloco))
    print(_table(rows))
    if args.json:
        meta = dict(machine=platform.node(), cpus=os.cpu_count(), python=platform.python_version())
        with open(args.json, "w") as out:
            json.dump(dict(meta=meta, rows=rows), out, indent=1)


if __name__ == "__main__":
    main()
