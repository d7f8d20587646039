"""Units of the cost model: bandwidths and durations read from text and written back.

Bit rates use powers of ten (network convention: ``10gbit`` is ``1e10`` bits a second); byte
rates take decimal (``MB/s``) or binary (``MiB/s``) prefixes as written.
:class:`jaxcomp.costmodel.cost.Network` reads its strings with these. Plain Python: no JAX.
"""

from __future__ import annotations

import math
import re

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
