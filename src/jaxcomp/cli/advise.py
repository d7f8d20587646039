"""``jaxcomp advise``: will gradient compression make this training job faster?

The command line over :mod:`jaxcomp.costmodel.advise` (paper 002's performance model): each
method's predicted step time and speed-up, the compression a compressor would need for near-linear
scaling, and the bandwidth below which each method starts to pay; ``--measure-codec`` times the
codecs (:func:`jaxcomp.optim.timing.overhead_seconds`), ``--plot`` draws the step time against the
bandwidth. This module reads and checks the flags; :mod:`jaxcomp.cli._advise_report` prints.
"""

from __future__ import annotations

import argparse
import math
import sys

from jaxcomp import methods
from jaxcomp.cli import _advise_report, _report
from jaxcomp.costmodel import cost
from jaxcomp.costmodel.advise import (  # noqa: F401  (re-exported for the old path jaxcomp.advise)
    BANDWIDTH_SEARCH,
    DEFAULT_BUCKET_BYTES,
    DEFAULT_GAMMA,
    DEFAULT_TARGET_EFFICIENCY,
    MAX_MEASURED_PARAMS,
    MAX_PARAMS,
    PLOT_FORMATS,
    break_even_bandwidth,
    compressed_time,
    required_compression,
    sync_sgd_time,
)


def _parser():
    parser = argparse.ArgumentParser(
        prog="jaxcomp advise",
        description="Predict whether gradient compression speeds up data-parallel training "
        "(performance model of Agarwal et al., MLSys 2022, with jaxcomp's collectives).",
    )
    _add_job_flags(parser)
    _add_method_flags(parser)
    _add_model_flags(parser)
    return parser


def _add_job_flags(parser):
    """The training job: its size, its workers, their network and the backward pass."""
    parser.add_argument("--params", type=float, required=True, help="model parameters, e.g. 25.6e6")
    parser.add_argument("--workers", type=int, required=True, help="data-parallel workers")
    parser.add_argument(
        "--bandwidth", required=True, help="per-link bandwidth, e.g. 10gbit, 25Gbps, 1.25GB/s"
    )
    parser.add_argument(
        "--latency", default="0", help="per-message latency α, e.g. 0.5ms (default 0)"
    )
    parser.add_argument(
        "--backward-ms", type=float, required=True, help="backward pass on one worker, ms"
    )


def _add_method_flags(parser):
    """The compressed methods and what their encode and decode cost."""
    parser.add_argument(
        "--ratio", type=float, default=0.01, help="top-k density k/n (default 0.01)"
    )
    parser.add_argument("--rate", type=int, default=8, help="ZFP bits per value (default 8)")
    parser.add_argument("--bits", type=int, default=4, help="quantization bits (default 4)")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD rank (default 4)")
    parser.add_argument(
        "--inner-size", type=int, default=None, help="workers per node; adds hierarchical_topk"
    )
    parser.add_argument(
        "--methods",
        default=None,
        help="comma-separated compressed methods (default: all that apply)",
    )
    parser.add_argument(
        "--encode-decode-ms",
        default="0",
        help="encode+decode time: one number for every method, or method=ms pairs "
        "separated by commas (default 0: speedups are then upper bounds)",
    )
    parser.add_argument(
        "--measure-codec",
        action="store_true",
        help="time each method's local work on this machine at this model size (top-k "
        "selection and scatter, the ZFP ring's encodes and decodes, THC's transforms, "
        "rounding and packing) and use it instead of --encode-decode-ms",
    )


