"""The α-β cost model: predicted time of each gradient collective, and the choice between them.

A message of ``m`` bytes costs ``α + m β`` (latency ``α`` in seconds, ``β = 1 / bandwidth`` in
seconds per byte). A collective then costs ``α`` times its number of sequential message steps
plus ``β`` times the bytes each worker sends along its critical path (:func:`sync_seconds`, the
one formula: :func:`jaxcomp.compress_auto` evaluates it inside the step on the same numbers).
Each method object says its own steps and bytes (:meth:`jaxcomp.methods.Method.message_steps`,
:meth:`jaxcomp.methods.Method.wire_bytes`); this module adds them up, and :func:`choose` picks
the cheapest.

Methods are :mod:`jaxcomp.methods` objects, or their names with options
(``predict("ar_topk", ..., ratio=0.01)``, see :data:`jaxcomp.methods.SHORTHAND`). Everything here
is plain Python and loads no JAX: it runs without devices and costs microseconds.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re

from jaxcomp import methods
from jaxcomp.collectives import sizes
from jaxcomp.methods import Method
from jaxcomp.ops import _checks

_FLOAT32_BYTES = 4


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
# Units

_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"

# Bits per second use powers of ten (network convention: 10 Gbit/s = 1e10 bit/s); bytes per
# second take decimal (KB, MB, GB) or binary (KiB, MiB, GiB) prefixes as written.
_BANDWIDTH_UNITS = {
    "bit": 1 / 8,
    "bps": 1 / 8,
    "b/s": 1 / 8,
    "bit/s": 1 / 8,
    "kbit": 1e3 / 8,
    "kbps": 1e3 / 8,
    "kb/s": 1e3 / 8,
    "kbit/s": 1e3 / 8,
    "mbit": 1e6 / 8,
    "mbps": 1e6 / 8,
    "mb/s": 1e6 / 8,
    "mbit/s": 1e6 / 8,
    "gbit": 1e9 / 8,
    "gbps": 1e9 / 8,
    "gb/s": 1e9 / 8,
    "gbit/s": 1e9 / 8,
    "tbit": 1e12 / 8,
    "tbps": 1e12 / 8,
    "tb/s": 1e12 / 8,
    "tbit/s": 1e12 / 8,
    "B/s": 1.0,
    "KB/s": 1e3,
    "MB/s": 1e6,
    "GB/s": 1e9,
    "TB/s": 1e12,
    "KiB/s": 2.0**10,
    "MiB/s": 2.0**20,
    "GiB/s": 2.0**30,
    "TiB/s": 2.0**40,
}

_DURATION_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _split_number(text, name):
    if isinstance(text, bool):
        raise TypeError(f"{name} must be a number or a string, got {text!r}")
    if isinstance(text, (int, float)):
        return float(text), ""
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a number or a string, got {type(text).__name__}")
    match = re.fullmatch(_NUMBER + r"\s*(\S*)", text.strip())
    if not match:
        raise ValueError(
            f"{name}: cannot read {text!r}; expected a number and a unit, like '10gbit' or '0.5ms'"
        )
    return float(match.group(1)), match.group(2)


def parse_bandwidth(text: str | float, name: str = "bandwidth") -> float:
    """Reads a bandwidth such as ``"10gbit"``, ``"25Gbps"``, ``"1.25GB/s"``; returns bytes per
    second.

    Bit units (``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit``, also written ``Gbps`` or
    ``gb/s``) are case-insensitive and decimal. Byte units must be written with a capital ``B``
    (``MB/s``, ``GiB/s``). A bare number is bytes per second.

    Args:
      text: the bandwidth, a string or a positive number.
      name: the argument name used in error messages.

    Returns:
      Bytes per second, a positive float.

    Example:
      >>> parse_bandwidth("10gbit")
      1250000000.0

    References:
      Agarwal et al., MLSys 2022, §4.1 (bandwidth BW in the performance model).
    """
    value, unit = _split_number(text, name)
    if unit == "":
        scale = 1.0
    elif unit in _BANDWIDTH_UNITS and "B" in unit:
        scale = _BANDWIDTH_UNITS[unit]
    elif "B" not in unit and unit.lower() in _BANDWIDTH_UNITS:
        scale = _BANDWIDTH_UNITS[unit.lower()]
    else:
        raise ValueError(
            f"{name}: unknown unit {unit!r} in {text!r}; use e.g. gbit, mbit, Gbps, GB/s, MiB/s"
        )
    result = value * scale
    if not (result > 0 and math.isfinite(result)):
        raise ValueError(f"{name} must be positive and finite, got {text!r}")
    return result


def parse_duration(text: str | float, name: str = "latency") -> float:
    """Reads a duration such as ``"0.5ms"``, ``"20us"``, ``"1s"``; returns seconds.

    Args:
      text: the duration, a string or a non-negative number of seconds.
      name: the argument name used in error messages.

    Returns:
      Seconds, a non-negative float.

    Example:
      >>> parse_duration("0.5ms")
      0.0005

    References:
      Tyagi & Swany, arXiv 2312.02493, Table I (latency α).
    """
    value, unit = _split_number(text, name)
    if unit not in _DURATION_UNITS and unit != "":
        raise ValueError(f"{name}: unknown unit {unit!r} in {text!r}; use s, ms, us or ns")
    result = value * _DURATION_UNITS.get(unit, 1.0)
    if not (result >= 0 and math.isfinite(result)):
        raise ValueError(f"{name} must be non-negative and finite, got {text!r}")
    return result


def format_bandwidth(bytes_per_second: float) -> str:
    """Writes bytes per second as Gbit/s or Mbit/s, e.g. ``"10 Gbit/s"``.

    Args:
      bytes_per_second: a positive rate.

    Returns:
      A short human-readable string.

    Example:
      >>> format_bandwidth(1.25e9)
      '10 Gbit/s'

    References:
      Agarwal et al., MLSys 2022, §4.1.
    """
    bits = bytes_per_second * 8
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.3g} bit/s"


def format_duration(seconds: float) -> str:
    """Writes seconds as s, ms or µs, e.g. ``"0.5 ms"``.

    Args:
      seconds: a non-negative duration.

    Returns:
      A short human-readable string.

    Example:
      >>> format_duration(0.0025)
      '2.5 ms'

    References:
      Tyagi & Swany, arXiv 2312.02493, Table I.
    """
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


# ---------------------------------------------------------------------------------------------
# The model


def _method(method, ratio=None, rate=None, bits=None, rank=None) -> Method:
    """A method object; a name takes the options it accepts (``"dense"`` ignores ``ratio=``)."""
    return methods.parse(method, strict=False, ratio=ratio, rate=rate, bits=bits, rank=rank)


def sync_seconds(steps, volume, alpha, beta, overhead=0.0):
    """The α-β model: ``α · steps + β · volume + overhead`` seconds.

    Plain arithmetic, so it runs on Python floats, numpy arrays and traced ``jnp`` arrays alike:
    :func:`predict` and the in-step choice of :func:`jaxcomp.compress_auto` both use it.

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
    method = _method(method, ratio, rate, bits, rank)
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


def _check_seconds(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be >= 0 and finite, got {value}")
    return float(value)


def _values(nbytes):
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real):
        raise TypeError(f"nbytes must be a number of bytes, got {type(nbytes).__name__}")
    nbytes = float(nbytes)
    if not (nbytes > 0 and math.isfinite(nbytes)):
        raise ValueError(f"nbytes must be positive and finite, got {nbytes}")
    # The gradient is float32: a partial value still occupies a whole one.
    return math.ceil(nbytes / _FLOAT32_BYTES)
