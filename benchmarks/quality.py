"""Training quality: a character-level transformer language model trained once per compression
method.

    python benchmarks/quality.py  # every method, ~19 min on 2 cores (see BENCHMARKS.md)
    python benchmarks/quality.py --methods dense,ar_topk(0.01) --steps 300
    python benchmarks/quality.py --quick --out /tmp/q  # a tiny model for a few steps (smoke test)
    python benchmarks/quality.py --model large --methods dense,zfp(8)  # 2.45M params, 4-9 min a row
    python benchmarks/quality.py --task mlp-charlm --pairings dense,adam:sign  # the quality zoo
    python benchmarks/quality.py --task zoo  # every zoo task (benchmarks/quality_zoo.py's options)

A small GPT-style model (flax nnx; pre-LayerNorm blocks of causal self-attention and a GELU MLP)
learns to predict the next character of Python source: files of the standard library of the running
interpreter, read from its installation, so nothing is downloaded (``CORPUS`` names them; the JSON
records each file's size). The concatenation is split 90/10 into a training and a held-out part.

Every method trains data-parallel on 8 virtual CPU devices with ``jaxcomp.data_parallel`` and
``optax.chain(jaxcomp.compress(method), optax.adam(warm-up + cosine schedule))``, from the same
initial params, on the same batches, for the same number of steps. At the end each run is evaluated
on the same held-out sequences. The script prints a Markdown table (final held-out loss, its ratio
to dense's, bytes one device sends per step and their ratio to dense's) and writes ``quality.json``
and ``quality.png`` (held-out and training loss curves) to ``--out``.

The methods are data (``rows()``): one line each. Methods that other branches add (PowerSGD, sign,
a 16-bit cast) appear as soon as ``jaxcomp.methods`` has them.
"""

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from typing import Any

N_DEVICES = 8

# The model, its corpus, batches and learning-rate schedule live in the package (``jaxcomp netbench
# --to-loss`` trains the same model); their names stay importable from here.
from jaxcomp.training.charlm import (  # noqa: E402
    CORPUS,  # noqa: F401
    MODELS,
    QUICK,
    VOCAB,  # noqa: F401
    Config,
    batches,
    count_params,
    load_corpus,
    make_model,  # noqa: F401
    schedule,
    task,
)


@dataclasses.dataclass(frozen=True)
class Row:
    """One run: a name for the table, a jaxcomp method, compress's options and data_parallel's."""

    name: str
    method: Any
    options: dict = dataclasses.field(default_factory=dict)
    parallel: dict = dataclasses.field(
        default_factory=dict
    )  # data_parallel's keywords (shard=, gather_dtype=)
    optimizer: str = "adam"  # what follows compress in the chain: see optimizer()


def rows():
    """Every run, dense first: each method at its usual settings."""
    from jaxcomp import methods as m

    def topk(ratio, **options):
        method = m.TopK(ratio)
        suffix = "_noef" if options.get("error_feedback") is False else ""
        return Row(f"{method.describe()}{suffix}", method, options)

    # The issue's list, which fits the 20 minutes: top-k 1% and 0.1% with error feedback and without
    # (on the all-gather). AR-Topk's rows are variants: 1.4 minutes each, and 13 rows took 22.0.
    table = [Row("dense", m.Dense())]
    for ratio in (0.01, 0.001):
        table += [topk(ratio), topk(ratio, error_feedback=False)]
    table += [
        Row("zfp(8)", m.Zfp(8)),
        Row("quantized(4)", m.Quantized(4)),
        Row("randomk(0.01)", m.RandomK(0.01)),
    ]
    # Methods landing on other branches: one line each, present once jaxcomp.methods has them.
    if hasattr(m, "PowerSGD"):
        table.append(Row("powersgd(4)", m.PowerSGD(4)))
    if hasattr(m, "Sign"):
        table.append(Row("sign", m.Sign()))
    if hasattr(m, "Cast"):
        table.append(Row("cast(bfloat16)", m.Cast("bfloat16")))
    # compress("auto") on a 1 Gbit/s network; the other auto rows are variants.
    return table + [row for row in auto_rows() if row.name == "auto@1gbit"]


