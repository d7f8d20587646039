"""A sparse aggregate and its update: :class:`SparseTotal` and :func:`scatter_leaves`.

Top-k and random-k sum ``(index, value)`` pairs over the devices. Their total used to be built
as a dense vector (zeros, then a scatter) and copied leaf by leaf into the update: on the CPU a
fresh 100 MB vector zeroed, written and read again for a 25M-parameter model. A
:class:`SparseTotal` keeps the pairs, and :func:`scatter_leaves` writes them straight into the
update's leaves (one native pass on the CPU, ``kernels/scatter.h``); :meth:`SparseTotal.dense` is
the dense vector, the reference both follow bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.ops import flat


@jax.tree_util.register_pytree_node_class
class SparseTotal:
    """The sum over the devices of sparse rows: ``rows`` rows of ``(index, value)`` pairs, added
    into ``n`` zeros in row order (in float32), or set (``add=False``: one row of distinct
    indices). Indices outside ``[0, n)`` are dropped. ``drop``: non-finite sums count as 0.

    Args:
      indices: int32 ``[rows, pairs]`` (a 1-D array is one row).
      values: ``[rows, pairs]`` floats, the pairs' values.
      n: static int, the length of the dense total.
      add: add the rows in order (True), or set the one row's values (False).
      dtype: the dense total's dtype (default: the values').
      drop: non-finite entries of the sum become 0.

    Example:
      >>> import jax.numpy as jnp
      >>> t = SparseTotal(jnp.array([[0, 2], [2, 1]]), jnp.array([[1.0, 2.0], [3.0, 4.0]]), 4)
      >>> t.dense().tolist()
      [1.0, 4.0, 5.0, 0.0]

    References:
      Shi et al., MLSys 2021, §3.2 (the gathered pairs added into a dense vector).
    """

    def __init__(self, indices, values, n: int, *, add: bool = True, dtype=None, drop=False):
        indices, values = jnp.asarray(indices), jnp.asarray(values)
        self.indices = indices if indices.ndim == 2 else indices.reshape(1, -1)
        self.values = values if values.ndim == 2 else values.reshape(1, -1)
        self.n, self.add, self.drop = int(n), bool(add), bool(drop)
        self.dtype = jnp.dtype(dtype if dtype is not None else self.values.dtype)

    def tree_flatten(self):
        return (self.indices, self.values), (self.n, self.add, self.dtype, self.drop)

    @classmethod
    def tree_unflatten(cls, aux, children):
        # No conversion: JAX may unflatten with placeholders in place of the arrays.
        total = object.__new__(cls)
        total.indices, total.values = children
        total.n, total.add, total.dtype, total.drop = aux
        return total

    def dropped(self) -> SparseTotal:
        """The same total with its non-finite sums as 0."""
        aux = (self.n, self.add, self.dtype, True)
        return self.tree_unflatten(aux, (self.indices, self.values))

    def dense(self):
        """The total as a dense ``[n]`` vector of :attr:`dtype`, in XLA ops."""
        if self.add:

            def add_row(row, total):
                update = self.values[row].astype(jnp.float32)
                return total.at[self.indices[row]].add(update, unique_indices=True, mode="drop")

            zeros = jnp.zeros(self.n, jnp.float32)
            total = jax.lax.fori_loop(0, self.indices.shape[0], add_row, _like(zeros, self.values))
            total = total.astype(self.dtype)
        else:
            total = (
                _like(jnp.zeros(self.n, self.dtype), self.values)
                .at[self.indices[0]]
                .set(self.values[0].astype(self.dtype), unique_indices=True, mode="drop")
            )
        return flat.dropped(total) if self.drop else total


def _like(x, like):
    from jaxcomp.ops import _ffi

    return _ffi.like_varying(x, like)


def _check(total, shapes, scale):
    if not isinstance(total, SparseTotal):
        raise TypeError(f"total must be a SparseTotal, got {type(total).__name__}")
    sizes = [int(np.prod(s)) for s in shapes]
    if sum(sizes) != total.n:
        raise ValueError(
            f"shapes must hold the total's {total.n} values, got {sum(sizes)} in {list(shapes)}"
        )
    _check_scale(scale)
    if not total.add and total.indices.shape[0] != 1:
        raise ValueError(f"add=False takes one row, got {total.indices.shape[0]}")


def scatter_leaves_xla(total: SparseTotal, shapes, scale=1.0, silenced=None):
    """:func:`scatter_leaves` in XLA ops (every platform but the CPU, and the kernel's
    reference): the dense total, then each leaf's slice of it, scaled.

    Args:
      total: a :class:`SparseTotal`.
      shapes: the leaves' shapes, in order; their sizes add up to ``total.n``.
      scale: a Python float > 0, every entry's factor (``1 / devices`` for the mean).
      silenced: None, or a bool scalar: True makes every leaf 0.

    Returns:
      A list of float32 arrays of ``shapes``.

    Example:
      >>> import jax.numpy as jnp
      >>> t = SparseTotal(jnp.array([0, 2]), jnp.array([2.0, 4.0]), 3)
      >>> [x.tolist() for x in scatter_leaves_xla(t, [(1,), (2,)], 0.5)]
      [[1.0], [0.0, 2.0]]

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (the averaged aggregate).
    """
    _check(total, shapes, scale)
    return split_scaled_xla(total.dense(), shapes, scale, silenced)


#: :func:`split_scaled` writes leaves of up to this many values with its native kernel.
SPLIT_SMALL_VALUES = 1 << 16
#: ... in runs of at least this many consecutive such leaves (a run is one kernel call).
SPLIT_MIN_RUN = 8


def split_scaled(dense, shapes, scale=1.0, silenced=None, drop=False):
    """A dense total's leaves of ``shapes``, in order, each in float32 times ``scale`` (zeros when
    ``silenced``; with ``drop`` non-finite values as 0): how the update and the residual are read
    out of any dense vector.

    Sliced by XLA, each leaf's slice is fused into its consumers with its offset as a constant, so
    no two leaves share a compiled loop: XLA:CPU compiles each on its own, and a model of 1,000
    small leaves spent most of its first step on them (docs/performance.md, "The first step of a
    model of 1,000 small leaves"). So on the CPU (a float32 total), runs of at least
    :data:`SPLIT_MIN_RUN` leaves of at most :data:`SPLIT_SMALL_VALUES` values each are written by
    one native pass (``kernels/scatter.h``, ``split_leaves``), bit for bit :func:`split_scaled_xla`.
    A large leaf stays an XLA slice: fused into its consumers it costs no pass over memory, where
    the kernel would write it out (an MLP of 25M values in 12 leaves stepped slower so). Elsewhere,
    and for other dtypes, :func:`split_scaled_xla` runs.

    Args:
      dense: a 1-D array of at least the shapes' total size.
      shapes: the leaves' shapes, in order.
      scale: a Python number > 0, every entry's factor (``1 / devices`` for the mean).
      silenced: None, or a bool scalar: True makes every leaf 0.
      drop: non-finite entries become 0 (the residual: a value that overflowed is not kept), in
        the same pass.

    Returns:
      A list of float32 arrays of ``shapes``.

    Example:
      >>> import jax.numpy as jnp
      >>> [x.tolist() for x in split_scaled(jnp.array([2.0, 4.0, 6.0]), [(1,), (2,)], 0.5)]
      [[1.0], [2.0, 3.0]]

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (the averaged aggregate).
    """
    from jaxcomp.ops import _ffi

    shapes = [tuple(s) for s in shapes]
    _check_dense(dense, shapes, scale)
    if _ffi.check_implementation(None) == "xla" or dense.dtype != jnp.float32:
        return split_scaled_xla(dense, shapes, scale, silenced, drop)
    sizes = [int(np.prod(s)) for s in shapes]
    offsets = np.cumsum([0] + sizes).tolist()
    out = []
    for first, stop, native in _split_runs(sizes):
        part = dense if first == 0 else dense[offsets[first] : offsets[stop]]
        split = _split_native if native else split_scaled_xla
        out += split(part, shapes[first:stop], scale, silenced, drop)
    return out


def _split_runs(sizes) -> list[tuple[int, int, bool]]:
    """``(first, stop, native)``: the leaves cut into runs, each split natively or by XLA."""
    small = [n <= SPLIT_SMALL_VALUES for n in sizes]
    runs, first = [], 0
    for i in range(1, len(sizes) + 1):
        if i == len(sizes) or small[i] != small[first]:
            runs.append((first, i, small[first] and i - first >= SPLIT_MIN_RUN))
            first = i
    merged = []  # neighbouring XLA runs as one
    for run in runs:
        if merged and not run[2] and not merged[-1][2]:
            merged[-1] = (merged[-1][0], run[1], False)
        else:
            merged.append(run)
    return merged


def _split_native(dense, shapes, scale, silenced, drop):
    """:func:`split_scaled` by the native kernel on the CPU (XLA's slices elsewhere)."""
    from jaxcomp.ops import _ffi

    call = _ffi.ffi_call(
        "jaxcomp_split_leaves",
        [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes],
        vmap_method="sequential",
    )
    flag = jnp.zeros((), jnp.int32) if silenced is None else jnp.asarray(silenced, jnp.int32)

    def native(dense, flag):
        return call(dense, flag, scale=np.float32(scale), drop=np.int64(drop))

    def portable(dense, flag):
        return split_scaled_xla(dense, shapes, scale, None if silenced is None else flag != 0, drop)

    return list(_ffi.platform_dependent(dense, flag, cpu=native, default=portable))


def _check_dense(dense, shapes, scale):
    size = sum(int(np.prod(s)) for s in shapes)
    if dense.ndim != 1 or dense.shape[0] < size:
        raise ValueError(
            f"dense must be 1-D with at least the shapes' {size} values, got shape {dense.shape}"
        )
    _check_scale(scale)


def _check_scale(scale):
    if not isinstance(scale, (int, float)) or not np.isfinite(scale) or not scale > 0:
        raise ValueError(f"scale must be a finite Python number > 0, got {scale!r}")


def split_scaled_xla(dense, shapes, scale=1.0, silenced=None, drop=False):
    """:func:`split_scaled` in XLA ops (every platform but the CPU, and the kernel's reference):
    each leaf's slice, in float32 (its non-finite values as 0 with ``drop``), times ``scale``.

    Args:
      dense: a 1-D array of at least the shapes' total size.
      shapes: the leaves' shapes, in order.
      scale: every entry's factor.
      silenced: None, or a bool scalar: True makes every leaf 0.
      drop: non-finite entries become 0.

    Returns:
      A list of float32 arrays of ``shapes``.

    Example:
      >>> import jax.numpy as jnp
      >>> [x.tolist() for x in split_scaled_xla(jnp.array([2.0, 4.0, 6.0]), [(2,), (1,)], 2.0)]
      [[4.0, 8.0], [12.0]]

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (the averaged aggregate).
    """
    out, offset = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        update = dense[offset : offset + size].reshape(shape).astype(jnp.float32)
        update = flat.dropped(update) * scale if drop else update * scale
        out.append(update if silenced is None else flat.cleared(silenced, update))
        offset += size
    return out


def scatter_leaves(total: SparseTotal, shapes, scale=1.0, silenced=None):
    """The update's leaves from a sparse total: ``total.dense() * scale`` split into ``shapes``,
    written straight into the leaves.

    On the CPU (float32 values and total) one native pass (``kernels/scatter.h``) zeroes the
    leaves and adds the pairs into them, in row order, bit for bit :func:`scatter_leaves_xla`;
    elsewhere, and for other dtypes, that function runs.

    Args:
      total: a :class:`SparseTotal`.
      shapes: the leaves' shapes, in order; their sizes add up to ``total.n``.
      scale: a Python float > 0, every entry's factor (``1 / devices`` for the mean).
      silenced: None, or a bool scalar: True makes every leaf 0 (a skipped step).

    Returns:
      A list of float32 arrays of ``shapes``.

    Example:
      >>> import jax.numpy as jnp
      >>> t = SparseTotal(jnp.array([[0, 2], [2, 1]]), jnp.array([[1.0, 2.0], [3.0, 4.0]]), 4)
      >>> [x.tolist() for x in scatter_leaves(t, [(2,), (2,)], 0.5)]
      [[0.5, 2.0], [2.5, 0.0]]

    References:
      Shi et al., MLSys 2021, §3.2 (the gathered pairs added into a dense vector); Tyagi & Swany,
      arXiv 2312.02493, Alg. 1 (the averaged aggregate).
    """
    from jaxcomp.ops import _ffi

    _check(total, shapes, scale)
    shapes = [tuple(s) for s in shapes]
    implementation = _ffi.check_implementation(None)
    f32 = total.values.dtype == jnp.float32 and total.dtype == jnp.float32
    if implementation == "xla" or not f32 or not shapes:
        return scatter_leaves_xla(total, shapes, scale, silenced)
    call = _ffi.ffi_call(
        "jaxcomp_scatter_leaves",
        [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes],
        vmap_method="sequential",
    )
    flag = jnp.zeros((), jnp.int32) if silenced is None else jnp.asarray(silenced, jnp.int32)

    def native(indices, values, flag):
        return call(
            indices.astype(jnp.int32),
            values,
            flag,
            scale=np.float32(scale),
            add=np.int64(total.add),
            drop=np.int64(total.drop),
        )

    def portable(indices, values, flag):
        again = jax.tree.unflatten(jax.tree.structure(total), [indices, values])
        return scatter_leaves_xla(again, shapes, scale, None if silenced is None else flag != 0)

    return list(
        _ffi.platform_dependent(total.indices, total.values, flag, cpu=native, default=portable)
    )
