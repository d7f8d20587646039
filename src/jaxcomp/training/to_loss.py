"""Time to quality: the rows that race to a dense run's loss on the char-LM, and how each runs
(the timed loop itself is :mod:`jaxcomp.training.to_loss_loop`).

    results = to_loss.run_rows(["dp", "diloco-h50-avg-int8"], charlm.MODELS["wide"], steps=300,
                               max_steps=900, eval_every=30)

Every row trains the same model (:mod:`jaxcomp.training.charlm`) from the same params on the same
batches:

* ``dp`` is ``jaxcomp.data_parallel`` with a dense all-reduce and Adam (warm-up + cosine
  schedule, :func:`charlm.schedule`); ``ar_topk``, ``auto`` and ``auto-topk`` are the same with
  ``compress("ar_topk", ratio=0.01)``, ``compress("auto")`` and ``compress("auto", ratio=0.01)``:
  per-step compression;
* ``ar_topk-dgc`` and ``ar_topk_star-dgc`` are AR-Topk 1% (SPLIT's leader, the default, and
  the paper's STAR; before 2026-11-29 ``ar_topk-dgc`` was STAR's and ``ar_topk_split-dgc``
  SPLIT's) with the recipe that keeps top-k near Adam's loss: DGC's momentum correction (0.9),
  a 50-step warm-up sent as ZFP rate 8, and Adam without momentum (``b1=0``) after it;
* ``adam-sign`` and ``adam-sign_ring`` are ``jaxcomp.adam`` (the same schedule) with 25 dense
  warm-up steps and a dense variance refresh every 100, its momentum sent as scaled signs,
  all-gathered or in a ring;
* the ``diloco-*`` rows are ``jaxcomp.diloco`` with one worker per device (or per row of
  ``inner`` devices), the same Adam as inner optimizer, the paper's outer Nesterov SGD (lr 0.7,
  momentum 0.9) or, for ``-avg``, plain averaging, for ``-n3`` Nesterov SGD with lr 1.0 and
  momentum 0.3, and ``H`` inner steps between exchanges; ``-int8`` sends the pseudo-gradients as
  8-bit codes (``jaxcomp.Quantized(8)``, error feedback), ``-topk`` as top-10%, ``-topk2r02`` as
  top-2% with 2-bit values (SparseLoCo's, :mod:`jaxcomp.training.to_loss_codecs`), ``-stream``
  syncs 2 fragments staggered, applied 1 step late (``-stream4``: 4 fragments), and
  ``-eager`` runs eager rounds (``diloco(eager=True)``: each exchange beside the next round,
  applied a round late; ``-eager4``: 4 fragments), and ``-muon`` trains each worker with
  ``jaxcomp.muon`` (MuLoCo's inner optimizer) on the same schedule instead of Adam.

A row name may add settings (:func:`parse_row`): ``@outer=`` a DiLoCo row's outer optimizer,
``@codec=`` its pseudo-gradients' codec (:data:`CODECS` or ``topkBrDIGITS``), ``@exchange=``
how a two-level row shares the exchange, ``@metrics=worker`` no loss mean over the slow axis
between syncs, ``@lr=`` the row's (or dp's) peak learning rate.

``dp`` runs first and sets the target. The clock leaves out the evaluations and the first
compilation; in a multi-process job process 0 evaluates and every process waits for its result.
"""

from __future__ import annotations

import dataclasses
import math

from jaxcomp.training import charlm
from jaxcomp.training.to_loss_codecs import (  # noqa: F401  (re-exported)
    CODECS,
    TOPK_FORM,
    check_codec,
    codec,
    low_bit_topk,
)
from jaxcomp.training.to_loss_loop import (  # noqa: F401  (summarize: re-exported)
    summarize,
    timed_curve,
)

_DEFAULTS = dict(outer="nesterov")
#: jaxcomp.adam's settings in the ``adam-*`` rows: a short warm-up (25 dense steps) and a dense
#: variance refresh every 100.
_SHORT = {"warmup_steps": 25, "refresh_every": 100}
#: compress's settings in the ``*-dgc`` rows (the warm-up's method, ZFP 8, is added by _build).
_DGC = {"momentum_correction": 0.9, "warmup_steps": 50}

