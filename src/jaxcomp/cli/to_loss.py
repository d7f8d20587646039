"""``jaxcomp netbench --to-loss``: time to quality, the data-parallel baseline against per-step
compression and DiLoCo, on the char-LM (:mod:`jaxcomp.training.charlm`), in one process or on an
emulated cluster.

    jaxcomp netbench --to-loss                              # one process, 8 devices: minutes
    jaxcomp netbench --to-loss --steps 100 --rows dp,diloco-h10
    jaxcomp netbench --to-loss --quick                      # a tiny model, a few steps
    sudo jaxcomp netbench --to-loss --hosts 4 --rates 1gbit,100mbit --model wide --steps 150 \\
        --out results/ttq                                   # the emulated cluster (root)

The rows (:data:`jaxcomp.training.to_loss.ROWS`) train the same model from the same params on the
same batches. ``dp`` runs first and sets the target: its held-out loss after ``--steps`` steps.
Every other row trains until its held-out loss (evaluated every ``--eval-every`` steps) reaches the
target, or for ``--max-steps`` steps (default 3x ``--steps``; past ``--steps`` the learning rate
stays at the schedule's end value). The clock leaves out the evaluations and the first compilation.
The table gives the wall-clock to the target (at the first evaluation at or below it), the speed-up
over ``dp``'s, the held-out loss after ``--steps`` steps (the same samples as ``dp``) and at the
end, the bytes one device (host) sent to the target, and the seconds and CPU seconds per step.

With ``--hosts N --rates R1,R2``, one job per rate runs every row on N emulated hosts (network
namespaces, ``tc tbf`` links at the rate, one ``jax.distributed`` process per host, gloo;
:mod:`jaxcomp.distributed.cluster`); the hosts also count what their ``eth0`` really sent
(``wire``). Without ``--hosts`` every device is a virtual device of one process: the wall-clock is
compute, not a network. With ``--inner N`` every DiLoCo worker is a row of N devices (on a cluster,
each host gets N devices). ``--out`` writes ``time_to_quality.json`` and the plot of held-out loss
against wall-clock, one panel per rate. ``--fault-tolerant`` runs fault-tolerant DiLoCo instead,
undisturbed and with a worker killed and restarted mid-run (:mod:`jaxcomp.cli.to_loss_ft`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile

from jaxcomp.cli import _report
from jaxcomp.training import charlm
from jaxcomp.training.to_loss import (
    CLUSTER_ROWS,
    ONE_PROCESS_ROWS,
    OUTER_FORMS,
    ROWS,
    parse_row,
    run_rows,
    summarize,
)

#: Devices of a one-process run (virtual CPU devices).
N_DEVICES = 8
#: ``--model``: the char-LM's sizes.
MODELS = charlm.MODELS


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
    plt = _report.pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels) + 3, 4.8), squeeze=False)
    for ax, (label, results) in zip(axes[0], panels):
        target = results[0]["curve"][-1]["loss"]
        styles = _report.distinct_styles(len(results))
        for r, style in zip(results, styles):
            seconds = [p["seconds"] for p in r["curve"][1:]]
            losses = [p["loss"] for p in r["curve"][1:]]
            if r["name"] == "dp":  # the reference
                style = dict(style, color="black", linestyle="-", linewidth=2.5)
            ax.plot(seconds, losses, markersize=4, label=r["name"], **style)
        ax.axhline(target, color="grey", linestyle=":", linewidth=1, label="dp's final loss")
        # dp's first evaluation sets the top: DiLoCo's global params sit at the initial loss
        # until the first sync, and would squash the curves that matter.
        first = results[0]["curve"][1]["loss"] if len(results[0]["curve"]) > 1 else None
        if first is not None:
            ax.set_ylim(top=target + 1.5 * (first - target) + 1e-3)
        ax.set_xscale("log")
        _report.log_ticks_1_2_5(ax.xaxis)  # the default minor labels run into each other
        ax.set_xlabel("training wall-clock (s, log scale)")
        ax.set_ylabel("held-out loss (nats / character)")
        ax.set_title(label)
        ax.grid(alpha=0.3, which="both")
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8)
    fig.suptitle(title)
    _report.save_figure(fig, path, dpi=100)


def _wire():
    """Bytes this emulated host's ``eth0`` has sent."""
    from jaxcomp.distributed.cluster import read_interface_counters

    return read_interface_counters()[0]