def _add_model_flags(parser):
    """The performance model's options (buckets, overlap, sharding), the target and the plot."""
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=DEFAULT_BUCKET_BYTES / 2**20,
        help="gradient bucket, MiB (default 25, PyTorch DDP's)",
    )
    parser.add_argument(
        "--gamma",
        type=float,
        default=DEFAULT_GAMMA,
        help="backward slowdown under overlap (default 1.05; paper 002: 1.04-1.1)",
    )
    parser.add_argument(
        "--batch-overlap",
        action="store_true",
        help="also overlap the compressed methods with the backward pass, bucket by "
        "bucket (encode/decode then slows the backward pass)",
    )
    parser.add_argument(
        "--no-overlap",
        action="store_true",
        help="dense all-reduce after the backward pass instead of overlapped",
    )
    parser.add_argument(
        "--target-efficiency",
        type=float,
        default=DEFAULT_TARGET_EFFICIENCY,
        help="fraction of linear scaling that counts as near-linear (default 0.9)",
    )
    parser.add_argument(
        "--plot", default=None, metavar="PNG", help="write speedup against bandwidth here"
    )
    parser.add_argument(
        "--shard",
        action="store_true",
        help="sharded training (data_parallel(shard=...)): each method's reduce-scatter plus the "
        "params' all-gather, for the methods that have one; dense costs the same either way",
    )


def _encode_decode(text, compressed, parser):
    """``--encode-decode-ms``: one number for every method, or label=ms pairs; seconds per
    method."""
    labels = {m.label: m for m in compressed}
    try:
        if "=" not in text:
            value = float(text)
            if not value >= 0:
                raise ValueError
            return {m: value / 1e3 for m in compressed}
        table = dict.fromkeys(compressed, 0.0)
        for item in text.split(","):
            name, _, value = item.partition("=")
            name = name.strip()
            if name not in labels:
                parser.error(
                    f"--encode-decode-ms names {name!r}, which is not among the methods "
                    f"{list(labels)}"
                )
            table[labels[name]] = float(value) / 1e3
            if not table[labels[name]] >= 0:
                raise ValueError
        return table
    except ValueError:
        parser.error(
            f"--encode-decode-ms must be a number of ms >= 0 or method=ms pairs, got {text!r}"
        )


def _options(args):
    return dict(
        ratio=args.ratio, rate=args.rate, bits=args.bits, rank=args.rank, inner_size=args.inner_size
    )