#: The rows by name: what each trains (see the module docstring).
ROWS = {
    "dp": dict(kind="dp", method="dense"),
    "ar_topk": dict(kind="dp", method="ar_topk", settings={"ratio": 0.01}),
    "auto": dict(kind="dp", method="auto"),
    # docs/training.md's recipe for top-k (and _build's ZFP warm-up), Adam's b1 = 0 after it.
    "ar_topk-dgc": dict(kind="dgc", method="ar_topk", settings={"ratio": 0.01, **_DGC}),
    "ar_topk_star-dgc": dict(kind="dgc", method="ar_topk_star", settings={"ratio": 0.01, **_DGC}),
    "auto-topk": dict(kind="dp", method="auto", settings={"ratio": 0.01}),
    # jaxcomp.adam (1-bit Adam's recipe) with a short warm-up: 25 dense steps, a dense variance
    # refresh every 100; the momentum as signs, all-gathered or in a ring.
    "adam-sign": dict(kind="onebit", method="sign", adam=_SHORT),
    "adam-sign_ring": dict(kind="onebit", method="sign_ring", adam=_SHORT),
    "diloco-h10": dict(kind="diloco", sync_every=10),
    "diloco-h10-int8": dict(kind="diloco", sync_every=10, compress="int8"),
    "diloco-h10-avg": dict(kind="diloco", sync_every=10, outer="avg"),
    "diloco-h10-avg-int8": dict(kind="diloco", sync_every=10, compress="int8", outer="avg"),
    "diloco-h50": dict(kind="diloco", sync_every=50),
    "diloco-h50-int8": dict(kind="diloco", sync_every=50, compress="int8"),
    "diloco-h50-avg": dict(kind="diloco", sync_every=50, outer="avg"),
    "diloco-h50-avg-int8": dict(kind="diloco", sync_every=50, compress="int8", outer="avg"),
    "diloco-h10-n3-int8": dict(
        kind="diloco", sync_every=10, compress="int8", outer="nesterov-1-0.3"
    ),
    "diloco-h50-n3": dict(kind="diloco", sync_every=50, outer="nesterov-1-0.3"),
    "diloco-h50-n3-int8": dict(
        kind="diloco", sync_every=50, compress="int8", outer="nesterov-1-0.3"
    ),
    "diloco-h50-topk": dict(kind="diloco", sync_every=50, compress="topk"),
    # SparseLoCo's pseudo-gradients: top-1, 2 and 3% with 2-bit values (@codec=topkBrDIGITS
    # names any other ratio and width).
    "diloco-h50-avg-topk2r01": dict(kind="diloco", sync_every=50, compress="topk2r01", outer="avg"),
    "diloco-h50-avg-topk2r02": dict(kind="diloco", sync_every=50, compress="topk2r02", outer="avg"),
    "diloco-h50-avg-topk2r03": dict(kind="diloco", sync_every=50, compress="topk2r03", outer="avg"),
    "diloco-h50-stream": dict(kind="diloco", sync_every=50, fragments=2, delay=1),
    # Eager rounds: each fragment's exchange beside the next round, applied a round late.
    "diloco-h50-avg-eager": dict(kind="diloco", sync_every=50, outer="avg", eager=True),
    # MuLoCo's workers: Muon inside (jaxcomp.muon, AdamW's scale), dense or SparseLoCo's codec.
    "diloco-h50-avg-muon": dict(kind="diloco", sync_every=50, outer="avg", inner="muon"),
    "diloco-h50-avg-muon-topk2r02": dict(
        kind="diloco", sync_every=50, compress="topk2r02", outer="avg", inner="muon"
    ),
    "diloco-h50-avg-eager4-int8": dict(
        kind="diloco", sync_every=50, compress="int8", outer="avg", fragments=4, eager=True
    ),
    "diloco-h200-int8": dict(kind="diloco", sync_every=200, compress="int8"),
    "diloco-h10-avg-stream-int8": dict(
        kind="diloco", sync_every=10, compress="int8", outer="avg", fragments=2, delay=1
    ),
    # 4 fragments: each exchange a quarter of the model, small enough to hide behind one step.
    "diloco-h10-avg-stream4-int8": dict(
        kind="diloco", sync_every=10, compress="int8", outer="avg", fragments=4, delay=1
    ),
    "diloco-h50-avg-stream4-int8": dict(
        kind="diloco", sync_every=50, compress="int8", outer="avg", fragments=4, delay=1
    ),
}
#: The rows of a run in one process, and of a run on an emulated cluster, when none are named.
ONE_PROCESS_ROWS = ("dp", "diloco-h10", "diloco-h10-int8", "diloco-h50", "diloco-h50-int8")
CLUSTER_ROWS = (
    "dp",
    "ar_topk",
    "auto",
    "diloco-h10-avg-int8",
    "diloco-h10-avg-stream-int8",
    "diloco-h50-avg-int8",
    "diloco-h50-int8",
)