#: The ``auto-topk`` rows' settings: top-k at 1%, ZFP at rate 8 and THC 4 bits as candidates.
AUTO_TOPK = {"ratio": 0.01, "rate": 8, "bits": 4}


def auto_rows():
    """``compress("auto")`` at its defaults (dense, the bfloat16 cast, ZFP 8) and ``auto-topk``
    (``compress("auto", ratio=0.01, rate=8, bits=4)``): on the network ``data_parallel`` probes
    (here, in-process devices: a fast one), and told a 1 Gbit/s or a 100 Mbit/s network with 1 ms
    latency (``@1gbit``, ``@100mbit``), where the cost model prefers compressed candidates. Quality
    depends on what it picks: the JSON's ``choices`` counts the steps each candidate ran."""
    from jaxcomp.costmodel.cost import Network

    return [
        Row(f"{name}{f'@{rate}' if rate else ''}", "auto", {**settings, **network})
        for name, settings in (("auto", {}), ("auto-topk", AUTO_TOPK))
        for rate, network in (
            ("1gbit", {"network": Network.parse("1ms", "1gbit")}),
            ("100mbit", {"network": Network.parse("1ms", "100mbit")}),
            ("", {}),
        )
    ]


def variants():
    """Runs for the investigation in BENCHMARKS.md ("Training quality"), not run by default: other
    settings of the methods that lose quality."""
    from jaxcomp import methods as m

    def star(ratio):
        # AR-Topk with the paper's leader (STAR), its default until 2026-11-29: the rows measured
        # before then under "ar_topk(...)" are these "ar_topk_star(...)" rows.
        return m.TopK(ratio, collective="ar", leader="star")

    # The sparsifiers with DGC's momentum correction and 100 dense steps first, behind two
    # optimizers.
    sparsifiers = (m.TopK(0.01), star(0.01), m.TopK(0.001), star(0.001), m.RandomK(0.01))

    dgc = {"momentum_correction": 0.9, "warmup_steps": 100}

    def with_dgc(suffix, optimizer, methods=sparsifiers, **options):
        return [
            Row(f"{method.describe()} {suffix}", method, {**dgc, **options}, optimizer=optimizer)
            for method in methods
        ]

    # The recipe that brings top-k within 3% (docs/training.md, "What the methods cost in model
    # quality"): Adam without momentum after the momentum-corrected top-k.
    recipe = with_dgc("dgc warmup100 adam-b1=0", "adam(b1=0)")
    # With Adam's variance frozen too (1-bit Adam's recipe). DGC's velocity (u = 0.9 u + g) is about
    # 10 times Adam's momentum and a frozen variance does not normalize that away, so its steps are
    # up to 10 times larger; "lr=2e-4" is 2e-3's scale (BENCHMARKS.md, "Training quality": what
    # looked like a fix was the larger steps).
    fixed = with_dgc("dgc+frozen-adam", "adam(b1=0,frozen=100)")
    fixed.append(
        Row(
            "allgather_topk(0.01) dgc+frozen-adam lr=2e-4",
            m.TopK(0.01),
            dgc,
            optimizer="adam(b1=0,frozen=100,lr=2e-4)",
        )
    )
    # jaxcomp.adam (issue 25): the momentum compressed with error feedback after 100 dense Adam
    # steps; "frozen" keeps the variance frozen for good (1-bit Adam's), the default refreshes it
    # on one dense step in 50.
    compressed = (
        m.Dense(),
        m.TopK(0.01),
        star(0.01),
        m.TopK(0.001),
        star(0.001),
        m.RandomK(0.01),
        m.Sign(),
        m.Sign(aggregation="ring"),
        m.PowerSGD(4),
        m.Quantized(4),
        m.Zfp(8),
        m.Cast("bfloat16"),
    )
    onebit = [Row(f"{x.describe()} jaxcomp.adam", x, optimizer="jaxcomp.adam") for x in compressed]
    onebit += [
        Row(f"{x.describe()} jaxcomp.adam frozen", x, optimizer="jaxcomp.adam(refresh=0)")
        for x in compressed
    ]
    # A shorter warm-up and rarer refreshes: fewer dense steps, so fewer bytes over the run.
    onebit += [
        Row(
            f"{x.describe()} jaxcomp.adam short", x, optimizer="jaxcomp.adam(warmup=25,refresh=100)"
        )
        for x in (m.Sign(), m.Sign(aggregation="ring"))
    ]
    # The warm-up and the refreshes sent as ZFP rate 8 (4x fewer bytes on the steps that dominate
    # a run's bytes; ZFP 8 keeps a plain Adam's loss): issue 25's ">= 10x fewer bytes" over a run.
    zfp_warmup = {"warmup_method": m.Zfp(8)}
    onebit += [
        Row(f"{x.describe()} jaxcomp.adam zfp-warmup", x, zfp_warmup, optimizer="jaxcomp.adam")
        for x in (m.Sign(), m.Sign(aggregation="ring"), m.TopK(0.01), m.PowerSGD(4))
    ]
    recipe += with_dgc("dgc warmup100 adam-b1=0 zfp-warmup", "adam(b1=0)", **zfp_warmup)
    # Half the warm-up: all-gather top-k 1% on 8 devices sends 1/12.5 of dense's bytes a step, so
    # 100 ZFP steps of 500 leave the run at 1/8.8; 50 bring it to 1/10.
    # AR-Topk with every device leading k/N of the shared indices (SPLIT, the default since
    # 2026-11-29; its rows were "ar_topk_split(...)" before): alone, and at the recipe with the
    # short ZFP warm-up.
    split = [m.TopK(r, collective="ar") for r in (0.01, 0.001)]
    for methods in (sparsifiers, split):
        recipe += with_dgc(
            "dgc warmup50 adam-b1=0 zfp-warmup",
            "adam(b1=0)",
            methods,
            warmup_steps=50,
            **zfp_warmup,
        )
    recipe += [Row(x.describe(), x) for x in split]
    return (
        [row for row in auto_rows() if row.name != "auto@1gbit"]
        + recipe
        + fixed
        + onebit
        + [
            Row("ar_topk_star(0.01)", star(0.01)),
            Row("ar_topk_star(0.001)", star(0.001)),
            Row("ar_topk_star(0.01)_noef", star(0.01), {"error_feedback": False}),
            Row("ar_topk_star(0.001)_noef", star(0.001), {"error_feedback": False}),
            Row("ar_topk(0.01)_noef", m.TopK(0.01, collective="ar"), {"error_feedback": False}),
            Row("ar_topk_var(0.01)", m.TopK(0.01, collective="ar", leader="var")),
            # About allgather_topk(0.01)'s bytes on 8 devices: AR-Topk's k is the whole step's, the
            # all-gather's k is each device's (up to 8k distinct values summed).
            Row("ar_topk_star(0.04)", star(0.04)),
            Row("quantized(4) leaf", m.Quantized(4), {"granularity": "leaf"}),
            Row("quantized(4)_noef", m.Quantized(4), {"error_feedback": False}),
            Row(
                "quantized(4) leaf_noef",
                m.Quantized(4),
                {"granularity": "leaf", "error_feedback": False},
            ),
            Row("zfp(8)_noef", m.Zfp(8), {"error_feedback": False}),
            # What the guardrail changes where it triggers on a run that does not diverge (the
            # large model's cast, 2026-11-27).
            Row("cast(bfloat16) noguard", m.Cast("bfloat16"), {"guardrail": False}),
            # The other cast (issue 25's "the casts"): float16 behind a shared power-of-two scale.
            Row("cast(float16)", m.Cast("float16")),
            # The casts without error feedback, as PyTorch's fp16/bf16 hooks run (their residual
            # is 100 MB of state on a 25M model, and updating it costs passes a step): their
            # default since 2026-11-29, so "cast(...)" rows before then are these "_ef" rows.
            Row("cast(bfloat16)_noef", m.Cast("bfloat16"), {"error_feedback": False}),
            Row("cast(float16)_noef", m.Cast("float16"), {"error_feedback": False}),
            Row("cast(bfloat16)_ef", m.Cast("bfloat16"), {"error_feedback": True}),
            Row("cast(float16)_ef", m.Cast("float16"), {"error_feedback": True}),
            Row("zfp(8) leaf", m.Zfp(8), {"granularity": "leaf"}),
            # A dense warm-up (DGC's, PyTorch's start_powerSGD_iter): 100 of the 500 steps dense.
            Row("allgather_topk(0.01) warmup100", m.TopK(0.01), {"warmup_steps": 100}),
            Row("ar_topk_star(0.01) warmup100", star(0.01), {"warmup_steps": 100}),
            Row("powersgd(4) warmup100", m.PowerSGD(4), {"warmup_steps": 100}),
            # Does a higher rank buy PowerSGD's quality back, and at how many bytes (issue 25)?
            Row("powersgd(8)", m.PowerSGD(8)),
            Row("powersgd(16)", m.PowerSGD(16)),
            # The factors sent as float16 (PyTorch's fp16_compress_wrapper): half the bytes, so a
            # higher rank at issue 25's >= 10x; with ZFP's short warm-up of the other rows.
            *(Row(f"powersgd_fp16({r})", m.PowerSGD(r, dtype="float16")) for r in (8, 12, 16)),
            *(
                Row(
                    f"powersgd_fp16({r}) zfp-warmup50",
                    m.PowerSGD(r, dtype="float16"),
                    {"warmup_steps": 50, **zfp_warmup},
                )
                for r in (8, 12)
            ),
            Row("sign warmup100", m.Sign(), {"warmup_steps": 100}),
            # Sharded training (issue 11): ZeRO-3 with the params gathered in bfloat16 (ZeRO++'s
            # qwZ), and the compressed reduce-scatters.
            Row("dense shard=params", m.Dense(), parallel={"shard": "params"}),
            Row(
                "dense shard=params bf16-gather",
                m.Dense(),
                parallel={"shard": "params", "gather_dtype": "bfloat16"},
            ),
            Row("zfp(8) shard=params", m.Zfp(8), parallel={"shard": "params"}),
            Row("quantized(4) shard=params", m.Quantized(4), parallel={"shard": "params"}),
            # Is it Adam? Freezing Adam's variance after a dense warm-up (1-bit Adam's remedy) makes
            # the update linear in what error feedback delivers, however bursty; dense beside it
            # measures what freezing alone costs.
            Row("dense adam-frozen100", m.Dense(), optimizer="adam(frozen=100)"),
            Row(
                "allgather_topk(0.01) warmup100 adam-frozen100",
                m.TopK(0.01),
                {"warmup_steps": 100},
                optimizer="adam(frozen=100)",
            ),
            # Are small layers starved by one model-wide top-k? k per leaf; norms and biases dense.
            Row("allgather_topk(0.01) leaf", m.TopK(0.01), {"granularity": "leaf"}),
            Row("allgather_topk(0.01) min_size=1024", m.TopK(0.01), {"min_size": 1024}),
            # DGC's own setting: SGD with momentum, the momentum moved before top-k (momentum
            # correction and factor masking), against dense with the same SGD.
            Row("dense sgd-momentum", m.Dense(), optimizer="sgd(lr=0.3,momentum=0.9)"),
            Row(
                "allgather_topk(0.01) dgc sgd",
                m.TopK(0.01),
                {"momentum_correction": 0.9},
                optimizer="sgd(lr=0.3)",
            ),
            # DGC with Adam: the momentum before top-k (corrected and masked), Adam without its own
            # momentum after (its variance then sees the bursts).
            Row(
                "allgather_topk(0.01) dgc adam-b1=0",
                m.TopK(0.01),
                {"momentum_correction": 0.9},
                optimizer="adam(b1=0)",
            ),
        ]
    )


