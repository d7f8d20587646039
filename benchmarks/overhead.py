"""Where a compressed step spends its time besides the wire: the local work of each method.

    python benchmarks/overhead.py [--devices 4] [--params 25e6] [--repeats 5] [--json out.json]
                                  [--guardrail-off]

In one process with ``--devices`` CPU devices the "network" is memory, so a ``data_parallel``
step's time is the model's compute, a cheap in-memory exchange, and each method's own passes over
the gradient (selection, codecs, scatters, error feedback): what the emulated cluster adds to
every step on top of the wire. Every method's local work is its step minus the dense
``compress`` step; the dense step itself is compared with a plain ``lax.pmean`` step of the same
model (no jaxcomp). Each figure is the best of ``--repeats`` rounds, the methods interleaved in
every round. It imports whichever jaxcomp is on the path, so running it from two checkouts
compares two versions (BENCHMARKS.md). ``--guardrail-off`` adds each method once more with
``compress(guardrail=False)`` (the ``... noguard`` rows): the guardrail's cost, side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

import jaxcomp  # noqa: E402

STEP_METHODS = {
    "dense": ("dense", {}),
    "dense_leaf": ("dense", {"granularity": "leaf"}),
    "allgather_topk": ("allgather_topk", {"ratio": 0.01}),
    "ar_topk": ("ar_topk", {"ratio": 0.01}),
    "zfp": ("zfp", {"rate": 8}),
    "quantized": ("quantized", {"bits": 4}),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4, help="in-process CPU devices (default 4)")
    parser.add_argument("--params", type=float, default=25e6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--guardrail-off",
        action="store_true",
        help="also time every method with compress(guardrail=False) (rows '<method> noguard')",
    )
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", args.devices)
    width = round((args.params / 6) ** 0.5)
    rng = np.random.default_rng(0)
    params = {
        f"w{i}": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        for i in range(6)
    }
    n_params = sum(p.size for p in params.values())

    def loss_fn(p, batch):
        h = batch["x"]
        for i in range(6):
            h = jnp.tanh(h @ p[f"w{i}"]) if i < 5 else h @ p[f"w{i}"]
        return jnp.mean((h - batch["y"]) ** 2)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = 4 * args.devices
    batch = jax.device_put(
        {
            "x": rng.standard_normal((rows, width)).astype(np.float32),
            "y": rng.standard_normal((rows, width)).astype(np.float32),
        },
        NamedSharding(mesh, P("data")),
    )

    adam = optax.adam(1e-4)

    def plain(p, opt, b):
        loss, g = jax.value_and_grad(loss_fn)(jax.lax.pcast(p, "data", to="varying"), b)
        g = jax.lax.pmean(g, "data")
        u, opt = adam.update(g, opt, p)
        return optax.apply_updates(p, u), opt, jax.lax.pmean(loss, "data")

    plain_step = jax.jit(
        jax.shard_map(plain, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P()))
    )
    runners = {}
    plain_state = [params, adam.init(params)]

    def run_plain():
        p, o, loss = plain_step(plain_state[0], plain_state[1], batch)
        plain_state[:] = [p, o]
        loss.block_until_ready()

    runners["pmean"] = run_plain
    setups = dict(STEP_METHODS)
    if args.guardrail_off:
        for label, (method, options) in STEP_METHODS.items():
            setups[f"{label} noguard"] = (method, {**options, "guardrail": False})
    for label, (method, options) in setups.items():
        dp = jaxcomp.data_parallel(
            loss_fn, optax.chain(jaxcomp.compress(method, **options), adam), mesh
        )
        box = [dp.init(params)]

        def run(dp=dp, box=box):
            box[0], metrics = dp.step(box[0], batch)
            jax.block_until_ready(metrics["loss"])

        runners[label] = run
    best = {label: float("inf") for label in runners}
    for _ in range(args.repeats + 1):  # the first round compiles and warms up
        for label, run in runners.items():
            start = time.perf_counter()
            run()
            best[label] = min(best[label], time.perf_counter() - start)
    local = {label: best[label] - best["dense"] for label in setups if label != "dense"}
    result = {"params": n_params, "steps": best, "local_work": local, "version": jaxcomp.__file__}
    print(
        f"{n_params / 1e6:.1f}M params, {args.devices} in-process CPU devices, best of "
        f"{args.repeats}:"
    )
    for label, seconds in best.items():
        print(f"  step {label:23s} {seconds * 1e3:8.1f} ms")
    for label, seconds in local.items():
        print(f"  local work {label:18s} {seconds * 1e3:8.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
