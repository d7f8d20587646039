"""Time to quality: data-parallel training against per-step compression and DiLoCo (dense and
compressed pseudo-gradients) on the character-level language model of ``benchmarks/quality.py``,
in one process or on an emulated cluster.

    python benchmarks/time_to_quality.py                    # one process, 8 devices, ~15 min
    python benchmarks/time_to_quality.py --steps 100 --rows dp,diloco-h10
    python benchmarks/time_to_quality.py --quick            # a tiny model, a few steps (smoke test)
    sudo python benchmarks/time_to_quality.py --hosts 4 --rates 1gbit,100mbit --model wide \\
        --steps 150 --out results/ttq                       # the emulated cluster (root)
    sudo python benchmarks/time_to_quality.py --hosts 2 --inner 2 --rates 100mbit --model wide \\
        --rows dp,diloco-h10-avg-int8,diloco-h10-avg-int8@exchange=whole   # hosts of 2 devices

Every row trains the same model from the same params on the same batches (``quality.batches``):

* ``dp`` is ``jaxcomp.data_parallel`` with a dense all-reduce and Adam (the warm-up + cosine
  schedule of quality.py); ``ar_topk``, ``auto`` and ``auto-topk`` are the same with
  ``compress("ar_topk", ratio=0.01)``, ``compress("auto")`` (dense, the bfloat16 cast or ZFP 8)
  and ``compress("auto", ratio=0.01)`` (dense or top-k 1%): per-step compression;
* ``adam-sign`` and ``adam-sign_ring`` are ``jaxcomp.adam`` (the same schedule) with 25 dense
  warm-up steps and a dense variance refresh every 100, its momentum sent as scaled signs,
  all-gathered or in a ring (``Sign(aggregation="ring")``): per-step compression that keeps
  Adam's quality;
* the ``diloco-*`` rows are ``jaxcomp.diloco`` with one worker per device, the same Adam as inner
  optimizer (each worker on its share of every batch, so every row sees the same samples), the
  paper's outer Nesterov SGD (lr 0.7, momentum 0.9) or, for ``-avg``, plain averaging
  (``optax.sgd(1.0)``), for ``-n3`` Nesterov SGD with lr 1.0 and momentum 0.3 (the best of a
  screening at H = 50), and ``H`` inner steps between exchanges; ``-int8`` sends the
  pseudo-gradients as 8-bit codes (``jaxcomp.Quantized(8)``, error feedback), ``-topk`` as top-10%
  (``jaxcomp.TopK(0.1)``, error feedback), ``-stream`` syncs 2 fragments staggered, applied 1 step
  late (``-stream4``: 4 fragments). A row name may add settings: ``@outer=nesterov:1.0:0.3`` (or
  ``sgd:1.3``, ``avg``...) sets a DiLoCo row's outer optimizer, ``@codec=int4`` its
  pseudo-gradients' codec (:data:`CODECS`) and ``@lr=3e-3`` its (or dp's) Adam peak learning
  rate, so that one job screens settings beside ``dp``
  (``--rows dp,diloco-h50@outer=sgd:1.3,diloco-h50@lr=3e-3``).

``dp`` runs first and sets the target: its held-out loss after ``--steps`` steps. Every other row
trains until its held-out loss (evaluated every ``--eval-every`` steps) reaches the target, or for
``--max-steps`` steps (default 3x ``--steps``; past ``--steps`` the learning rate stays at the
schedule's end value). The clock leaves out the evaluations and the first compilation (one step
run and dropped before it starts), and on a cluster host 0 evaluates and every host waits for its
result. The table gives the wall-clock to the target (at the first evaluation at or below
it), the speed-up over ``dp``'s, the held-out loss after ``--steps`` steps (the same samples as
``dp``) and at the end, the bytes one device (host) sent to the target, and the seconds and CPU
seconds per step.

With ``--hosts N --rates R1,R2``, one job per rate runs every row on N emulated hosts (network
namespaces, ``tc tbf`` links at the rate, one ``jax.distributed`` process with one CPU device per
host, gloo; ``jaxcomp.distributed.cluster``); the hosts also count what their ``eth0`` really sent
(``wire``). Without ``--hosts`` every device is a virtual device of one process: the wall-clock is
compute, not a network. ``--plot`` draws held-out loss against wall-clock, one panel per rate.

With ``--inner N`` every DiLoCo worker is a row of N devices (on a cluster: each host gets N
devices and is one worker): a two-level mesh whose inner axis averages the inner gradients, and
whose outer exchange each device of the row shares (``exchange="split"``, or ``@exchange=whole``
in a row's name: every device sends the whole pseudo-gradient). ``dp`` stays data-parallel over
all the devices. The bytes columns are then per device (the wire column per host).
"""

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if "--worker" not in sys.argv:  # a cluster host gets its device count from the launcher
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import quality  # noqa: E402  (the model, corpus and batches)