def adam_frozen_variance(learning_rate, freeze_after: int, b1=0.9, b2=0.999, eps=1e-8):
    """``optax.adam`` whose second moment stops changing after ``freeze_after`` updates: for the
    investigation of whether Adam's per-coordinate normalization is what costs top-k its quality.

    Up to then it is Adam (bias-corrected ``m / (sqrt(v) + eps)``, the same state); afterwards ``v``
    keeps its value and its bias correction stays at ``freeze_after``, so the update is linear in
    the gradients: what error feedback delivers late, in bursts, moves the params as far in total as
    had it come step by step. 1-bit Adam's variance freezing (Tang et al., ICML 2021) without its
    compression. (Measured here, it does not help top-k: BENCHMARKS.md, "Training quality".)

    Example:
      >>> import jax.numpy as jnp
      >>> tx = adam_frozen_variance(0.1, freeze_after=1)
      >>> state = tx.init(jnp.zeros(1))
      >>> u, state = tx.update(jnp.ones(1), state)      # Adam's first step: -lr * sign
      >>> u, state = tx.update(3 * jnp.ones(1), state)  # v frozen at 0.001: momentum over sqrt(v)
      >>> [round(float(x), 4) for x in (u[0], state.nu[0])]
      [-0.2053, 0.001]
    """
    import jax
    import jax.numpy as jnp
    import optax

    schedule = learning_rate if callable(learning_rate) else (lambda count: learning_rate)

    def update(updates, state, params=None):
        count = optax.safe_int32_increment(state.count)
        live = count <= freeze_after
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
        nu = jax.tree.map(
            lambda v, g: jnp.where(live, b2 * v + (1 - b2) * jnp.square(g), v), state.nu, updates
        )
        steps = count.astype(jnp.float32)
        variance_steps = jnp.minimum(count, freeze_after).astype(jnp.float32)
        lr = schedule(state.count)
        out = jax.tree.map(
            lambda m, v: (
                -lr * (m / (1 - b1**steps)) / (jnp.sqrt(v / (1 - b2**variance_steps)) + eps)
            ),
            mu,
            nu,
        )
        return out, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(optax.scale_by_adam(b1, b2, eps).init, update)


