"""What the guardrail sees on a healthy run: the gradient energy of every step, and when the
detector would trigger at each ``patience``.

Trains quality.py's char-LM densely (Adam, its schedule) on one CPU device, with the batch cut
into ``--devices`` shards whose gradients are taken one by one (as data-parallel devices would),
and records per step the loss, ``G = sum_d ||g_d||^2`` (the guardrail's statistic) and each
shard's energy. Then it runs the guardrail's own detector (``jaxcomp.optim.stages.divergence``,
under ``jax.lax.scan``) over that sequence for ``patience`` 1, 2 and 3 with the default
``Guardrail`` otherwise, and prints the steps whose ``G`` is furthest above the running mean and
the triggers of each setting. Nothing here diverges: every trigger is a false one.

Command (about 4 minutes for the large model on 2 cores)::

    python benchmarks/guardrail_trace.py --model large --out guardrail_trace.json

Results: BENCHMARKS.md, "The guardrail's patience".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import quality  # noqa: E402  (the model, corpus, batches and optimizer)


def trace(config, devices: int, seed: int = 0):
    """Per step: ``(loss, G, [energy of each shard's gradient])`` of a dense run."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    train_tokens, _, _ = quality.load_corpus()
    graphdef, params = nnx.split(quality.make_model(config, seed), nnx.Param)

    def loss_fn(p, tokens):
        tokens = tokens.astype(jnp.int32)
        logits = nnx.merge(graphdef, p)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    tx = quality.optimizer("adam", config)

    @jax.jit
    def step(p, opt, tokens):
        shards = tokens.reshape(devices, -1, tokens.shape[-1])
        losses, grads = jax.vmap(jax.value_and_grad(loss_fn), in_axes=(None, 0))(p, shards)
        per_shard = sum(
            jnp.sum(g.reshape(devices, -1) ** 2, axis=1) for g in jax.tree.leaves(grads)
        )
        updates, opt = tx.update(jax.tree.map(lambda g: g.mean(0), grads), opt, p)
        return optax.apply_updates(p, updates), opt, losses.mean(), per_shard

    windows = quality.batches(train_tokens, config, config.steps, seed)
    opt, rows, started = tx.init(params), [], time.perf_counter()
    for t in range(config.steps):
        params, opt, loss, per_shard = step(params, opt, train_tokens[windows[t]])
        per_shard = np.asarray(per_shard, np.float64)
        rows.append((float(loss), float(per_shard.sum()), per_shard.tolist()))
        if t % 100 == 0:
            seconds = time.perf_counter() - started
            message = f"step {t}: loss {rows[-1][0]:.4f}, G {rows[-1][1]:.1f}, {seconds:.0f} s"
            print(message, file=sys.stderr, flush=True)
    return rows


def detect(energies, patience: int):
    """The steps at which the default guardrail with ``patience`` triggers on ``energies`` (a
    cast's view: gain 1, the error-fed energy the gradient's), and the running mean before each
    step."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxcomp.optim.stages import divergence

    guardrail = divergence.Guardrail(patience=patience)

    def one(state, g):
        trigger = divergence.triggered(guardrail, state, g, g, 1.0)
        return divergence.advance(guardrail, state, trigger, g, g, 1.0), (trigger, state.mean)

    _, (triggers, means) = jax.lax.scan(one, divergence.init(), jnp.asarray(energies, jnp.float32))
    return np.flatnonzero(np.asarray(triggers)).tolist(), np.asarray(means, np.float64)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="large", choices=sorted(quality.MODELS))
    parser.add_argument("--steps", type=int, help="training steps (the model's default: 500)")
    parser.add_argument("--devices", type=int, default=8, help="shards of each batch (8)")
    parser.add_argument("--out", help="write the trace and the triggers to this JSON file")
    args = parser.parse_args(argv)
    config = quality.MODELS[args.model]
    if args.steps is not None:
        if args.steps <= config.warmup:
            parser.error(f"--steps must be more than the schedule's {config.warmup} warm-up steps")
        config = dataclasses.replace(config, steps=args.steps)
    if config.batch % args.devices:
        parser.error(f"--devices must divide the model's batch of {config.batch} sequences")
    rows = trace(config, args.devices)
    energies = [row[1] for row in rows]
    found, means = {}, None
    for patience in (1, 2, 3):
        found[patience], mean = detect(energies, patience)
        means = mean if means is None else means
        print(f"patience {patience}: triggers at steps {found[patience] or 'none'}")
    ratios = [g / m if m > 0 else 0.0 for g, m in zip(energies, means)]
    print("steps furthest above the running mean (patience 1's mean):")
    for t in sorted(sorted(range(len(rows)), key=lambda t: -ratios[t])[:8]):
        shards = rows[t][2]
        print(f"  step {t}: G {energies[t]:.1f} = {ratios[t]:.1f}x the mean, loss "
              f"{rows[t][0]:.3f}, largest shard {max(shards):.1f}, "
              f"median shard {sorted(shards)[len(shards) // 2]:.1f}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "devices": args.devices, "rows": rows,
                       "triggers": found}, f)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
