"""Top-k, threshold search and threshold top-k as XLA operations (see :mod:`jaxcomp.ops.xla`).

The k-th largest magnitude key ``K`` of a row settles everything (docs/kernels.md): after
``rounds`` bisection rounds the lower threshold is ``K`` with its low ``31 - rounds`` bits
cleared. As in the CPU kernel, a histogram of the keys' top 16 bits (a scatter-add, one pass over
the row) gives K's top 16 bits: its bin is where the count from the top reaches ``k``. A second
histogram, of the low 15 bits of the keys inside that bin, gives the rest when ``rounds > 16``.
A row shorter than :data:`SORT_BELOW` sorts its keys instead: the histograms' 2**16 + 2**15 bins a
row are fixed work, which on thousands of short rows costs seconds a call on XLA:CPU where the
sort takes a millisecond (docs/kernels.md); both find the same K (``tests/xla_test.py`` compares
them).
Selection keeps every key at or above the upper threshold and the lowest-index keys inside the
bracket, and compacts them in index order: population counts of the mask packed 32 entries to a
word, prefix sums over the words only, and a binary search per output slot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

_KEY_BITS = 31
_COARSE_BITS = 16
_FINE_BITS = _KEY_BITS - _COARSE_BITS
#: Rows shorter than this find their k-th key by a sort, longer ones by the two histograms: on
#: XLA:CPU the sort is faster on one row below about this length, the histograms above it
#: (docs/kernels.md, ``find_threshold``, has the timings).
SORT_BELOW = 1 << 14


def _keys(x):
    """Magnitude keys (uint32): float32 bits without the sign; key order is magnitude order."""
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) & jnp.uint32(0x7FFFFFFF)


def _rows(x):
    return x.reshape(-1, x.shape[-1])


def _histogram(bins, keys, weight, count):
    """Per row, how many keys fall in each of ``count`` bins (``bins``: int32, ``weight``: 0/1)."""
    rows, n = keys.shape
    row = jnp.broadcast_to(jnp.arange(rows)[:, None], (rows, n))
    return jnp.zeros((rows, count), jnp.int32).at[row, bins].add(weight, mode="drop")


def _kth_bin(hist, need):
    """Per row, the highest bin b with hist[b] + hist[b + 1] + ... >= need, and the count above
    b."""
    from_top = jnp.cumsum(hist[:, ::-1], axis=-1)  # [j]: bins count-1-j .. count-1
    reached = jnp.sum(
        from_top < need[:, None], axis=-1
    )  # bins from the top before the one reaching it
    above = jnp.take_along_axis(jnp.pad(from_top, ((0, 0), (1, 0))), reached[:, None], axis=-1)[
        :, 0
    ]
    return hist.shape[-1] - 1 - reached, above


def _bracket(keys, k, rounds, by=None):
    """Per row: ``lo`` (the k-th largest key, low ``31 - rounds`` bits cleared) and ``hi``.
    ``by``: "sort" or "histogram"; None picks by the row's length (:data:`SORT_BELOW`)."""
    by = by or ("sort" if keys.shape[-1] < SORT_BELOW else "histogram")
    kth = _kth_key_sorted(keys, k) if by == "sort" else _kth_key_histogram(keys, k, rounds)
    lo = (kth >> (_KEY_BITS - rounds)) << (_KEY_BITS - rounds)
    return lo, lo + (jnp.uint32(1) << (_KEY_BITS - rounds))


def _kth_key_sorted(keys, k):
    """Per row, the k-th largest key."""
    return jnp.sort(keys, axis=-1)[:, keys.shape[-1] - k]


def _kth_key_histogram(keys, k, rounds):
    """Per row, the k-th largest key's top ``rounds`` bits (the others are cleared by the
    caller): its top 16 bits from a histogram of the keys' top 16 bits, the rest (when
    ``rounds > 16``) from a histogram of the low 15 bits of the keys in that bin."""
    rows, n = keys.shape
    need = jnp.full((rows,), k, jnp.int32)
    coarse = (keys >> _FINE_BITS).astype(jnp.int32)
    kth_coarse, above = _kth_bin(
        _histogram(coarse, keys, jnp.ones((rows, n), jnp.int32), 1 << _COARSE_BITS), need
    )
    kth = kth_coarse.astype(jnp.uint32) << _FINE_BITS
    if rounds > _COARSE_BITS:
        inside = (coarse == kth_coarse[:, None]).astype(jnp.int32)
        fine = (keys & ((1 << _FINE_BITS) - 1)).astype(jnp.int32)
        kth_fine, _ = _kth_bin(_histogram(fine, keys, inside, 1 << _FINE_BITS), need - above)
        kth = kth | kth_fine.astype(jnp.uint32)
    return kth


