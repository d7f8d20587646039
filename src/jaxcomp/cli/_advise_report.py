"""What ``jaxcomp advise`` prints: the job, one line per method, where the encode/decode times
came from, the compression near-linear scaling needs, the break-even bandwidths, and the plot.

Each function takes the parsed flags and the job's model (``jaxcomp.cli.advise``'s: the step time
of dense or of a method at a network).
"""

from __future__ import annotations

import math

import numpy as np

from jaxcomp.cli import _report
from jaxcomp.costmodel import cost
from jaxcomp.costmodel.advise import break_even_bandwidth, required_compression
from jaxcomp.methods import Dense


def _setting(method):
    return "-" if method.setting is None else f"{method.setting:g}"


def print_setting(args, network, model) -> None:
    """The job in one line, how dense synchronises, and the caveats of sharding and one worker."""
    count = f"{args.params / 1e9:.4g}B" if args.params >= 1e9 else f"{args.params / 1e6:.4g}M"
    print(
        f"jaxcomp advise: {count} parameters ({_bytes(model.nbytes)} float32), "
        f"{args.workers} workers, {network}, backward {args.backward_ms:g} ms"
    )
    buckets = max(math.ceil(model.nbytes / model.bucket), 1)
    how = (
        f"overlapped with the backward pass in {buckets} buckets of {args.bucket_mb:g} MiB, "
        f"γ={args.gamma:g}"
        if model.overlap
        else "after the backward pass"
    )
    print(f"dense baseline: ring all-reduce {how}")
    if args.shard:
        print(
            "sharded (--shard): each method reduce-scatters the gradient, then the params are "
            "all-gathered densely; sharded dense sends what the all-reduce sends"
        )
    if args.workers == 1:
        print(
            "(1 worker: nothing crosses the network, so no method can be faster than dense; "
            "compression only adds its encode/decode time)"
        )
    print()


def print_table(args, network, model, dense_step, rows) -> None:
    """One line per method (dense first): what it sends, its times, speedup and scaling."""
    header = (
        f"{'method':<24}{'setting':<14}{'sent/worker':>12}{'comm':>11}{'enc+dec':>10}"
        f"{'step T_obs':>12}{'speedup':>9}{'scaling':>14}"
    )
    print(header)
    print("-" * len(header))

    def row(name, setting, sent, comm, codec, step):
        scaling = args.workers * model.backward / step
        print(
            f"{name:<24}{setting:<14}{_bytes(sent):>12}{cost.format_duration(comm):>11}"
            f"{cost.format_duration(codec) if codec else '0':>10}{cost.format_duration(step):>12}"
            f"{dense_step / step:>8.2f}x{scaling:>8.1f}x of {args.workers}"
        )

    nbytes, workers = model.nbytes, args.workers
    dense_comm = cost.predict(Dense(), nbytes, workers, network)
    row(
        Dense().label, "-", cost.volume_bytes(Dense(), nbytes, workers), dense_comm, 0.0, dense_step
    )
    for method, step in rows:
        inner = dict(inner_size=args.inner_size, shard=args.shard)
        row(
            method.label,
            _setting(method),
            cost.volume_bytes(method, nbytes, workers, **inner),
            cost.predict(method, nbytes, workers, network, **inner),
            model.encode_decode[method],
            step,
        )


def print_notes(measured, encode_decode, compressed) -> None:
    """Where the encode/decode times came from, or that they are missing."""
    if measured:
        import jax

        print(
            f"(encode/decode of {', '.join(measured)} measured on this machine's "
            f"{jax.default_backend()}; a training step's codec may run elsewhere)"
        )
    if not any(encode_decode.values()) and compressed:
        print(
            "(encode/decode time not included: pass --encode-decode-ms; these speedups are upper "
            "bounds)"
        )
    print()


def print_required_compression(args, network, model) -> None:
    """The compression an all-reduce-compatible compressor would need for near-linear scaling."""
    needed = required_compression(
        model.nbytes,
        args.workers,
        network,
        model.backward,
        target_efficiency=args.target_efficiency,
        bucket_bytes=model.bucket,
        gamma=args.gamma,
    )
    target = f"{args.target_efficiency:.0%} of linear scaling"
    if needed is None:
        print(
            f"Compression needed for {target}: unreachable (latency or the overlap slowdown bound "
            "the step)"
        )
    elif needed == 1.0:
        print(f"Compression needed for {target}: none, dense synchronous SGD already reaches it")
    else:
        print(
            f"Compression needed for {target}: {needed:.2f}x "
            "(an all-reduce-compatible compressor with free encode/decode)"
        )


def print_break_even(args, network, model, compressed) -> None:
    """Per method, the bandwidth below which it beats dense."""
    print("Compression pays below (break-even bandwidth):")
    for method in compressed:
        edge = break_even_bandwidth(
            lambda bw, m=method: model.method_at(m, cost.Network(network.alpha, bw)),
            lambda bw: model.dense_at(cost.Network(network.alpha, bw)),
        )
        if args.workers == 1:
            verdict = "never (1 worker sends nothing)"
        elif edge is None:
            verdict = "never (slower than dense at every bandwidth from 1 Mbit/s to 10 Tbit/s)"
        elif math.isinf(edge):
            verdict = "always (faster than dense up to 10 Tbit/s)"
        else:
            verdict = f"{cost.format_bandwidth(edge)}" + (
                "  <- pays here" if network.bandwidth < edge else ""
            )
        print(f"  {method.label:<24}{verdict}")


def plot(path, network, compressed, dense_at, method_at, workers, backward):
    bandwidths = np.geomspace(1e8 / 8, 4e11 / 8, 120)  # 0.1 to 400 Gbit/s
    figure, axes = _report.pyplot().subplots(figsize=(7, 4.5))
    x = bandwidths * 8 / 1e9

    def speedup(step_of):
        return [
            workers * backward / step_of(cost.Network(network.alpha, float(bw)))
            for bw in bandwidths
        ]

    axes.plot(x, speedup(dense_at), color="black", linewidth=2, label="dense (overlapped)")
    for method in compressed:
        axes.plot(x, speedup(lambda net, m=method: method_at(m, net)), label=method.label)
    axes.axhline(workers, color="gray", linestyle=":", label="linear")
    axes.axvline(network.bandwidth * 8 / 1e9, color="gray", linestyle="--", linewidth=0.8)
    axes.set_xscale("log")
    axes.set_xlabel("bandwidth (Gbit/s)")
    axes.set_ylabel(f"speedup over one worker ({workers} workers)")
    axes.set_title(f"α = {cost.format_duration(network.alpha)}")
    axes.legend(fontsize=8)
    _report.save_figure(figure, path, dpi=120)


def _bytes(count):
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count:.3g} B"