def optimizer(name: str, config: "Config"):
    """The optimizer after ``compress``, from a row's ``optimizer``; every one follows the warm-up +
    cosine schedule to its peak learning rate (``config.learning_rate`` for Adam):

    * ``"adam"``: ``optax.adam``, every row of the table;
    * ``"adam(lr=4e-3)"``: Adam with another peak learning rate;
    * ``"adam(b1=0,frozen=100)"``: Adam without momentum (for DGC's momentum correction, which moves
      the momentum before compression) and/or with its variance frozen after 100 steps
      (:func:`adam_frozen_variance`); either keyword alone works too;
    * ``"sgd(lr=0.3,momentum=0.9)"``: SGD, with momentum or without.
    """
    import optax

    kind, _, rest = name.partition("(")
    try:
        options = {
            key.strip(): float(value)
            for key, value in (
                item.split("=") for item in rest.rstrip(")").split(",") if item.strip()
            )
        }
    except ValueError:
        raise ValueError(f"optimizer {name!r}: options are key=number, comma-separated") from None

    if kind == "adam" and set(options) <= {"b1", "frozen", "lr"}:
        b1, peak = options.get("b1", 0.9), options.get("lr", config.learning_rate)
        if "frozen" in options:
            return adam_frozen_variance(schedule(config, peak), int(options["frozen"]), b1=b1)
        return optax.adam(schedule(config, peak), b1=b1)
    if kind == "sgd" and set(options) <= {"lr", "momentum"} and "lr" in options:
        return optax.sgd(schedule(config, options["lr"]), momentum=options.get("momentum") or None)
    raise ValueError(
        f"unknown optimizer {name!r}: adam, adam(b1=..,frozen=..,lr=..) or sgd(lr=..,momentum=..)"
    )


