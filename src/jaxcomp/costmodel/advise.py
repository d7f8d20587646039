"""The formulas of ``jaxcomp advise`` (:mod:`jaxcomp.cli.advise`): will gradient compression make a
training job faster?

Paper 002's performance model (§4.1, App. B): synchronous SGD overlaps the all-reduce of
gradient buckets with the backward pass,

    T_obs ≈ max(γ T_comp, (k - 1) T_comm(b)) + T_comm(b̂),

with ``k`` buckets of ``b`` bytes (the last one ``b̂``), ``T_comp`` the backward pass and ``γ``
its slowdown from the overlap (1.04-1.1 measured). A compression method runs after the backward
pass (overlapping it slows both down, paper 002 §3.1), so

    T_obs ≈ T_comp + T_encode-decode + T_comm(compressed gradient).

``T_comm`` comes from :func:`jaxcomp.costmodel.cost.predict`, jaxcomp's α-β model of each
collective. From these the advisor prints each method's step time and speedup, the compression ratio
an all-reduce-compatible compressor would need for near-linear scaling (paper 002 App. D: about 4x
at 10 Gbit/s), and the bandwidth below which each method starts to pay.
"""

from __future__ import annotations

import math

import numpy as np

from jaxcomp import methods
from jaxcomp.costmodel import cost
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
      network: the :class:`jaxcomp.costmodel.cost.Network`.
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
    overlappable, last = _bucketed_comm(method, nbytes, n_workers, network, bucket_bytes)
    if overlap:
        return max(gamma * backward_seconds, overlappable) + last
    return backward_seconds + overlappable + last


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
      network: the :class:`jaxcomp.costmodel.cost.Network`.
      backward_seconds: ``T_comp``, seconds.
      encode_decode_seconds: ``T_encode-decode`` for the whole gradient, seconds.
      ratio: with a name: density for the top-k methods.
      rate: with a name: ZFP bits per value.
      bits: with a name: quantization bits.
      rank: with a name: PowerSGD's rank.
      inner_size: workers per node for hierarchical top-k.
      shard: sharded training: the method's reduce-scatter plus the params' all-gather
        (:func:`jaxcomp.costmodel.cost.predict`'s ``shard``).
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
    overlappable, last = _bucketed_comm(method, nbytes, n_workers, network, bucket_bytes, **options)
    return max(gamma * (backward_seconds + encode_decode_seconds), overlappable) + last


def _bucketed_comm(method, nbytes, n_workers, network, bucket_bytes, **options):
    """``((k-1) T_comm(b), T_comm(b̂))``: the ``k - 1`` full buckets of ``b`` bytes, which can
    overlap the backward pass, and the last bucket ``b̂``, which waits for its end."""
    full_buckets = max(math.ceil(nbytes / bucket_bytes) - 1, 0)
    last_bucket = nbytes - full_buckets * bucket_bytes
    per_bucket = (
        cost.predict(method, bucket_bytes, n_workers, network, **options) if full_buckets else 0.0
    )
    last = cost.predict(method, last_bucket, n_workers, network, **options)
    return full_buckets * per_bucket, last


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
      network: the :class:`jaxcomp.costmodel.cost.Network`.
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
# Argument checks (the command line is jaxcomp.cli.advise)


def _check_positive(value, name, allow_zero=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(
            f"{name} must be {'>= 0' if allow_zero else '> 0'} and finite, got {value}"
        )
