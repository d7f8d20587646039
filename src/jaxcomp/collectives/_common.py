"""Argument checks and small pieces shared by the collectives' modules (not public: each
collective validates its own arguments with these, so every error names the argument)."""

from __future__ import annotations

import jax

from jaxcomp.ops import _checks


def axis_size(axis_name, name="axis_name"):
    """Devices along ``axis_name`` (an axis or a tuple of axes of the enclosing ``shard_map``), or a
    ValueError naming ``name`` when it is not one."""
    try:
        return jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"{name}={axis_name!r} is not an axis of the enclosing shard_map's mesh; call this "
            "inside jax.shard_map and pass one of its mesh axis names"
        ) from None


def local_vector(x):
    """``x`` as this device's local 1-D float vector, or an error naming ``x``."""
    x = _checks.float_array(x, "x")
    if x.ndim != 1:
        raise ValueError(
            f"x must be this device's local 1-D vector, got shape {x.shape}; flatten it first"
        )
    return x


def one_device_total(x, axis_name):
    """``x`` as the total of a sum over one device: the same values, typed replicated (invariant)
    like every other total, so a step's updates agree on every device of a 1-device mesh too. The
    psum over one device is an identity that XLA removes."""
    return jax.lax.psum(x, axis_name)


def check_rows(n, axis_name):
    """The devices of ``axis_name``, which must split ``n`` values into equal rows."""
    n_devices = axis_size(axis_name)
    if n % n_devices:
        raise ValueError(
            f"x has {n} values, not {n_devices} rows of equal length to reduce-scatter"
        )
    return n_devices
