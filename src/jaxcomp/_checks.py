"""Argument checks shared by jaxcomp's public functions.

Every check runs in Python at trace time and raises a ValueError or TypeError that names the
argument, before anything is lowered or run.
"""

from __future__ import annotations

import operator

import numpy as np

#: Kernels index with int32, so a row holds at most this many values.
MAX_ROW_LENGTH = 2**31 - 1


def __getattr__(name):
    # FLOAT_DTYPES needs JAX's dtypes; built on first use, so that importing this module (as the
    # cost model does) loads no JAX.
    if name == "FLOAT_DTYPES":
        import jax.numpy as jnp

        return (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def float_array(x, name: str):
    """Returns ``x`` as a JAX array with at least one dimension and a supported float dtype."""
    import jax.numpy as jnp

    # Strings would be read as dtype names ("abc" -> numpy's "data type 'abc' not understood").
    if x is None or isinstance(x, (str, bytes)):
        raise TypeError(f"{name} must be a float32, bfloat16 or float16 array, got {type(x).__name__}")
    try:
        dtype = jnp.result_type(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a float32, bfloat16 or float16 array, got {type(x).__name__}") from None
    if dtype not in __getattr__("FLOAT_DTYPES"):
        raise TypeError(
            f"{name} must be float32, bfloat16 or float16, got dtype {dtype}")
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError(f"{name} must have at least one dimension (the values), got a scalar")
    n = x.shape[-1]
    if n < 1:
        raise ValueError(f"{name} must hold at least one value in its last dimension, got shape {x.shape}")
    if n > MAX_ROW_LENGTH:
        raise ValueError(f"{name}'s last dimension is {n}; jaxcomp indexes rows with int32, so at most {MAX_ROW_LENGTH}")
    return x


def static_int(value, name: str, lo: int, hi: int | None = None) -> int:
    """Returns ``value`` as a Python int in ``[lo, hi]``; it must be static (not traced)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be a static Python integer (it fixes an output shape), got {type(value).__name__}"
        ) from None
    if value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value
