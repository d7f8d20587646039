"""The Walsh-Hadamard transform, and the cheap random streams of THC's quantizer.

:func:`hadamard_transform` runs a native kernel on the CPU (``kernels/hadamard.h``: all log2(n)
butterfly stages of a row in cache, about one pass over memory) and the same butterflies as XLA ops
elsewhere (GPU, TPU); both compute the same floats in the same order, so they agree bit for bit.

:func:`counter_uniform` and :func:`counter_signs` draw the quantizer's per-value randomness from a
counter-based integer hash (murmur3's 32-bit finalizer of the value's index mixed with a seed
that comes from a ``jax.random`` key). On a CPU that costs about one pass over memory, against
about ten for ``jax.random.uniform``'s threefry; the draws are for stochastic rounding and random
signs, which need independence and uniformity, not cryptographic strength.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.ops import _checks, _ffi

_GOLDEN = np.uint32(0x9E3779B9)


def _check_rows(x, name="x"):
    x = _checks.float_array(x, name)
    n = x.shape[-1] if x.ndim else 0
    if x.ndim == 0 or n < 1 or n & (n - 1):
        raise ValueError(f"{name}'s last axis must have a power-of-two length, got shape {x.shape}")
    return x


def hadamard_reference(x):
    """:func:`hadamard_transform` as XLA ops: log2(n) butterfly stages, in the native kernel's
    order.

    Args:
      x: float array whose last axis has a power-of-two length.

    Returns:
      The unnormalized transform of each row, float32.

    Example:
      >>> import jax.numpy as jnp
      >>> hadamard_reference(jnp.array([1.0, 0.0, 0.0, 0.0])).tolist()
      [1.0, 1.0, 1.0, 1.0]

    References:
      Fino & Algazi, "Unified Matrix Treatment of the Fast Walsh-Hadamard Transform", IEEE Trans.
      Computers, 1976.
    """
    x = _check_rows(x).astype(jnp.float32)
    lead, n = x.shape[:-1], x.shape[-1]
    h = 1
    while h < n:
        pairs = x.reshape(lead + (n // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = jnp.stack([a + b, a - b], axis=-2).reshape(lead + (n,))
        h *= 2
    return x


def hadamard_transform(x, *, implementation=None):
    """Unnormalized Walsh-Hadamard transform of each row of ``x`` (``H_n x``, ``H_n H_n = n I``).

    Differentiable: the transform is linear and ``H_n`` symmetric, so the gradient of a loss is
    the transform of the output's gradient.

    Args:
      x: float32, bfloat16 or float16 array; its last axis (the rows) has a power-of-two length.
        Leading axes are independent rows.
      implementation: ``"native"`` (the CPU kernel; CPU only), ``"xla"``
        (:func:`hadamard_reference`, any platform, the same floats bit for bit) or ``None``: native
        on the CPU, xla elsewhere.

    Returns:
      float32 array of ``x``'s shape. Divide by ``sqrt(n)`` for the orthonormal transform.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> jaxcomp.hadamard_transform(jnp.array([1.0, 2.0, 3.0, 4.0])).tolist()
      [10.0, -2.0, -4.0, 0.0]

    References:
      Li et al., "THC: Accelerating Distributed Deep Learning Using Tensor Homomorphic
      Compression", NSDI 2024 (the randomized Hadamard transform before quantizing).
    """
    x = _check_rows(x).astype(jnp.float32)
    implementation = _ffi.check_implementation(implementation)
    return _transform(x, implementation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _transform(x, implementation):
    if implementation == "xla":
        return hadamard_reference(x)
    call = jax.ffi.ffi_call(
        "jaxcomp_hadamard", jax.ShapeDtypeStruct(x.shape, jnp.float32), vmap_method="broadcast_all"
    )

    def native(v):
        return _ffi.like_varying(call(v), v)

    if implementation == "native":
        return native(x)
    # The XLA path is the designed one off the CPU (the same butterflies): no warning.
    return _ffi.platform_dependent(x, cpu=native, default=hadamard_reference)


def _transform_forward(x, implementation):
    return _transform(x, implementation), None


def _transform_backward(implementation, _, cotangent):
    return (_transform(cotangent, implementation),)  # H is symmetric: the VJP is H itself


_transform.defvjp(_transform_forward, _transform_backward)


def _fmix32(h):
    """murmur3's 32-bit finalizer: every input bit flips each output bit with probability ~1/2."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _hash(key, shape):
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    seed = jax.random.bits(key, (2,), jnp.uint32)
    size = int(np.prod(shape))
    index = jax.lax.iota(jnp.uint32, size)
    return _fmix32(_fmix32(index * _GOLDEN + seed[0]) ^ seed[1]).reshape(shape)


def counter_uniform(key, shape):
    """Uniform floats in ``[0, 1)`` with 24 random bits each, from a counter hash seeded by ``key``.

    Args:
      key: a ``jax.random`` key (typed, or raw ``uint32[2]``).
      shape: static output shape.

    Returns:
      float32 array of ``shape``.

    Example:
      >>> import jax
      >>> u = counter_uniform(jax.random.key(0), (10000,))
      >>> bool(0.48 < float(u.mean()) < 0.52), bool(u.min() >= 0), bool(u.max() < 1)
      (True, True, True)

    References:
      Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3", SC 2011 (counter-based
      generators); Appleby, MurmurHash3 (the 32-bit finalizer).
    """
    return (_hash(key, shape) >> 8).astype(jnp.float32) * np.float32(2.0**-24)


def counter_signs(key, shape):
    """Random ``±1.0`` (float32), one hash bit each, from a counter hash seeded by ``key``.

    Args:
      key: a ``jax.random`` key (typed, or raw ``uint32[2]``).
      shape: static output shape.

    Returns:
      float32 array of ``shape`` holding -1.0 and 1.0.

    Example:
      >>> import jax
      >>> s = counter_signs(jax.random.key(0), (10000,))
      >>> sorted(set(s.tolist())), abs(float(s.mean())) < 0.05
      ([-1.0, 1.0], True)

    References:
      Li et al., THC, NSDI 2024 (shared random signs of the randomized Hadamard transform).
    """
    return jnp.where(_hash(key, shape) >> 31 == 0, np.float32(1.0), np.float32(-1.0))