#: The outer optimizers by name; ``sgd:LR`` and ``nesterov:LR:MOMENTUM`` name any other.
OUTERS = {
    "nesterov": "nesterov:0.7:0.9",  # the paper's
    "avg": "sgd:1.0",  # plain parameter averaging (local SGD)
    # the best of a screening at H = 50 over 1500 steps (docs/training.md, section 7)
    "nesterov-1-0.3": "nesterov:1.0:0.3",
}
OUTER_FORMS = ", ".join(OUTERS) + ", sgd:LR or nesterov:LR:MOMENTUM"


def _outer(spec):
    """The outer optimizer of a name in :data:`OUTERS` or a ``sgd:LR`` / ``nesterov:LR:MOMENTUM``
    spec; ValueError for anything else."""
    import optax

    kind, *numbers = OUTERS.get(spec, spec).split(":")
    try:
        numbers = [float(x) for x in numbers]
    except ValueError:
        numbers = []
    if not all(math.isfinite(x) for x in numbers):
        numbers = []
    if kind == "sgd" and len(numbers) == 1 and numbers[0] > 0:
        return optax.sgd(numbers[0])
    if kind == "nesterov" and len(numbers) == 2 and numbers[0] > 0 and 0 <= numbers[1] < 1:
        return optax.sgd(numbers[0], momentum=numbers[1], nesterov=True)
    raise ValueError(f"outer optimizer {spec!r}: use {OUTER_FORMS} (LR > 0, 0 <= MOMENTUM < 1)")


