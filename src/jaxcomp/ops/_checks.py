"""Argument checks shared by jaxcomp's public functions.

Every check runs in Python at trace time and raises a ValueError or TypeError that names the
argument, before anything is lowered or run.
"""

from __future__ import annotations

import operator

import numpy as np

from jaxcomp.ops.zfp_format import row_words

#: Kernels index with int32, so a row holds at most this many values.
MAX_ROW_LENGTH = 2**31 - 1

#: Largest THC code width (:data:`jaxcomp.collectives.sizes.MAX_QUANTIZATION_BITS`).
MAX_QUANTIZATION_BITS = 16


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
        raise TypeError(
            f"{name} must be a float32, bfloat16 or float16 array, got {type(x).__name__}"
        )
    try:
        dtype = jnp.result_type(x)
    except (TypeError, ValueError):
        raise TypeError(
            f"{name} must be a float32, bfloat16 or float16 array, got {type(x).__name__}"
        ) from None
    if dtype not in __getattr__("FLOAT_DTYPES"):
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got dtype {dtype}")
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError(f"{name} must have at least one dimension (the values), got a scalar")
    n = x.shape[-1]
    if n < 1:
        raise ValueError(
            f"{name} must hold at least one value in its last dimension, got shape {x.shape}"
        )
    if n > MAX_ROW_LENGTH:
        raise ValueError(
            f"{name}'s last dimension is {n}; jaxcomp indexes rows with int32, so at most "
            f"{MAX_ROW_LENGTH}"
        )
    return x


