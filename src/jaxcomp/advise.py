"""``jaxcomp advise``: will gradient compression make this training job faster?

Paper 002's performance model (§4.1, App. B): synchronous SGD overlaps the all-reduce of
gradient buckets with the backward pass,

    T_obs ≈ max(γ T_comp, (k - 1) T_comm(b)) + T_comm(b̂),

with ``k`` buckets of ``b`` bytes (the last one ``b̂``), ``T_comp`` the backward pass and ``γ``
its slowdown from the overlap (1.04-1.1 measured). A compression method runs after the backward
pass (overlapping it slows both down, paper 002 §3.1), so

    T_obs ≈ T_comp + T_encode-decode + T_comm(compressed gradient).

``T_comm`` comes from :func:`jaxcomp.cost.predict`, jaxcomp's α-β model of each collective. From
these the advisor prints each method's step time and speedup, the compression ratio an
all-reduce-compatible compressor would need for near-linear scaling (paper 002 App. D: about 4x
at 10 Gbit/s), and the bandwidth below which each method starts to pay.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

from jaxcomp import cost, methods
from jaxcomp.methods import Dense

#: PyTorch DDP's default bucket (paper 002 §2: "25 MB by default in PyTorch").
DEFAULT_BUCKET_BYTES = 25 * 2**20

#: Slowdown of the backward pass from overlapping communication; paper 002 measures 1.04-1.1.
DEFAULT_GAMMA = 1.05

#: The fraction of linear scaling that counts as near-linear.
DEFAULT_TARGET_EFFICIENCY = 0.9

#: Bandwidths searched for break-even points, bytes per second (1 Mbit/s to 10 Tbit/s).
BANDWIDTH_SEARCH = (1e6 / 8, 1e13 / 8)

#: Largest --params: 10 trillion parameters (40 TB of float32 gradient); the byte counts stay exact.
MAX_PARAMS = 1e13

#: Largest --params that --measure-codec times (a 1 GiB float32 gradient, with the codec's buffers).
MAX_MEASURED_PARAMS = 2**28

#: Image formats --plot writes (matplotlib's, by the file's suffix).
PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg")


def sync_sgd_time(
    nbytes: float,
    n_workers: int,
    network: cost.Network,
    backward_seconds: float,
    *,
    bucket_bytes: float = DEFAULT_BUCKET_BYTES,
    gamma: float = DEFAULT_GAMMA,
    overlap: bool = True,
    method=Dense(),
) -> float:
    """Backward pass plus gradient synchronization of dense synchronous SGD, ``T_obs``.

    With overlap (paper 002 §4.1): ``max(γ T_comp, (k-1) T_comm(b)) + T_comm(b̂)``, the last
    bucket's all-reduce waiting for the end of the backward pass. Without: ``T_comp`` plus every
    bucket's all-reduce.

    Args:
      nbytes: bytes of the float32 gradient.
      n_workers: the number of workers.
      network: the :class:`jaxcomp.cost.Network`.
      backward_seconds: ``T_comp``, the backward pass on one worker, seconds.
      bucket_bytes: gradient bucket size ``b``.
      gamma: backward slowdown under overlap, >= 1.
      overlap: whether buckets are reduced while the backward pass runs.
      method: the dense method, :class:`jaxcomp.Dense` (a ring, paper 002 Eqn 1) by default, or
        ``Dense(allreduce="tree")`` (names from :data:`jaxcomp.methods.SHORTHAND` work too).

    Returns:
      ``T_obs`` in seconds.

    Example:
      >>> net = cost.Network.parse("0", "10gbit")
      >>> round(sync_sgd_time(4 * 25.6e6, 64, net, 0.122), 3)  # ResNet-50 on 64 V100s
      0.166

    References:
      Agarwal et al., MLSys 2022, §4.1 and Eqn (1).
    """
    _check_positive(backward_seconds, "backward_seconds", allow_zero=True)
    _check_positive(bucket_bytes, "bucket_bytes")
    if not isinstance(gamma, (int, float)) or isinstance(gamma, bool) or not gamma >= 1:
        raise ValueError(f"gamma must be a number >= 1, got {gamma!r}")
    method = methods.parse(method)
    if not method.sends_everything:
        raise ValueError(
            f"method must be a dense one (that sends everything), got {method.describe()}"
        )
    if n_workers == 1:
        return backward_seconds  # nothing to synchronize, nothing to overlap with
    full_buckets = max(math.ceil(nbytes / bucket_bytes) - 1, 0)
    last_bucket = nbytes - full_buckets * bucket_bytes
    per_bucket = cost.predict(method, bucket_bytes, n_workers, network) if full_buckets else 0.0
    last = cost.predict(method, last_bucket, n_workers, network)
    if overlap:
        return max(gamma * backward_seconds, full_buckets * per_bucket) + last
    return backward_seconds + full_buckets * per_bucket + last


def compressed_time(
    method,
    nbytes: float,
    n_workers: int,
    network: cost.Network,
    backward_seconds: float,
    *,
    encode_decode_seconds: float = 0.0,
    ratio=None,
    rate=None,
    bits=None,
    rank=None,
    inner_size=None,
    overlap: bool = False,
    bucket_bytes: float = DEFAULT_BUCKET_BYTES,
    gamma: float = DEFAULT_GAMMA,
    shard: bool = False,
) -> float:
    """Backward pass plus compressed synchronization, ``T_obs`` of paper 002 App. B.

    Without overlap (the paper's model, its best case on GPUs): ``T_comp + T_encode-decode +
    T_comm``, the compressed gradient sent as one message. With overlap, each bucket is encoded
    and sent as the backward pass produces it; encoding competes with the backward pass for the
    same compute (paper 002 App. A), so ``max(γ (T_comp + T_ed), (k-1) T_comm(b)) + T_comm(b̂)``.

    Args:
      method: a :mod:`jaxcomp.methods` object, or a name with ``ratio``/``rate``/``bits``.
      nbytes: bytes of the float32 gradient.
      n_workers: the number of workers.
      network: the :class:`jaxcomp.cost.Network`.
      backward_seconds: ``T_comp``, seconds.
      encode_decode_seconds: ``T_encode-decode`` for the whole gradient, seconds.
      ratio: with a name: density for the top-k methods.
      rate: with a name: ZFP bits per value.
      bits: with a name: quantization bits.
      rank: with a name: PowerSGD's rank.
      inner_size: workers per node for hierarchical top-k.
      shard: sharded training: the method's reduce-scatter plus the params' all-gather
        (:func:`jaxcomp.cost.predict`'s ``shard``).
      overlap: whether buckets are compressed and sent during the backward pass.
      bucket_bytes: bucket size when overlapping.
      gamma: backward slowdown when overlapping.

    Returns:
      ``T_obs`` in seconds.

    Example:
      >>> net = cost.Network.parse("0.5ms", "10gbit")
      >>> from jaxcomp.methods import TopK
      >>> round(compressed_time(TopK(0.01), 1.024e8, 64, net, 0.122, encode_decode_seconds=0.1), 4)
      0.3282

    References:
      Agarwal et al., MLSys 2022, App. A and App. B.
    """
    _check_positive(backward_seconds, "backward_seconds", allow_zero=True)
    _check_positive(encode_decode_seconds, "encode_decode_seconds", allow_zero=True)
    method = methods.parse(method, strict=False, ratio=ratio, rate=rate, bits=bits, rank=rank)
    options = dict(inner_size=inner_size, shard=shard)
    if n_workers == 1:
        return (
            backward_seconds + encode_decode_seconds
        )  # compressed for nobody: only the codec's cost
    if not overlap:
        return (
            backward_seconds
            + encode_decode_seconds
            + cost.predict(method, nbytes, n_workers, network, **options)
        )
    _check_positive(bucket_bytes, "bucket_bytes")
    full_buckets = max(math.ceil(nbytes / bucket_bytes) - 1, 0)
    last_bucket = nbytes - full_buckets * bucket_bytes
    per_bucket = (
        cost.predict(method, bucket_bytes, n_workers, network, **options) if full_buckets else 0.0
    )
    last = cost.predict(method, last_bucket, n_workers, network, **options)
    return max(gamma * (backward_seconds + encode_decode_seconds), full_buckets * per_bucket) + last


def required_compression(
    nbytes: float,
    n_workers: int,
    network: cost.Network,
    backward_seconds: float,
    *,
    target_efficiency: float = DEFAULT_TARGET_EFFICIENCY,
    bucket_bytes: float = DEFAULT_BUCKET_BYTES,
    gamma: float = DEFAULT_GAMMA,
    max_ratio: float = 1e4,
) -> float | None:
    """Smallest compression ratio for near-linear scaling (paper 002 §4.2, App. D, Fig. 12/18).

    An ideal all-reduce-compatible compressor with no encode/decode cost shrinks the gradient by
    ``r``; the step then runs :func:`sync_sgd_time` on ``nbytes / r``. Returns the least ``r``
    with ``T_comp / T_obs >= target_efficiency``.

    Args:
      nbytes: bytes of the float32 gradient.
      n_workers: the number of workers.
      network: the :class:`jaxcomp.cost.Network`.
      backward_seconds: ``T_comp``, seconds, > 0.
      target_efficiency: the fraction of linear scaling wanted, in (0, 1).
      bucket_bytes: bucket size.
      gamma: backward slowdown under overlap.
      max_ratio: the largest ratio searched.

    Returns:
      The ratio (1.0 when dense already scales), or None when no ratio up to ``max_ratio``
      reaches the target (latency or ``γ`` bound it).

    Example:
      >>> round(required_compression(1.024e8, 64, cost.Network.parse("0", "5gbit"), 0.122), 2)
      3.58

    References:
      Agarwal et al., MLSys 2022, §4.2 and App. D.
    """
    _check_positive(backward_seconds, "backward_seconds")
    if not 0 < target_efficiency < 1:
        raise ValueError(f"target_efficiency must be in (0, 1), got {target_efficiency!r}")

    def reaches(ratio):
        step = sync_sgd_time(
            nbytes / ratio,
            n_workers,
            network,
            backward_seconds,
            bucket_bytes=bucket_bytes,
            gamma=gamma,
        )
        return backward_seconds / step >= target_efficiency

    if reaches(1.0):
        return 1.0
    # The step time is not monotone in the ratio (the last, unoverlapped bucket grows when a
    # bucket boundary is crossed), so scan a fine grid for the first ratio that reaches the
    # target, then refine between it and its predecessor.
    grid = np.geomspace(1.0, max_ratio, 2001)
    hits = [i for i, r in enumerate(grid) if reaches(float(r))]
    if not hits:
        return None
    low, high = float(grid[hits[0] - 1]), float(grid[hits[0]])
    for _ in range(50):
        middle = math.sqrt(low * high)
        low, high = (low, middle) if reaches(middle) else (middle, high)
    return high


def break_even_bandwidth(compressed, dense, search=BANDWIDTH_SEARCH, points: int = 400):
    """The bandwidth below which ``compressed`` beats ``dense``.

    Args:
      compressed: ``bandwidth -> seconds`` of the compressed step.
      dense: ``bandwidth -> seconds`` of the dense step.
      search: ``(low, high)`` bandwidths searched, bytes per second.
      points: grid points before refining.

    Returns:
      Bytes per second; ``math.inf`` if compression wins across the whole search range, None if
      it never wins.

    Example:
      >>> round(break_even_bandwidth(lambda bw: 0.1 + 1e6 / bw, lambda bw: 1e8 / bw) / 1e9, 3)
      0.99

    References:
      Agarwal et al., MLSys 2022, App. D (effect of network bandwidth, Fig. 19).
    """
    grid = np.geomspace(search[0], search[1], points)
    wins = np.array([compressed(float(bw)) < dense(float(bw)) for bw in grid])
    if not wins.any():
        return None
    last = int(np.flatnonzero(wins)[-1])
    if last == len(grid) - 1:
        return math.inf
    low, high = float(grid[last]), float(grid[last + 1])
    for _ in range(60):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if compressed(middle) < dense(middle) else (low, middle)
    return low


# ---------------------------------------------------------------------------------------------
# Command line


def _parser():
    parser = argparse.ArgumentParser(
        prog="jaxcomp advise",
        description="Predict whether gradient compression speeds up data-parallel training "
        "(performance model of Agarwal et al., MLSys 2022, with jaxcomp's collectives).",
    )
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
    return parser


def _encode_decode(text, compressed, parser):
    """``--encode-decode-ms``: one number for every method, or label=ms pairs; seconds per method."""
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
                    f"--encode-decode-ms names {name!r}, which is not among the methods {list(labels)}"
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


def _setting(method):
    return "-" if method.setting is None else f"{method.setting:g}"


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
    if args.measure_codec and args.params > MAX_MEASURED_PARAMS:
        parser.error(
            f"--measure-codec times the codec on a gradient of --params float32 values in this machine's "
            f"memory, at most {MAX_MEASURED_PARAMS:,}; got {args.params:g}. Pass --encode-decode-ms "
            "instead (or measure a smaller model and scale the time by the size)"
        )
    if args.plot is not None:
        problem = _unwritable_plot(args.plot)
        if problem:
            parser.error(f"--plot {args.plot!r}: {problem}")
    if not 0 < args.target_efficiency < 1:
        parser.error(f"--target-efficiency must be in (0, 1), got {args.target_efficiency}")
    if args.inner_size is not None and (args.inner_size < 1 or args.workers % args.inner_size):
        parser.error(f"--inner-size must divide --workers ({args.workers}), got {args.inner_size}")

    compressed = [
        m
        for m in cost.available_methods(**_options(args))
        if not m.sends_everything and (m.scatters or not args.shard)
    ]
    labels = [m.label for m in compressed]
    if args.methods is not None:
        wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
        if not wanted:
            parser.error(f"--methods names no method; give a comma-separated list of {labels}")
        picked = []
        for name in wanted:
            try:
                method = methods.parse(
                    name,
                    strict=False,
                    ratio=args.ratio,
                    rate=args.rate,
                    bits=args.bits,
                    rank=args.rank,
                )
            except ValueError:
                method = None
            if method not in compressed:
                parser.error(f"--methods: {name!r} is not one of {labels}")
            picked.append(method)
        compressed = picked
    encode_decode = _encode_decode(args.encode_decode_ms, compressed, parser)
    measured = []
    if args.measure_codec:
        import jax

        from jaxcomp import probe  # jax and the kernels load only when a codec is timed

        for method in compressed:
            # Each method's whole local work (the ZFP ring's hops, THC's transforms and packing).
            encode_decode[method] = probe.codec_seconds(
                method, math.ceil(args.params), n_workers=min(args.workers, 64)
            )
            measured.append(method.label)

    nbytes = 4.0 * args.params
    backward = args.backward_ms / 1e3
    bucket = args.bucket_mb * 2**20
    overlap = not args.no_overlap

    def dense_at(net):
        return sync_sgd_time(
            nbytes,
            args.workers,
            net,
            backward,
            bucket_bytes=bucket,
            gamma=args.gamma,
            overlap=overlap,
        )

    def method_at(method, net):
        return compressed_time(
            method,
            nbytes,
            args.workers,
            net,
            backward,
            encode_decode_seconds=encode_decode[method],
            overlap=args.batch_overlap,
            bucket_bytes=bucket,
            gamma=args.gamma,
            inner_size=args.inner_size,
            shard=args.shard,
        )

    try:
        dense_step = dense_at(network)
        rows = [(m, method_at(m, network)) for m in compressed]
    except (TypeError, ValueError) as error:
        parser.error(str(error))

    count = f"{args.params / 1e9:.4g}B" if args.params >= 1e9 else f"{args.params / 1e6:.4g}M"
    print(
        f"jaxcomp advise: {count} parameters ({_bytes(nbytes)} float32), "
        f"{args.workers} workers, {network}, backward {args.backward_ms:g} ms"
    )
    buckets = max(math.ceil(nbytes / bucket), 1)
    how = (
        f"overlapped with the backward pass in {buckets} buckets of {args.bucket_mb:g} MiB, γ={args.gamma:g}"
        if overlap
        else "after the backward pass"
    )
    print(f"dense baseline: ring all-reduce {how}")
    if args.shard:
        print(
            "sharded (--shard): each method reduce-scatters the gradient, then the params are all-gathered "
            "densely; sharded dense sends what the all-reduce sends"
        )
    if args.workers == 1:
        print(
            "(1 worker: nothing crosses the network, so no method can be faster than dense; "
            "compression only adds its encode/decode time)"
        )
    print()
    header = (
        f"{'method':<24}{'setting':<14}{'sent/worker':>12}{'comm':>11}{'enc+dec':>10}{'step T_obs':>12}"
        f"{'speedup':>9}{'scaling':>14}"
    )
    print(header)
    print("-" * len(header))

    def row(name, setting, sent, comm, codec, step):
        scaling = args.workers * backward / step
        print(
            f"{name:<24}{setting:<14}{_bytes(sent):>12}{cost.format_duration(comm):>11}"
            f"{cost.format_duration(codec) if codec else '0':>10}{cost.format_duration(step):>12}"
            f"{dense_step / step:>8.2f}x{scaling:>8.1f}x of {args.workers}"
        )

    dense_comm = cost.predict(Dense(), nbytes, args.workers, network)
    row(
        Dense().label,
        "-",
        cost.volume_bytes(Dense(), nbytes, args.workers),
        dense_comm,
        0.0,
        dense_step,
    )
    for method, step in rows:
        inner = dict(inner_size=args.inner_size, shard=args.shard)
        row(
            method.label,
            _setting(method),
            cost.volume_bytes(method, nbytes, args.workers, **inner),
            cost.predict(method, nbytes, args.workers, network, **inner),
            encode_decode[method],
            step,
        )
    if measured:
        print(
            f"(encode/decode of {', '.join(measured)} measured on this machine's {jax.default_backend()}; "
            "a training step's codec may run elsewhere)"
        )
    if not any(encode_decode.values()) and compressed:
        print(
            "(encode/decode time not included: pass --encode-decode-ms; these speedups are upper bounds)"
        )
    print()

    needed = required_compression(
        nbytes,
        args.workers,
        network,
        backward,
        target_efficiency=args.target_efficiency,
        bucket_bytes=bucket,
        gamma=args.gamma,
    )
    target = f"{args.target_efficiency:.0%} of linear scaling"
    if needed is None:
        print(
            f"Compression needed for {target}: unreachable (latency or the overlap slowdown bound the step)"
        )
    elif needed == 1.0:
        print(f"Compression needed for {target}: none, dense synchronous SGD already reaches it")
    else:
        print(
            f"Compression needed for {target}: {needed:.2f}x "
            "(an all-reduce-compatible compressor with free encode/decode)"
        )

    print("Compression pays below (break-even bandwidth):")
    for method in compressed:
        edge = break_even_bandwidth(
            lambda bw, m=method: method_at(m, cost.Network(network.alpha, bw)),
            lambda bw: dense_at(cost.Network(network.alpha, bw)),
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

    if args.plot:
        _plot(args.plot, network, compressed, dense_at, method_at, args.workers, backward)
        print(f"wrote {args.plot}")
    return 0


def _plot(path, network, compressed, dense_at, method_at, workers, backward):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidths = np.geomspace(1e8 / 8, 4e11 / 8, 120)  # 0.1 to 400 Gbit/s
    figure, axes = plt.subplots(figsize=(7, 4.5))
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
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _unwritable_plot(path) -> str | None:
    """Why the plot cannot be written to ``path``, or None; checked before any work."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "is a folder; name the image file, e.g. speedup.png"
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} is not writable"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return "the file exists and is not writable"
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix not in PLOT_FORMATS:
        return f"the name must end in one of {', '.join('.' + f for f in PLOT_FORMATS)} (the image format)"
    return None


def _bytes(count):
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count:.3g} B"


def _check_positive(value, name, allow_zero=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(
            f"{name} must be {'>= 0' if allow_zero else '> 0'} and finite, got {value}"
        )


if __name__ == "__main__":
    sys.exit(main())
