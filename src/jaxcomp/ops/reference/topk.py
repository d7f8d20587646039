"""Pure-JAX references of :func:`jaxcomp.topk`, :func:`jaxcomp.find_threshold` and
:func:`jaxcomp.threshold_topk`, following ``docs/kernels.md`` step by step.

Each works on one row and is vmapped over the leading axes. They favour the obvious over the
fast: a full stable sort for top-k, one pass over the row per bisection round.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.ops import _checks

#: Every magnitude key is below this, so it is the bisection's first upper bound.
_KEY_END = 2**31


def _magnitude_keys(x):
    """The magnitude key of each value: its float32 bits with the sign bit cleared (uint32).

    Key order is magnitude order, and every NaN has a larger key than +-Inf.
    """
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return bits & jnp.uint32(0x7FFFFFFF)


def _over_rows(row_fn, x):
    """Applies ``row_fn`` to every row (last axis) of ``x``; outputs get x's leading axes back."""
    batch = x.shape[:-1]
    outputs = jax.vmap(row_fn)(x.reshape((-1, x.shape[-1])))
    return jax.tree.map(lambda out: out.reshape(batch + out.shape[1:]), outputs)


def _check(x, k, rounds=None):
    x, k = _checks.check_k(x, k)
    return x, k, None if rounds is None else _checks.check_rounds(rounds)


def _bisect(keys, k, rounds):
    """The bracket ``(lo, hi)`` after ``rounds`` rounds; invariant ``C(lo) >= k > C(hi)``."""

    def round_(_, bracket):
        lo, hi = bracket
        mid = lo + (hi - lo) // 2
        enough = jnp.sum(keys >= mid) >= k  # C(mid) >= k
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    return lax.fori_loop(0, rounds, round_, (jnp.uint32(0), jnp.uint32(_KEY_END)))


def _select(x, take, k):
    """Values and int32 indices of the ``k`` entries where ``take`` holds, in index order."""
    (indices,) = jnp.nonzero(take, size=k)
    indices = indices.astype(jnp.int32)
    return x[indices], indices


def topk(x, k):
    """Reference of :func:`jaxcomp.topk`: stable sort by descending magnitude key, keep ``k``.

    Args:
      x: float32, bfloat16 or float16 array ``[..., n]``.
      k: static int, ``1 <= k <= n``.

    Returns:
      ``(values, indices)``, each ``[..., k]``, ascending index order.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.ops import reference
      >>> reference.topk(jnp.array([1.0, -2.0, 2.0, 0.5]), 2)[1].tolist()
      [1, 2]

    References:
      Top-k sparsification as used by Tyagi & Swany (arXiv 2312.02493) and Shi et al. (MLSys 2021).
    """
    x, k, _ = _check(x, k)
    return _topk(x, k)


@functools.partial(jax.jit, static_argnums=1)
def _topk(x, k):
    def row(values):
        keys = _magnitude_keys(values)
        # Ascending order of (largest key - key); the stable sort puts lower indices first on ties.
        order = jnp.argsort(jnp.uint32(_KEY_END - 1) - keys, stable=True)
        indices = jnp.sort(order[:k]).astype(jnp.int32)
        return values[indices], indices

    return _over_rows(row, x)


def find_threshold(x, k, rounds=16):  # 16 = jaxcomp.DEFAULT_ROUNDS
    """Reference of :func:`jaxcomp.find_threshold`: the bisection, one count per round.

    Args:
      x: float32, bfloat16 or float16 array ``[..., n]``.
      k: static int, ``1 <= k <= n``.
      rounds: static int in ``[1, 31]``.

    Returns:
      ``(threshold, count)``, each ``[...]``: float32 from the bits of ``lo`` and ``C(lo)`` (int32).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.ops import reference
      >>> t, c = reference.find_threshold(jnp.array([0.5, -3.0, 1.0, 2.0]), 2, rounds=31)
      >>> float(t), int(c)
      (2.0, 2)

    References:
      Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
      Clusters", MLSys 2021, §3.1 (MSTopK).
    """
    x, k, rounds = _check(x, k, rounds)
    return _find_threshold(x, k, rounds)


# `rounds` stays a traced loop bound, so one compilation serves every rounds value.
@functools.partial(jax.jit, static_argnums=1)
def _find_threshold(x, k, rounds):
    def row(values):
        keys = _magnitude_keys(values)
        lo, _ = _bisect(keys, k, rounds)
        count = jnp.sum(keys >= lo).astype(jnp.int32)
        return lax.bitcast_convert_type(lo, jnp.float32), count

    return _over_rows(row, x)


def threshold_topk(x, k, rounds=16):  # 16 = jaxcomp.DEFAULT_ROUNDS
    """Reference of :func:`jaxcomp.threshold_topk`: keys ``>= hi``, then the first bracket keys.

    Args:
      x: float32, bfloat16 or float16 array ``[..., n]``.
      k: static int, ``1 <= k <= n``.
      rounds: static int in ``[1, 31]``.

    Returns:
      ``(values, indices)``, each ``[..., k]``, ascending index order.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.ops import reference
      >>> reference.threshold_topk(jnp.array([0.5, -3.0, 1.0, 2.0]), 2)[1].tolist()
      [1, 3]

    References:
      Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
      Clusters", MLSys 2021, §3.1 (MSTopK).
    """
    x, k, rounds = _check(x, k, rounds)
    return _threshold_topk(x, k, rounds)


@functools.partial(jax.jit, static_argnums=1)
def _threshold_topk(x, k, rounds):
    def row(values):
        keys = _magnitude_keys(values)
        lo, hi = _bisect(keys, k, rounds)
        above = keys >= hi  # fewer than k, all in the exact top-k
        inside = (keys >= lo) & (keys < hi)
        still_needed = k - jnp.sum(above)
        take = above | (inside & (jnp.cumsum(inside) <= still_needed))  # lowest indices first
        return _select(values, take, k)

    return _over_rows(row, x)