def _positive(text):
    """``float(text)`` if it is a finite number > 0, else None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def parse_row(name):
    """A row name and its settings.

    ``diloco-h50@outer=nesterov:1.0:0.3@lr=3e-3`` is the row ``diloco-h50`` with that outer
    optimizer (DiLoCo rows) and inner (or dp's) peak learning rate, so that one job can screen
    settings beside ``dp``. DiLoCo rows also take ``@exchange=split|whole``, ``@codec=`` (a
    name in :data:`CODECS` or ``topkBrDIGITS``, for the row's pseudo-gradients) and
    ``@metrics=worker``
    (``diloco(worker_metrics=True)``: the training loss per worker, so that no step but a sync
    sends anything over the slow axis; the default ``mean`` averages it over every device each
    step).

    Args:
      name: a name of :data:`ROWS`, each setting added as ``@key=value``.

    Returns:
      ``(row, settings)``: the name in :data:`ROWS` and a dict of the settings given
      (``"outer"``, ``"exchange"``, ``"codec"``, ``"metrics"``, ``"lr"``).

    Raises:
      ValueError: naming the row, for an unknown row, setting or value.

    Example:
      >>> parse_row("diloco-h50-int8@outer=avg@lr=3e-3")
      ('diloco-h50-int8', {'outer': 'avg', 'lr': 0.003})

    References:
      Douillard et al., "DiLoCo" (arXiv 2311.08105), Sec. 3: the outer optimizer and H.
    """
    base, *parts = name.split("@")
    if base not in ROWS:
        raise ValueError(
            f"unknown row {base!r} in {name!r}; choose from {list(ROWS)} (a DiLoCo row sends "
            f"its pseudo-gradients with any codec as @codec=NAME: {', '.join(CODECS)} or "
            f"{TOPK_FORM})"
        )
    settings = {}
    for part in parts:
        key, _, value = part.partition("=")
        if key == "outer" and ROWS[base]["kind"] == "diloco":
            try:
                _outer(value)
            except ValueError as error:
                raise ValueError(f"row {name!r}: {error}") from None
            settings["outer"] = value
        elif key == "exchange" and ROWS[base]["kind"] == "diloco":
            if value not in ("split", "whole"):
                raise ValueError(f"row {name!r}: @exchange= takes split or whole, got {value!r}")
            settings["exchange"] = value
        elif key == "metrics" and ROWS[base]["kind"] == "diloco":
            if value not in ("mean", "worker"):
                raise ValueError(f"row {name!r}: @metrics= takes mean or worker, got {value!r}")
            settings["metrics"] = value
        elif key == "codec" and ROWS[base]["kind"] == "diloco":
            try:
                known = value in CODECS or low_bit_topk(value) is not None
            except ValueError as error:  # topkBrDIGITS with bits or a ratio out of range
                raise ValueError(f"row {name!r}: {error}") from None
            if not known:
                raise ValueError(
                    f"row {name!r}: @codec= takes {', '.join(CODECS)} or {TOPK_FORM}, got {value!r}"
                )
            settings["codec"] = value
        elif key == "lr":
            settings["lr"] = _positive(value)
            if settings["lr"] is None:
                raise ValueError(
                    f"row {name!r}: @lr= takes a finite learning rate > 0, got {value!r}"
                )
        else:
            raise ValueError(
                f"row {name!r}: @{part} is not a setting of it; a row takes @lr=PEAK"
                + (
                    ", @outer=SPEC, @exchange=split|whole, @codec=NAME and @metrics=mean|worker"
                    if ROWS[base]["kind"] == "diloco"
                    else ""
                )
            )
    return base, settings


def _row_options(name, quick=False):
    """The row's settings (with its ``@outer=``); ``quick`` (the smoke test's few steps)
    exchanges every 2 steps."""
    base, settings = parse_row(name)
    options = dict(_DEFAULTS, **ROWS[base])
    for key in ("outer", "exchange"):
        if key in settings:
            options[key] = settings[key]
    if "codec" in settings:
        options["compress"] = settings["codec"]
    if settings.get("metrics") == "worker":  # no loss mean over the slow axis between syncs
        options["worker_metrics"] = True
    if quick and options["kind"] == "diloco":
        options.update(sync_every=2, fragments=1, delay=0)
    return options


def _row_config(name, config):
    """``config`` with the row's ``@lr=`` as its peak learning rate, if it has one."""
    lr = parse_row(name)[1].get("lr")
    return config if lr is None else dataclasses.replace(config, learning_rate=lr)


def _row_tx(name, options, config):
    """The row's optimizer: Adam on the model's schedule (:func:`charlm.schedule`), or for an
    ``adam-*`` row the whole ``jaxcomp.adam`` with the row's method and settings on the same
    schedule. ``name`` is the row's (its settings are already in ``config``)."""
    import optax

    from jaxcomp.optim.muon import muon
    from jaxcomp.optim.optimizers import adam

    del name
    if options.get("inner") == "muon":
        return muon(charlm.schedule(config))
    if options["kind"] == "dgc":  # the momentum is corrected before top-k, on each device
        return optax.adam(charlm.schedule(config), b1=0.0)
    if options["kind"] != "onebit":
        return optax.adam(charlm.schedule(config))
    return adam(charlm.schedule(config), options["method"], **options["adam"])


def _build(options, loss_fn, adam, devices, inner=1):
    """The row's training object (``data_parallel`` or ``diloco``) on ``devices``: ``dp`` rows
    data-parallel over all of them, DiLoCo rows one worker per device or, with ``inner > 1``,
    per row of ``inner`` devices (a two-level mesh, the exchange split over the row unless the
    row says ``@exchange=whole``)."""
    import optax
    from jax.sharding import Mesh

    from jaxcomp.methods import Zfp
    from jaxcomp.optim.compression import compress
    from jaxcomp.training.diloco import diloco
    from jaxcomp.training.trainer import data_parallel

    options = dict(options)
    kind = options.pop("kind")
    options.pop("inner", None)  # the inner optimizer is ``adam`` (_row_tx)
    if kind == "onebit":  # ``adam`` is the whole jaxcomp.adam (_prepare)
        return data_parallel(loss_fn, adam, Mesh(devices, ("data",)))
    if kind in ("dp", "dgc"):
        settings = dict(options.get("settings", {}))
        if kind == "dgc":
            settings["warmup_method"] = Zfp(8)
        tx = compress(options["method"], **settings)
        return data_parallel(loss_fn, optax.chain(tx, adam), Mesh(devices, ("data",)))
    pseudo = codec(options.pop("compress", None) or "none")
    if inner > 1:
        mesh = Mesh(devices.reshape(-1, inner), ("workers", "data"))
        options.update(inner_axis="data")
    else:
        mesh = Mesh(devices, ("workers",))
    return diloco(
        loss_fn, adam, _outer(options.pop("outer")), mesh=mesh, compress=pseudo, **options
    )


def _prepare(name, config, corpus, first, *, quick, devices, inner, seed):
    """The row's run, its compiled step (one step run and dropped), the initial params and
    held-out batch, its jitted loss, and this process's rows of each batch."""
    import jax
    import numpy as np

    loss_fn, params, heldout = charlm.task(config, corpus, seed)
    options, config = _row_options(name, quick), _row_config(name, config)
    # Each process's devices together (a DiLoCo worker's row is one host's devices).
    ordered = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    devices = np.array(ordered[: devices or None])
    run = _build(options, loss_fn, _row_tx(name, options, config), devices, inner)
    rows = config.batch // jax.process_count()
    mine = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
    state = run.init(params)
    # Compile before the clock starts: one step on the first batch, result dropped (no donation).
    jax.block_until_ready(run.step(state, run.shard_batch({"tokens": corpus[0][first[mine]]})))
    return run, state, options, (jax.jit(loss_fn), params, heldout), mine


def train(
    name,
    config,
    corpus,
    *,
    steps,
    eval_every,
    target=None,
    quick=False,
    devices=None,
    inner=1,
    seed=0,
    log=None,
    wire=None,
):
    """Trains one row for ``steps`` steps, or until an evaluation reaches ``target``.

    The clock runs over the steps only: the first compilation (one step run and dropped) and the
    evaluations are left out. In a multi-process job every process calls it (each with its rows of
    every batch); process 0 evaluates and every process waits for its result.

    Args:
      name: the row (:func:`parse_row`).
      config: the model and schedule (:class:`charlm.Config`).
      corpus: :func:`charlm.load_corpus`'s ``(train, heldout, files)``.
      steps: the most steps to run.
      eval_every: steps between held-out evaluations (and after the last step).
      target: stop at the first evaluation at or below this held-out loss (None: never).
      quick: the smoke test's few steps: DiLoCo rows exchange every 2 steps.
      devices: use this many devices (default all).
      inner: DiLoCo rows: devices per worker (a two-level mesh).
      seed: the params' and the batches' seed.
      log: called with a line per evaluation.
      wire: a callable returning the bytes this host's network interface has sent (the emulated
        cluster), or None.

    Returns:
      ``{"name", "curve", "steps", "options"}``; ``curve`` holds one point per evaluation:
      ``{"step", "seconds", "cpu", "loss", "bytes", "wire"}`` (training time, CPU time, held-out
      loss, jaxcomp's bytes sent per device so far, and what ``wire()`` grew by, or None).

    Example:
      >>> result = train("dp", charlm.QUICK, charlm.load_corpus(), steps=2, eval_every=1,
      ...                devices=2)
      >>> [p["step"] for p in result["curve"]], result["curve"][-1]["seconds"] > 0
      ([0, 1, 2], True)

    References:
      Mattson et al., "MLPerf Training Benchmark" (MLSys 2020): time to a target quality, the
      measure of training speed; Agarwal et al., "On the Utility of Gradient Compression in
      Distributed Training Systems" (MLSys 2022): compression judged end to end.
    """
    windows = charlm.batches(corpus[0], config, steps, seed)
    run, state, options, (evaluate, params, heldout), mine = _prepare(
        name, config, corpus, windows[0], quick=quick, devices=devices, inner=inner, seed=seed
    )
    curve = timed_curve(
        run,
        state,
        lambda step: {"tokens": corpus[0][windows[step][mine]]},
        steps=steps,
        eval_every=eval_every,
        evaluate=evaluate,
        params=params,
        heldout=heldout,
        target=target,
        log=log and (lambda line: log(f"{name}: {line}")),
        wire=wire,
    )
    return dict(name=name, curve=curve, steps=curve[-1]["step"], options=options)


def run_rows(
    names,
    config,
    *,
    steps,
    max_steps,
    eval_every,
    quick=False,
    devices=None,
    inner=1,
    log=None,
    wire=None,
):
    """Trains ``dp`` (the target: its held-out loss after ``steps`` steps), then every other row
    until it reaches the target, or for ``max_steps``.

    Args:
      names: the rows (:func:`parse_row`), ``dp`` first.
      config: the model and schedule (:class:`charlm.Config`).
      steps: dp's steps.
      max_steps: the other rows' cap (past ``config.steps`` the learning rate stays at the
        schedule's end value).
      eval_every, quick, devices, inner, log, wire: as :func:`train` takes them.

    Returns:
      :func:`train`'s result for each row, in order.

    Example:
      >>> results = run_rows(["dp", "dp@lr=8e-3"], charlm.QUICK, steps=2, max_steps=4,
      ...                    eval_every=1, devices=2)
      >>> [r["name"] for r in results], results[0]["steps"]
      (['dp', 'dp@lr=8e-3'], 2)

    References:
      Douillard et al., "DiLoCo" (arXiv 2311.08105), Sec. 4: DiLoCo against synchronous
      data parallelism at equal samples.
    """
    corpus = charlm.load_corpus()
    results, target = [], None
    for name in names:
        limit = steps if name == "dp" or target is None else max_steps
        result = train(
            name,
            config,
            corpus,
            steps=limit,
            eval_every=eval_every,
            target=target,
            quick=quick,
            devices=devices,
            inner=inner,
            log=log,
            wire=wire,
        )
        if name == "dp":
            target = result["curve"][-1]["loss"]
        results.append(result)
    return results