_DEFAULTS = dict(outer="nesterov")
_SHORT = "warmup=25,refresh=100"
ROWS = {
    "dp": dict(kind="dp", method="dense"),
    "ar_topk": dict(kind="dp", method="ar_topk", settings={"ratio": 0.01}),
    "auto": dict(kind="dp", method="auto"),
    "auto-topk": dict(kind="dp", method="auto", settings={"ratio": 0.01}),
    # jaxcomp.adam (1-bit Adam's recipe) with a short warm-up: 25 dense steps, a dense variance
    # refresh every 100; the momentum as signs, all-gathered or in a ring.
    "adam-sign": dict(kind="onebit", method="sign", optimizer=f"jaxcomp.adam({_SHORT})"),
    "adam-sign_ring": dict(kind="onebit", method="sign_ring", optimizer=f"jaxcomp.adam({_SHORT})"),
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
    "diloco-h50-stream": dict(kind="diloco", sync_every=50, fragments=2, delay=1),
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

#: The pseudo-gradients' codecs of DiLoCo rows (``-int8``, ``-topk``, or ``@codec=NAME``), all
#: with error feedback: THC's 8 bits after a random Hadamard rotation; the same 8 bits without
#: the rotation (``int8flat``: no transform before and after, on a grid as wide as the raw
#: values); THC's 4 bits (Streaming DiLoCo's width); top-10%.
CODECS = ("none", "int8", "int8flat", "int4", "topk")


def codec(name):
    """The ``jaxcomp`` method of a name in :data:`CODECS` (None: dense pseudo-gradients)."""
    import jaxcomp

    if name not in CODECS:
        raise ValueError(f"codec {name!r}: choose from {', '.join(CODECS)}")
    return {
        "none": None,
        "int8": jaxcomp.Quantized(8),
        "int8flat": jaxcomp.Quantized(8, hadamard=False),
        "int4": jaxcomp.Quantized(4),
        "topk": jaxcomp.TopK(0.1),
    }[name]


#: ``--model``: quality.py's two, and "wide" (3.67M params, 16 sequences a step): a model whose
#: gradient is large against its compute, so that the network matters on the emulated cluster.
MODELS = dict(quality.MODELS, wide=quality.Config(layers=2, width=384, heads=6, batch=16))


#: The outer optimizers by name; ``sgd:LR`` and ``nesterov:LR:MOMENTUM`` name any other.
OUTERS = {
    "nesterov": "nesterov:0.7:0.9",  # the paper's
    "avg": "sgd:1.0",  # plain parameter averaging (local SGD)
    # the best of a screening at H = 50 over 1500 steps (BENCHMARKS.md, "DiLoCo in one process")
    "nesterov-1-0.3": "nesterov:1.0:0.3",
}
_OUTER_FORMS = ", ".join(OUTERS) + ", sgd:LR or nesterov:LR:MOMENTUM"


def _outer(spec):
    """The outer optimizer of a name in :data:`OUTERS` or a ``sgd:LR`` / ``nesterov:LR:MOMENTUM``
    spec; ValueError for anything else."""
    import optax

    kind, *numbers = OUTERS.get(spec, spec).split(":")
    try:
        numbers = [float(x) for x in numbers]
    except ValueError:
        numbers = []
    if kind == "sgd" and len(numbers) == 1 and numbers[0] > 0:
        return optax.sgd(numbers[0])
    if kind == "nesterov" and len(numbers) == 2 and numbers[0] > 0 and 0 <= numbers[1] < 1:
        return optax.sgd(numbers[0], momentum=numbers[1], nesterov=True)
    raise ValueError(f"outer optimizer {spec!r}: use {_OUTER_FORMS} (LR > 0, 0 <= MOMENTUM < 1)")


def _positive(text):
    """``float(text)`` if it is a number > 0, else None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value > 0 else None


def parse_row(name):
    """A row name and its settings: ``diloco-h50@outer=nesterov:1.0:0.3@lr=3e-3`` is the row
    ``diloco-h50`` with that outer optimizer (DiLoCo rows) and inner (or dp's) peak learning rate,
    so that one job can screen settings beside ``dp``; DiLoCo rows also take ``@exchange=`` and
    ``@codec=`` (a name in :data:`CODECS`, for the row's pseudo-gradients). Returns ``(row,
    {"outer": spec, "lr": float, ...})``, with only the settings given; ValueError naming the row
    for anything unknown."""
    base, *parts = name.split("@")
    if base not in ROWS:
        raise ValueError(f"unknown row {base!r} in {name!r}; choose from {list(ROWS)}")
    settings = {}
    for part in parts:
        key, _, value = part.partition("=")
        if key == "outer" and ROWS[base]["kind"] == "diloco":
            _outer(value)
            settings["outer"] = value
        elif key == "exchange" and ROWS[base]["kind"] == "diloco":
            if value not in ("split", "whole"):
                raise ValueError(f"row {name!r}: @exchange= takes split or whole, got {value!r}")
            settings["exchange"] = value
        elif key == "codec" and ROWS[base]["kind"] == "diloco":
            if value not in CODECS:
                raise ValueError(f"row {name!r}: @codec= takes {', '.join(CODECS)}, got {value!r}")
            settings["codec"] = value
        elif key == "lr":
            settings["lr"] = _positive(value)
            if settings["lr"] is None:
                raise ValueError(f"row {name!r}: @lr= takes a learning rate > 0, got {value!r}")
        else:
            raise ValueError(
                f"row {name!r}: @{part} is not a setting of it; a row takes @lr=PEAK"
                + (
                    ", @outer=SPEC, @exchange=split|whole and @codec=NAME"
                    if ROWS[base]["kind"] == "diloco"
                    else ""
                )
            )
    return base, settings


def row_options(name, quick=False):
    """The row's settings (with its ``@outer=``); ``quick`` (the smoke test's few steps)
    exchanges every 2 steps."""
    base, settings = parse_row(name)
    options = dict(_DEFAULTS, **ROWS[base])
    for key in ("outer", "exchange"):
        if key in settings:
            options[key] = settings[key]
    if "codec" in settings:
        options["compress"] = settings["codec"]
    if quick and options["kind"] == "diloco":
        options.update(sync_every=2, fragments=1, delay=0)
    return options


def row_config(name, config):
    """``config`` with the row's ``@lr=`` as its peak learning rate, if it has one."""
    lr = parse_row(name)[1].get("lr")
    return config if lr is None else dataclasses.replace(config, learning_rate=lr)


def row_tx(name, options, config):
    """The row's optimizer: quality.py's Adam (its schedule), or for an ``adam-*`` row the whole
    ``jaxcomp.adam`` with the row's method and settings on the same schedule."""
    if options["kind"] != "onebit":
        return quality.optimizer("adam", config)
    row = quality.Row(name, options["method"], {}, optimizer=options["optimizer"])
    return quality.transformation(row, config)


def build(options, loss_fn, adam, devices, inner=1):
    """The row's training object (``data_parallel`` or ``diloco``) on ``devices``: ``dp`` rows
    data-parallel over all of them, DiLoCo rows one worker per device or, with ``inner > 1``,
    per row of ``inner`` devices (a two-level mesh, the exchange split over the row unless the
    row says ``@exchange=whole``)."""
    import optax
    from jax.sharding import Mesh

    import jaxcomp

    options = dict(options)
    kind = options.pop("kind")
    if kind == "onebit":  # ``adam`` is the whole jaxcomp.adam (_prepare)
        return jaxcomp.data_parallel(loss_fn, adam, Mesh(devices, ("data",)))
    if kind == "dp":
        tx = jaxcomp.compress(options["method"], **options.get("settings", {}))
        return jaxcomp.data_parallel(loss_fn, optax.chain(tx, adam), Mesh(devices, ("data",)))
    compress = codec(options.pop("compress", None) or "none")
    if inner > 1:
        mesh = Mesh(devices.reshape(-1, inner), ("workers", "data"))
        options.update(inner_axis="data")
    else:
        mesh = Mesh(devices, ("workers",))
    return jaxcomp.diloco(
        loss_fn, adam, _outer(options.pop("outer")), mesh=mesh, compress=compress, **options
    )


class _Clock:
    """Wall-clock and CPU seconds of the training steps, with evaluations left out."""

    def __init__(self):
        self.seconds = self.cpu = 0.0

    def start(self):
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def stop(self):
        self.seconds += time.perf_counter() - self._wall
        self.cpu += time.process_time() - self._cpu


def _local(tree):
    """This process's copy of replicated arrays, on its first local device."""
    import jax
    import numpy as np

    device = jax.local_devices()[0]

    def host(x):
        return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)

    return jax.device_put(jax.tree.map(host, tree), device)