def _pack(mask):
    """[rows, n] bool -> [rows, ceil(n / 32)] uint32, entry 32 w + j at bit j of word w."""
    rows, n = mask.shape
    words = -(-n // 32)
    mask = jnp.pad(mask, ((0, 0), (0, words * 32 - n))).reshape(rows, words, 32)
    return jnp.sum(
        mask.astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32
    )


def _low_mask(bits):
    """Words with their low ``bits`` (0..32) bits set."""
    bits = jnp.asarray(bits, jnp.uint32)
    return jnp.where(
        bits >= 32, jnp.uint32(0xFFFFFFFF), (jnp.uint32(1) << jnp.minimum(bits, 31)) - 1
    )


def _count_before(mask):
    """[rows, n]: how many entries of each row before each entry hold ``mask``. Counted 32 at a
    time (population counts of packed words), so the prefix sum runs over n / 32 words: XLA's
    prefix sums cost far more per element than its elementwise operations."""
    rows, n = mask.shape
    words = _pack(mask)
    counts = lax.population_count(words).astype(jnp.int32)
    before_word = jnp.cumsum(counts, axis=-1) - counts
    bit = jnp.arange(32, dtype=jnp.uint32)
    within = lax.population_count(words[..., None] & _low_mask(bit)).astype(jnp.int32)
    return (before_word[..., None] + within).reshape(rows, words.shape[-1] * 32)[:, :n]


def _positions(mask, k):
    """[rows, k] int32: the indices of the k entries of each row that hold ``mask`` (exactly k),
    in ascending order. Each output slot finds its word by binary search over the words' running
    counts and its bit by binary search over population counts: work for k entries, not n."""
    words = _pack(mask)
    counts = lax.population_count(words).astype(jnp.int32)
    through = jnp.cumsum(counts, axis=-1)
    slot = jnp.arange(k, dtype=jnp.int32)

    def row(through_row, counts_row, words_row):
        word = jnp.searchsorted(through_row, slot, side="right").astype(jnp.int32)
        rank = slot - (through_row[word] - counts_row[word])  # among the set bits of its word
        bits = words_row[word]
        position = jnp.zeros_like(slot)
        for width in (16, 8, 4, 2, 1):
            below = lax.population_count(bits & _low_mask(position + width)).astype(jnp.int32)
            position = jnp.where(below <= rank, position + width, position)
        return word * 32 + position

    return jax.vmap(row)(through, counts, words)


def _select(x, keys, k, lo, hi):
    """Every key >= hi and the first (k - #{key >= hi}) keys in [lo, hi), in index order."""
    above = keys >= hi[:, None]
    inside = (keys >= lo[:, None]) & ~above
    need = k - jnp.sum(above, axis=-1, dtype=jnp.int32)
    taken = above | (inside & (_count_before(inside) < need[:, None]))
    indices = _positions(taken, k)
    return jnp.take_along_axis(x, indices, axis=-1), indices


@functools.partial(jax.jit, static_argnames=("k", "rounds"))
def find_threshold(x, k, rounds):
    """:func:`jaxcomp.find_threshold` in plain XLA operations, bit-identical to the native kernel.

    Args:
      x: float32 ``[..., n]`` (checked by the public op).
      k: static int in ``[1, n]``.
      rounds: static int in ``[1, 31]``.

    Returns:
      ``(threshold, count)``, each ``[...]``: float32 and int32, as the native kernel's.

    Example:
      >>> import jax.numpy as jnp
      >>> t, c = find_threshold(jnp.array([0.5, -3.0, 1.0, 2.0]), 2, 31)
      >>> float(t), int(c)
      (2.0, 2)

    References:
      Shi et al., MLSys 2021, §3.1 (MSTopK); the radix search of the magnitude key, as
      ``kernels/topk.h`` does it.
    """
    keys = _keys(_rows(x))
    lo, _ = _bracket(keys, k, rounds)
    count = jnp.sum(keys >= lo[:, None], axis=-1, dtype=jnp.int32)
    threshold = lax.bitcast_convert_type(lo, jnp.float32)
    return threshold.reshape(x.shape[:-1]), count.reshape(x.shape[:-1])


@functools.partial(jax.jit, static_argnames=("k", "rounds"))
def threshold_topk(x, k, rounds):
    """:func:`jaxcomp.threshold_topk` in plain XLA operations, bit-identical to the native kernel.

    Args:
      x: float32 ``[..., n]`` (checked by the public op).
      k: static int in ``[1, n]``.
      rounds: static int in ``[1, 31]``.

    Returns:
      ``(values, indices)``, each ``[..., k]``, in ascending index order.

    Example:
      >>> import jax.numpy as jnp
      >>> threshold_topk(jnp.array([0.5, -3.0, 1.0, 2.0]), 2, 16)[1].tolist()
      [1, 3]

    References:
      Shi et al., MLSys 2021, §3.1 (MSTopK).
    """
    rows = _rows(x)
    keys = _keys(rows)
    lo, hi = _bracket(keys, k, rounds)
    values, indices = _select(rows, keys, k, lo, hi)
    return values.reshape(x.shape[:-1] + (k,)), indices.reshape(x.shape[:-1] + (k,))


@functools.partial(jax.jit, static_argnames=("k",))
def topk(x, k):
    """:func:`jaxcomp.topk` in plain XLA operations: threshold top-k with all 31 rounds, exact.

    Args:
      x: float32 ``[..., n]`` (checked by the public op).
      k: static int in ``[1, n]``.

    Returns:
      ``(values, indices)``, each ``[..., k]``, in ascending index order; ties to the lower
      index, NaN ranks largest, as the native kernel.

    Example:
      >>> import jax.numpy as jnp
      >>> topk(jnp.array([0.5, -3.0, 1.0, 2.0]), 2)[0].tolist()
      [-3.0, 2.0]

    References:
      Top-k sparsification as in Tyagi & Swany (arXiv 2312.02493) and Shi et al. (MLSys 2021).
    """
    return threshold_topk(x, k, _KEY_BITS)
