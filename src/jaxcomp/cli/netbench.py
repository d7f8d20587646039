"""``jaxcomp netbench``: step time per method on an emulated cluster of N hosts at given link rates.

    jaxcomp netbench --hosts 2,4 --rates 10gbit,1gbit,100mbit,none --params 25e6 --plot netbench.png
    jaxcomp netbench --hosts 2 --rates 1gbit --model mlp4096,gpt2,resnet50,many_small

The command line over :func:`jaxcomp.distributed.netbench.run_benchmark` (which says what a cell
measures): its flags, checked before any cluster is built, the progress bar over the cells, the
markdown table of the rows and the speedup plot.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from jaxcomp.cli import _report
from jaxcomp.distributed.cluster import (
    ClusterError,
    check_support,
    parse_rate,
    sigterm_as_interrupt,
)
from jaxcomp.distributed.netbench import (
    DEFAULT_BATCH,
    DEFAULT_HOSTS,
    DEFAULT_PARAMS,
    DEFAULT_RATES,
    METHODS,
    OPTIMIZERS,
    run_benchmark,
)
from jaxcomp.methods import Dense
from jaxcomp.ops.allocator import ALLOCATORS


def _mb(value):
    return "-" if value is None else f"{value / 1e6:.1f}"


def _s(value):
    return "-" if value is None else f"{value:.3f}"


def table(rows) -> str:
    """The markdown table of :func:`run_benchmark`'s rows.

    Args:
      rows: the rows :func:`run_benchmark` returns.

    Returns:
      A markdown table, one line per row; rows without a ``"model"`` or a ``"speedup_plain"``
      (older results) show ``-`` there. "speedup vs faster plain" is against the faster of
      ``pmean`` and ``pmean_flat`` in the row's job (each is slow on some models under XLA:CPU).

    Example:
      >>> table([]).splitlines()[0].split(" | ")[:4]
      ['| model', 'hosts', 'rate', 'method']

    References:
      Agarwal et al., "On the Utility of Gradient Compression in Distributed Training Systems",
      MLSys 2022 (measure the step, not the bytes); docs/network.md has the set-up.
    """
    header = (
        "model | hosts | rate | method | step s | CPU s/step | compute s | sync s | "
        "predicted sync s | advise step s | wire MB/step/host | bytes_sent MB | "
        "sync: dense / this | speedup vs pmean | speedup vs faster plain | ran | state MB/host | "
        "peak RSS MB/host"
    ).split(" | ")
    dense_sync = {
        (r.get("model"), r["hosts"], r["rate"]): r["sync"]
        for r in rows
        if r["method"] == Dense().label
    }
    return _report.format_table(
        header, [_table_cells(r, dense_sync) for r in rows], align="lrllrrrrrrrrrrrlrr"
    )


def _table_cells(r, dense_sync) -> list[str]:
    """One row of the table: ``dense_sync`` is dense's sync time by (model, hosts, rate)."""
    base = dense_sync.get((r.get("model"), r["hosts"], r["rate"]))
    ratio = f"{base / r['sync']:.1f}x" if base and base > 0 and r["sync"] > 0 else "-"
    return [
        r.get("model") or "-",
        str(r["hosts"]),
        r["rate"],
        r["method"],
        _s(r["step"]),
        _s(r.get("cpu")),
        _s(r["compute"]),
        _s(r["sync"]),
        _s(r.get("predicted_sync")),
        _s(r.get("advise_step")),
        _mb(r["wire_tx"]),
        _mb(r.get("bytes_sent")),
        ratio,
        f"{r['speedup']:.2f}x",
        "-" if r.get("speedup_plain") is None else f"{r['speedup_plain']:.2f}x",
        r["ran"],
        _mb(r.get("state_bytes")),
        _mb(r.get("peak_rss")),
    ]


