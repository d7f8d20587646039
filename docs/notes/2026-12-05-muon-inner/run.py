"""DiLoCo on the small char-LM with AdamW or Muon as the inner optimizer, dense or compressed
pseudo-gradients: the runs of the note ``2026-12-05-muon-inner.md``.

    flock /tmp/jaxcomp-tests.lock python run.py --steps 300 --out muon_inner.json

Eight workers (8 virtual CPU devices, one worker each) train ``charlm.MODELS["small"]`` from the
same params on the same batches; each inner optimizer follows warm-up plus cosine decay to a
tenth of its peak; the outer optimizer is the paper's Nesterov. A run records the held-out loss
of the global params after every tenth of the run. Results are written after every run, and a
run already in ``--out`` is not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

#: (inner optimizer, peak learning rate, outer compression) of every run, in order.
RUNS = (
    ("adamw", 2e-3, "dense"),
    ("adamw", 4e-3, "dense"),
    ("muon", 2e-3, "dense"),
    ("muon", 4e-3, "dense"),
    ("adamw", 4e-3, "topk2"),
    ("muon", 4e-3, "topk2"),
    ("adamw", 4e-3, "quantized2"),
    ("muon", 4e-3, "quantized2"),
    ("optax-muon", 2e-2, "dense"),
)


def inner_tx(name: str, peak: float, steps: int):
    """The inner optimizer: AdamW (the DiLoCo paper's), ``jaxcomp.muon`` or optax's Muon with
    its own defaults (width scaling, so Muon's own rate; no weight decay on the AdamW leaves)."""
    import optax

    import jaxcomp
    from jaxcomp.training import charlm

    config = charlm.MODELS["small"]
    lr = optax.warmup_cosine_decay_schedule(0.0, peak, config.warmup, steps, end_value=0.1 * peak)
    if name == "adamw":
        return optax.adamw(lr, weight_decay=0.1)
    if name == "optax-muon":
        return optax.contrib.muon(lr, weight_decay=0.1)
    return jaxcomp.muon(lr, weight_decay=0.1)


def compression(name: str):
    """The outer exchange: dense, SparseLoCo's 2-bit top-k or 2-bit quantization."""
    import jaxcomp

    return {
        "dense": None,
        "topk2": jaxcomp.TopK(0.02, value_bits=2),
        "quantized2": jaxcomp.Quantized(bits=2),
    }[name]


def train(name: str, peak: float, compress: str, steps: int, sync_every: int) -> dict:
    """One run; returns its record."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import jaxcomp
    from jaxcomp.training import charlm

    config = charlm.MODELS["small"]
    corpus = charlm.load_corpus()
    loss_fn, params, heldout = charlm.task(config, corpus, seed=0)
    tokens = corpus[0]
    windows = charlm.batches(tokens, config, steps, seed=0)
    mesh = Mesh(np.array(jax.devices()[:8]), ("workers",))
    run = jaxcomp.diloco(
        loss_fn,
        inner_tx(name, peak, steps),
        mesh=mesh,
        sync_every=sync_every,
        compress=compression(compress),
    )
    evaluate = jax.jit(loss_fn)
    state = run.init(params)
    curve, every, start, sent = [], max(1, steps // 10), time.perf_counter(), 0.0
    for step in range(steps):
        state, metrics = run.step(state, run.shard_batch({"tokens": tokens[windows[step]]}))
        sent = max(sent, float(metrics["bytes_sent"]))
        if (step + 1) % every == 0 or step + 1 == steps:
            held = float(evaluate(jax.device_get(run.params(state)), heldout))
            curve.append([step + 1, held])
    return {
        "inner": name,
        "lr": peak,
        "compress": compress,
        "steps": steps,
        "sync_every": sync_every,
        "initial": float(evaluate(params, heldout)),
        "heldout": curve,
        "final": curve[-1][1],
        "bytes_sent_per_sync": sent,
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--runs", type=int, nargs="*", help="indices into RUNS (default all)")
    parser.add_argument("--out", default="muon_inner.json")
    args = parser.parse_args(argv)
    results = json.load(open(args.out)) if os.path.exists(args.out) else []
    done = {(r["inner"], r["lr"], r["compress"], r["steps"], r["sync_every"]) for r in results}
    for i in args.runs if args.runs is not None else range(len(RUNS)):
        name, peak, compress = RUNS[i]
        if (name, peak, compress, args.steps, args.sync_every) in done:
            continue
        record = train(name, peak, compress, args.steps, args.sync_every)
        results.append(record)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"{name:6s} lr={peak:g} {compress:10s} held-out {record['final']:.4f} "
              f"({record['seconds']} s)", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