def transformation(row: Row, config: Config):
    """The row's whole optimizer: ``compress`` chained with :func:`optimizer`'s, or, for
    ``optimizer="jaxcomp.adam"`` (``"jaxcomp.adam(warmup=50,lr=4e-3)"``), :func:`jaxcomp.adam`
    with the row's method and options, on the same schedule."""
    import optax

    import jaxcomp

    kind, _, rest = row.optimizer.partition("(")
    if kind != "jaxcomp.adam":
        return optax.chain(
            jaxcomp.compress(row.method, **row.options), optimizer(row.optimizer, config)
        )
    options = {
        key.strip(): float(value)
        for key, value in (item.split("=") for item in rest.rstrip(")").split(",") if item.strip())
    }
    peak = options.pop("lr", config.learning_rate)
    if "warmup" in options:
        options["warmup_steps"] = int(options.pop("warmup"))
    if "refresh" in options:  # refresh=0: the variance frozen for good (1-bit Adam's)
        options["refresh_every"] = int(options.pop("refresh")) or None
    return jaxcomp.adam(schedule(config, peak), row.method, **options, **row.options)


def train(row: Row, config: Config, corpus, devices, seed=0, progress=True):
    """Trains one row; returns its results (curves, final held-out loss, bytes, wall time)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import jaxcomp

    train_tokens = corpus[0]
    mesh = Mesh(np.array(devices), ("data",))
    loss_fn, params, heldout = task(config, corpus, seed)
    tx = transformation(row, config)
    dp = jaxcomp.data_parallel(loss_fn, tx, mesh, **row.parallel)
    evaluate = (
        jax.jit(lambda state, batch: loss_fn(dp.params(state), batch))
        if row.parallel.get("shard") == "params"
        else jax.jit(lambda state, batch: loss_fn(state.params, batch))
    )
    windows = batches(train_tokens, config, config.steps, seed)
    eval_at = set(np.linspace(0, config.steps, config.eval_points + 1).astype(int)[1:].tolist())

    state = dp.init(params)
    train_curve, eval_curve, metrics = [], [(0, float(evaluate(state, heldout)))], None
    started = time.perf_counter()
    steps = range(config.steps)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc=f"{row.name:>24}", file=sys.stderr, mininterval=1.0)
    sent, ran = [], []  # per step, read after the loop like the loss
    for step in steps:
        state, metrics = dp.step(state, {"tokens": train_tokens[windows[step]]})
        train_curve.append(metrics["loss"])  # read after the loop: steps run ahead of the host
        sent.append(metrics["bytes_sent"] + metrics.get("gather_bytes", 0.0))
        ran.append(metrics.get("method", -1))
        if step + 1 in eval_at:
            eval_curve.append((step + 1, float(evaluate(state, heldout))))
    train_curve = [float(v) for v in train_curve]
    return {
        "name": row.name,
        "method": row.method if isinstance(row.method, str) else row.method.describe(),
        "options": {
            key: value if isinstance(value, (bool, int, float, str)) else str(value)
            for key, value in {**row.options, **row.parallel}.items()
        },
        "choices": choices(state, ran),
        "mean_bytes_per_step": float(np.mean([float(v) for v in sent])),
        "optimizer": row.optimizer,
        "heldout_loss": eval_curve[-1][1],
        "train_loss": train_curve,
        "eval_curve": eval_curve,
        # Sharded: the gradient's reduce-scatter plus the params' all-gather.
        "bytes_per_step": float(metrics["bytes_sent"]) + float(metrics.get("gather_bytes", 0.0)),
        "gain": float(metrics["gain"]),
        "seconds": time.perf_counter() - started,
    }


def choices(state, ran) -> dict:
    """``{branch: steps it ran}`` where the state has branches: ``compress("auto")``'s
    candidates, or a method and the guardrail's dense fallback; empty for one branch."""
    import collections

    import jaxcomp

    compress_state = jaxcomp.find_compress_state(state)
    branches = compress_state.methods if compress_state is not None else ()
    if len(branches) < 2:
        return {}
    return dict(collections.Counter(branches[int(v)].describe() for v in ran))


