"""Top-k selection by magnitude: exact (:func:`topk`) and MSTopK threshold search.

Semantics (ties, NaN, output order, what ``rounds`` means) are in ``docs/kernels.md``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.ops import _checks, _ffi
from jaxcomp.ops import xla as _xla

#: Bisection rounds of the threshold search by default: 8 exponent bits and 8 mantissa bits, all
#: resolved by one 16-bit histogram pass over memory; selected and unselected magnitudes are then
#: separated by a factor of at most 1 + 2**-8.
DEFAULT_ROUNDS = 16


def _rows_call(target, x, result_shapes, **attrs):
    """Calls ``target`` on ``x`` (any leading dims, passed in its own dtype) with int64
    attributes."""
    call = _ffi.ffi_call(target, result_shapes, vmap_method="broadcast_all")
    return call(x, **{name: np.int64(v) for name, v in attrs.items()})


def _dispatch_selection(op, x, target, k, portable, implementation, **attrs):
    """``(values, indices)`` of a selecting op: values in ``x``'s dtype, indices int32.

    The CPU kernels and the XLA path take float32, so a bfloat16/float16 ``x`` is upcast (exact)
    for them and the selected values cast back (exact: they are upcast inputs). The CUDA kernels
    read 16-bit input directly and write the values in its dtype: no upcast pass over memory,
    the same indices, and values whose upcast is the float32 path's.
    """
    batch = x.shape[:-1]
    dtype = x.dtype
    int_shape = jax.ShapeDtypeStruct(batch + (k,), jnp.int32)

    def native(v):
        values, indices = _rows_call(
            target,
            v.astype(jnp.float32),
            (jax.ShapeDtypeStruct(batch + (k,), jnp.float32), int_shape),
            k=k,
            **attrs,
        )
        return values.astype(dtype), indices

    def native_cuda(v):
        return _rows_call(
            target, v, (jax.ShapeDtypeStruct(batch + (k,), dtype), int_shape), k=k, **attrs
        )

    def xla(v):
        values, indices = portable(v.astype(jnp.float32))
        return values.astype(dtype), indices

    return _ffi.dispatch(op, (x,), native, xla, implementation, native_cuda=native_cuda)


def topk(x, k, *, implementation=None):
    """The ``k`` entries of largest magnitude along the last axis, exactly.

    Args:
      x: float32, bfloat16 or float16 array ``[..., n]``; leading axes are independent rows.
      k: static int, ``1 <= k <= n``.
      implementation: ``"native"`` (the FFI kernel), ``"xla"`` (:mod:`jaxcomp.ops.xla`, any
        platform, the same result bit for bit) or ``None``: native where a native module serves the
        platform, else xla with a warning.

    Returns:
      ``(values, indices)``, each ``[..., k]``: ``values`` keep sign and dtype, ``indices`` are
      int32, both in ascending index order. Among equal magnitudes the lower index wins; NaN ranks
      as the largest magnitude.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> values, indices = jaxcomp.topk(jnp.array([0.5, -3.0, 1.0, 2.0]), 2)
      >>> values.tolist(), indices.tolist()
      ([-3.0, 2.0], [1, 3])

    References:
      Top-k sparsification as used by Tyagi & Swany (arXiv 2312.02493) and Shi et al. (MLSys 2021).
    """
    x, k = _checks.check_k(x, k)
    implementation = _ffi.check_implementation(implementation)
    return _dispatch_selection(
        "jaxcomp.topk", x, "jaxcomp_topk", k, lambda v: _xla.topk(v, k), implementation
    )


def find_threshold(x, k, rounds=DEFAULT_ROUNDS, *, implementation=None):
    """MSTopK threshold search: a magnitude threshold that keeps at least ``k`` entries.

    Bisects the float32 bit pattern of ``|x|`` (exponent first, then mantissa) for ``rounds``
    rounds, keeping a lower threshold with at least ``k`` entries at or above it and an upper one
    with fewer than ``k``. MSTopK starts at ``mean(|x|)`` and doubles or halves; here an exponent
    histogram evaluates every power-of-two threshold in the same pass, so the start point no longer
    matters and the search never stalls outside the right binade.

    Args:
      x: float32, bfloat16 or float16 array ``[..., n]``; leading axes are independent rows.
      k: static int, ``1 <= k <= n``.
      rounds: static int in ``[1, 31]``; each round halves the bracket. 31 finds the exact k-th
        largest magnitude.
      implementation: ``"native"``, ``"xla"`` or ``None``, as for :func:`topk`.

    Returns:
      ``(threshold, count)``, each ``[...]``: the lower threshold (float32) and the exact number of
      entries with ``|x| >= threshold`` (int32, at least ``k``).

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> t, c = jaxcomp.find_threshold(jnp.array([0.5, -3.0, 1.0, 2.0]), 2, rounds=31)
      >>> float(t), int(c)
      (2.0, 2)

    References:
      Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
      Clusters", MLSys 2021, §3.1 (MSTopK).
    """
    x, k = _checks.check_k(x, k)
    rounds = _checks.check_rounds(rounds)
    implementation = _ffi.check_implementation(implementation)
    batch = x.shape[:-1]
    results = (jax.ShapeDtypeStruct(batch, jnp.float32), jax.ShapeDtypeStruct(batch, jnp.int32))

    def native(v):  # CPU: float32 input
        return _rows_call(
            "jaxcomp_find_threshold", v.astype(jnp.float32), results, k=k, rounds=rounds
        )

    def native_cuda(v):  # the CUDA kernels read bfloat16/float16 as they are
        return _rows_call("jaxcomp_find_threshold", v, results, k=k, rounds=rounds)

    return _ffi.dispatch(
        "jaxcomp.find_threshold",
        (x,),
        native,
        lambda v: _xla.find_threshold(v.astype(jnp.float32), k, rounds),
        implementation,
        native_cuda=native_cuda,
    )


def threshold_topk(x, k, rounds=DEFAULT_ROUNDS, *, implementation=None):
    """Approximate top-k by MSTopK thresholds, exactly ``k`` entries, no sort.

    Takes every entry above the upper threshold of :func:`find_threshold`'s bracket, then fills
    to exactly ``k`` with the lowest-index entries between the two thresholds. Every selected
    magnitude is at least the lower threshold and every unselected one is below the upper; for
    normal floats the two differ by a factor of at most ``1 + 2**(8 - rounds)``. With
    ``rounds=31`` the result equals :func:`topk`.

    Args:
      x: float32, bfloat16 or float16 array ``[..., n]``; leading axes are independent rows.
      k: static int, ``1 <= k <= n``.
      rounds: static int in ``[1, 31]`` (default :data:`DEFAULT_ROUNDS`).
      implementation: ``"native"``, ``"xla"`` or ``None``, as for :func:`topk`.

    Returns:
      ``(values, indices)`` like :func:`topk`: ``[..., k]``, ascending index order.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> values, indices = jaxcomp.threshold_topk(jnp.array([0.5, -3.0, 1.0, 2.0]), 2)
      >>> indices.tolist()
      [1, 3]

    References:
      Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
      Clusters", MLSys 2021, §3.1 (MSTopK).
    """
    x, k = _checks.check_k(x, k)
    rounds = _checks.check_rounds(rounds)
    implementation = _ffi.check_implementation(implementation)
    return _dispatch_selection(
        "jaxcomp.threshold_topk",
        x,
        "jaxcomp_threshold_topk",
        k,
        lambda v: _xla.threshold_topk(v, k, rounds),
        implementation,
        rounds=rounds,
    )


def merged_indices_xla(runs, pad):
    """:func:`merged_indices` in XLA ops: every platform but the CPU, and the kernel's reference.

    Args:
      runs: int32 ``[runs, length]``.
      pad: a Python int, what each repeat becomes.

    Returns:
      The int32 ``[runs * length]`` merge, each repeat ``pad``.

    Example:
      >>> import jax.numpy as jnp
      >>> merged_indices_xla(jnp.array([[0, 3], [1, 3]], jnp.int32), 9).tolist()
      [0, 1, 3, 9]

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-A (AR-Topk's shared indices; SPLIT is jaxcomp's).
    """
    ordered = jnp.sort(runs.reshape(-1))
    repeat = jnp.concatenate([jnp.zeros(1, bool), ordered[1:] == ordered[:-1]])
    return jnp.where(repeat, jnp.int32(pad), ordered)


def merged_indices(runs, pad):
    """Rows of indices as one ascending vector, each repeat of an index replaced by ``pad``:
    ``sort(runs.ravel())`` with every entry equal to the one before it marked.

    AR-Topk's SPLIT leader all-gathers every device's top-k indices, each device's ascending
    (:func:`topk`'s order), and sends each index once. On the CPU a native kernel
    (``kernels/merge.h``) merges the ascending rows pairwise instead of sorting them (XLA:CPU's
    sort of the indices costs about as much as a pass over the gradient); rows that are not
    ascending are sorted, so the result is :func:`merged_indices_xla`'s, bit for bit, for any
    input.

    Args:
      runs: int32 ``[runs, length]``, ``runs, length >= 1``.
      pad: a Python int in int32's range (SPLIT passes ``n``, which every scatter drops).

    Returns:
      int32 ``[runs * length]``.

    Example:
      >>> import jax.numpy as jnp
      >>> merged_indices(jnp.array([[0, 3, 4], [1, 3, 5]], jnp.int32), 9).tolist()
      [0, 1, 3, 9, 4, 5]

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-A (AR-Topk's shared indices; SPLIT is jaxcomp's).
    """
    runs = jnp.asarray(runs)
    if runs.ndim != 2 or runs.dtype != jnp.int32 or 0 in runs.shape:
        raise ValueError(
            f"runs must be a non-empty 2-D int32 array, got {runs.dtype} of shape {runs.shape}"
        )
    if not isinstance(pad, (int, np.integer)) or not -(2**31) <= int(pad) < 2**31:
        raise ValueError(f"pad must be a Python int in int32's range, got {pad!r}")
    pad = int(pad)
    if _ffi.check_implementation(None) == "xla":
        return merged_indices_xla(runs, pad)
    call = _ffi.ffi_call(
        "jaxcomp_merge_indices",
        jax.ShapeDtypeStruct((runs.size,), jnp.int32),
        vmap_method="sequential",
    )
    return _ffi.platform_dependent(
        runs,
        cpu=lambda r: call(r, pad=np.int64(pad)),
        default=lambda r: merged_indices_xla(r, pad),
    )
