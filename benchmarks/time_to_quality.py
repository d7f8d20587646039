"""Time to quality: data-parallel training against DiLoCo (dense and compressed pseudo-gradients)
on the character-level language model of ``benchmarks/quality.py``, in one process.

    python benchmarks/time_to_quality.py                    # ~8 min on 2 cores, 300 steps
    python benchmarks/time_to_quality.py --steps 100 --rows dp,diloco-h10
    python benchmarks/time_to_quality.py --quick            # a tiny model, a few steps (smoke test)

Every row trains the same model from the same params on the same batches (``quality.batches``) on
8 virtual CPU devices: ``dp`` is ``jaxcomp.data_parallel`` with a dense all-reduce and Adam (the
warm-up + cosine schedule of quality.py); the ``diloco-*`` rows are ``jaxcomp.diloco`` with 8
workers (one device each), the same Adam as inner optimizer (each worker on its 1/8 of every
batch, so every row sees the same samples), the paper's outer Nesterov SGD (lr 0.7, momentum
0.9), and ``H`` inner steps between exchanges; ``-int8`` sends the pseudo-gradients as 8-bit
codes (``jaxcomp.Quantized(8)``, error feedback), ``-topk`` as top-10% (``jaxcomp.TopK(0.1)``,
error feedback), ``-stream`` syncs 2 fragments staggered, applied 1 step late. The held-out loss
is the global params' (DiLoCo's ``params(state)``).

The table: held-out loss after the same number of samples (and its ratio to ``dp``'s), the bytes
one device sent over the run (and ``dp``'s over them), and the wall-clock of the training steps
(evaluation excluded). All devices are one process on one CPU: the wall-clock is compute, not a
network; ``bytes`` is what a network would carry. The emulated-cluster version (real links at
1 Gbit / 100 Mbit) is not here.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import quality  # noqa: E402  (the model, corpus and batches)

ROWS = {
    "dp": None,
    "diloco-h10": dict(sync_every=10),
    "diloco-h10-int8": dict(sync_every=10, compress="int8"),
    "diloco-h50": dict(sync_every=50),
    "diloco-h50-int8": dict(sync_every=50, compress="int8"),
    "diloco-h50-topk": dict(sync_every=50, compress="topk"),
    "diloco-h50-stream": dict(sync_every=50, fragments=2, delay=1),
}


def _method(name):
    import jaxcomp

    return {None: None, "int8": jaxcomp.Quantized(8), "topk": jaxcomp.TopK(0.1)}[name]


def train(name, config, corpus, seed=0):
    """One row: ``{"name", "eval_curve", "heldout_loss", "bytes", "seconds"}``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import Mesh

    import jaxcomp

    train_tokens, heldout_tokens, _ = corpus
    graphdef, params = nnx.split(quality.make_model(config, seed), nnx.Param)

    def loss_fn(params, batch):
        tokens = batch["tokens"].astype(jnp.int32)
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    devices = np.array(jax.devices()[: quality.N_DEVICES])
    adam = quality.optimizer("adam", config)
    options = ROWS[name]
    if options is None:
        mesh = Mesh(devices, ("data",))
        run = jaxcomp.data_parallel(loss_fn, optax.chain(jaxcomp.compress("dense"), adam), mesh)
    else:
        mesh = Mesh(devices, ("workers",))
        options = dict(options, compress=_method(options.get("compress")))
        run = jaxcomp.diloco(loss_fn, adam, mesh=mesh, **options)
    evaluate = jax.jit(lambda params, batch: loss_fn(params, batch))
    eval_config = dataclasses.replace(config, batch=config.eval_sequences)
    heldout = {
        "tokens": heldout_tokens[quality.batches(heldout_tokens, eval_config, 1, seed + 1)[0]]
    }
    windows = quality.batches(train_tokens, config, config.steps, seed)
    eval_at = set(np.linspace(0, config.steps, config.eval_points + 1).astype(int)[1:].tolist())
    state = run.init(params)
    curve, sent, seconds = [(0, float(evaluate(run.params(state), heldout)))], [], 0.0
    for step in range(config.steps):
        started = time.perf_counter()
        state, metrics = run.step(state, {"tokens": train_tokens[windows[step]]})
        sent.append(metrics["bytes_sent"])
        if step + 1 in eval_at:
            jax.block_until_ready(state)
            seconds += time.perf_counter() - started
            curve.append((step + 1, float(evaluate(run.params(state), heldout))))
        else:
            seconds += time.perf_counter() - started
    return {
        "name": name,
        "eval_curve": curve,
        "heldout_loss": curve[-1][1],
        "bytes": float(sum(float(b) for b in sent)),
        "seconds": seconds,
    }


def format_table(results) -> str:
    base = next((r for r in results if r["name"] == "dp"), results[0])
    lines = [
        "| row | held-out loss | / dp | bytes per device | dp / row | train seconds |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = base["bytes"] / r["bytes"] if r["bytes"] else float("inf")
        lines.append(
            f"| {r['name']} | {r['heldout_loss']:.4f} | "
            f"{r['heldout_loss'] / base['heldout_loss']:.3f} | {r['bytes'] / 1e6:.2f} MB | "
            f"{ratio:.0f}x | {r['seconds']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows", default=",".join(ROWS), help="comma-separated, of: " + ", ".join(ROWS)
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="a tiny model for a few steps")
    parser.add_argument("--out", default=None, help="write time_to_quality.json here")
    args = parser.parse_args(argv)
    config = (
        quality.QUICK if args.quick else dataclasses.replace(quality.Config(), steps=args.steps)
    )
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if args.quick:  # every row, with exchanges every 2 steps
        for n in names:
            if ROWS[n] is not None:
                ROWS[n] = dict(ROWS[n], sync_every=2, fragments=1, delay=0)
    corpus = quality.load_corpus()
    results = []
    for name in names:
        results.append(train(name, config, corpus))
        print(f"{name}: {results[-1]['heldout_loss']:.4f}", file=sys.stderr, flush=True)
    print(
        f"{config.steps} steps of {config.batch} sequences of {config.context} characters, "
        f"{quality.N_DEVICES} devices\n"
    )
    print(format_table(results))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "time_to_quality.json"), "w") as f:
            json.dump({"config": dataclasses.asdict(config), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
