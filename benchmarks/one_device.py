"""A training step on one device: each method's ``data_parallel`` step beside a plain jitted one.

    python benchmarks/one_device.py [--models mlp2041,mlp4096] [--methods dense,auto,ar_topk]

A 1-device mesh is the first thing users try. For every zoo model (:mod:`jaxcomp.training.zoo`)
this times, in one job, a plain ``jax.jit`` step (``jax.grad`` of the model's loss, then
``optax.sgd``) and ``jaxcomp.data_parallel`` of ``optax.chain(jaxcomp.compress(method),
optax.sgd)`` on a mesh of the first device, both on the same batch. On one device nothing is
sent, so every millisecond beyond the plain step is the method's local work and the machinery
around it (packing, error feedback, the guardrail, metrics). Methods are :mod:`passes`'s (the
issue's list at their usual settings) plus ``auto`` (``compress("auto")``, which runs dense on
one device).

Rounds interleave the runs (each call in a round: one warm-up, then the best of 2) and each
figure is the best round. Results go to stdout as a table and to ``--json``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import passes  # noqa: E402  (the methods, their options, the interleaved timing)

#: The runs beside the plain step: passes.py's methods, and compress("auto").
METHODS = (*passes.METHODS, "auto")


def parse_args(argv=None):
    from jaxcomp.training import zoo

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        default="mlp2041,mlp4096",
        help=f"zoo models (default mlp2041,mlp4096; any of {','.join(zoo.NAMES)})",
    )
    parser.add_argument("--methods", default=",".join(METHODS), help="methods (default all)")
    parser.add_argument("--batch", type=int, default=8, help="rows a step (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; the best counts")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.methods = [m for m in args.methods.split(",") if m]
    for name, known, flag in (
        (args.models, zoo.NAMES, "--models"),
        (args.methods, METHODS, "--methods"),
    ):
        unknown = sorted(set(name) - set(known))
        if unknown:
            parser.error(f"{flag}: {', '.join(unknown)} not one of {', '.join(known)}")
    if args.batch < 1 or args.repeats < 1:
        parser.error("--batch and --repeats must be at least 1")
    return args


def plain_step(model, batch):
    """A no-argument call of one plain jitted SGD step of ``model`` on ``batch``."""
    sgd = optax.sgd(1e-4)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(model.loss_fn)(params, batch)
        updates, opt_state = sgd.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = model.params, sgd.init(model.params)
    return lambda: step(params, opt_state)


def compressed_step(model, batch, method: str):
    """A no-argument call of one ``data_parallel`` step of ``compress(method)`` and SGD on a mesh
    of the first device (the state is not advanced: every call times the same step)."""
    import jaxcomp

    if method == "auto":
        tx = jaxcomp.compress("auto")
    else:
        name, options = passes.method_options(method)
        tx = jaxcomp.compress(name, **options)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    dp = jaxcomp.data_parallel(model.loss_fn, optax.chain(tx, optax.sgd(1e-4)), mesh)
    state = dp.init(model.params)
    stacked = jax.tree.map(lambda v: v[None], batch)  # the one device's rows
    return lambda: dp.step(state, stacked)


def measure(model, methods, repeats: int, batch_size: int = 8) -> list[dict]:
    """One model's rows: per method its step's best time and its ratio to the plain step's."""
    batch = model.make_batch(np.random.default_rng(0), batch_size)
    runs = {"plain": plain_step(model, batch)}
    for method in methods:
        runs[method] = compressed_step(model, batch, method)
    best = passes.best_of_rounds(runs, repeats)
    return [
        {
            "model": model.name,
            "params": model.n_params,
            "method": m,
            "seconds": best[m],
            "plain_seconds": best["plain"],
            "vs_plain": best[m] / best["plain"],
        }
        for m in methods
    ]


def table(rows) -> str:
    """The rows as a markdown table, one line per model and method."""
    return passes.markdown(
        "model|params:|method|step ms:|plain step ms:|vs plain:",
        rows,
        lambda r: [
            r["model"],
            f"{r['params'] / 1e6:.1f}M",
            r["method"],
            f"{r['seconds'] * 1e3:.1f}",
            f"{r['plain_seconds'] * 1e3:.1f}",
            f"{r['vs_plain']:.2f}x",
        ],
    )


def main(argv=None) -> int:
    from jaxcomp.training import zoo

    args = parse_args(argv)
    print(
        f"# {platform.node()}: {platform.processor() or platform.machine()}, jax "
        f"{jax.__version__}, one device of {len(jax.devices())}",
        flush=True,
    )
    passes.run_models(
        args.models,
        lambda name: measure(zoo.build(name), args.methods, args.repeats, args.batch),
        table,
        args.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
