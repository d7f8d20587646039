"""The peer, side by side: PyTorch DDP and its compression hooks beside jaxcomp on the same emulated
cluster.

    # the issue's set-up (long)
    sudo .venv/bin/python benchmarks/peers.py --json peers.json
    sudo .venv/bin/python benchmarks/peers.py --models mlp4096,resnet50,many_small --rates 1gbit
    # a smoke run, under a minute
    sudo .venv/bin/python benchmarks/peers.py --hosts 2 --rates 1gbit --models mlp2041 \\
        --params 2e5 --steps 2 --warmup 1

For every model, host count and link rate it builds a :class:`jaxcomp.distributed.cluster.Cluster`
(network namespaces behind ``tbf``-shaped veth links, one process per host, gloo over ``eth0``)
twice, with the same rate: once for ``jaxcomp netbench``'s rows
(:func:`jaxcomp.distributed.netbench.run_benchmark`: the plain ``lax.pmean`` baseline and jaxcomp's
methods) and once for PyTorch's: ``DistributedDataParallel`` with gloo's all-reduce (``ddp``),
``fp16_compress_hook``, ``bf16_compress_hook`` and ``powerSGD_hook`` (rank ``--powersgd-rank``). The
models are ``jaxcomp.training.zoo``'s, by name; ``benchmarks/torch_zoo.py`` builds the same layers
in PyTorch (the same parameter and tensor counts), with the same loss and batches of the same shapes
and rows per host. Both report the median step of the slowest host; the wire bytes come from each
host's ``eth0`` counters.

PyTorch lives in its own virtual environment (``--torch-venv``, default ``.venv-torch`` beside
``.venv``), created by this script on first use with ``pip install torch==2.13.0 numpy`` (on this
project's machines pip finds a CPU build of it on disk, ~190 MB; elsewhere pip downloads PyPI's CUDA
build, several GB, which runs on the CPU all the same: pass ``--torch-requirement`` to choose). It
is never a dependency of jaxcomp or of its CI. The torch half of this file (``--torch-worker``) runs
inside each emulated host under that environment's Python, and imports nothing from jaxcomp.

Differences that remain, said in the output too: the jaxcomp rows come from netbench as it is, which
trains with Adam(1e-4) by default (``--jax-optimizer sgd``: SGD(1e-4), the optimizer work of the
torch rows' default; the torch rows use ``--torch-optimizer``, SGD by default, as the issue asks)
and averages its wire bytes over the warm-up and the timed steps (the torch rows: timed steps only);
netbench does not record CPU time. PowerSGD over gloo runs with every gradient in one DDP bucket
(``bucket_cap_mb`` above the model's size; the worker checks that each step saw one bucket). DDP
runs with ``broadcast_buffers=False``: ResNet-50's BatchNorm statistics are not trained, and
netbench drops them. Initial values differ (each framework's initializers); speed is measured.

Needs root (network namespaces) and 2+ GB of memory per host for the 25M-parameter models (GPT-2:
about 3 GB per torch host; its CPU step is seconds long, so give it fewer hosts or steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import pairwise

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TORCH_VENV = os.path.join(REPO, ".venv-torch")
#: What pip installs into the torch environment when it is missing (a CPU build on this project's
#: machines).
DEFAULT_TORCH_REQUIREMENT = "torch==2.13.0 numpy"  # PowerSGDState imports numpy

#: The models, by their ``jaxcomp.training.zoo`` names (``jaxcomp netbench --model``); the torch
#: worker builds the same layers, in the same order, with the same loss and random batches of the
#: same shapes.
MODELS = {
    "mlp4096": "MLP 1024-4096-4096-1024-10, tanh between, softmax cross-entropy over 10 classes",
    "mlp2041": (
        "six square 2041-wide Dense layers, tanh between, mean squared error (--params resizes it)"
    ),
    "gpt2": "GPT-2 small (tied head), 64-token sequences, next-token cross-entropy",
    "resnet50": (
        "ResNet-50 v1.5 (torchvision's layout), BatchNorm in train mode, 64x64 images, 1000 classes"
    ),
    "many_small": (
        "256 residual blocks of LayerNorm + Dense 64x64, softmax cross-entropy over 10 classes"
    ),
}
MLP4096_WIDTHS = (1024, 4096, 4096, 1024, 10)
SQUARE_LAYERS = 6  # mlp2041: netbench's own MLP (--params 25e6 --layers 6)
MLP2041_PARAMS = SQUARE_LAYERS * 2041 * 2041  # netbench.width_for(this, 6) == 2041
GPT2_SEQ_LEN, RESNET_IMAGE = 64, 64  # jaxcomp.training.zoo's defaults

#: Torch rows: name -> (row label, DDP comm hook in torch.distributed.algorithms.ddp_comm_hooks or
#: None).
TORCH_METHODS = {
    "plain": ("ddp", None),
    "fp16": ("ddp+fp16_compress_hook", "default_hooks.fp16_compress_hook"),
    "bf16": ("ddp+bf16_compress_hook", "default_hooks.bf16_compress_hook"),
    "powersgd": ("ddp+powerSGD_hook", "powerSGD_hook.powerSGD_hook"),
}
DEFAULT_JAX_METHODS = ("pmean", "dense", "bf16", "powersgd", "ar_topk")
DEFAULT_RATES = ("1gbit", "100mbit")
FRAMEWORKS = ("jaxcomp", "torch")


@dataclasses.dataclass(frozen=True)
class Config:
    """One run of the benchmark: every (model, hosts, rate) cell, both frameworks."""

    models: tuple[str, ...] = ("mlp4096",)
    hosts: tuple[int, ...] = (4,)
    rates: tuple[str, ...] = DEFAULT_RATES
    frameworks: tuple[str, ...] = FRAMEWORKS
    jax_methods: tuple[str, ...] = DEFAULT_JAX_METHODS
    torch_methods: tuple[str, ...] = tuple(TORCH_METHODS)
    params: float | None = None  # overrides mlp2041's size (square layers, netbench's --params)
    batch: int = 2  # rows per host
    steps: int = 5
    warmup: int = 2
    powersgd_rank: int = 4
    powersgd_start: int = 2
    torch_optimizer: str = "sgd"
    jax_optimizer: str = "adam"  # netbench's --optimizer
    lr: float = 1e-3
    timeout: float = 1800
    torch_venv: str = DEFAULT_TORCH_VENV
    torch_requirement: str = DEFAULT_TORCH_REQUIREMENT
    install: bool = True
    json: str | None = None
    log: str | None = None
    allocator: str = "glibc"  # both frameworks' hosts: jaxcomp.ops.allocator.environment's name


# ----------------------------------------------------------------------------------------------
# Pure helpers: model shapes, DDP options, the table (no torch, no jaxcomp needed).


def torch_widths(model: str, params: float | None = None) -> tuple[int, ...] | None:
    """The layer sizes of ``model``'s MLP (input first), or None for the models that are not MLPs.

    Args:
      model: a name from :data:`MODELS`.
      params: mlp2041's parameter count instead of its own (square layers, as netbench's
        ``--params``).

    Returns:
      ``(in, hidden..., out)`` of consecutive ``nn.Linear`` layers, or None.

    Example:
      >>> torch_widths("mlp4096")
      (1024, 4096, 4096, 1024, 10)
      >>> torch_widths("mlp2041", 1e5)
      (129, 129, 129, 129, 129, 129, 129)
    """
    if model == "mlp2041":
        from jaxcomp.distributed.netbench import (
            width_for,  # netbench's own MLP: the same width (imports no JAX)
        )

        width = width_for(MLP2041_PARAMS if params is None else params, SQUARE_LAYERS)
        return (width,) * (SQUARE_LAYERS + 1)
    return MLP4096_WIDTHS if model == "mlp4096" else None


def mlp_params(widths) -> int:
    """Parameters (weights and biases) of consecutive dense layers of these sizes.

    Example:
      >>> mlp_params((1024, 4096, 4096, 1024, 10))
      25185290
    """
    return sum(a * b + b for a, b in pairwise(widths))


def one_bucket_cap_mb(n_params: int, bytes_per_param: int = 4) -> int:
    """A DDP ``bucket_cap_mb`` that holds every gradient of ``n_params`` parameters in one bucket.

    PowerSGD's hook over gloo needs that: with several buckets, the all-reduces it chains inside
    each bucket's future callbacks (P, then Q) of different buckets reach gloo in different orders
    on different ranks, and gloo aborts the process at the first mismatch (seen with torch 2.13 on
    2 ranks: ``gloo::EnforceNotMet ... Received data size doesn't match expected size``, with DDP's
    default buckets as with ``bucket_cap_mb=0.5``; one bucket ran clean).

    Args:
      n_params: the model's parameters.
      bytes_per_param: bytes of one gradient element (float32: 4).

    Returns:
      MiB, at least 1024 (the issue's setting) and above the gradients' size.

    Example:
      >>> one_bucket_cap_mb(25_185_290), one_bucket_cap_mb(400_000_000)
      (1024, 1527)
    """
    return max(1024, math.ceil(n_params * bytes_per_param / 2**20) + 1)


def ddp_options(method: str, n_params: int, *, rank: int = 4, start_iter: int = 2) -> dict:
    """How the torch worker builds DDP for ``method``: bucket size, comm hook and the hook's state.

    Args:
      method: a key of :data:`TORCH_METHODS`.
      n_params: the model's parameters (PowerSGD: all in one bucket).
      rank: PowerSGD's ``matrix_approximation_rank``.
      start_iter: PowerSGD's ``start_powerSGD_iter`` (plain all-reduce before it; >= 2 with error
        feedback and warm start, torch's own rule).

    Returns:
      ``{"label", "hook", "bucket_cap_mb", "powersgd"}``: ``hook`` is a path under
      ``torch.distributed.algorithms.ddp_comm_hooks`` or None; ``bucket_cap_mb`` None keeps DDP's
      default buckets; ``powersgd`` holds ``PowerSGDState``'s keyword arguments or None.

    Example:
      >>> ddp_options("powersgd", 25_185_290)["bucket_cap_mb"]
      1024
    """
    if method not in TORCH_METHODS:
        raise ValueError(f"torch method must be one of {tuple(TORCH_METHODS)}, got {method!r}")
    label, hook = TORCH_METHODS[method]
    if method != "powersgd":
        return {"label": label, "hook": hook, "bucket_cap_mb": None, "powersgd": None}
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"PowerSGD rank must be a positive integer, got {rank!r}")
    if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 2:
        raise ValueError(
            f"start_powerSGD_iter must be an integer >= 2 (torch needs two plain steps before "
            f"error feedback and warm start), got {start_iter!r}"
        )
    state = {
        "matrix_approximation_rank": rank,
        "start_powerSGD_iter": start_iter,
        "use_error_feedback": True,
        "warm_start": True,
        "random_seed": 0,
    }
    return {
        "label": f"{label}(rank={rank})",
        "hook": hook,
        "bucket_cap_mb": one_bucket_cap_mb(n_params),
        "powersgd": state,
    }


def torch_warmup(method: str, warmup: int, start_iter: int) -> int:
    """Untimed steps before ``method``'s timed ones: PowerSGD's plain steps and its first compressed
    one too.

    Example:
      >>> torch_warmup("plain", 2, 2), torch_warmup("powersgd", 2, 2)
      (2, 3)
    """
    return max(warmup, start_iter + 1) if method == "powersgd" else warmup


def _s(value):
    return "-" if value is None else f"{value:.3f}"


def _mb(value):
    if value is None:
        return "-"
    return (
        f"{value / 1e6:.1f}" if value >= 1e6 else f"{value / 1e6:.3f}"
    )  # small models' rows stay readable


def _x(value):
    return "-" if value is None else f"{value:.2f}x"


def add_cross_speedups(rows) -> list[dict]:
    """Sets each row's ``vs_torch_ddp``: torch's plain DDP step over this row's, in the same cell.

    Args:
      rows: rows with ``model``, ``hosts``, ``rate``, ``framework``, ``method`` and ``step``.

    Returns:
      The same rows (changed in place): ``vs_torch_ddp`` is None where the cell has no torch ``ddp``
      row.
    """
    plain = {
        (r["model"], r["hosts"], r["rate"]): r["step"]
        for r in rows
        if r["framework"] == "torch" and r["method"] == TORCH_METHODS["plain"][0]
    }
    for r in rows:
        base = plain.get((r["model"], r["hosts"], r["rate"]))
        r["vs_torch_ddp"] = base / r["step"] if base and r["step"] else None
    return rows


def table(rows) -> str:
    """The markdown table of both frameworks' rows.

    Args:
      rows: dicts with ``model``, ``params``, ``hosts``, ``rate``, ``framework``, ``method``,
        ``step``, ``compute``, ``cpu`` (CPU s per step, None where unknown), ``wire_tx`` (bytes per
        step and host), ``speedup`` (against the framework's own plain baseline) and
        ``vs_torch_ddp``.

    Returns:
      A markdown table, one line per row.

    Example:
      >>> table([]).splitlines()[0].split(" | ")[:3]
      ['| model', 'params', 'hosts']
    """
    lines = [
        (
            "| model | params | hosts | rate | framework | method | step s | compute s | CPU "
            "s/step | wire MB/step/host | speed vs own plain | speed vs torch DDP |"
        ),
        "|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['hosts']} | {r['rate']} | "
            f"{r['framework']} | {r['method']} | {_s(r['step'])} | {_s(r.get('compute'))} | "
            f"{_s(r.get('cpu'))} | {_mb(r.get('wire_tx'))} | {_x(r.get('speedup'))} | "
            f"{_x(r.get('vs_torch_ddp'))} |"
        )
    return "\n".join(lines)


def machine() -> dict:
    """The machine the numbers come from: cores, CPU model, Python, OS."""
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                model,
            )
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "nproc": cores,
        "cpu": model,
        "python": platform.python_version(),
        "os": platform.platform(),
    }


#: How the header names the jaxcomp rows' optimizer (netbench's, learning rate 1e-4).
_JAX_OPTIMIZERS = {"adam": "Adam(1e-4)", "sgd": "SGD(1e-4)"}


def header(config: Config, info: dict, argv) -> str:
    """The lines printed above the table: the command, the machine, the set-up and what still
    differs."""
    torch_opt = f"{config.torch_optimizer.upper()}(lr={config.lr:g})"
    return "\n".join(
        [
            f"command: {' '.join(shlex.quote(a) for a in argv)}",
            (
                f"machine: {info['nproc']} cores, {info['cpu']}; torch {info.get('torch', '-')}, "
                f"jax {info.get('jax', '-')}"
            ),
            (
                f"set-up: one process per host, gloo on eth0, {config.batch} rows per host, "
                f"{config.steps} timed steps after {config.warmup} warm-up (PowerSGD: after its "
                f"start_powerSGD_iter={config.powersgd_start} plain steps too); step = median of "
                "the slowest host; wire = bytes sent by a host's eth0 per step; both frameworks' "
                f"hosts' malloc: {config.allocator}"
            ),
            (
                f"optimizers: jaxcomp rows {_JAX_OPTIMIZERS[config.jax_optimizer]} (netbench), "
                f"torch rows {torch_opt}; torch: 1 "
                "thread per host, CPU s/step = process CPU time per timed step (host mean); "
                "netbench's wire bytes average warm-up and timed steps"
            ),
        ]
    )


# ----------------------------------------------------------------------------------------------
# Arguments.


def _csv(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def build_parser() -> argparse.ArgumentParser:
    """The command line (:func:`parse_args` checks the values)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp4096", help=f"from {','.join(MODELS)} (default mlp4096)")
    p.add_argument("--hosts", default="4", help="emulated host counts, comma-separated (default 4)")
    p.add_argument(
        "--rates", default=",".join(DEFAULT_RATES), help="link rates (default 1gbit,100mbit)"
    )
    p.add_argument(
        "--frameworks", default=",".join(FRAMEWORKS), help="jaxcomp,torch (default both)"
    )
    p.add_argument(
        "--jax-methods",
        default=",".join(DEFAULT_JAX_METHODS),
        help=f"netbench methods; pmean always runs (default {','.join(DEFAULT_JAX_METHODS)})",
    )
    p.add_argument(
        "--torch-methods",
        default=",".join(TORCH_METHODS),
        help=f"from {','.join(TORCH_METHODS)}; plain always runs (default all)",
    )
    p.add_argument(
        "--params",
        type=float,
        default=None,
        help="mlp2041's parameters instead of 25M (square layers)",
    )
    p.add_argument(
        "--batch", type=int, default=2, help="rows per host (default 2: global 8 on 4 hosts)"
    )
    p.add_argument(
        "--steps", type=int, default=5, help="timed steps per method, the median counts (default 5)"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--powersgd-rank", type=int, default=4, help="torch PowerSGD's rank (default 4)")
    p.add_argument(
        "--powersgd-start", type=int, default=2, help="torch's start_powerSGD_iter (default 2)"
    )
    p.add_argument(
        "--torch-optimizer", default="sgd", choices=("sgd", "adam"), help="torch rows' optimizer"
    )
    p.add_argument(
        "--jax-optimizer",
        default="adam",
        choices=("adam", "sgd"),
        help="jaxcomp rows' optimizer, lr 1e-4 (netbench's --optimizer; default adam; sgd does "
        "the torch rows' default optimizer work)",
    )
    p.add_argument(
        "--lr", type=float, default=1e-3, help="torch rows' learning rate (default 1e-3)"
    )
    p.add_argument(
        "--timeout", type=float, default=1800, help="seconds per cluster job (default 1800)"
    )
    p.add_argument(
        "--torch-venv",
        default=DEFAULT_TORCH_VENV,
        help="PyTorch's own environment (made if missing)",
    )
    p.add_argument(
        "--torch-requirement",
        default=DEFAULT_TORCH_REQUIREMENT,
        help=f"what pip installs there (default {DEFAULT_TORCH_REQUIREMENT})",
    )
    p.add_argument(
        "--no-install", action="store_true", help="fail instead of creating --torch-venv"
    )
    p.add_argument(
        "--allocator",
        choices=("tuned", "glibc"),
        default="glibc",
        help="both frameworks' hosts' malloc: 'glibc' its defaults (the default), 'tuned' keeps "
        "buffers over 32 MB on the heap (jaxcomp.tune_host_allocator; each host keeps its peak "
        "heap)",
    )
    p.add_argument("--json", default=None, help="write the header, machine and rows as JSON here")
    p.add_argument("--log", default=None, help="append the host processes' output here")
    return p


def _positive_ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in _csv(text))
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{flag} must be positive integers separated by commas, got {text!r}")
    return values


def _names(text: str, flag: str, allowed) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(_csv(text)))
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ValueError(f"{flag} must be among {','.join(allowed)}, got {text!r}")
    return names


def config_from_args(args) -> Config:
    """A :class:`Config` from parsed arguments; raises ``ValueError`` naming the flag that is
    wrong."""
    models = _names(args.models, "--models", MODELS)
    frameworks = _names(args.frameworks, "--frameworks", FRAMEWORKS)
    torch_methods = _names(args.torch_methods, "--torch-methods", TORCH_METHODS)
    torch_methods = tuple(dict.fromkeys(("plain",) + torch_methods))
    jax_methods = tuple(dict.fromkeys(("pmean",) + _csv(args.jax_methods)))
    rates = _csv(args.rates)
    if not rates:
        raise ValueError("--rates names no rate")
    for name in ("batch", "steps", "powersgd_rank"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.powersgd_start < 2:
        raise ValueError(
            f"--powersgd-start must be >= 2 (torch runs two plain steps before PowerSGD's error "
            f"feedback and warm start), got {args.powersgd_start}"
        )
    if args.params is not None:
        if not (math.isfinite(args.params) and args.params >= 1000):
            raise ValueError(f"--params must be a finite number >= 1000, got {args.params}")
        if models != ("mlp2041",):
            raise ValueError(f"--params sizes mlp2041 only; --models is {args.models!r}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be a positive number, got {args.lr}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    for path in (args.json, args.log):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(f"the folder of {path!r} does not exist")
    return Config(
        models=models,
        hosts=_positive_ints(args.hosts, "--hosts"),
        rates=rates,
        frameworks=frameworks,
        jax_methods=jax_methods,
        torch_methods=torch_methods,
        params=args.params,
        batch=args.batch,
        steps=args.steps,
        warmup=args.warmup,
        powersgd_rank=args.powersgd_rank,
        powersgd_start=args.powersgd_start,
        torch_optimizer=args.torch_optimizer,
        jax_optimizer=args.jax_optimizer,
        lr=args.lr,
        timeout=args.timeout,
        torch_venv=os.path.abspath(args.torch_venv),
        torch_requirement=args.torch_requirement,
        install=not args.no_install,
        json=args.json,
        log=args.log,
        allocator=args.allocator,
    )


def check_rates_and_methods(config: Config) -> None:
    """Checks the rates and jaxcomp methods against jaxcomp itself (``ValueError`` naming the
    flag)."""
    from jaxcomp.distributed.cluster import parse_rate

    for rate in config.rates:
        try:
            parse_rate(rate)
        except ValueError as e:
            raise ValueError(f"--rates: {e}") from None
    if "jaxcomp" in config.frameworks:
        from jaxcomp.distributed.netbench import METHODS

        bad = [m for m in config.jax_methods if m not in METHODS]
        if bad:
            raise ValueError(
                f"--jax-methods must be among {','.join(METHODS)}, got {','.join(bad)}"
            )


# ----------------------------------------------------------------------------------------------
# PyTorch's environment.


def torch_python(venv: str) -> str:
    """The Python of the torch environment ``venv``."""
    return os.path.join(venv, "bin", "python")


def ensure_torch(config: Config, out=sys.stderr) -> str:
    """Makes (or completes) the torch environment where needed; returns torch's version after
    checking gloo.

    Args:
      config: where the environment lives, what pip installs there, and whether it may.
      out: where progress goes.

    Returns:
      ``torch.__version__`` as the environment's Python reports it.

    Raises:
      RuntimeError: torch there cannot import, lacks gloo or PowerSGD's numpy, and ``install`` is
        off or pip failed.
    """
    version, why = _check_torch(config.torch_venv)
    if version is not None:
        return version
    if not config.install:
        raise RuntimeError(
            f"no usable PyTorch environment at {config.torch_venv} ({why}); drop --no-install "
            f"to let peers.py make it, or point --torch-venv at one"
        )
    start = time.monotonic()
    print(
        f"peers: installing `{config.torch_requirement}` into {config.torch_venv}",
        file=out,
        flush=True,
    )
    python = torch_python(config.torch_venv)
    commands = [] if os.path.exists(python) else [[sys.executable, "-m", "venv", config.torch_venv]]
    commands.append([python, "-m", "pip", "install", "-q", *shlex.split(config.torch_requirement)])
    for command in commands:
        result = subprocess.run(command, check=False, capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(
                f"`{' '.join(command)}` failed ({result.returncode}): {result.stderr[-2000:]}"
            )
    print(f"peers: torch installed in {time.monotonic() - start:.0f} s", file=out, flush=True)
    version, why = _check_torch(config.torch_venv)
    if version is None:
        raise RuntimeError(f"PyTorch in {config.torch_venv} is not usable after installing: {why}")
    return version


def _check_torch(venv: str) -> tuple[str | None, str]:
    """``(torch.__version__, "")`` if ``venv``'s torch imports with gloo and numpy, else
    ``(None, why)``."""
    python = torch_python(venv)
    if not os.path.exists(python):
        return None, f"{python} does not exist"
    check = (
        "import numpy, torch, torch.distributed as dist; "  # PowerSGDState imports numpy
        "assert dist.is_available() and dist.is_gloo_available(), 'torch.distributed has no gloo'; "
        "print(torch.__version__)"
    )
    result = subprocess.run([python, "-c", check], check=False, capture_output=True, text=True)
    if result.returncode:
        return None, (result.stderr.strip().splitlines() or ["no output"])[-1]
    return result.stdout.strip(), ""


# ----------------------------------------------------------------------------------------------
# Torch worker: runs inside each emulated host under the torch environment's Python.


def _join_process_group(timeout: float):
    """Joins the job :meth:`jaxcomp.distributed.cluster.Cluster.start` described (its JAXCOMP_*
    variables) with gloo."""
    import datetime

    import torch.distributed as dist

    address, port = os.environ["JAXCOMP_COORDINATOR_ADDRESS"].rsplit(":", 1)
    os.environ.update(
        MASTER_ADDR=address,
        MASTER_PORT=port,
        RANK=os.environ["JAXCOMP_PROCESS_ID"],
        WORLD_SIZE=os.environ["JAXCOMP_NUM_PROCESSES"],
    )
    if os.environ.get("JAXCOMP_INTERFACE"):
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["JAXCOMP_INTERFACE"]
    dist.init_process_group(
        "gloo", init_method="env://", timeout=datetime.timedelta(seconds=timeout)
    )
    return dist.get_rank(), dist.get_world_size()


def _build(spec):
    """``(module, make_batch, loss_fn)`` of ``spec``'s model, the same initial params on every host
    and method."""
    # beside this file: the worker runs it as a script, so its folder is on sys.path
    import torch_zoo

    return torch_zoo.build(spec["model"], mlp_widths=spec["widths"], seed=0)


def _optimizer(spec, params):
    import torch

    if spec["optimizer"] == "adam":
        return torch.optim.Adam(params, lr=spec["lr"])
    return torch.optim.SGD(params, lr=spec["lr"])


def _tx_bytes(interface: str) -> int:
    with open(f"/sys/class/net/{interface}/statistics/tx_bytes") as f:
        return int(f.read())


def _timed_steps(model, loss_fn, optimizer, batches, warmup, steps, interface, on_timed_start=None):
    """Runs ``warmup`` then ``steps`` training steps; the timed steps' wall times, CPU s/step, tx
    bytes/step."""
    times, loss = [], None
    for i in range(warmup + steps):
        if i == warmup:
            if on_timed_start is not None:
                on_timed_start()
            cpu_start, tx_start = time.process_time(), _tx_bytes(interface)
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()  # DDP: returns once every bucket's all-reduce (and hook) is done
        optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return {
        "times": times,
        "step": statistics.median(times),
        "cpu": (time.process_time() - cpu_start) / steps,
        "wire_tx": (_tx_bytes(interface) - tx_start) / steps,
        "loss": float(loss.detach()),
    }


def _hooked(options, seen):
    """The DDP comm hook and its state for ``options`` (:func:`ddp_options`), counting buckets into
    ``seen``."""
    import importlib

    module, name = options["hook"].rsplit(".", 1)
    hook = getattr(
        importlib.import_module(f"torch.distributed.algorithms.ddp_comm_hooks.{module}"), name
    )
    state = None
    if options["powersgd"] is not None:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        state = PowerSGDState(process_group=None, **options["powersgd"])

    def counted(hook_state, bucket):
        seen.append(bucket.index())
        return hook(hook_state, bucket)

    return state, counted


def _run_torch_method(spec, method, position, batches, interface):
    """One method's DDP model, its warm-up and timed steps; the result entry."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    module, _, loss_fn = _build(spec)
    options = ddp_options(
        method,
        sum(p.numel() for p in module.parameters()),
        rank=spec["powersgd_rank"],
        start_iter=spec["powersgd_start"],
    )
    ddp_kwargs = (
        {} if options["bucket_cap_mb"] is None else {"bucket_cap_mb": options["bucket_cap_mb"]}
    )
    # No buffer broadcast: ResNet-50's BatchNorm statistics are not trained, and jaxcomp's rows drop
    # them.
    model = DistributedDataParallel(module, broadcast_buffers=False, **ddp_kwargs)
    seen = []
    state = None
    if options["hook"] is not None:
        state, hook = _hooked(options, seen)
        model.register_comm_hook(state, hook)
    optimizer = _optimizer(spec, model.parameters())
    # The first method also pays for gloo's connections and TCP's ramp-up: two more warm-up steps.
    warmup = torch_warmup(method, spec["warmup"], spec["powersgd_start"]) + (
        2 if position == 0 else 0
    )
    dist.barrier()
    entry = _timed_steps(
        model,
        loss_fn,
        optimizer,
        batches,
        warmup,
        spec["steps"],
        interface,
        on_timed_start=seen.clear,
    )
    entry.update(label=options["label"], bucket_cap_mb=options["bucket_cap_mb"], warmup=warmup)
    if options["hook"] is not None:
        entry["buckets_per_step"] = len(seen) / spec["steps"]
    if state is not None:
        entry["powersgd_iter"] = state.iter
        if entry["buckets_per_step"] != 1:
            raise RuntimeError(
                f"PowerSGD ran with {entry['buckets_per_step']} buckets a step, not one "
                f"(bucket_cap_mb={options['bucket_cap_mb']})"
            )
    dist.barrier()
    return entry


def _local_compute(spec, batches):
    """The same model's step with no communication, every host at once: the median seconds."""
    import torch.distributed as dist

    model, _, loss_fn = _build(spec)
    optimizer = _optimizer(spec, model.parameters())
    dist.barrier()
    times = []
    for i in range(spec["warmup"] + spec["steps"]):
        x, y = batches[i % len(batches)]
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - start)
    dist.barrier()
    return statistics.median(times)


def torch_worker(spec: dict) -> None:
    """One host's half of the torch job: every method of ``spec`` in turn; writes
    ``<out>/torch-<rank>.json``."""
    import gc

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the emulated hosts share the machine's cores
    rank, world = _join_process_group(spec["timeout"])
    interface = os.environ.get("JAXCOMP_INTERFACE") or "eth0"
    generator = torch.Generator().manual_seed(1 + rank)
    model, make_batch, _ = _build(spec)
    batches = [make_batch(generator, spec["batch"]) for _ in range(4)]
    result = {
        "rank": rank,
        "world": world,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in model.parameters()),
        "tensors": len(list(model.parameters())),
        "compute": _local_compute(spec, batches),
        "methods": {},
    }
    del model
    path = os.path.join(spec["out"], f"torch-{rank}.json")
    for position, method in enumerate(spec["methods"]):
        gc.collect()
        result["methods"][method] = _run_torch_method(spec, method, position, batches, interface)
        with open(path, "w") as f:  # after every method: a failed job keeps what it measured
            json.dump(result, f)
        if rank == 0:
            entry = result["methods"][method]
            print(
                f"peers torch: {world} hosts, {entry['label']}: step {entry['step']:.3f} s, "
                f"wire {entry['wire_tx'] / 1e6:.1f} MB/step",
                file=sys.stderr,
                flush=True,
            )
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Controller: the clusters, both frameworks' jobs, the table.

#: Runs ``python ARGS`` under another interpreter: Cluster.start starts jaxcomp's Python in each
#: host, and this replaces it (same process, same process group) with the torch environment's.
_EXEC = "import os, sys; os.execv(sys.argv[1], sys.argv[1:])"


def torch_cell(config: Config, model: str, hosts: int, rate: str, out) -> list[dict]:
    """The torch rows of one (model, hosts, rate) cell, from one job on a fresh emulated cluster."""
    from jaxcomp.distributed.cluster import Cluster, ClusterError, format_rate, parse_rate
    from jaxcomp.ops import allocator

    rate_bits = parse_rate(rate)
    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            "model": model,
            "widths": torch_widths(model, config.params),
            "methods": config.torch_methods,
            "batch": config.batch,
            "steps": config.steps,
            "warmup": config.warmup,
            "powersgd_rank": config.powersgd_rank,
            "powersgd_start": config.powersgd_start,
            "optimizer": config.torch_optimizer,
            "lr": config.lr,
            "timeout": config.timeout,
            "out": tmp,
        }
        command = [
            "-c",
            _EXEC,
            torch_python(config.torch_venv),
            os.path.abspath(__file__),
            "--torch-worker",
            json.dumps(spec),
        ]
        with Cluster(hosts, rate=rate_bits) as cluster:
            codes = cluster.run(
                command,
                timeout=config.timeout,
                env={"OMP_NUM_THREADS": "1", **allocator.environment(config.allocator)},
                stdout=out,
                stderr=out,
                cwd=tmp,
            )
        results = []
        for rank in range(hosts):
            path = os.path.join(tmp, f"torch-{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    results.append(json.load(f))
        if any(codes) or len(results) != hosts:
            raise ClusterError(
                f"the torch job ({model}, {hosts} hosts, {format_rate(rate_bits)}) failed, exit "
                f"codes {codes}{_log_tail(out)}"
            )
    return torch_rows(results, model, hosts, format_rate(rate_bits))


def torch_rows(results, model: str, hosts: int, rate: str) -> list[dict]:
    """Rows from every host's result: the slowest host's median step, CPU and wire bytes averaged
    over hosts."""
    rows = []
    for method in results[0]["methods"]:
        per_host = [r["methods"][method] for r in results]
        first = per_host[0]
        rows.append(
            {
                "model": model,
                "params": results[0]["params"],
                "hosts": hosts,
                "rate": rate,
                "framework": "torch",
                "method": first["label"],
                "step": max(e["step"] for e in per_host),
                "compute": max(r["compute"] for r in results),
                "cpu": statistics.fmean(e["cpu"] for e in per_host),
                "wire_tx": statistics.fmean(e["wire_tx"] for e in per_host),
                "host_steps": [e["step"] for e in per_host],
                "host_wire_tx": [e["wire_tx"] for e in per_host],
                "times": first["times"],
                "loss": first["loss"],
                "warmup": first["warmup"],
                "bucket_cap_mb": first["bucket_cap_mb"],
                "buckets_per_step": first.get("buckets_per_step"),
                "torch": results[0]["torch"],
            }
        )
    base = rows[0]["step"]  # plain DDP runs first
    for row in rows:
        row["speedup"] = base / row["step"]
    return rows


def _log_tail(out) -> str:
    name = getattr(out, "name", None)
    if not name or not os.path.exists(name):
        return ""
    out.flush()
    with open(name) as f:
        return "; the hosts' output ends with:\n" + f.read()[-3000:]


def netbench_options(model: str, params: float | None) -> dict:
    """:func:`jaxcomp.distributed.netbench.run_benchmark`'s keyword arguments that make it train
    ``model``.

    Args:
      model: a name from :data:`MODELS`.
      params: mlp2041's size from ``--params``, or None.

    Returns:
      ``{"models": (model,)}``, or ``{"params", "layers"}`` for a resized mlp2041 (netbench's own
      square MLP; the zoo's mlp2041 is that MLP at 25M).

    Example:
      >>> netbench_options("mlp2041", 2e5), netbench_options("gpt2", None)
      ({'params': 200000.0, 'layers': 6}, {'models': ('gpt2',)})
    """
    if model == "mlp2041" and params is not None:
        return {"params": float(params), "layers": SQUARE_LAYERS}
    return {"models": (model,)}


def jaxcomp_cell(config: Config, model: str, hosts: int, rate: str, log_path: str) -> list[dict]:
    """jaxcomp netbench's rows of one cell."""
    from jaxcomp.distributed import netbench

    found = netbench.run_benchmark(
        hosts=(hosts,),
        rates=(rate,),
        methods=config.jax_methods,
        steps=config.steps,
        warmup=config.warmup,
        batch=config.batch,
        timeout=config.timeout,
        progress=None,
        log=log_path,
        allocator=config.allocator,
        optimizer=config.jax_optimizer,
        **netbench_options(model, config.params),
    )
    keep = (
        "step",
        "compute",
        "sync",
        "wire_tx",
        "speedup",
        "speedup_plain",
        "bytes_sent",
        "ran",
        "times",
        "predicted_sync",
    )
    return [
        {
            "model": model,
            "params": r["params"],
            "hosts": r["hosts"],
            "rate": r["rate"],
            "framework": "jaxcomp",
            "method": r["method"],
            "cpu": None,
            **{k: r.get(k) for k in keep},
        }
        for r in found
    ]


def run(config: Config, argv, out=sys.stdout) -> dict:
    """Every cell, both frameworks; prints the header and table, writes ``--json``; returns the
    report."""
    from jaxcomp.distributed.cluster import check_support

    check_support()
    info = machine()
    if "torch" in config.frameworks:
        info["torch"] = ensure_torch(config)
    if "jaxcomp" in config.frameworks:
        import jax

        info["jax"] = jax.__version__
    report = {"command": argv, "machine": info, "config": dataclasses.asdict(config), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        log_path = config.log or os.path.join(tmp, "hosts.log")
        for model in config.models:
            for hosts in config.hosts:
                for rate in config.rates:
                    _run_cell(config, report, model, hosts, rate, log_path)
                    _save(config, report)
    add_cross_speedups(report["rows"])
    _save(config, report)
    print(header(config, info, argv), file=out)
    print(file=out)
    print(table(report["rows"]), file=out)
    return report


def _run_cell(config, report, model, hosts, rate, log_path) -> None:
    print(f"peers: {model}, {hosts} hosts, {rate}", file=sys.stderr, flush=True)
    if "jaxcomp" in config.frameworks:
        report["rows"] += jaxcomp_cell(config, model, hosts, rate, log_path)
    if "torch" in config.frameworks:
        with open(log_path, "a") as out:
            report["rows"] += torch_cell(config, model, hosts, rate, out)


def _save(config: Config, report: dict) -> None:
    if config.json:
        with open(config.json, "w") as f:
            json.dump(report, f, indent=1)


def main(argv=None) -> int:
    """``benchmarks/peers.py [--models ...] [--hosts 4] [--rates 1gbit,100mbit] [--json
    out.json]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--torch-worker"]:
        torch_worker(json.loads(argv[1]))
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        check_rates_and_methods(config)
    except ValueError as e:
        parser.error(str(e))
    from jaxcomp.distributed.cluster import ClusterError, sigterm_as_interrupt

    try:
        with sigterm_as_interrupt():  # `kill` tears the clusters down too
            run(config, [sys.argv[0], *argv])
    except (ClusterError, RuntimeError) as e:
        print(f"peers: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