def format_table(results) -> str:
    """The results as a Markdown table, ratios to the dense run: the last step's bytes, and the mean
    over the run (dense warm-up and refresh steps included); auto rows add what they ran."""
    dense = next((r for r in results if r["name"] == "dense"), None)
    lines = [
        "| method | held-out loss | vs dense | bytes / step / device | vs dense "
        "| mean bytes / step | vs dense |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def ratio(r, key):
        return f"{mean_bytes(r, key) / mean_bytes(dense, key):.4f}" if dense else "-"

    for r in results:
        loss_ratio = f"{r['heldout_loss'] / dense['heldout_loss']:.4f}" if dense else "-"
        ran = ", ".join(f"{name} {n}" for name, n in r.get("choices", {}).items())
        lines.append(
            f"| {r['name']}{f' (ran: {ran})' if ran else ''} | {r['heldout_loss']:.4f} "
            f"| {loss_ratio} | {r['bytes_per_step']:,.0f} | {ratio(r, 'bytes_per_step')} "
            f"| {mean_bytes(r, 'mean_bytes_per_step'):,.0f} | {ratio(r, 'mean_bytes_per_step')} |"
        )
    return "\n".join(lines)


def mean_bytes(result, key) -> float:
    """``result[key]``; results of older JSONs have no mean and give the last step's."""
    return result.get(key, result["bytes_per_step"])


def plot(results, path, title):
    """Held-out loss and smoothed training loss of every run, dense black and dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_eval, ax_train) = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.cm.tab20(np.linspace(0, 1, 20))
    for i, r in enumerate(results):
        # Dense black and dashed on top; runs without error feedback dotted; 20 distinct colors.
        style = (
            {"color": "black", "linestyle": "--", "zorder": 3}
            if r["name"] == "dense"
            else {
                "color": colors[i % 20],
                "linestyle": ":" if r["options"].get("error_feedback") is False else "-",
            }
        )
        steps, values = zip(*r["eval_curve"])
        ax_eval.plot(steps[1:], values[1:], marker=".", label=r["name"], **style)
        loss = np.asarray(r["train_loss"])
        window = max(1, len(loss) // 30)
        ax_train.plot(
            np.arange(window, len(loss) + 1),
            np.convolve(loss, np.ones(window) / window, "valid"),
            label=r["name"],
            **style,
        )
    for ax, name in ((ax_eval, "held-out loss"), (ax_train, "training loss (moving average)")):
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats / character)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    ax_eval.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def merge(paths, out):
    """Joins several runs' ``quality.json`` (same config) into one table, JSON and plot in
    ``out``."""
    by_name, first = {}, None
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if first is not None and data["config"] != first["config"]:
            raise SystemExit(
                f"--merge: {path} has another config than {paths[0]}: {data['config']} vs "
                f"{first['config']}"
            )
        first = first or data
        by_name.update({r["name"]: r for r in data["results"]})
    results = sorted(
        by_name.values(), key=lambda r: r["name"] != "dense"
    )  # dense first, else in order
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "quality.json"), "w") as f:
        json.dump(dict(first, results=results, merged_from=list(paths)), f)
    print(format_table(results))
    plot(
        results,
        os.path.join(out, "quality.png"),
        f"char-level transformer ({first['params'] / 1e6:.2f}M params) on stdlib source, 8 "
        f"devices, {first['config']['steps']} steps",
    )
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    zoo = argparse.ArgumentParser(add_help=False)
    zoo.add_argument("--task")
    known, rest = zoo.parse_known_args(argv)
    if known.task is not None:
        # The quality zoo's tasks (benchmarks/quality_zoo.py): "zoo" for all of them.
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import quality_zoo

        tasks = [] if known.task == "zoo" else ["--tasks", known.task]
        return quality_zoo.main(tasks + rest)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--methods",
        help="comma-separated row names (default: every method; --list adds the variants)",
    )
    parser.add_argument("--list", action="store_true", help="print the row names and exit")
    parser.add_argument("--steps", type=int, help="training steps (default 500; 6 with --quick)")
    parser.add_argument(
        "--learning-rate", type=float, help="Adam's peak learning rate (default 4e-3)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a tiny model for a few steps (smoke test)"
    )
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="small",
        help="small: 0.44M params, 32 sequences a step, the whole default run in ~19 min "
        "(default); large: 2.45M params, 16 sequences a step, 4-9 min a row",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default="quality-results", help="folder for quality.json and quality.png"
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="train nothing: join the results of these quality.json files (a later run of the "
        "same name replaces an earlier one), print the table and write --out's JSON and plot",
    )
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)

    config = QUICK if args.quick else MODELS[args.model]
    if args.steps is not None:
        if args.steps < 1:
            parser.error(f"--steps must be positive, got {args.steps}")
        config = dataclasses.replace(
            config, steps=args.steps, warmup=min(config.warmup, args.steps // 10)
        )
    if args.learning_rate is not None:
        if not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
            parser.error(f"--learning-rate must be a positive number, got {args.learning_rate}")
        config = dataclasses.replace(config, learning_rate=args.learning_rate)

    default = [row.name for row in rows()]
    table = {row.name: row for row in rows() + variants()}
    if args.list:
        print("\n".join(table))
        return 0
    names = [n.strip() for n in args.methods.split(",") if n.strip()] if args.methods else default
    unknown = [n for n in names if n not in table]
    if unknown or not names:
        parser.error(f"--methods: unknown {unknown}; choose from {','.join(table)}")
    os.makedirs(args.out, exist_ok=True)
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N_DEVICES}"
    )
    import jax

    jax.config.update("jax_num_cpu_devices", N_DEVICES)

    corpus = load_corpus()
    devices = jax.devices("cpu")[:N_DEVICES]
    n_params = count_params(config)
    header = (
        f"{platform.node()}: {os.cpu_count()} cores, jax {jax.__version__}, Python "
        f"{platform.python_version()}, {N_DEVICES} virtual CPU devices; corpus "
        f"{sum(size for _, size in corpus[2]):,} bytes ({len(corpus[0]):,} train / "
        f"{len(corpus[1]):,} held-out characters) from {len(corpus[2])} stdlib files; model "
        f"{n_params:,} params ({config.layers} layers, width {config.width}, context "
        f"{config.context}); {config.steps} steps of {config.batch} sequences, Adam peak lr "
        f"{config.learning_rate:g}"
    )
    print(header, file=sys.stderr)
    started = time.perf_counter()
    results = []
    for name in names:
        results.append(
            train(
                table[name], config, corpus, devices, seed=args.seed, progress=not args.no_progress
            )
        )
        with open(
            os.path.join(args.out, "quality.json"), "w"
        ) as f:  # partial results survive an interrupt
            json.dump(
                {
                    "header": header,
                    "config": dataclasses.asdict(config),
                    "params": n_params,
                    "corpus": [{"path": p, "bytes": s} for p, s in corpus[2]],
                    "results": results,
                },
                f,
            )
    print(format_table(results))
    plot(
        results,
        os.path.join(args.out, "quality.png"),
        f"char-level transformer ({n_params / 1e6:.2f}M params) on stdlib source, 8 devices, "
        f"{config.steps} steps",
    )
    print(
        f"total {time.perf_counter() - started:.0f} s; wrote {args.out}/quality.json and "
        "quality.png",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
