"""The α-β cost model: predicted time of each gradient collective, and the choice between them.

A message of ``m`` bytes costs ``α + m β`` (latency ``α`` in seconds, ``β = 1 / bandwidth`` in
seconds per byte). A collective then costs ``α`` times its number of sequential message steps
plus ``β`` times the bytes each worker sends along its critical path (:func:`sync_seconds`, the
one formula: :func:`jaxcomp.compress_auto` evaluates it inside the step on the same numbers).
Each method object says its own steps and bytes; :mod:`jaxcomp.costmodel.terms` checks and
counts them (:func:`message_steps`, :func:`volume_bytes`), this module adds them up
(:func:`predict`), and :func:`choose` picks the cheapest. :mod:`jaxcomp.costmodel.units` reads
and writes bandwidths and durations (:func:`parse_bandwidth`, :func:`format_duration`, ...).

Methods are :mod:`jaxcomp.methods` objects, or their names with options
(``predict("ar_topk", ..., ratio=0.01)``, see :data:`jaxcomp.methods.SHORTHAND`). Everything here
is plain Python and loads no JAX: it runs without devices and costs microseconds.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from jaxcomp import methods

# The terms and the units are imported here for the model and for the names users import from
# this module (cost.parse_bandwidth, cost.message_steps, ...).
from jaxcomp.costmodel.terms import message_steps, sync_seconds, volume_bytes
from jaxcomp.costmodel.units import (
    format_bandwidth,
    format_duration,
    parse_bandwidth,
    parse_duration,
)
from jaxcomp.methods import Method


@dataclasses.dataclass(frozen=True)
class Network:
    """A network in the α-β model.

    Attributes:
      alpha: latency of one message, in seconds (``α``).
      bandwidth: bytes per second one link carries (``1 / β``).

    Example:
      >>> net = Network(alpha=parse_duration("0.5ms"), bandwidth=parse_bandwidth("10gbit"))
      >>> round(net.beta * 1e9, 3)  # nanoseconds per byte
      0.8

    References:
      Tyagi & Swany, arXiv 2312.02493, §2-A2 and Table I (the α-β model).
    """

    alpha: float
    bandwidth: float

    def __post_init__(self):
        for name in ("alpha", "bandwidth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
            # Plain floats, so equal Networks compare and hash equal whatever numpy type fed them.
            object.__setattr__(self, name, float(value))
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value}")
        if self.alpha < 0:
            raise ValueError(f"alpha (latency, seconds) must be >= 0, got {self.alpha}")
        if self.bandwidth <= 0:
            raise ValueError(f"bandwidth (bytes per second) must be > 0, got {self.bandwidth}")

    @property
    def beta(self) -> float:
        """Seconds per byte, ``1 / bandwidth``."""
        return 1.0 / self.bandwidth

    @classmethod
    def parse(cls, latency: str | float, bandwidth: str | float) -> Network:
        """Builds a Network from strings such as ``"0.5ms"`` and ``"10gbit"``.

        Args:
          latency: a duration for :func:`parse_duration` (a bare number is seconds).
          bandwidth: a rate for :func:`parse_bandwidth` (a bare number is bytes per second).

        Returns:
          The Network.

        Example:
          >>> Network.parse("1ms", "1GB/s")
          Network(alpha=0.001, bandwidth=1000000000.0)

        References:
          Tyagi & Swany, arXiv 2312.02493, Table I.
        """
        return cls(
            alpha=parse_duration(latency, "latency"),
            bandwidth=parse_bandwidth(bandwidth, "bandwidth"),
        )

    def __str__(self):
        return f"α={format_duration(self.alpha)}, bandwidth={format_bandwidth(self.bandwidth)}"


# ---------------------------------------------------------------------------------------------
# The model: the terms of terms.py added up, and the choice


def _method(method, ratio=None, rate=None, bits=None, rank=None) -> Method:
    """A method object; a name takes the options it accepts (``"dense"`` ignores ``ratio=``)."""
    return methods.parse(method, strict=False, ratio=ratio, rate=rate, bits=bits, rank=rank)


def predict(
    method,
    nbytes: float,
    n_workers: int,
    network: Network,
    ratio: float | None = None,
    rate: float | None = None,
    bits: int | None = None,
    *,
    rank: int | None = None,
    inner_size: int | None = None,
    overhead: float = 0.0,
    shard: bool = False,
) -> float:
    """Predicted seconds to synchronize one float32 gradient of ``nbytes`` with ``method``.

    :func:`sync_seconds` of the method's :func:`message_steps` and :func:`volume_bytes`. With
    ``M`` the gradient's bytes, ``M c`` the bytes of the kept values and ``L = log2 N``, the dense
    and all-gather methods are exactly paper 000 Table I and §3-D:

    * dense, ring: ``2(N-1) α + 2(N-1)/N · M β``; as a tree: ``2L α + 2L · M β``;
    * all-gather top-k: ``L α + 2(N-1) · M c β`` (values and int32 indices).

    AR-Topk with the paper's STAR leader (``"ar_topk_star"``) follows Eqn (4a)/(4b) with the
    indices' broadcast replaced by the all-reduce of leader-masked indices jaxcomp runs:
    ``4(N-1) α + 4(N-1)/N · M c β`` (ring) and ``4L α + 4L · M c β`` (tree). With SPLIT, its
    default leader, the indices are all-gathered: ``(L + 2(N-1)) α + 3(N-1)/N · M c β`` (ring;
    ``k`` a multiple of ``N``).

    Args:
      method: a :class:`jaxcomp.methods.Method` or a :data:`jaxcomp.methods.SHORTHAND` name.
      nbytes: size of the float32 gradient in bytes (``4 n``), > 0.
      n_workers: the number of workers ``N >= 1``.
      network: the :class:`Network`.
      ratio: with a name: density ``k / n`` in ``(0, 1]``, for the top-k methods.
      rate: with a name: ZFP bits per value.
      bits: with a name: bits per code, for ``quantized``.
      rank: with a name: PowerSGD's rank.
      inner_size: workers per node, for hierarchical top-k.
      overhead: seconds added as is, e.g. the measured encode/decode time of the method.
      shard: sharded training (``data_parallel(shard=...)``): the method's reduce-scatter form
        plus the params' all-gather (dense: the same bytes as its all-reduce; ZFP, THC and
        bf16: the gradient's half compressed, the params' half not).

    Returns:
      Predicted seconds.

    Example:
      >>> from jaxcomp.methods import Dense
      >>> net = Network.parse("1ms", "10gbit")
      >>> round(predict(Dense(), 4e8, 8, net), 3)  # 100M float32 parameters
      0.574

    References:
      Tyagi & Swany, arXiv 2312.02493, Table I, Eqn (4a)/(4b).
    """
    if not isinstance(network, Network):
        raise TypeError(
            f"network must be a jaxcomp.costmodel.cost.Network, got {type(network).__name__}"
        )
    overhead = _check_seconds(overhead, "overhead")
    method = _method(method, ratio, rate, bits, rank)
    steps = message_steps(method, n_workers, inner_size=inner_size, shard=shard)
    volume = volume_bytes(method, nbytes, n_workers, inner_size=inner_size, shard=shard)
    return sync_seconds(steps, volume, network.alpha, network.beta, overhead)


def available_methods(
    *, ratio=None, rate=None, bits=None, rank=None, inner_size=None
) -> tuple[Method, ...]:
    """The methods the given options allow (dense always), with the model's ring and tree variants.

    Args:
      ratio: density for the top-k methods, or None to leave them out.
      rate: ZFP bits per value, or None to leave ZFP out.
      bits: quantization bits, or None to leave THC out.
      rank: PowerSGD's rank, or None to leave it out.
      inner_size: workers per node, or None to leave hierarchical top-k out.

    Returns:
      A tuple of :class:`jaxcomp.methods.Method` (:func:`jaxcomp.methods.candidates`).

    Example:
      >>> [m.label for m in available_methods(ratio=0.01)]  # doctest: +NORMALIZE_WHITESPACE
      ['dense', 'dense_tree', 'allgather_topk', 'ar_topk', 'ar_topk_tree', 'randomk', 'bf16',
       'sign', 'sign_allreduce', 'sign_ring']

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-D.
    """
    return methods.candidates(
        ratio=ratio,
        rate=rate,
        bits=bits,
        rank=rank,
        hierarchical=inner_size is not None,
        variants=True,
    )


def cheapest(seconds) -> int:
    """The index of the least time; ties go to the earlier candidate (as ``argmin`` does).

    Args:
      seconds: predicted seconds per candidate.

    Returns:
      The index of the first least time.

    Example:
      >>> cheapest([3.0, 1.0, 1.0])
      1

    References:
      Tyagi & Swany, arXiv 2312.02493, Eqn (5a)-(5c) (the argmin over collectives).
    """
    seconds = list(seconds)
    return min(range(len(seconds)), key=seconds.__getitem__)


def choose(
    nbytes: float,
    n_workers: int,
    network: Network,
    ratio: float | None = None,
    candidates=None,
    *,
    rate: float | None = None,
    bits: int | None = None,
    rank: int | None = None,
    inner_size: int | None = None,
    overhead=None,
):
    """The candidate with the least predicted time (:func:`cheapest` of :func:`predict_all`).

    Where only all-gather top-k and AR-Topk with STAR's leader (``"ar_topk_star"`` and
    ``"ar_topk_star_tree"``) compete, this is the closed form of paper 000 Eqn (5a)-(5c):
    AR-Topk-ring beats the tree when
    ``α/β < (log N - (N-1)/N) / (N-1-log N) · M c`` and beats all-gather when
    ``α/β < (1 - 1/N - log N / (2(N-1))) · M c``; AR-Topk-tree beats all-gather when
    ``α/β < ((N-1)/log N - 3/2) · M c``.

    Args:
      nbytes: size of the float32 gradient in bytes.
      n_workers: the number of workers.
      network: the :class:`Network`.
      ratio: with names: density for the top-k candidates.
      candidates: methods (objects or names) to choose among; by default every method the given
        options allow (:func:`available_methods`), dense included.
      rate: with names: ZFP bits per value.
      bits: with names: bits per code for ``quantized``.
      rank: with names: PowerSGD's rank.
      inner_size: workers per node for hierarchical top-k.
      overhead: optional ``{candidate: seconds}`` added to each candidate (encode/decode time).

    Returns:
      The cheapest candidate, as given (an object or a name); ties go to the earlier one.

    Example:
      >>> net = Network.parse("1ms", "10gbit")
      >>> choose(4e8, 8, net, ratio=0.01).describe(), choose(4e8, 8, net, ratio=0.001).describe()
      ('randomk(0.01)', 'allgather_topk(0.001)')
      >>> choose(4e8, 8, net, 0.01, ["dense", "allgather_topk", "ar_topk"])  # names in, a name out
      'ar_topk'

    References:
      Tyagi & Swany, arXiv 2312.02493, Eqn (5a)-(5c) and §3-E.
    """
    if isinstance(candidates, str):
        raise TypeError(f"candidates must be a sequence of methods, got the string {candidates!r}")
    names = (
        tuple(candidates)
        if candidates is not None
        else available_methods(ratio=ratio, rate=rate, bits=bits, rank=rank, inner_size=inner_size)
    )
    times = predict_all(
        nbytes,
        n_workers,
        network,
        names,
        ratio=ratio,
        rate=rate,
        bits=bits,
        rank=rank,
        inner_size=inner_size,
        overhead=overhead,
    )
    return names[cheapest(times)]


def predict_all(
    nbytes: float,
    n_workers: int,
    network: Network,
    candidates,
    *,
    ratio=None,
    rate=None,
    bits=None,
    rank=None,
    inner_size=None,
    overhead=None,
) -> list[float]:
    """:func:`predict` for each candidate, in order.

    Args:
      nbytes: size of the float32 gradient in bytes.
      n_workers: the number of workers.
      network: the :class:`Network`.
      candidates: a non-empty sequence of methods (objects or names).
      ratio: with names: density for the top-k candidates (names that take none ignore it).
      rate: with names: ZFP bits per value.
      bits: with names: bits per code for ``quantized``.
      rank: with names: PowerSGD's rank.
      inner_size: workers per node for hierarchical top-k.
      overhead: optional ``{candidate: seconds}`` added to each candidate.

    Returns:
      A list of predicted seconds, one per candidate.

    Example:
      >>> from jaxcomp.methods import Dense
      >>> [round(t, 4) for t in predict_all(4e6, 4, Network.parse("1ms", "10gbit"),
      ...                                   [Dense(), Dense("tree")])]
      [0.0108, 0.0168]

    References:
      Tyagi & Swany, arXiv 2312.02493, Table I, Eqn (4a)/(4b).
    """
    if isinstance(candidates, str):
        raise TypeError(f"candidates must be a sequence of methods, got the string {candidates!r}")
    names = tuple(candidates)
    if not names:
        raise ValueError("candidates must name at least one method")
    overhead = {} if overhead is None else dict(overhead)
    for name in overhead:
        if name not in names:
            raise ValueError(f"overhead names {name!r}, which is not among the candidates {names}")
    return [
        predict(
            _method(m, ratio, rate, bits, rank),
            nbytes,
            n_workers,
            network,
            inner_size=inner_size,
            overhead=overhead.get(m, 0.0),
        )
        for m in names
    ]


# ---------------------------------------------------------------------------------------------
# Checks


def _check_seconds(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be >= 0 and finite, got {value}")
    return float(value)
