"""Top-k, threshold search and threshold top-k as XLA operations (see :mod:`jaxcomp.xla`).

The k-th largest magnitude key ``K`` of a row settles everything (docs/kernels.md): after
``rounds`` bisection rounds the lower threshold is ``K`` with its low ``31 - rounds`` bits
cleared. Its bits are found most significant first, :data:`DIGIT_BITS` at a time: one pass over
the row counts the keys at or above each of the ``2**DIGIT_BITS - 1`` candidate thresholds that
share the bits found so far, and the new digit is the number of those counts that reach ``k``
(counts fall as thresholds rise). Selection keeps every key at or above the upper threshold and
the lowest-index keys inside the bracket, and compacts them in index order with a prefix sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

#: Key bits resolved per pass over the row: 15 comparisons per value and pass, 8 passes for
#: exact top-k. Wider digits mean fewer passes but more comparisons per value.
DIGIT_BITS = 4
_KEY_BITS = 31


def _keys(x):
    """Magnitude keys (uint32): float32 bits without the sign; key order is magnitude order."""
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) & jnp.uint32(0x7FFFFFFF)


def _rows(x):
    return x.reshape(-1, x.shape[-1])


def _bracket(keys, k, rounds):
    """Per row: ``lo`` (the k-th largest key, low ``31 - rounds`` bits cleared) and ``hi``."""
    prefix = jnp.zeros(keys.shape[:-1], jnp.uint32)  # the key bits resolved so far
    resolved = 0
    while resolved < rounds:
        width = min(DIGIT_BITS, rounds - resolved)
        shift = _KEY_BITS - resolved - width
        base = prefix << (_KEY_BITS - resolved) if resolved else prefix  # lo so far
        steps = jnp.arange(1, 1 << width, dtype=jnp.uint32) << shift
        thresholds = base[:, None] + steps  # [rows, 2**width - 1]: every digit but 0
        counts = jnp.sum(keys[:, None, :] >= thresholds[:, :, None], axis=-1, dtype=jnp.int32)
        digit = jnp.sum(counts >= k, axis=-1, dtype=jnp.uint32)
        prefix = (prefix << width) | digit
        resolved += width
    lo = prefix << (_KEY_BITS - rounds)
    return lo, lo + (jnp.uint32(1) << (_KEY_BITS - rounds))


def _select(x, keys, k, lo, hi):
    """Every key >= hi and the first (k - #{key >= hi}) keys in [lo, hi), in index order."""
    above = keys >= hi[:, None]
    inside = (keys >= lo[:, None]) & ~above
    need = k - jnp.sum(above, axis=-1, dtype=jnp.int32)
    taken = above | (inside & (jnp.cumsum(inside, axis=-1, dtype=jnp.int32) <= need[:, None]))
    # Exactly k entries per row are taken: the j-th lands in output slot j, the rest nowhere.
    slot = jnp.where(taken, jnp.cumsum(taken, axis=-1, dtype=jnp.int32) - 1, k)
    rows, n = keys.shape
    row = jnp.broadcast_to(jnp.arange(rows)[:, None], (rows, n))
    index = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (rows, n))
    indices = jnp.zeros((rows, k), jnp.int32).at[row, slot].set(index, mode="drop")
    values = jnp.take_along_axis(x, indices, axis=-1)
    return values, indices


def find_threshold(x, k, rounds):
    """:func:`jaxcomp.find_threshold` for float32 ``x [..., n]`` (checked arguments)."""
    keys = _keys(_rows(x))
    lo, _ = _bracket(keys, k, rounds)
    count = jnp.sum(keys >= lo[:, None], axis=-1, dtype=jnp.int32)
    threshold = lax.bitcast_convert_type(lo, jnp.float32)
    return threshold.reshape(x.shape[:-1]), count.reshape(x.shape[:-1])


def threshold_topk(x, k, rounds):
    """:func:`jaxcomp.threshold_topk` for float32 ``x [..., n]`` (checked arguments)."""
    rows = _rows(x)
    keys = _keys(rows)
    lo, hi = _bracket(keys, k, rounds)
    values, indices = _select(rows, keys, k, lo, hi)
    return values.reshape(x.shape[:-1] + (k,)), indices.reshape(x.shape[:-1] + (k,))


def topk(x, k):
    """:func:`jaxcomp.topk` for float32 ``x [..., n]``: threshold top-k with all 31 rounds."""
    return threshold_topk(x, k, _KEY_BITS)
