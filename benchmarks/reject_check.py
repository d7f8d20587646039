"""What keeping non-finite updates out costs: each zoo model's step under each policy.

    python benchmarks/reject_check.py [--models mlp2041,mlp4096,many_small] [--json F]

``data_parallel(nonfinite_updates=)`` keeps a value that ``tx`` made not finite out of the
params and the optimizer state: ``"drop"`` (the default) keeps the old value of each such entry,
elementwise; ``"skip"`` skips the whole step, which needs a flag over the whole update and
state before anything is written. This times, in one job and interleaved, each model's
``data_parallel`` step on a mesh of the first device under ``drop``, under ``skip`` and with
neither (the benchmark traces the step with both taken out), for three optimizers: dense Adam
after ``compress("dense")``, Adam after ``compress("sign")`` and ``jaxcomp.adam(lr, "sign")``.
On one device nothing is sent, so the differences are local work (a sharded run's ``skip`` adds
one boolean all-reduce). Each time is the best of ``--repeats`` rounds; beside them, the bytes
XLA's cost analysis says the compiled step accesses (the step with every branch of the compress
state in it), which no other load on the machine moves.
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
import passes  # noqa: E402  (the interleaved timing and the tables)

#: The optimizers, by name: ``tx()``.
OPTIMIZERS = {
    "dense+adam": lambda: _chain("dense"),
    "sign+adam": lambda: _chain("sign"),
    "jaxcomp.adam(sign)": lambda: __import__("jaxcomp").adam(1e-4, "sign"),
}


def _chain(method):
    import jaxcomp

    return optax.chain(jaxcomp.compress(method), optax.adam(1e-4))


#: The policies timed: ``data_parallel``'s two and neither.
POLICIES = ("drop", "skip", "none")


def step_call(model, batch, optimizer: str, policy: str):
    """A no-argument call of one ``data_parallel`` step (the state is not advanced), compiled
    under ``policy``."""
    import jaxcomp
    from jaxcomp.training import step as step_module

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    dp = jaxcomp.data_parallel(
        model.loss_fn,
        OPTIMIZERS[optimizer](),
        mesh,
        nonfinite_updates="skip" if policy == "skip" else "drop",
    )
    state = dp.init(model.params)
    stacked = jax.tree.map(lambda v: v[None], batch)
    kept = step_module.keep_finite, step_module._new_params
    if policy == "none":
        step_module.keep_finite = lambda old, new: new
        step_module._new_params = lambda *args: kept[1](*args[:5], False)
    try:
        jax.block_until_ready(dp.step(state, stacked))  # traces and compiles now
        cost = dp._jit_step(None).lower(state, stacked).compile().cost_analysis()
    finally:
        step_module.keep_finite, step_module._new_params = kept
    cost = cost[0] if isinstance(cost, list) else cost
    return (lambda: dp.step(state, stacked)), float(cost.get("bytes accessed", float("nan")))


def measure(model, repeats: int, batch_size: int) -> list[dict]:
    """One model's rows: per optimizer its step under each policy, and the ratios to none."""
    batch = model.make_batch(np.random.default_rng(0), batch_size)
    built = {
        (name, policy): step_call(model, batch, name, policy)
        for name in OPTIMIZERS
        for policy in POLICIES
    }
    best = passes.best_of_rounds({k: call for k, (call, _) in built.items()}, repeats)
    rows = []
    for name in OPTIMIZERS:
        row = {"model": model.name, "params": model.n_params, "optimizer": name}
        for policy in POLICIES:
            row[f"{policy}_seconds"] = best[(name, policy)]
            row[f"{policy}_vs_none"] = best[(name, policy)] / best[(name, "none")]
            row[f"{policy}_bytes"] = built[(name, policy)][1]
        rows.append(row)
    return rows


def table(rows) -> str:
    """The rows as a markdown table."""
    return passes.markdown(
        "model|params:|optimizer|none ms:|drop ms:|skip ms:|drop / none:|skip / none:"
        "|bytes: drop / none:|bytes: skip / none:",
        rows,
        lambda r: [
            r["model"],
            f"{r['params'] / 1e6:.1f}M",
            r["optimizer"],
            f"{r['none_seconds'] * 1e3:.1f}",
            f"{r['drop_seconds'] * 1e3:.1f}",
            f"{r['skip_seconds'] * 1e3:.1f}",
            f"{r['drop_vs_none']:.3f}x",
            f"{r['skip_vs_none']:.3f}x",
            f"{r['drop_bytes'] / r['none_bytes']:.3f}x",
            f"{r['skip_bytes'] / r['none_bytes']:.3f}x",
        ],
    )


def main(argv=None) -> int:
    from jaxcomp.training import zoo

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp2041,mlp4096,many_small")
    parser.add_argument("--batch", type=int, default=8, help="rows a step (default 8)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; the best counts")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(zoo.NAMES))
    if unknown:
        parser.error(f"--models: {', '.join(unknown)} not one of {', '.join(zoo.NAMES)}")
    print(f"# {platform.node()}: jax {jax.__version__}, one device of {len(jax.devices())}")
    passes.run_models(
        models, lambda name: measure(zoo.build(name), args.repeats, args.batch), table, args.json
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
