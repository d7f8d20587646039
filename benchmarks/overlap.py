"""What XLA:CPU runs at the same time: a collective beside compute, in one jitted program.

Run on emulated hosts (as root)::

    jaxcomp cluster --hosts 2 --rate 100mbit -- benchmarks/overlap.py
    jaxcomp cluster --hosts 2 --rate 1gbit -- benchmarks/overlap.py --case backward

``--case independent`` (default) times, median of 5 after one untimed call: a chain of matmuls
(``compute``), a ``psum`` of ``--floats`` values (``comm``), both in one program with no
dependency between them (``both``: the larger of the two if they overlap), and the ``psum`` made
to wait for the compute (``serial``: their sum), and the ``psum`` inside a ``lax.cond`` beside the
compute (``both_in_cond``, as DiLoCo's delayed exchanges run).

``--case backward`` times the gradient of an MLP of ``--layers`` square layers of ``--width``:
alone (``compute``), its weights' ``psum`` alone (``comm``), the gradient then one ``psum`` per
layer as XLA builds it (``merged``: XLA's collective combiner joins them into one, after the
whole backward pass), and the same chained layer by layer with
``jaxcomp.optim.stages.aggregation.depends_on`` in the order the backward pass finishes them
(``chained``: each layer's ``psum`` runs beside the rest of the backward pass). Results:
docs/performance.md, "Overlapping the backward pass".
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from jaxcomp.distributed import launch  # noqa: E402


def _median_seconds(f, *args, repeats=5):
    import jax

    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _independent(mesh, args):
    """compute, comm, both and serial of a matmul chain and an unrelated psum."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def compute(x):
        for _ in range(args.layers):
            x = jnp.tanh(x @ x) * 0.01
        return x

    def jit(f, n_in):
        out = P("d") if n_in == 1 else (P("d"), P("d"))
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("d"),) * n_in, out_specs=out))

    def local(shape):
        n = jax.device_count()
        sharding = NamedSharding(mesh, P("d"))
        data = np.ones(shape, np.float32) * 0.5
        return jax.make_array_from_process_local_data(sharding, data, (shape[0] * n,) + shape[1:])

    x, v = local((args.width, args.width)), local((args.floats,))
    return dict(
        compute=_median_seconds(jit(compute, 1), x),
        comm=_median_seconds(jit(lambda v: jax.lax.psum(v, "d"), 1), v),
        both=_median_seconds(jit(lambda x, v: (compute(x), jax.lax.psum(v, "d")), 2), x, v),
        serial=_median_seconds(
            jit(lambda x, v: (compute(x), jax.lax.psum(v + compute(x)[0, 0], "d")), 2), x, v
        ),
        # The psum inside a lax.cond taken on every call (as DiLoCo's exchanges are): does the
        # conditional run beside the compute too?
        both_in_cond=_median_seconds(jit(lambda x, v: (compute(x), _in_cond(v)), 2), x, v),
    )


def _in_cond(v):
    """``psum(v)`` inside a ``lax.cond`` whose (replicated) predicate is always true."""
    import jax

    def summed(v):
        return jax.lax.pcast(jax.lax.psum(v, "d"), "d", to="varying")

    taken = jax.lax.psum(1, "d") > 0
    return jax.lax.cond(taken, summed, lambda v: v, v)


def _backward(mesh, args):
    """compute, comm, merged and chained of an MLP's gradient and one psum per layer."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcomp.optim.stages.aggregation import depends_on

    def grads(ws, x):
        def loss(ws):
            h = x
            for w in ws:
                h = jnp.tanh(h @ w)
            return jnp.mean(h**2)

        return jax.grad(loss)(jax.lax.pcast(ws, "d", to="varying"))

    def chained(ws, x):
        totals, previous = [], []
        for g in reversed(grads(ws, x)):  # the last layer's gradient is finished first
            total = jax.lax.psum(depends_on(g.ravel(), previous), "d")
            previous = [total]
            totals.append(total.sum())
        return totals

    cases = dict(
        compute=lambda ws, x: [jax.lax.psum(g.sum(), "d") for g in grads(ws, x)],
        comm=lambda ws, x: [
            jax.lax.psum(jax.lax.pcast(w, "d", to="varying"), "d").sum() for w in ws
        ],
        merged=lambda ws, x: [jax.lax.psum(g, "d").sum() for g in grads(ws, x)],
        chained=chained,
    )
    rng = np.random.default_rng(0)  # the same weights on every host
    ws = [rng.random((args.width, args.width), dtype=np.float32) * 0.01 for _ in range(args.layers)]
    ws = jax.device_put(ws, NamedSharding(mesh, P()))
    rows = args.batch
    x = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("d")),
        rng.random((rows, args.width), dtype=np.float32),
        (rows * jax.device_count(), args.width),
    )
    return {
        name: _median_seconds(
            jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())), ws, x
        )
        for name, f in cases.items()
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", choices=("independent", "backward"), default="independent")
    parser.add_argument("--layers", type=int, help="matmuls / MLP layers (default 24 / 8)")
    parser.add_argument("--width", type=int, help="matrix side (default 768 / 2048)")
    parser.add_argument("--floats", type=int, default=2_000_000, help="psum values (independent)")
    parser.add_argument("--batch", type=int, default=256, help="rows per host (backward)")
    args = parser.parse_args(argv)
    backward = args.case == "backward"
    args.layers = args.layers or (8 if backward else 24)
    args.width = args.width or (2048 if backward else 768)
    process = launch.initialize()
    import jax

    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    seconds = (_backward if backward else _independent)(mesh, args)
    if process == 0:
        print(f"{args.case}, {jax.process_count()} processes:")
        print("  " + ", ".join(f"{name} {s:.3f} s" for name, s in seconds.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