def plot(rows, path) -> None:
    """Speedup against link rate per method (measured points) beside the cost model's curve.

    One panel per model (a row of panels each) and host count; a method's dashed line is the cost
    model's step time of the plain pmean over the method's (compute + predicted sync), at the rates
    measured.

    Args:
      rows: the rows :func:`run_benchmark` returns.
      path: the PNG to write.

    Returns:
      None.

    Example:
      >>> plot(rows, "netbench.png")  # doctest: +SKIP

    References:
      Agarwal et al., "On the Utility of Gradient Compression in Distributed Training Systems",
      MLSys 2022 (measure the step, not the bytes); docs/network.md has the set-up.
    """
    plt = _report.pyplot()
    models = list(dict.fromkeys(r.get("model") for r in rows))
    hosts = sorted({r["hosts"] for r in rows})
    fig, axes = plt.subplots(
        len(models), len(hosts), figsize=(6 * len(hosts), 4.5 * len(models)), squeeze=False
    )
    for row, model in zip(axes, models):
        for ax, n in zip(row, hosts):
            cell = [
                r
                for r in rows
                if r.get("model") == model and r["hosts"] == n and parse_rate(r["rate"]) is not None
            ]
            _plot_panel(ax, cell)
            ax.set_title(
                f"{model + ', ' if model else ''}{n} emulated hosts (points: measured, dashed: "
                "cost model)"
            )
    _report.save_figure(fig, path, dpi=120)


def _plot_panel(ax, cell):
    """One model's and host count's speedups against the rate: measured points, the cost model's
    dashes."""
    for method in dict.fromkeys(r["method"] for r in cell):
        if method == "pmean":
            continue
        points = sorted(
            (parse_rate(r["rate"]), r["speedup"], r.get("predicted_sync"), r["compute"])
            for r in cell
            if r["method"] == method
        )
        (line,) = ax.plot(
            [p[0] / 1e9 for p in points], [p[1] for p in points], "o", label=f"{method} measured"
        )
        base = {parse_rate(r["rate"]): r for r in cell if r["method"] == "pmean"}
        model = [
            (p[0] / 1e9, (base[p[0]]["compute"] + base[p[0]]["predicted_sync"]) / (p[3] + p[2]))
            for p in points
            if p[2] is not None and base.get(p[0], {}).get("predicted_sync") is not None
        ]
        if model:
            ax.plot(
                [m[0] for m in model],
                [m[1] for m in model],
                "--",
                color=line.get_color(),
                alpha=0.6,
            )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("link rate, Gbit/s")
    ax.set_ylabel("step speedup vs plain pmean")
    ax.legend(fontsize=7)


_DESCRIPTION = (
    "The network benchmark: data-parallel training steps on an emulated cluster, per method and "
    "link rate."
)


def _parser() -> argparse.ArgumentParser:
    from jaxcomp.training import zoo

    parser = argparse.ArgumentParser(prog="jaxcomp netbench", description=_DESCRIPTION)
    parser.add_argument(
        "--to-loss",
        action="store_true",
        help="time to quality instead: train the char-LM per row (data-parallel, compressed, "
        "DiLoCo) until dense's held-out loss, in one process or on emulated hosts; `jaxcomp "
        "netbench --to-loss --help` lists its options",
    )
    parser.add_argument(
        "--hosts",
        default=",".join(map(str, DEFAULT_HOSTS)),
        help="emulated host counts (default 2,4)",
    )
    parser.add_argument(
        "--rates",
        default=",".join(DEFAULT_RATES),
        help=f"link rates, 'none' for no limit (default {','.join(DEFAULT_RATES)})",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="NAME[,NAME...]",
        help=f"train these jaxcomp.training.zoo models, one cell each, from {','.join(zoo.NAMES)} "
        "(default: the MLP of --params)",
    )
    parser.add_argument(
        "--params",
        type=float,
        default=None,
        help="parameters of the MLP of 6 square layers trained without --model (default 25e6)",
    )
    parser.add_argument("--methods", default=",".join(METHODS), help=f"from {','.join(METHODS)}")
    parser.add_argument(
        "--steps", type=int, default=3, help="timed steps per method, the median counts (default 3)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    parser.add_argument(
        "--batch",
        type=int,
        default=DEFAULT_BATCH,
        help="rows (sequences, images) per host (default 4)",
    )
    parser.add_argument(
        "--timeout", type=float, default=1800, help="seconds per cell (default 1800)"
    )
    _add_host_options(parser)
    parser.add_argument("--plot", default=None, help="write the speedup plot (PNG) here")
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    parser.add_argument("--log", default=None, help="append the workers' output here")
    return parser


