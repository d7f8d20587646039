"""``jaxcomp demo``: data-parallel training of a small flax model once per compression method.

Trains an MLP on scikit-learn's bundled digits (8x8 images, 10 classes; ships with scikit-learn,
no download) on 8 virtual CPU devices, with the same initial params, batches and step count for
every method, then prints a verdict table (final eval accuracy and its gap to dense, eval loss,
bytes sent per step and the ratio to dense, mean step time, "within 1 pt of dense?", and the
setting or trade-off of the row) and saves, in ``--out``, the table as ``verdict.md`` and
``verdict.csv`` and the eval curves as ``loss_curves.png``: one column per family of methods
(top-k; quantizers and casts; random-k, sign and low rank; auto), eval loss above eval accuracy,
dense drawn in every panel as the reference.

    jaxcomp demo                       # all methods, a minute or two on a small machine
    python -m jaxcomp demo --steps 600 --methods dense,ar_topk,ar_topk_noef

**Random-k and the optimizer's momentum.** With error feedback, random-k sends each entry about
once every ``1 / density`` steps, with all that entry's gradient since: every entry arrives as a
stale burst. Stale updates already act as momentum (Mitliagkas et al. 2016, "Asynchrony begets
momentum"); SGD's momentum 0.9 on top of them makes training blow up, and so does DGC's momentum
correction. So the random-k rows run the same optimizer without momentum: SGD at
``lr / (1 - 0.9)``, the step momentum SGD takes in a steady state (Adam with ``b1=0`` under
``--optimizer adam``).

The runs and their trade-offs are in :mod:`jaxcomp.cli._demo_runs`, a row's verdict in
:mod:`jaxcomp.cli._demo_verdict`; what the rows measured at the defaults is in docs/training.md
(its introduction).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

from jaxcomp.cli import _report
from jaxcomp.cli._demo_runs import (  # noqa: F401  (re-exported: the demo's names, as before)
    AUTO,
    CODECS,
    DENSE,
    FAMILIES,
    SPARSE_AND_LOW_RANK,
    TOPK,
    Run,
    runs,
)
from jaxcomp.cli._demo_verdict import (  # noqa: F401  (re-exported, as above)
    EXPLODED,
    TABLE_HEADER,
    WITHIN_POINTS,
    diverged,
    figure,
    format_table,
    plot,
    save_tables,
    verdicts,
)

#: Virtual CPU devices the demo trains on.
N_DEVICES = 8


#: The momentum of ``--optimizer momentum`` (SGD).
MOMENTUM = 0.9


def _use_virtual_cpu_devices():
    """Asks for 8 CPU devices; must run before JAX starts a backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={N_DEVICES}".strip()
        )
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", N_DEVICES)
    except RuntimeError:  # a backend already started (e.g. in a notebook); checked below
        pass
    cpus = jax.devices("cpu")
    if len(cpus) < N_DEVICES:
        raise SystemExit(
            f"jaxcomp demo needs {N_DEVICES} CPU devices, found {len(cpus)}: run it in a fresh "
            f"process or set XLA_FLAGS=--xla_force_host_platform_device_count={N_DEVICES}"
        )
    return cpus[:N_DEVICES]


def load_digits(test_fraction=0.2, seed=0):
    """scikit-learn's digits as float32 ``(x_train, y_train, x_test, y_test)``, pixels in [0, 1]."""
    from sklearn.datasets import load_digits as sklearn_digits

    data = sklearn_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def make_model(seed=0, hidden=128):
    """The demo's MLP (64 -> hidden -> hidden -> 10) as a flax nnx module."""
    from flax import nnx

    rngs = nnx.Rngs(seed)
    return nnx.Sequential(
        nnx.Linear(64, hidden, rngs=rngs),
        nnx.relu,
        nnx.Linear(hidden, hidden, rngs=rngs),
        nnx.relu,
        nnx.Linear(hidden, 10, rngs=rngs),
    )


def make_optimizer(name: str, learning_rate: float, momentum_free: bool = False):
    """The optimizer after ``compress`` in the chain: ``"adam"`` or ``"momentum"`` (SGD, 0.9).

    ``momentum_free`` gives the same optimizer without momentum, for error feedback that delivers
    in bursts (random-k): SGD at ``learning_rate / (1 - 0.9)``, the step of momentum SGD in a
    steady state, or Adam with ``b1=0``."""
    import optax

    if name == "adam":
        return optax.adam(learning_rate, b1=0.0) if momentum_free else optax.adam(learning_rate)
    if name == "momentum":
        if momentum_free:
            return optax.sgd(learning_rate / (1 - MOMENTUM))
        return optax.sgd(learning_rate, momentum=MOMENTUM)
    raise ValueError(f"optimizer must be 'adam' or 'momentum', got {name!r}")


