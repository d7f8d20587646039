"""What a user waits for before training starts: each method's first data_parallel step.

    python benchmarks/first_step.py [--models mlp2041,many_small] [--methods zfp,ar_topk]
                                    [--devices 4] [--json out.json]

The first ``step`` traces the step (JAX builds its program in Python), compiles it (XLA) and runs
it; every later step only runs. In a notebook, each change of method, model or mesh pays the first
step again. For each zoo model and method this prints the seconds of ``init`` plus the first step,
split into the trace (``jax.jit(...).trace``), the compile and the run, and one later step for
scale. It imports whichever jaxcomp is on the path, so running it from two checkouts compares two
versions (BENCHMARKS.md, "The first step").
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", default="mlp2041,many_small", help="zoo models, comma-separated"
    )
    parser.add_argument(
        "--methods",
        default="pmean,dense,ar_topk,zfp,quantized,sign_ring,powersgd",
        help="labels of jaxcomp.distributed.netbench.METHODS (netbench's --methods)",
    )
    parser.add_argument("--devices", type=int, default=4, help="in-process CPU devices (default 4)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    return parser.parse_args(argv)


def _time_first_step(jaxcomp, model, method, mesh, batch):
    """Seconds of init, the first step's trace, compile and run, and a second step."""
    import jax

    start = time.perf_counter()
    jitted, state, batch = _build(jaxcomp, model, method, mesh, batch)
    state = jax.block_until_ready(state)
    init = time.perf_counter() - start
    start = time.perf_counter()
    traced = jitted.trace(*state, batch)
    trace = time.perf_counter() - start
    start = time.perf_counter()
    compiled = traced.lower().compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(compiled(*state, batch))
    run = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(compiled(*state, batch))
    later = time.perf_counter() - start
    return {"init": init, "trace": trace, "compile": compile_s, "run": run, "later": later}


def _build(jaxcomp, model, method, mesh, batch):
    """``(jitted step, its state arguments, the placed batch)``: ``pmean`` is netbench's baseline
    without jaxcomp (``lax.pmean`` of the gradients, Adam), any other label a data_parallel step
    of ``compress`` with Adam."""
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcomp.distributed import netbench_worker
    from jaxcomp.distributed.netbench import METHODS

    if method == "pmean":
        plain = netbench_worker._plain_pmean_step(model.loss_fn, mesh)
        placed = jax.device_put(batch, NamedSharding(mesh, P("data")))
        return plain._step, plain.init(model.params), placed
    compressor, options, shard = METHODS[method]
    tx = optax.chain(jaxcomp.compress(compressor, **options), optax.adam(1e-3))
    dp = jaxcomp.data_parallel(model.loss_fn, tx, mesh, shard=shard)
    return dp.step, (dp.init(model.params),), dp.shard_batch(batch)


def main(argv=None) -> int:
    args = _parse(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np
    from jax.sharding import Mesh

    import jaxcomp
    from jaxcomp.training import zoo

    mesh = Mesh(np.array(jax.devices()), ("data",))
    rows = []
    print(f"jaxcomp from {jaxcomp.__file__}, {args.devices} devices")
    print(
        f"{'model':12s} {'method':10s} {'init':>6s} {'trace':>6s} {'compile':>8s} "
        f"{'run':>6s} {'first':>6s} {'later':>6s}"
    )
    for name in args.models.split(","):
        model = zoo.build(name)
        batch = model.make_batch(np.random.default_rng(0), 2 * args.devices)
        for method in args.methods.split(","):
            t = _time_first_step(jaxcomp, model, method, mesh, batch)
            first = t["init"] + t["trace"] + t["compile"] + t["run"]
            rows.append({"model": name, "method": method, **t, "first": first})
            print(
                f"{name:12s} {method:10s} {t['init']:6.2f} {t['trace']:6.2f} "
                f"{t['compile']:8.2f} {t['run']:6.2f} {first:6.2f} {t['later']:6.3f}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
