"""Link rates as ``tc(8)`` writes them (``"1gbit"``, ``"100mbit"``): what the emulated cluster
(:class:`jaxcomp.distributed.cluster.Cluster`) shapes its links to and ``jaxcomp netbench``
reports."""

from __future__ import annotations

import math
import re

from jaxcomp.costmodel.cost import parse_bandwidth

# What tc(8) writes: a number, an SI prefix, then bit (or bps, b/s); a bare prefix means bits.
_RATE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(bit|bps|b/s)?\s*")


def parse_rate(rate) -> float | None:
    """Bits per second from ``"1gbit"``, ``"100mbit"``, ``"10Gbit"``, ``"250kbit"`` or a number.

    Args:
      rate: a string with a unit of bits per second, a number of bits per second, or None /
        ``"none"`` / ``"unlimited"`` for no limit.

    Returns:
      Bits per second as a float, or None for no limit.

    Example:
      >>> parse_rate("1gbit"), parse_rate("100mbit"), parse_rate(None)
      (1000000000.0, 100000000.0, None)

    References:
      ``tc(8)``: rates in bits per second with SI prefixes, as ``tc qdisc ... tbf rate`` reads them.
    """
    if rate is None or (
        isinstance(rate, str) and rate.strip().lower() in ("none", "unlimited", "inf")
    ):
        return None
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        value = float(rate)
    else:
        match = _RATE.fullmatch(str(rate).lower())
        if not match:
            raise ValueError(
                "rate must look like '1gbit', '100mbit' or '250kbit' (bits per second), "
                f"got {rate!r}"
            )
        value = _bits_per_second(float(match.group(1)), match.group(2))
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"rate must be a positive, finite number of bits per second, got {rate!r}")
    return value


def _bits_per_second(number: float, prefix: str) -> float:
    """``number`` with an SI ``prefix`` of bits per second, read by the cost model's parser
    (bytes)."""
    if not 0 < number < math.inf:  # parse_rate says why, in its own words
        return number
    try:
        return 8 * parse_bandwidth(f"{number!r}{prefix}bit", "rate")
    except ValueError:  # the text was checked: only an overflow to infinity is left
        return math.inf


def format_rate(bits_per_second: float | None) -> str:
    """``1e9`` -> ``"1gbit"``; None -> ``"none"`` (the inverse of :func:`parse_rate` for round
    values).

    Args:
      bits_per_second: a rate, or None for no limit.

    Returns:
      The rate as ``tc`` writes it.

    Example:
      >>> format_rate(1e9), format_rate(1e8), format_rate(None)
      ('1gbit', '100mbit', 'none')

    References:
      ``tc(8)`` (rate units).
    """
    if bits_per_second is None:
        return "none"
    for unit, scale in (("t", 1e12), ("g", 1e9), ("m", 1e6), ("k", 1e3)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:g}{unit}bit"
    return f"{bits_per_second:g}bit"
