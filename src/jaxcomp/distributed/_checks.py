"""Argument checks shared by the launcher and the rendezvous: a ValueError that names the
argument."""

from __future__ import annotations

import math


def positive_int(value, name: str) -> int:
    """``value`` when it is an integer ``>= 1`` (not a bool), else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def positive_seconds(value, name: str) -> float:
    """``value`` as a float when it is a positive finite number, else a ValueError naming
    ``name``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a positive finite number of seconds, got {value!r}")
    return float(value)


def port(value, name: str) -> int:
    """``value`` when it is a port number in [1, 65535], else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ValueError(f"{name} must be a port number in [1, 65535], got {value!r}")
    return value