def _add_host_options(parser):
    """What every host's steps run with: the allocator, the optimizer, donation."""
    parser.add_argument(
        "--allocator",
        choices=ALLOCATORS,
        default="glibc",
        help="the hosts' malloc: 'glibc' its defaults (fresh pages for every buffer over 32 MB, "
        "every step; the default), 'tuned' keeps them on the heap (jaxcomp.tune_host_allocator: "
        "compressed steps up to 2x faster, but each host keeps its peak heap: resnet50 on 4 "
        "hosts ran out of 24 GiB)",
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adam",
        help="what every step applies after the mean, learning rate 1e-4 (default adam; sgd is "
        "what benchmarks/peers.py's torch rows run by default)",
    )
    parser.add_argument(
        "--donate",
        action="store_true",
        help="every step donates its input state (data_parallel(donate=True)): one state's "
        "memory less per host (GPT-2's PowerSGD row on 4 hosts ran out of 24 GiB without it)",
    )


def _names(text):
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _checked_args(parser, args):
    """The flags' values, checked before any cluster is built: (hosts, rates, methods, models)."""
    from jaxcomp.training import zoo

    try:
        hosts = tuple(int(h) for h in args.hosts.split(","))
    except ValueError:
        parser.error(f"--hosts must be integers separated by commas, got {args.hosts!r}")
    if any(h < 2 for h in hosts):  # one host sends nothing: there is no network to measure
        parser.error(
            f"--hosts: every count must be at least 2 (hosts that talk), got {args.hosts!r}"
        )
    rates, methods = _names(args.rates), _names(args.methods)
    try:
        for rate in rates:
            parse_rate(rate)
    except ValueError as e:
        parser.error(f"--rates: {e}")
    if not rates:
        parser.error("--rates names no rate")
    if any(m not in METHODS for m in methods) or not methods:
        parser.error(f"--methods must be among {','.join(METHODS)}, got {args.methods!r}")
    models = None if args.model is None else _names(args.model)
    if models is not None and (not models or any(m not in zoo.NAMES for m in models)):
        parser.error(f"--model must be among {','.join(zoo.NAMES)}, got {args.model!r}")
    if models is not None and args.params is not None:
        parser.error(
            "--params sizes the MLP trained without --model: give one of --model and --params"
        )
    if args.params is not None and not (args.params >= 1000 and math.isfinite(args.params)):
        parser.error(f"--params must be a finite number >= 1000, got {args.params}")
    for name in ("steps", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        parser.error(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    for flag, path in (("--plot", args.plot), ("--json", args.json)):
        problem = path and _report.unwritable_file(path)
        if problem:
            parser.error(f"{flag} {path!r}: {problem}")
    return hosts, rates, methods, models


def main(argv=None) -> int:
    """Runs ``jaxcomp netbench``: prints the table of every cell's rows, writes the plot and the
    JSON.

    ``jaxcomp netbench [--hosts 2,4] [--rates ...] [--model resnet50,gpt2 | --params 25e6] [--plot
    out.png]``; ``jaxcomp netbench --to-loss ...`` runs :func:`jaxcomp.cli.to_loss.main` instead.

    Args:
      argv: the arguments after ``netbench`` (default ``sys.argv[1:]``); ``--help`` lists them.

    Returns:
      0 on success, 2 when a cluster could not be built or a job failed (bad flags exit with
      status 2, as argparse does).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--to-loss" in argv:
        from jaxcomp.cli import to_loss

        return to_loss.main([a for a in argv if a != "--to-loss"])
    parser = _parser()
    args = parser.parse_args(argv)
    hosts, rates, methods, models = _checked_args(parser, args)
    cells = len(models or (None,)) * len(hosts) * len(rates)
    try:
        rows = _run(args, hosts, rates, methods, models, cells)
    except ClusterError as e:
        print(f"jaxcomp netbench: {e}", file=sys.stderr)
        return 2
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


def _run(args, hosts, rates, methods, models, cells) -> list[dict]:
    """:func:`run_benchmark` under a progress bar, saving the rows to ``--json`` after each cell."""

    def save(rows):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)

    check_support()  # what is missing is said before the progress bar shows
    with sigterm_as_interrupt():  # `kill` tears the cluster down too
        return run_benchmark(
            hosts,
            rates,
            params=DEFAULT_PARAMS if args.params is None else args.params,
            methods=methods,
            steps=args.steps,
            warmup=args.warmup,
            batch=args.batch,
            timeout=args.timeout,
            progress=_report.progress_bar(total=cells, unit="cell"),
            log=args.log,
            on_cell=save,
            models=models,
            allocator=args.allocator,
            optimizer=args.optimizer,
            donate=args.donate,
        )


if __name__ == "__main__":
    sys.exit(main())
