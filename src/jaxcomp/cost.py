"""The α-β cost model: predicted time of each gradient collective, and the choice between them.

A message of ``m`` bytes costs ``α + m β`` (latency ``α`` in seconds, ``β = 1 / bandwidth`` in
seconds per byte). A collective then costs ``α`` times its number of sequential message steps
plus ``β`` times the bytes each worker sends along its critical path. The byte volumes come from
:func:`jaxcomp.collectives.bytes_sent` (one source of truth for what each collective puts on
the wire); this module adds the step counts of paper 000's Table I and Eqn (4a)/(4b) and picks
the cheapest method.

Everything here is plain Python: it runs without devices and costs microseconds, so the
transformation can re-decide between steps.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re

from jaxcomp import _checks

#: Every method :func:`predict` knows, in the order :func:`choose` breaks ties (cheapest
#: bookkeeping first: dense needs no compression at all).
METHODS = (
    "dense_ring",
    "dense_tree",
    "allgather_topk",
    "ar_topk_ring",
    "ar_topk_tree",
    "hierarchical_topk",
    "zfp_ring",
    "zfp_recursive_doubling",
    "quantized",
)

#: Methods that keep every value (no ratio, rate or bits needed).
DENSE_METHODS = ("dense_ring", "dense_tree")

#: Methods that send a top-k selection and so need ``ratio``.
TOPK_METHODS = ("allgather_topk", "ar_topk_ring", "ar_topk_tree", "hierarchical_topk")

#: How each method maps onto :func:`jaxcomp.collectives.bytes_sent`: (method, algorithm).
_COLLECTIVE = {
    "dense_ring": ("psum", "ring"),
    "dense_tree": ("psum", "tree"),
    "allgather_topk": ("allgather_topk", None),
    "ar_topk_ring": ("ar_topk", "ring"),
    "ar_topk_tree": ("ar_topk", "tree"),
    "hierarchical_topk": ("hierarchical_topk", None),
    "zfp_ring": ("zfp_allreduce", "ring"),
    "zfp_recursive_doubling": ("zfp_allreduce", "recursive_doubling"),
    "quantized": ("quantized_psum", None),
}

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
    def parse(cls, latency: str | float, bandwidth: str | float) -> "Network":
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
        return cls(alpha=parse_duration(latency, "latency"), bandwidth=parse_bandwidth(bandwidth, "bandwidth"))

    def __str__(self):
        return f"α={format_duration(self.alpha)}, bandwidth={format_bandwidth(self.bandwidth)}"


# ---------------------------------------------------------------------------------------------
# Units

_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"

# Bits per second use powers of ten (network convention: 10 Gbit/s = 1e10 bit/s); bytes per
# second take decimal (KB, MB, GB) or binary (KiB, MiB, GiB) prefixes as written.
_BANDWIDTH_UNITS = {
    "bit": 1 / 8, "bps": 1 / 8, "b/s": 1 / 8, "bit/s": 1 / 8,
    "kbit": 1e3 / 8, "kbps": 1e3 / 8, "kb/s": 1e3 / 8, "kbit/s": 1e3 / 8,
    "mbit": 1e6 / 8, "mbps": 1e6 / 8, "mb/s": 1e6 / 8, "mbit/s": 1e6 / 8,
    "gbit": 1e9 / 8, "gbps": 1e9 / 8, "gb/s": 1e9 / 8, "gbit/s": 1e9 / 8,
    "tbit": 1e12 / 8, "tbps": 1e12 / 8, "tb/s": 1e12 / 8, "tbit/s": 1e12 / 8,
    "B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
    "KiB/s": 2.0**10, "MiB/s": 2.0**20, "GiB/s": 2.0**30, "TiB/s": 2.0**40,
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
        raise ValueError(f"{name}: cannot read {text!r}; expected a number and a unit, like '10gbit' or '0.5ms'")
    return float(match.group(1)), match.group(2)


def parse_bandwidth(text: str | float, name: str = "bandwidth") -> float:
    """Reads a bandwidth such as ``"10gbit"``, ``"25Gbps"``, ``"1.25GB/s"``; returns bytes per second.

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
        raise ValueError(f"{name}: unknown unit {unit!r} in {text!r}; use e.g. gbit, mbit, Gbps, GB/s, MiB/s")
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


def _log2_steps(n_workers):
    # A tree or recursive-doubling phase over a non-power-of-two group needs one more round.
    return math.ceil(math.log2(n_workers)) if n_workers > 1 else 0


