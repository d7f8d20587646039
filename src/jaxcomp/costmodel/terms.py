"""The α-β terms of one collective: its sequential message steps, the bytes along its critical
path, and the seconds they add up to.

Each method object says its own steps and bytes (:meth:`jaxcomp.methods.Method.message_steps`,
:meth:`jaxcomp.methods.Method.wire_bytes`); these functions check the arguments, cost a gradient
too large for the kernels as pieces, and add sharded training's all-gather.
:mod:`jaxcomp.costmodel.cost` assembles them into predictions and choices. Plain Python: no JAX.
"""

from __future__ import annotations

import math
import numbers

from jaxcomp import methods
from jaxcomp.collectives import sizes
from jaxcomp.ops import _checks

_FLOAT32_BYTES = 4


def sync_seconds(steps, volume, alpha, beta, overhead=0.0):
    """The α-β model: ``α · steps + β · volume + overhead`` seconds.

    Plain arithmetic, so it runs on Python floats, numpy arrays and traced ``jnp`` arrays alike:
    :func:`jaxcomp.costmodel.cost.predict` and the in-step choice of
    :func:`jaxcomp.compress_auto` both use it.

    Args:
      steps: sequential message steps.
      volume: bytes sent along the critical path.
      alpha: latency, seconds per message.
      beta: seconds per byte.
      overhead: seconds added as is (the method's local work).

    Returns:
      Seconds (of the arguments' type).

    Example:
      >>> sync_seconds(14, 7000.0, 1e-3, 1e-9)
      0.014007

    References:
      Tyagi & Swany, arXiv 2312.02493, §2-A2 and Table I.
    """
    return alpha * steps + beta * volume + overhead


def message_steps(
    method, n_workers: int, *, inner_size: int | None = None, shard: bool = False, **options
) -> int:
    """Sequential message steps of a method: what its latency term multiplies ``α`` by.

    Each method counts its own (:meth:`jaxcomp.methods.Method.message_steps`): an all-reduce
    as a ring (``2(N-1)``) or a tree (``2 ceil(log2 N)``), an all-gather by recursive doubling
    (``ceil(log2 N)``), as in paper 000 Table I. Paper 000's Eqn (4a)/(4b) broadcast AR-Topk's
    indices (``log N`` steps) where jaxcomp, with STAR's leader, all-reduces them, since a
    ``shard_map`` program has no broadcast primitive; with SPLIT's (the default) every device's
    share is all-gathered.

    Args:
      method: a :class:`jaxcomp.methods.Method` or a :data:`jaxcomp.methods.SHORTHAND` name.
      n_workers: the number of workers ``N >= 1``.
      inner_size: workers per node, for methods that reduce over two axes (hierarchical top-k).
      shard: sharded training (``data_parallel(shard=...)``): the method's reduce-scatter
        (:meth:`jaxcomp.methods.Method.reduce_scatter_steps`) plus the params' ring all-gather
        (``N - 1``).
      **options: with a name, the method's options (``ratio=``, ...).

    Returns:
      The step count (0 when ``N == 1``).

    Example:
      >>> message_steps("ar_topk", 8, ratio=0.01)  # SPLIT: all-gather 3, ring all-reduce 14
      17
      >>> message_steps("ar_topk_star", 8, ratio=0.01)  # two ring all-reduces
      28

    References:
      Tyagi & Swany, arXiv 2312.02493, Table I and Eqn (4a)/(4b); Shi et al., MLSys 2021, §3.2;
      the ZFP allreduce paper (004), §III.
    """
    if isinstance(method, str) and not options:
        # Steps do not depend on the ratio, rate or bits: any valid setting builds the method.
        options = {"ratio": 0.5, "rate": 8, "bits": 8}
    method = methods.parse(method, strict=False, **options)
    n = _check_workers(n_workers)
    if shard:
        return method.reduce_scatter_steps(n) + sizes.reduce_scatter_steps(n)
    return method.message_steps(n, inner_size=inner_size)


def volume_bytes(
    method,
    nbytes: float,
    n_workers: int,
    *,
    ratio: float | None = None,
    rate: float | None = None,
    bits: int | None = None,
    rank: int | None = None,
    inner_size: int | None = None,
    shard: bool = False,
    gather_bytes: int = 4,
) -> float:
    """Bytes one worker sends along the critical path (:meth:`jaxcomp.methods.Method.wire_bytes`).

    A gradient of more than ``2**31 - 1`` values (the kernels' int32 row limit) is costed as
    pieces of at most that many values, sent back to back.

    Args:
      method: a :class:`jaxcomp.methods.Method` or a :data:`jaxcomp.methods.SHORTHAND` name.
      nbytes: size of the float32 gradient in bytes (``4 n``).
      n_workers: the number of workers ``N >= 1``.
      ratio: with a name: density ``k / n`` for the top-k methods.
      rate: with a name: ZFP bits per value.
      bits: with a name: bits per code for ``quantized``.
      rank: with a name: PowerSGD's rank.
      inner_size: workers per node for hierarchical top-k.
      shard: sharded training: the method's reduce-scatter
        (:meth:`jaxcomp.methods.Method.reduce_scatter_bytes`) plus the params' all-gather,
        ``(N-1)/N`` of the params in ``gather_bytes`` bytes a value.
      gather_bytes: with ``shard``, bytes per parameter in the all-gather (4; 2 with
        ``gather_dtype=jnp.bfloat16``).

    Returns:
      The byte count the β term multiplies.

    Example:
      >>> volume_bytes("dense", 4 * 1024, 4), volume_bytes("dense", 4 * 1024, 4, shard=True)
      (6144.0, 6144.0)

    References:
      Tyagi & Swany, arXiv 2312.02493, Table I and §3-D.
    """
    method = methods.parse(method, strict=False, ratio=ratio, rate=rate, bits=bits, rank=rank)
    n = _check_workers(n_workers)
    size = _values(nbytes)
    # The kernels index a row with int32, so a larger gradient travels as several pieces of at
    # most MAX_ROW_LENGTH values; their bytes add up.
    pieces, remainder = divmod(size, _checks.MAX_ROW_LENGTH)
    if shard:

        def bytes_of(values):
            return method.reduce_scatter_bytes(values, n) + sizes.reduce_scatter_bytes(
                values * gather_bytes, n
            )
    else:

        def bytes_of(values):
            return method.wire_bytes(values, n, inner_size=inner_size)

    total = pieces * bytes_of(_checks.MAX_ROW_LENGTH) if pieces else 0.0
    if remainder:
        total += bytes_of(remainder)
    return float(total)


def _check_workers(n_workers):
    if (
        isinstance(n_workers, bool)
        or not isinstance(n_workers, int)
        and not hasattr(n_workers, "__index__")
    ):
        raise TypeError(f"n_workers must be an integer, got {type(n_workers).__name__}")
    n = int(n_workers)
    if n < 1:
        raise ValueError(f"n_workers must be >= 1, got {n}")
    return n


def _values(nbytes):
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real):
        raise TypeError(f"nbytes must be a number of bytes, got {type(nbytes).__name__}")
    nbytes = float(nbytes)
    if not (nbytes > 0 and math.isfinite(nbytes)):
        raise ValueError(f"nbytes must be positive and finite, got {nbytes}")
    # The gradient is float32: a partial value still occupies a whole one.
    return math.ceil(nbytes / _FLOAT32_BYTES)