def _held_out(evaluate, params, heldout):
    """The held-out loss of ``params``, evaluated by process 0 and broadcast to every host: the
    hosts agree on it, and leave together (the clock restarts on every host at once)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    mine = jax.process_index() == 0
    loss = float(evaluate(_local(params), heldout)) if mine else 0.0
    if jax.process_count() == 1:
        return loss
    return float(multihost_utils.broadcast_one_to_all(np.float32(loss)))


def _wire():
    """Bytes this host's ``eth0`` has sent (the emulated cluster), or None (one process)."""
    if not os.path.exists("/sys/class/net/eth0") or "--worker" not in sys.argv:
        return None
    from jaxcomp.distributed.cluster import read_interface_counters

    return read_interface_counters()[0]


def _task(config, corpus, seed):
    """The loss function, the initial params and the held-out batch of the model."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    train_tokens, heldout_tokens, _ = corpus
    graphdef, params = nnx.split(quality.make_model(config, seed), nnx.Param)
    params = jax.tree.map(np.asarray, params)  # host arrays: init places them on the mesh

    def loss_fn(params, batch):
        tokens = batch["tokens"].astype(jnp.int32)
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    eval_config = dataclasses.replace(config, batch=config.eval_sequences)
    heldout = {
        "tokens": heldout_tokens[quality.batches(heldout_tokens, eval_config, 1, seed + 1)[0]]
    }
    return loss_fn, params, heldout


def _prepare(name, config, corpus, first, *, quick, devices, inner, seed):
    """The row's run, its compiled step (one step run and dropped), the initial params and
    held-out batch, its jitted loss, and this process's rows of each batch."""
    import jax
    import numpy as np

    loss_fn, params, heldout = _task(config, corpus, seed)
    options, config = row_options(name, quick), row_config(name, config)
    # Each process's devices together (a DiLoCo worker's row is one host's devices).
    ordered = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    devices = np.array(ordered[: devices or None])
    run = build(options, loss_fn, row_tx(name, options, config), devices, inner)
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
):
    """Trains one row for ``steps`` steps, or until an evaluation reaches ``target``.

    Returns ``{"name", "curve", "steps", "options"}``; ``curve`` holds one point per evaluation:
    ``{"step", "seconds", "cpu", "loss", "bytes", "wire"}`` (training time and bytes so far).
    """
    import jax
    import numpy as np

    windows = quality.batches(corpus[0], config, steps, seed)
    run, state, options, (evaluate, params, heldout), mine = _prepare(
        name, config, corpus, windows[0], quick=quick, devices=devices, inner=inner, seed=seed
    )
    clock, sent, total, wire0 = _Clock(), [], 0.0, _wire()
    curve = [dict(step=0, seconds=0.0, cpu=0.0, loss=_held_out(evaluate, params, heldout))]
    curve[0].update(bytes=0.0, wire=0 if wire0 is not None else None)
    for step in range(steps):
        clock.start()
        batch = {"tokens": corpus[0][windows[step][mine]]}
        state, metrics = run.step(state, run.shard_batch(batch))
        sent.append(metrics["bytes_sent"])
        if (step + 1) % eval_every and step + 1 < steps:
            clock.stop()
            continue
        jax.block_until_ready(state)
        clock.stop()
        loss = _held_out(evaluate, run.params(state), heldout)
        total += sum(float(np.asarray(b.addressable_data(0))) for b in sent)
        sent.clear()  # read once each: the host reads them at evaluations only
        wire = None if wire0 is None else _wire() - wire0
        curve.append(dict(step=step + 1, seconds=clock.seconds, cpu=clock.cpu, loss=loss))
        curve[-1].update(bytes=total, wire=wire)
        if log:
            log(f"{name}: step {step + 1}, held-out {loss:.4f}, {clock.seconds:.1f} s")
        if target is not None and loss <= target:
            break
    return dict(name=name, curve=curve, steps=curve[-1]["step"], options=options)