def main(argv=None) -> int:
    """Runs ``jaxcomp advise``: prints the predicted step time and speedup of each method.

    Args:
      argv: the arguments after ``advise`` (default ``sys.argv[1:]``).

    Returns:
      0 on success (bad arguments exit with status 2, as argparse does).

    Example:
      >>> main(["--params", "25.6e6", "--workers", "64", "--bandwidth", "10gbit",
      ...       "--latency", "0.5ms", "--backward-ms", "120"])  # doctest: +ELLIPSIS
      jaxcomp advise: 25.6M parameters...
      0

    References:
      Agarwal et al., MLSys 2022, §4.1, App. B and App. D.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    network = _checked_network(parser, args)
    compressed = _chosen_methods(parser, args)
    encode_decode = _encode_decode(args.encode_decode_ms, compressed, parser)
    measured = _measure_codecs(args, compressed, encode_decode)
    model = _Model(args, network, encode_decode)
    try:
        dense_step = model.dense_at(network)
        rows = [(m, model.method_at(m, network)) for m in compressed]
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    _advise_report.print_setting(args, network, model)
    _advise_report.print_table(args, network, model, dense_step, rows)
    _advise_report.print_notes(measured, encode_decode, compressed)
    _advise_report.print_required_compression(args, network, model)
    _advise_report.print_break_even(args, network, model, compressed)
    if args.plot:
        _advise_report.plot(
            args.plot,
            network,
            compressed,
            model.dense_at,
            model.method_at,
            args.workers,
            model.backward,
        )
        print(f"wrote {args.plot}")
    return 0


def _checked_network(parser, args) -> cost.Network:
    """The network of ``--latency`` and ``--bandwidth``, every other flag checked too."""
    try:
        network = cost.Network.parse(args.latency, args.bandwidth)
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    if not 1 <= args.params <= MAX_PARAMS:
        # Beyond it the bucket arithmetic of float64 byte counts loses the last bucket entirely.
        parser.error(f"--params must be in [1, {MAX_PARAMS:g}], got {args.params}")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if not args.backward_ms > 0:
        parser.error(f"--backward-ms must be > 0, got {args.backward_ms}")
    if not 0 < args.ratio <= 1:
        parser.error(f"--ratio must be in (0, 1], got {args.ratio}")
    if not (args.gamma >= 1 and math.isfinite(args.gamma)):
        parser.error(f"--gamma must be >= 1 and finite, got {args.gamma}")
    if not (args.bucket_mb > 0 and math.isfinite(args.bucket_mb)):
        parser.error(f"--bucket-mb must be > 0 and finite, got {args.bucket_mb}")
    if not (math.isfinite(args.backward_ms)):
        parser.error(f"--backward-ms must be finite, got {args.backward_ms}")
    _check_work_flags(parser, args)
    return network


def _check_work_flags(parser, args) -> None:
    """``--measure-codec``, ``--plot``, ``--target-efficiency`` and ``--inner-size``."""
    if args.measure_codec and args.params > MAX_MEASURED_PARAMS:
        parser.error(
            "--measure-codec times the codec on a gradient of --params float32 values in this "
            f"machine's memory, at most {MAX_MEASURED_PARAMS:,}; got {args.params:g}. Pass "
            "--encode-decode-ms instead (or measure a smaller model and scale the time by the size)"
        )
    if args.plot is not None:
        problem = _report.unwritable_file(args.plot, PLOT_FORMATS)
        if problem:
            parser.error(f"--plot {args.plot!r}: {problem}")
    if not 0 < args.target_efficiency < 1:
        parser.error(f"--target-efficiency must be in (0, 1), got {args.target_efficiency}")
    if args.inner_size is not None and (args.inner_size < 1 or args.workers % args.inner_size):
        parser.error(f"--inner-size must divide --workers ({args.workers}), got {args.inner_size}")


def _chosen_methods(parser, args) -> list:
    """The compressed methods to predict: every one that applies, or those of ``--methods``."""
    compressed = [
        m
        for m in cost.available_methods(**_options(args))
        if not m.sends_everything and (m.scatters or not args.shard)
    ]
    labels = [m.label for m in compressed]
    if args.methods is None:
        return compressed
    wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not wanted:
        parser.error(f"--methods names no method; give a comma-separated list of {labels}")
    picked = []
    for name in wanted:
        try:
            method = methods.parse(
                name, strict=False, ratio=args.ratio, rate=args.rate, bits=args.bits, rank=args.rank
            )
        except ValueError:
            method = None
        if method not in compressed:
            parser.error(f"--methods: {name!r} is not one of {labels}")
        picked.append(method)
    return picked


def _measure_codecs(args, compressed, encode_decode) -> list[str]:
    """``--measure-codec``: times each method's local work into ``encode_decode``; the labels
    timed."""
    if not args.measure_codec:
        return []
    from jaxcomp.costmodel import probe  # jax and the kernels load only when a codec is timed

    for method in compressed:
        # Each method's whole local work (the ZFP ring's hops, THC's transforms and packing).
        encode_decode[method] = probe.codec_seconds(
            method, math.ceil(args.params), n_workers=min(args.workers, 64)
        )
    return [method.label for method in compressed]


class _Model:
    """The job of the flags in paper 002's model: the step time of dense or of a method at a
    network."""

    def __init__(self, args, network, encode_decode):
        self.args = args
        self.encode_decode = encode_decode
        self.nbytes = 4.0 * args.params
        self.backward = args.backward_ms / 1e3
        self.bucket = args.bucket_mb * 2**20
        self.overlap = not args.no_overlap

    def dense_at(self, net):
        return sync_sgd_time(
            self.nbytes,
            self.args.workers,
            net,
            self.backward,
            bucket_bytes=self.bucket,
            gamma=self.args.gamma,
            overlap=self.overlap,
        )

    def method_at(self, method, net):
        return compressed_time(
            method,
            self.nbytes,
            self.args.workers,
            net,
            self.backward,
            encode_decode_seconds=self.encode_decode[method],
            overlap=self.args.batch_overlap,
            bucket_bytes=self.bucket,
            gamma=self.args.gamma,
            inner_size=self.args.inner_size,
            shard=self.args.shard,
        )


if __name__ == "__main__":
    sys.exit(main())