def _worker(args):
    """One emulated host's part of a cluster job: every row; host 0 writes the results."""
    from jaxcomp.distributed import launch

    process = launch.initialize()  # before any JAX op

    def log(line):
        if process == 0:
            print(line, file=sys.stderr, flush=True)

    results = run_rows(
        _names(args), _config(args), inner=args.inner or 1, log=log, wire=_wire, **_lengths(args)
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
                command = ["-m", __name__, *forward, "--rows", ",".join(_names(args))]
                # cwd: `-m` puts it first on sys.path, where a source checkout would shadow the
                # installed package.
                codes = cluster.run(
                    [*command, "--worker", tmp],
                    devices_per_host=args.inner or 1,
                    timeout=args.timeout,
                    cwd=tmp,
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
    config = charlm.QUICK if args.quick else MODELS[args.model]
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
    parser = argparse.ArgumentParser(
        prog="jaxcomp netbench --to-loss",
        description=__doc__.split("\n\n")[0],
        epilog="Rows: see jaxcomp.training.to_loss; BENCHMARKS.md has tables this made.",
    )
    parser.add_argument(
        "--rows",
        help="comma-separated, of: "
        + ", ".join(ROWS)
        + "; each may add @lr=PEAK (Adam's peak learning rate) and, for diloco rows, "
        + f"@outer=SPEC ({OUTER_FORMS})",
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
    parser.add_argument(
        "--fault-tolerant",
        action="store_true",
        help="fault-tolerant DiLoCo on a cluster, a worker killed and restarted mid-run "
        "(jaxcomp.cli.to_loss_ft; --fault-tolerant --help lists its flags)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def _check(parser, args):
    """Flag errors, before anything runs."""
    import importlib.util

    if importlib.util.find_spec("flax") is None:
        parser.error('the char-LM needs flax: pip install "jaxcomp[demo]"')
    # Paths before a run of minutes to hours, not after it.
    problem = args.plot and _report.unwritable_file(args.plot)
    if problem:
        parser.error(f"--plot {args.plot!r}: {problem}")
    problem = args.out and not args.worker and _report.unwritable_folder(args.out)
    if problem:
        parser.error(f"--out {args.out!r}: {problem}")
    for name in _names(args):
        try:
            _, settings = parse_row(name)
        except ValueError as error:
            parser.error(f"--rows: {error}")
        if settings.get("exchange") == "split" and (args.inner or 1) == 1:
            parser.error(
                f"--rows: row {name!r} splits the exchange over a worker's row of devices: "
                "pass --inner N (devices per worker, N >= 2)"
            )
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        parser.error(f"--timeout must be a number of seconds > 0, got {args.timeout}")
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
    if args.devices and args.devices > N_DEVICES:
        parser.error(f"--devices must be <= {N_DEVICES}, got {args.devices}")
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
    if not args.hosts and (args.devices or N_DEVICES) % inner:
        parser.error(f"--inner {inner} must divide the {args.devices or N_DEVICES} devices")


def main(argv=None) -> int:
    """Runs ``jaxcomp netbench --to-loss``: the rows' table per link rate, the JSON and the plot.

    Args:
      argv: the arguments after ``--to-loss`` (default ``sys.argv[1:]``); ``--help`` lists them.

    Returns:
      0 (bad flags exit with status 2, as argparse does; a failed cluster job raises).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--fault-tolerant" in argv:  # fault-tolerant DiLoCo, a worker killed and restarted
        from jaxcomp.cli import to_loss_ft

        return to_loss_ft.main([a for a in argv if a != "--fault-tolerant"])
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    if args.worker:
        _worker(args)
        return 0
    _virtual_devices()
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
    params = charlm.count_params(config)
    title = (
        f"char-LM, {params / 1e6:.2f}M params, {config.batch} sequences of {config.context} "
        f"characters a step, {args.hosts or args.devices or N_DEVICES} "
        + ("emulated hosts" if args.hosts else "devices in one process")
        + (f", DiLoCo workers of {args.inner} devices" if (args.inner or 1) > 1 else "")
    )
    for label, results in panels:
        per = "device" if (args.inner or 1) > 1 else "host"
        print(f"\n{label}: {title}\n\n{format_table(results, steps, per)}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "time_to_quality.json"), "w") as f:
            record = dict(command=["jaxcomp", "netbench", "--to-loss", *argv])
            record.update(machine=_report.machine())
            json.dump(
                dict(record, config=dataclasses.asdict(config), title=title, panels=panels), f
            )
    plot_path = args.plot or (args.out and os.path.join(args.out, "time_to_quality.png"))
    if plot_path:
        plot(panels, plot_path, title)
    return 0


def _virtual_devices():
    """One process: :data:`N_DEVICES` virtual CPU devices, if JAX has not started yet."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={N_DEVICES}"


if __name__ == "__main__":
    sys.exit(main())
