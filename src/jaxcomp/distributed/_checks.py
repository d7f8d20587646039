"""Argument checks shared by the launcher, the rendezvous and the quorum: a ValueError that
names the argument."""

from __future__ import annotations

import math


def positive_int(value, name: str) -> int:
    """``value`` when it is an integer ``>= 1`` (not a bool), else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def nonnegative_int(value, name: str) -> int:
    """``value`` when it is an integer ``>= 0`` (not a bool), else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def store_key(value, name: str) -> str:
    """``value`` when it is a key-value store's key (a non-empty str, no leading or trailing
    ``/``), else a ValueError naming ``name``."""
    if not isinstance(value, str) or not value or value.startswith("/") or value.endswith("/"):
        raise ValueError(f"{name} must be a non-empty str not starting or ending in /: {value!r}")
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