def train(
    run: Run,
    devices,
    data,
    steps,
    batch_size,
    learning_rate,
    optimizer="momentum",
    seed=0,
    progress=True,
):
    """Trains one run; returns a dict of results (curves, final eval, bytes, step time)."""
    dp, state, evaluate = _setup(run, devices, learning_rate, optimizer, seed)
    x_train = data[0]
    rng = np.random.default_rng(seed)  # the same batches for every run
    batches = [rng.choice(len(x_train), batch_size, replace=False) for _ in range(steps)]
    bar = _report.progress_bar(
        range(steps), enabled=progress, desc=f"{run.name:>20}", leave=True, mininterval=0.5
    )
    state, metrics, curves = _steps(dp, state, evaluate, data, batches, bar)
    return _results(run, state, metrics, evaluate, data, curves)


def _setup(run: Run, devices, learning_rate, optimizer, seed):
    """The run's mesh, model and training step: ``(data_parallel, its state, jitted eval)``."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import Mesh

    from jaxcomp.costmodel.cost import Network
    from jaxcomp.optim.auto import compress_auto
    from jaxcomp.optim.compression import compress
    from jaxcomp.training.trainer import data_parallel

    if isinstance(run.axis_name, tuple):  # 2 "nodes" of 4 devices: the outer axis is the slow one
        mesh = Mesh(np.array(devices).reshape(2, N_DEVICES // 2), run.axis_name)
    else:
        mesh = Mesh(np.array(devices), (run.axis_name,))
    graphdef, params = nnx.split(make_model(seed), nnx.Param)

    def loss_fn(params, batch):
        logits = nnx.merge(graphdef, params)(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, jnp.mean(logits.argmax(-1) == batch["y"])

    options = dict(run.options)
    if "network" in options:  # a simulated link: "latency/bandwidth"
        options["network"] = Network.parse(*options["network"].split("/"))
    aggregate = (
        compress_auto(run.method, axis_name=run.axis_name, **options)
        if isinstance(run.method, tuple)
        else compress(run.method, axis_name=run.axis_name, **options)
    )
    tx = optax.chain(aggregate, make_optimizer(optimizer, learning_rate, run.momentum_free))
    dp = data_parallel(loss_fn, tx, mesh, axis_name=run.axis_name, has_aux=True)
    return dp, dp.init(params), jax.jit(loss_fn)


def _steps(dp, state, evaluate, data, batches, bar):
    """The training loop: ``(state, last metrics, (losses, eval curve, mean step seconds))``; the
    eval curve holds ``(step, eval loss, eval accuracy)`` from step 0 (the initial params) on."""
    import jax

    x_train, y_train, x_test, y_test = data
    test = {"x": x_test, "y": y_test}
    steps = len(batches)
    eval_every = max(1, steps // 20)
    losses, metrics = [], None
    eval_curve = [(0, *map(float, evaluate(state.params, test)))]
    start = None
    for step in bar:
        if step == 1:  # step 0 compiles; time the rest
            jax.block_until_ready(state)
            start = time.perf_counter()
        index = batches[step]
        state, metrics = dp.step(state, {"x": x_train[index], "y": y_train[index]})
        # Reading the loss waits for the step: the progress bar and the step time stay honest.
        losses.append(float(metrics["loss"]))
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            eval_curve.append((step + 1, *map(float, evaluate(state.params, test))))
    jax.block_until_ready(state)
    step_time = (
        (time.perf_counter() - start) / max(1, steps - 1) if start is not None else float("nan")
    )
    return state, metrics, (losses, eval_curve, step_time)


def _results(run: Run, state, metrics, evaluate, data, curves) -> dict:
    """What :func:`train` returns: the curves, the final eval, the bytes and the step time."""
    from jaxcomp.optim.state import find_compress_state

    losses, eval_curve, step_time = curves
    eval_loss, eval_accuracy = evaluate(state.params, {"x": data[2], "y": data[3]})
    return {
        "name": run.name,
        "family": run.family,
        "note": run.note,
        "train_loss": np.asarray(losses),
        "eval_curve": [(step, loss) for step, loss, _ in eval_curve],
        "accuracy_curve": [(step, accuracy) for step, _, accuracy in eval_curve],
        "eval_loss": float(eval_loss),
        "eval_accuracy": float(eval_accuracy),
        "bytes_sent": float(metrics["bytes_sent"]),
        "density": float(metrics["density"]),
        "method": find_compress_state(state.opt_state).methods[int(metrics["method"])].label,
        "gain": float(metrics["gain"]),
        "step_time": step_time,
    }


def main(argv=None) -> int:
    """Runs the demo; returns the process exit code.

    Args:
      argv: command-line arguments after ``demo`` (default ``sys.argv[1:]``); ``--help`` lists them.

    Returns:
      0 on success.

    Example:
      >>> from jaxcomp.cli import demo
      >>> demo.main(["--steps", "20", "--methods", "dense,ar_topk", "--no-plot"])  # doctest: +SKIP
      0

    References:
      Tyagi & Swany, arXiv 2312.02493 (AR-Topk, error feedback); Shi et al., MLSys 2021
      (hierarchical top-k); ../shared/papers/004 (ZFP all-reduce); Li et al., THC, NSDI 2024.
    """
    parser = _parser(runs(0.01))
    args = parser.parse_args(argv)
    selected = _checked_runs(parser, args)
    data = _checked_data(parser, args)
    results, started = _train_all(args, selected, data)
    _report_results(args, results, started)
    return 0


def _parser(all_runs) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxcomp demo",
        description="Trains a small flax MLP on scikit-learn's digits, data-parallel on 8 CPU "
        "devices, once per gradient compression method; prints a table and saves a loss-curve "
        "plot.",
    )
    parser.add_argument(
        "--steps", type=int, default=500, help="training steps per method (default 500)"
    )
    parser.add_argument(
        "--methods",
        default=",".join(all_runs),
        help=f"comma-separated runs (default all: {','.join(all_runs)})",
    )
    parser.add_argument(
        "--density",
        type=float,
        default=0.01,
        help="fraction of gradient entries the top-k methods send (default 0.01)",
    )
    parser.add_argument("--batch-size", type=int, default=128, help="global batch (default 128)")
    parser.add_argument(
        "--optimizer",
        choices=("momentum", "adam"),
        default="momentum",
        help="optimizer after compress: SGD with momentum 0.9 (default) or adam",
    )
    parser.add_argument(
        "--learning-rate", type=float, default=0.05, help="learning rate (default 0.05)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        default="jaxcomp-demo",
        help="folder for the plot and the verdict table (default ./jaxcomp-demo)",
    )
    parser.add_argument(
        "--no-plot", action="store_true", help="write nothing to --out (no PNG, no table files)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def _checked_runs(parser, args) -> list[Run]:
    """The runs the flags name, every flag checked before any training (bad ones exit via
    argparse)."""
    if not 0.0 < args.density <= 1.0:  # before runs(), which builds the methods at this density
        parser.error(f"--density must be in (0, 1], got {args.density}")
    all_runs = runs(args.density)
    names = [name.strip() for name in args.methods.split(",") if name.strip()]
    unknown = [name for name in names if name not in all_runs]
    if unknown or not names:
        parser.error(f"--methods: unknown {unknown}; choose from {','.join(all_runs)}")
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    if args.batch_size < N_DEVICES or args.batch_size % N_DEVICES:
        parser.error(
            f"--batch-size must be a positive multiple of {N_DEVICES} (one share per device), "
            f"got {args.batch_size}"
        )
    if not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        parser.error(f"--learning-rate must be a positive finite number, got {args.learning_rate}")
    if not 0 <= args.seed < 2**32:
        parser.error(f"--seed must be in [0, 2**32 - 1], got {args.seed}")
    if not args.no_plot:
        # Where the plot goes is checked now, not after minutes of training.
        problem = _report.unwritable_folder(args.out)
        if problem:
            parser.error(f"--out {args.out!r}: {problem}")
    return [all_runs[name] for name in names]


def _checked_data(parser, args):
    """The digits split by ``--seed``; a batch larger than the training set is a flag error."""
    data = load_digits(seed=args.seed)
    if args.batch_size > len(data[0]):
        parser.error(
            f"--batch-size must be at most the {len(data[0])} training images (batches are drawn "
            f"without replacement), got {args.batch_size}"
        )
    return data


def _train_all(args, selected, data) -> tuple[list[dict], float]:
    """Trains every selected run on the virtual devices, one after the other;
    ``(results, start)``."""
    devices = _use_virtual_cpu_devices()
    print(
        f"digits: {len(data[0])} train / {len(data[2])} test images, {N_DEVICES} CPU devices, "
        f"{args.steps} steps of {args.batch_size} per method",
        file=sys.stderr,
    )
    started = time.perf_counter()
    results = [
        train(
            run,
            devices,
            data,
            args.steps,
            args.batch_size,
            args.learning_rate,
            optimizer=args.optimizer,
            seed=args.seed,
            progress=not args.no_progress,
        )
        for run in selected
    ]
    return results, started


def _report_results(args, results, started) -> None:
    """Prints the table, writes the plot and says how long it all took."""
    print()
    print(format_table(results))
    if not args.no_plot:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "loss_curves.png")
        plot(results, path)
        md, csv = save_tables(results, args.out)
        print(f"\nverdict table: {md}, {csv}\neval curves: {path}")
    print(f"total time: {time.perf_counter() - started:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