def summarize(result, target, steps):
    """The row's table figures: time to ``target`` (None if never reached), the loss after
    ``steps`` steps (the last evaluation at or before it) and at the end, and per-step times."""
    curve = result["curve"]
    reached = next((p for p in curve[1:] if p["loss"] <= target), None)
    at_steps = [p for p in curve if p["step"] <= steps][-1]
    last = curve[-1]
    return dict(
        name=result["name"],
        to_target=None if reached is None else reached["seconds"],
        bytes_to_target=None if reached is None else reached["bytes"],
        wire_to_target=None if reached is None else reached["wire"],
        loss_at_steps=at_steps["loss"],
        final_loss=last["loss"],
        steps=last["step"],
        step_seconds=last["seconds"] / last["step"],
        step_cpu=last["cpu"] / last["step"],
    )


def run_rows(
    names, config, *, steps, max_steps, eval_every, quick=False, devices=None, inner=1, log=None
):
    """Trains ``dp`` (the target) then every other row; returns the results in order."""
    corpus = quality.load_corpus()
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
        )
        if name == "dp":
            target = result["curve"][-1]["loss"]
        results.append(result)
    return results


def _megabytes(value):
    return "-" if value is None else f"{value / 1e6:.2f}"


def format_table(results, steps, per="host") -> str:
    """A Markdown table: one line per row, against ``dp`` (the first row); ``per`` names what
    the bytes column counts (a host, or a device when hosts have several)."""
    base = results[0]
    target = base["curve"][-1]["loss"]
    rows = [summarize(r, target, steps) for r in results]
    lines = [
        f"| row | time to dp's loss ({target:.4f}) | speed-up | loss after {steps} steps | "
        f"steps run | final loss | MB sent per {per} to target | wire MB per host | s / step | "
        "CPU s / step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in rows:
        reached = s["to_target"] is not None
        time_text = f"{s['to_target']:.1f} s" if reached else "not reached"
        speed = f"{rows[0]['to_target'] / s['to_target']:.2f}x" if reached else "-"
        lines.append(
            f"| {s['name']} | {time_text} | {speed} | {s['loss_at_steps']:.4f} | {s['steps']} | "
            f"{s['final_loss']:.4f} | {_megabytes(s['bytes_to_target'])} | "
            f"{_megabytes(s['wire_to_target'])} | {s['step_seconds']:.3f} | {s['step_cpu']:.3f} |"
        )
    return "\n".join(lines)


def plot(panels, path, title):
    """Held-out loss against training wall-clock: one panel per ``(label, results)``, one line
    per row (distinct colours and styles, legend outside), ``dp``'s final loss dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels) + 3, 4.8), squeeze=False)
    styles = ("-", "--", "-.", ":")
    for ax, (label, results) in zip(axes[0], panels):
        target = results[0]["curve"][-1]["loss"]
        for i, r in enumerate(results):
            seconds = [p["seconds"] for p in r["curve"][1:]]
            losses = [p["loss"] for p in r["curve"][1:]]
            style = dict(color="black", linewidth=2.5) if r["name"] == "dp" else {}
            style.setdefault("color", plt.cm.tab10(i % 10))
            ax.plot(seconds, losses, styles[i % 4], marker=".", label=r["name"], **style)
        ax.axhline(target, color="grey", linestyle=":", linewidth=1, label="dp's final loss")
        # dp's first evaluation sets the top: DiLoCo's global params sit at the initial loss
        # until the first sync, and would squash the curves that matter.
        first = results[0]["curve"][1]["loss"] if len(results[0]["curve"]) > 1 else None
        if first is not None:
            ax.set_ylim(top=target + 1.5 * (first - target) + 1e-3)
        ax.set_xscale("log")
        ax.set_xlabel("training wall-clock (s, log scale)")
        ax.set_ylabel("held-out loss (nats / character)")
        ax.set_title(label)
        ax.grid(alpha=0.3, which="both")
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _worker(args):
    """One emulated host's part of a cluster job: every row; host 0 writes the results."""
    from jaxcomp.distributed import launch

    process = launch.initialize()  # before any JAX op

    def log(line):
        if process == 0:
            print(line, file=sys.stderr, flush=True)

    results = run_rows(
        _names(args), _config(args), inner=args.inner or 1, log=log, **_lengths(args)
    )
    if process == 0:
        with open(os.path.join(args.worker, "results.json"), "w") as f:
            json.dump(results, f)


def _cluster(args, argv):
    """One job per rate on ``--hosts`` emulated hosts: ``[(rate, results), ...]``."""
    from jaxcomp.distributed.cluster import Cluster, ClusterError, sigterm_as_interrupt

    panels = []
    drop = ("--hosts", "--rates", "--rows", "--plot", "--out", "--timeout")
    forward = _drop_values(argv, drop)  # the hosts get the rest, and the rows by name
    for rate in args.rates.split(","):
        with tempfile.TemporaryDirectory() as tmp, sigterm_as_interrupt():
            with Cluster(args.hosts, rate=rate) as cluster:
                print(f"{args.hosts} hosts at {rate}", file=sys.stderr, flush=True)
                command = [os.path.abspath(__file__), *forward, "--rows", ",".join(_names(args))]
                codes = cluster.run(
                    [*command, "--worker", tmp],
                    devices_per_host=args.inner or 1,
                    timeout=args.timeout,
                )
            if any(codes):
                raise ClusterError(f"the {rate} job failed: host exit codes {codes}")
            with open(os.path.join(tmp, "results.json")) as f:
                panels.append((rate, json.load(f)))
    return panels


def _drop_values(argv, flags):
    """``argv`` without the ``flags`` and their values (``--flag v`` or ``--flag=v``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not any(a.startswith(f + "=") for f in flags):
            out.append(a)
    return out


def _names(args):
    default = CLUSTER_ROWS if args.hosts else ONE_PROCESS_ROWS
    names = [n.strip() for n in (args.rows or ",".join(default)).split(",") if n.strip()]
    return ["dp"] + [n for n in names if n != "dp"]


def _config(args):
    config = quality.QUICK if args.quick else MODELS[args.model]
    return dataclasses.replace(config, steps=_lengths(args)["steps"])


def _lengths(args):
    steps = args.steps or (6 if args.quick else 300)
    return dict(
        quick=args.quick,
        steps=steps,
        max_steps=args.max_steps or 3 * steps,
        eval_every=args.eval_every or max(1, steps // 10),
    )


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows",
        help="comma-separated, of: "
        + ", ".join(ROWS)
        + "; each may add @lr=PEAK (Adam's peak learning rate) and, for diloco rows, "
        + f"@outer=SPEC ({_OUTER_FORMS})",
    )
    parser.add_argument("--model", default="small", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, help="dp's steps, the target (default 300)")
    parser.add_argument("--max-steps", type=int, help="the other rows' cap (default 3x --steps)")
    parser.add_argument("--eval-every", type=int, help="steps between evaluations (steps / 10)")
    parser.add_argument("--quick", action="store_true", help="a tiny model for a few steps")
    parser.add_argument("--devices", type=int, help="one process: use this many (default 8)")
    parser.add_argument("--hosts", type=int, help="run on this many emulated hosts (root)")
    parser.add_argument(
        "--inner",
        type=int,
        help="DiLoCo rows: a worker is a row of this many devices (a two-level mesh, inner_axis; "
        "the exchange split over the row unless a row says @exchange=whole); on a cluster each "
        "host gets this many devices, one worker per host (default 1)",
    )
    parser.add_argument("--rates", default="1gbit,100mbit", help="link rates, one job each")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per cluster job")
    parser.add_argument("--out", help="write time_to_quality.json (and .png) here")
    parser.add_argument("--plot", help="write the plot here (default: in --out)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def _check(parser, args):
    """Flag errors, before anything runs."""
    for name in _names(args):
        try:
            parse_row(name)
        except ValueError as error:
            parser.error(f"--rows: {error}")
    for flag in ("steps", "max_steps", "eval_every", "hosts", "devices", "inner"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    lengths = _lengths(args)
    if lengths["max_steps"] < lengths["steps"]:
        parser.error(f"--max-steps ({lengths['max_steps']}) must be >= --steps")
    warmup = _config(args).warmup
    if lengths["steps"] <= warmup:
        parser.error(f"--steps must be more than the learning rate's {warmup} warm-up steps")
    if args.hosts:
        from jaxcomp.distributed.cluster import parse_rate

        for rate in args.rates.split(","):
            try:
                parse_rate(rate)
            except ValueError as error:
                parser.error(f"--rates: {error}")
    if args.hosts and args.devices:
        parser.error("--devices is for one process; on a cluster use --inner (devices per host)")
    if args.devices and args.devices > quality.N_DEVICES:
        parser.error(f"--devices must be <= {quality.N_DEVICES}, got {args.devices}")
    if args.devices and _config(args).batch % args.devices:
        parser.error(
            f"--devices {args.devices} must divide the model's batch {_config(args).batch}"
        )
    inner = args.inner or 1
    if args.hosts and _config(args).batch % (args.hosts * inner):
        parser.error(
            f"--hosts {args.hosts} x --inner {inner} devices must divide the model's batch "
            f"{_config(args).batch}"
        )
    if not args.hosts and (args.devices or quality.N_DEVICES) % inner:
        parser.error(f"--inner {inner} must divide the {args.devices or quality.N_DEVICES} devices")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    if args.worker:
        return _worker(args)
    config, lengths = _config(args), _lengths(args)
    steps = lengths["steps"]
    if args.hosts:
        panels = _cluster(args, argv)
    else:
        log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        rows = run_rows(
            _names(args), config, devices=args.devices, inner=args.inner or 1, log=log, **lengths
        )
        panels = [("one process", rows)]
    params = quality.count_params(config)
    title = (
        f"char-LM, {params / 1e6:.2f}M params, {config.batch} sequences of {config.context} "
        f"characters a step, {args.hosts or args.devices or quality.N_DEVICES} "
        + ("emulated hosts" if args.hosts else "devices in one process")
        + (f", DiLoCo workers of {args.inner} devices" if (args.inner or 1) > 1 else "")
    )
    for label, results in panels:
        per = "device" if (args.inner or 1) > 1 else "host"
        print(f"\n{label}: {title}\n\n{format_table(results, steps, per)}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "time_to_quality.json"), "w") as f:
            import jax

            record = dict(command=["python", "benchmarks/time_to_quality.py", *argv])
            record.update(
                machine=f"{platform.node()}: {os.cpu_count()} cores, jax {jax.__version__}"
            )
            json.dump(
                dict(record, config=dataclasses.asdict(config), title=title, panels=panels), f
            )
    plot_path = args.plot or (args.out and os.path.join(args.out, "time_to_quality.png"))
    if plot_path:
        plot(panels, plot_path, title)


if __name__ == "__main__":
    main()