def message_steps(method: str, n_workers: int, *, inner_size: int | None = None) -> int:
    """Sequential message steps of a method: what its latency term multiplies ``α`` by.

    Each all-reduce runs as a ring (``2(N-1)`` steps) or a tree (reduce up, broadcast down,
    ``2L`` steps, ``L = ceil(log2 N)``); each all-gather runs by recursive doubling (``L`` steps),
    as in paper 000 Table I. Per method, following the algorithm
    :func:`jaxcomp.collectives.bytes_sent` counts bytes for:

    ==========================  ====================================================
    ``dense_ring``              ``2(N-1)``
    ``dense_tree``              ``2L``
    ``allgather_topk``          ``L``
    ``ar_topk_ring``            ``4(N-1)``: the leader's indices (an all-reduce of leader-masked
                                indices), then the values at those indices, both ring
    ``ar_topk_tree``            ``4L``: the same two all-reduces as trees
    ``hierarchical_topk``       ``(G-1) + ceil(log2(N/G)) + ceil(log2 G)``: ring reduce-scatter in
                                the node, all-gather across nodes, all-gather in the node
                                (``G = inner_size``)
    ``zfp_ring``                ``2(N-1)``, as the dense ring (paper 004 §III-C)
    ``zfp_recursive_doubling``  ``log2 p`` for ``p`` the largest power of two ``<= N``, plus a
                                fold-in and a fold-out step when ``p < N`` (paper 004 §III-E)
    ``quantized``               ``4(N-1)``: ring all-reduce of the shared range, then of the
                                integer codes (paper 003)
    ==========================  ====================================================

    Paper 000's Eqn (4a)/(4b) broadcast the indices (``L`` steps) where jaxcomp all-reduces them
    (``2(N-1)`` or ``2L``), since a shard_map program has no broadcast primitive.

    Args:
      method: one of :data:`METHODS`.
      n_workers: the number of workers ``N >= 1``.
      inner_size: workers per node ``G``; required for ``hierarchical_topk``, must divide ``N``.

    Returns:
      The step count (0 when ``N == 1``).

    Example:
      >>> message_steps("ar_topk_ring", 8)
      28

    References:
      Tyagi & Swany, arXiv 2312.02493, Table I and Eqn (4a)/(4b); Shi et al., MLSys 2021, §3.2;
      the ZFP allreduce paper (004), §III.
    """
    _check_method(method)
    n = _check_workers(n_workers)
    if n == 1:
        return 0
    log_n = _log2_steps(n)
    if method in ("dense_ring", "zfp_ring"):
        return 2 * (n - 1)
    if method == "dense_tree":
        return 2 * log_n
    if method == "allgather_topk":
        return log_n
    if method in ("ar_topk_ring", "quantized"):
        return 4 * (n - 1)
    if method == "ar_topk_tree":
        return 4 * log_n
    if method == "hierarchical_topk":
        inner = _check_inner_size(inner_size, n)
        return (inner - 1) + _log2_steps(n // inner) + _log2_steps(inner)
    # zfp_recursive_doubling
    power_of_two = 1 << (n.bit_length() - 1)
    rounds = power_of_two.bit_length() - 1
    return rounds if power_of_two == n else rounds + 2


def volume_bytes(method: str, nbytes: float, n_workers: int, *, ratio: float | None = None,
                 rate: float | None = None, bits: int | None = None,
                 inner_size: int | None = None) -> float:
    """Bytes one worker sends along the critical path, from :func:`jaxcomp.collectives.bytes_sent`.

    A gradient of more than ``2**31 - 1`` values (the kernels' int32 row limit) is costed as
    pieces of at most that many values, sent back to back.

    Args:
      method: one of :data:`METHODS`.
      nbytes: size of the float32 gradient in bytes (``4 n``).
      n_workers: the number of workers ``N >= 1``.
      ratio: density ``k / n`` for the top-k methods.
      rate: ZFP bits per value for the ``zfp_*`` methods.
      bits: bits per code for ``quantized``.
      inner_size: workers per node for ``hierarchical_topk``.

    Returns:
      The byte count the β term multiplies.

    Example:
      >>> volume_bytes("dense_ring", 4 * 1024, 4)
      6144.0

    References:
      Tyagi & Swany, arXiv 2312.02493, Table I and §3-D.
    """
    _check_method(method)
    n = _check_workers(n_workers)
    size = _values(nbytes)
    _check_options(method, ratio, rate, bits, inner_size, n)
    # Imported here: collectives pulls in the kernels, and the model must stay importable
    # (and cheap) on machines that only want predictions, e.g. the advisor's CLI.
    from jaxcomp.collectives import bytes_sent

    collective, algorithm = _COLLECTIVE[method]
    options = {}
    if method in TOPK_METHODS:
        options["ratio"] = ratio
    if method.startswith("zfp"):
        options["rate"] = rate
    if method == "quantized":
        options["bits"] = bits
    if method == "hierarchical_topk":
        options["inner_size"] = inner_size
    if algorithm is not None:
        options["algorithm"] = algorithm
    # The kernels index a row with int32, so a larger gradient travels as several pieces of at
    # most MAX_ROW_LENGTH values; their bytes add up.
    pieces, remainder = divmod(size, _checks.MAX_ROW_LENGTH)
    total = pieces * bytes_sent(collective, _checks.MAX_ROW_LENGTH, n, **options) if pieces else 0.0
    if remainder:
        total += bytes_sent(collective, remainder, n, **options)
    return float(total)


def predict(method: str, nbytes: float, n_workers: int, network: Network, ratio: float | None = None,
            rate: float | None = None, bits: int | None = None, *, inner_size: int | None = None,
            overhead: float = 0.0) -> float:
    """Predicted seconds to synchronize one float32 gradient of ``nbytes`` with ``method``.

    ``α · message_steps + β · volume_bytes (+ overhead)``. With ``M`` the gradient's bytes,
    ``M c`` the bytes of the kept values and ``L = log2 N``, the dense and all-gather methods are
    exactly paper 000 Table I and §3-D:

    * ``dense_ring``: ``2(N-1) α + 2(N-1)/N · M β``;
    * ``dense_tree``: ``2L α + 2L · M β``;
    * ``allgather_topk``: ``L α + 2(N-1) · M c β`` (values and int32 indices).

    AR-Topk follows Eqn (4a)/(4b) with the indices' broadcast replaced by the all-reduce of
    leader-masked indices jaxcomp runs: ``4(N-1) α + 4(N-1)/N · M c β`` (ring) and
    ``4L α + 4L · M c β`` (tree). The remaining methods combine the steps of
    :func:`message_steps` with the bytes of :func:`jaxcomp.collectives.bytes_sent`.

    Args:
      method: one of :data:`METHODS`.
      nbytes: size of the float32 gradient in bytes (``4 n``), > 0.
      n_workers: the number of workers ``N >= 1``.
      network: the :class:`Network`.
      ratio: density ``k / n`` in ``(0, 1]``, for the top-k methods.
      rate: ZFP bits per value, for ``zfp_ring`` and ``zfp_recursive_doubling``.
      bits: bits per code, for ``quantized``.
      inner_size: workers per node, for ``hierarchical_topk``.
      overhead: seconds added as is, e.g. the measured encode/decode time of the method.

    Returns:
      Predicted seconds.

    Example:
      >>> net = Network.parse("1ms", "10gbit")
      >>> round(predict("dense_ring", 4e8, 8, net), 3)  # 100M float32 parameters
      0.574

    References:
      Tyagi & Swany, arXiv 2312.02493, Table I, Eqn (4a)/(4b).
    """
    if not isinstance(network, Network):
        raise TypeError(f"network must be a jaxcomp.cost.Network, got {type(network).__name__}")
    overhead = _check_seconds(overhead, "overhead")
    steps = message_steps(method, n_workers, inner_size=inner_size)
    volume = volume_bytes(method, nbytes, n_workers, ratio=ratio, rate=rate, bits=bits, inner_size=inner_size)
    return network.alpha * steps + volume * network.beta + overhead


def available_methods(*, ratio=None, rate=None, bits=None, inner_size=None) -> tuple[str, ...]:
    """The methods :func:`predict` can cost with the given options (dense always).

    Args:
      ratio: density for the top-k methods, or None to leave them out.
      rate: ZFP bits per value, or None to leave ZFP out.
      bits: quantization bits, or None to leave ``quantized`` out.
      inner_size: workers per node, or None to leave ``hierarchical_topk`` out.

    Returns:
      A tuple of method names in :data:`METHODS` order.

    Example:
      >>> available_methods(ratio=0.01)
      ('dense_ring', 'dense_tree', 'allgather_topk', 'ar_topk_ring', 'ar_topk_tree')

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-D.
    """
    names = list(DENSE_METHODS)
    if ratio is not None:
        names += ["allgather_topk", "ar_topk_ring", "ar_topk_tree"]
        if inner_size is not None:
            names.append("hierarchical_topk")
    if rate is not None:
        names += ["zfp_ring", "zfp_recursive_doubling"]
    if bits is not None:
        names.append("quantized")
    return tuple(m for m in METHODS if m in names)


def choose(nbytes: float, n_workers: int, network: Network, ratio: float | None = None,
           candidates=None, *, rate: float | None = None, bits: int | None = None,
           inner_size: int | None = None, overhead=None) -> str:
    """The method with the least predicted time (the argmin of :func:`predict`).

    Where only ``allgather_topk``, ``ar_topk_ring`` and ``ar_topk_tree`` compete, this is the
    closed form of paper 000 Eqn (5a)-(5c): AR-Topk-ring beats the tree when
    ``α/β < (log N - (N-1)/N) / (N-1-log N) · M c`` and beats all-gather when
    ``α/β < (1 - 1/N - log N / (2(N-1))) · M c``; AR-Topk-tree beats all-gather when
    ``α/β < ((N-1)/log N - 3/2) · M c``.

    Args:
      nbytes: size of the float32 gradient in bytes.
      n_workers: the number of workers.
      network: the :class:`Network`.
      ratio: density for the top-k candidates.
      candidates: method names to choose among; by default every method the given options
        allow (:func:`available_methods`), dense included.
      rate: ZFP bits per value for the ``zfp_*`` candidates.
      bits: bits per code for ``quantized``.
      inner_size: workers per node for ``hierarchical_topk``.
      overhead: optional ``{method: seconds}`` added to each candidate (encode/decode time).

    Returns:
      The name of the cheapest candidate; ties go to the earlier candidate.

    Example:
      >>> net = Network.parse("1ms", "10gbit")
      >>> choose(4e8, 8, net, ratio=0.01), choose(4e8, 8, net, ratio=0.001)
      ('ar_topk_ring', 'allgather_topk')

    References:
      Tyagi & Swany, arXiv 2312.02493, Eqn (5a)-(5c) and §3-E.
    """
    if isinstance(candidates, str):
        raise TypeError(f"candidates must be a sequence of method names, got the string {candidates!r}")
    names = tuple(candidates) if candidates is not None else available_methods(
        ratio=ratio, rate=rate, bits=bits, inner_size=inner_size)
    times = predict_all(nbytes, n_workers, network, names, ratio=ratio, rate=rate, bits=bits,
                        inner_size=inner_size, overhead=overhead)
    return names[min(range(len(names)), key=times.__getitem__)]


def predict_all(nbytes: float, n_workers: int, network: Network, candidates, *, ratio=None,
                rate=None, bits=None, inner_size=None, overhead=None) -> list[float]:
    """:func:`predict` for each candidate, in order.

    Args:
      nbytes: size of the float32 gradient in bytes.
      n_workers: the number of workers.
      network: the :class:`Network`.
      candidates: a non-empty sequence of method names.
      ratio: density for the top-k candidates.
      rate: ZFP bits per value.
      bits: bits per code for ``quantized``.
      inner_size: workers per node for ``hierarchical_topk``.
      overhead: optional ``{method: seconds}`` added to each candidate.

    Returns:
      A list of predicted seconds, one per candidate.

    Example:
      >>> [round(t, 4) for t in predict_all(4e6, 4, Network.parse("1ms", "10gbit"), ["dense_ring", "dense_tree"])]
      [0.0108, 0.0168]

    References:
      Tyagi & Swany, arXiv 2312.02493, Table I, Eqn (4a)/(4b).
    """
    if isinstance(candidates, str):
        raise TypeError(f"candidates must be a sequence of method names, got the string {candidates!r}")
    names = tuple(candidates)
    if not names:
        raise ValueError("candidates must name at least one method")
    overhead = {} if overhead is None else dict(overhead)
    for name in overhead:
        if name not in names:
            raise ValueError(f"overhead names {name!r}, which is not among the candidates {names}")
    return [predict(m, nbytes, n_workers, network, ratio, rate, bits, inner_size=inner_size,
                    overhead=overhead.get(m, 0.0)) for m in names]


# ---------------------------------------------------------------------------------------------
# Checks


def _check_method(method):
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def _check_workers(n_workers):
    if isinstance(n_workers, bool) or not isinstance(n_workers, int) and not hasattr(n_workers, "__index__"):
        raise TypeError(f"n_workers must be an integer, got {type(n_workers).__name__}")
    n = int(n_workers)
    if n < 1:
        raise ValueError(f"n_workers must be >= 1, got {n}")
    return n


def _check_inner_size(inner_size, n):
    if inner_size is None:
        raise ValueError("inner_size (workers per node) is required for hierarchical_topk")
    if isinstance(inner_size, bool) or not isinstance(inner_size, int):
        raise TypeError(f"inner_size must be an integer, got {type(inner_size).__name__}")
    if inner_size < 1 or n % inner_size:
        raise ValueError(f"inner_size must be >= 1 and divide n_workers ({n}), got {inner_size}")
    return inner_size


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


def _check_options(method, ratio, rate, bits, inner_size, n):
    # Presence only: bytes_sent validates the values themselves, naming the argument.
    if method in TOPK_METHODS and ratio is None:
        raise ValueError(f"ratio (density k/n) is required for {method}")
    if method.startswith("zfp") and rate is None:
        raise ValueError(f"rate (ZFP bits per value) is required for {method}")
    if method == "quantized" and bits is None:
        raise ValueError("bits (bits per quantized code) is required for quantized")
    if method == "hierarchical_topk":
        _check_inner_size(inner_size, n)