def static_int(value, name: str, lo: int, hi: int | None = None) -> int:
    """Returns ``value`` as a Python int in ``[lo, hi]``; it must be static (not traced)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be a static Python integer (it fixes an output shape), got "
            f"{type(value).__name__}"
        ) from None
    if value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def static_float(value, name: str, lo=None, hi=None, *, open_lo=False, open_hi=False) -> float:
    """``value`` as a finite Python float in the interval from ``lo`` to ``hi`` (either end
    open where asked, None: no bound), or an error naming ``name``; numpy scalars count.

    Example:
      >>> static_float(np.float32(0.5), "b1", 0, 1, open_lo=True, open_hi=True)
      0.5
    """
    if isinstance(value, (bool, np.bool_)) or not (
        isinstance(value, (int, float)) or _is_numpy_number(value)
    ):
        raise TypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    low = lo is None or (value > lo if open_lo else value >= lo)
    high = hi is None or (value < hi if open_hi else value <= hi)
    if not (np.isfinite(value) and low and high):
        if lo is not None and hi is not None:
            bound = f" in {'(' if open_lo else '['}{lo}, {hi}{')' if open_hi else ']'}"
        elif lo is not None:
            bound = f" {'>' if open_lo else '>='} {lo}"
        else:
            bound = "" if hi is None else f" {'<' if open_hi else '<='} {hi}"
        raise ValueError(f"{name} must be a finite number{bound}, got {value!r}")
    return value


def check_choice(value, name: str, choices):
    """``value`` if it is one of ``choices``, else a ValueError naming ``name`` and the choices.

    Example:
      >>> check_choice("ring", "algorithm", ("ring", "tree"))
      'ring'
    """
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_ratio(ratio) -> float:
    """``ratio`` as a float in ``(0, 1]``, or a TypeError/ValueError naming it.

    Example:
      >>> check_ratio(0.01)
      0.01
    """
    if (
        isinstance(ratio, bool)
        or not isinstance(ratio, (int, float))
        and not _is_numpy_number(ratio)
    ):
        raise TypeError(f"ratio must be a number in (0, 1], got {ratio!r}")
    ratio = float(ratio)
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    return ratio


def _is_numpy_number(value) -> bool:
    return (
        type(value).__module__ == "numpy" and hasattr(value, "dtype") and value.dtype.kind in "iuf"
    )


def check_rate(rate) -> int:
    """ZFP's ``rate`` (bits per value) as an int in ``[1, 32]``, or an error naming it.

    Example:
      >>> check_rate(8)
      8
    """
    return static_int(rate, "rate", 1, 32)


def check_bits(bits) -> int:
    """``bits`` as an int in ``[1, MAX_QUANTIZATION_BITS]``, or an error naming it.

    Example:
      >>> check_bits(8)
      8
    """
    return static_int(bits, "bits", 1, MAX_QUANTIZATION_BITS)


def check_flag(value, name: str) -> bool:
    """``value`` as a bool, or a TypeError naming ``name``.

    Example:
      >>> check_flag(True, "hadamard")
      True
    """
    if not isinstance(value, bool) and type(value).__name__ != "bool_":
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_devices(n_devices, inner_size=None) -> int:
    """``n_devices`` as an int >= 1 (and ``inner_size``, when given, dividing it), naming the
    argument.

    Example:
      >>> check_devices(8, 4)
      8
    """
    n = static_int(n_devices, "n_devices", 1)
    if inner_size is not None:
        inner = static_int(inner_size, "inner_size", 1, n)
        if n % inner:
            raise ValueError(f"inner_size ({inner}) must divide n_devices ({n})")
    return n


def check_message(n, dtype_bytes) -> tuple[int, int]:
    """``(n, dtype_bytes)`` validated: values in ``[1, 2**31 - 1]``, bytes per value in ``[1, 8]``.

    Example:
      >>> check_message(1000, 4)
      (1000, 4)
    """
    return (static_int(n, "n", 1, MAX_ROW_LENGTH), static_int(dtype_bytes, "dtype_bytes", 1, 8))


def check_explore_steps(explore_steps) -> int:
    """Validates ``explore_steps`` (an integer >= 1) and returns it.

    Example:
      >>> check_explore_steps(10)
      10
    """
    if (
        isinstance(explore_steps, bool)
        or not isinstance(explore_steps, (int, np.integer))
        or explore_steps < 1
    ):
        raise ValueError(f"explore_steps must be an integer >= 1, got {explore_steps!r}")
    return int(explore_steps)


def check_key(key, axis_name=None):  # noqa: D401
    """A ``jax.random`` key (typed or raw ``u32[2]``) as a typed key; with ``axis_name``, refuses a
    key that varies over that axis (every device must rotate by the same transform).

    Example:
      >>> import jax
      >>> check_key(jax.random.PRNGKey(0)).shape
      ()
    """
    import jax
    import jax.numpy as jnp

    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if not (typed and key.ndim == 0) and not (key.dtype == jnp.uint32 and key.shape == (2,)):
        raise TypeError(
            f"key must be one jax.random key (jax.random.key or PRNGKey), got "
            f"{key.dtype}{list(key.shape)}"
        )
    if axis_name is not None:
        from jaxcomp.ops._ffi import varying_axes

        if axis_name in varying_axes(key):
            raise ValueError(
                f"key must be the same on every device of {axis_name!r} (replicated: all devices "
                "must apply the same Hadamard transform), got a key that varies over it"
            )
    return key if typed else jax.random.wrap_key_data(key)


def check_k(x, k):
    """``(x, k)`` of a top-k op: ``x`` a float array, ``k`` a static int in ``[1, row length]``."""
    x = float_array(x, "x")
    k = static_int(k, "k", 1)
    if k > x.shape[-1]:
        raise ValueError(
            f"k must be at most the number of values in a row ({x.shape[-1]}), got {k}"
        )
    return x, k


def check_rounds(rounds) -> int:
    """The threshold search's ``rounds``: a static int in ``[1, 31]``."""
    return static_int(rounds, "rounds", 1, 31)


def check_decode(words, n, rate, dtype):
    """Checks :func:`jaxcomp.zfp_decode`'s arguments (also used by its reference)."""
    import jax.numpy as jnp

    n = static_int(n, "n", 1, MAX_ROW_LENGTH)
    rate = check_rate(rate)
    dtype = jnp.dtype(dtype)
    if dtype not in __getattr__("FLOAT_DTYPES"):
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    words = jnp.asarray(words)
    if words.dtype != jnp.uint32:
        raise TypeError(f"words must be uint32 (as zfp_encode returns), got dtype {words.dtype}")
    expected = row_words(n, rate)
    if words.ndim == 0 or words.shape[-1] != expected:
        raise ValueError(
            f"words must have {expected} words in its last axis for n={n}, rate={rate}, got shape "
            f"{words.shape}"
        )
    return words, n, rate, dtype
