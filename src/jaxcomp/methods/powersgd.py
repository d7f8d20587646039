"""``PowerSGD``: rank-r approximation of each matrix-shaped gradient by one warm-started power
iteration."""

from __future__ import annotations

import dataclasses
import math

from jaxcomp.collectives import sizes
from jaxcomp.methods import cast
from jaxcomp.methods.base import Method
from jaxcomp.methods.dense import ALLREDUCE_ALGORITHMS
from jaxcomp.ops import _checks


def matrix_view(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The 2-D view PowerSGD takes of a leaf: ``(prod(shape[:k]), prod(shape[k:]))`` for the split
    ``k`` whose matrix is the most square (the largest smaller side; on a tie the later split),
    or None for a scalar or a vector.

    That is a layer's inputs x outputs view, where its gradient is low-rank, for flax's dense,
    convolution and attention kernels alike, and the view whose rank-``r`` factors are smallest
    (docs/training.md, "PowerSGD views a leaf as its layer's inputs x outputs").

    Args:
      shape: the leaf's shape.

    Returns:
      ``(rows, cols)`` or None.

    Example:
      >>> matrix_view((3, 3, 16, 32)), matrix_view((128, 4, 32)), matrix_view((10,))
      ((144, 32), (128, 128), None)

    References:
      Vogels et al., NeurIPS 2019, §3 (tensors reshaped to matrices).
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        return None
    splits = [(math.prod(shape[:k]), math.prod(shape[k:])) for k in range(1, len(shape))]
    return max(reversed(splits), key=min)


def orthogonalize(p, eps: float = 1e-8):
    """Gram-Schmidt on the columns of ``p`` (rows x rank), in column order, as PowerSGD does; a zero
    column stays zero (it is divided by ``norm + eps``).

    Args:
      p: float32 ``(rows, rank)``.
      eps: added to each column's norm before dividing.

    Returns:
      ``p`` with orthonormal columns (orthogonal, and of norm 1 unless zero).

    Example:
      >>> import jax.numpy as jnp
      >>> q = orthogonalize(jnp.array([[1.0, 1.0], [0.0, 1.0]]))
      >>> [[round(float(v), 6) for v in row] for row in q]
      [[1.0, 0.0], [0.0, 1.0]]

    References:
      Vogels et al., NeurIPS 2019, Alg. 1 (orthogonalization of P); PyTorch's
      ``_orthogonalize_gram_schmidt``.
    """
    import jax.numpy as jnp

    columns = []
    for j in range(p.shape[1]):
        v = p[:, j]
        for u in columns:  # modified Gram-Schmidt: take off the projections one by one
            v = v - jnp.dot(u, v) * u
        columns.append(v / (jnp.linalg.norm(v) + eps))
    return jnp.stack(columns, axis=1)


@dataclasses.dataclass(frozen=True)
class PowerSGD(Method):
    """PowerSGD: each matrix-shaped leaf ``M`` (``rows x cols``, see :func:`matrix_view`) is sent as
    a rank-``rank`` product ``P Q^T`` found by one power iteration per step, warm-started from the
    previous step's ``Q``:

    1. ``P = M Q``; all-reduce ``P`` (summed over the devices); orthogonalize its columns;
    2. ``Q = M^T P``; all-reduce ``Q``; the sum is ``P Q^T``, and ``Q`` is kept for the next step.

    Both all-reduces are of small dense arrays, so the method is all-reduce compatible. Leaves that
    are not matrices (biases, norms), and matrices where the rank-``rank`` factors would not be at
    least ``min_compression_rate`` times smaller than the matrix, are sent as they are, fused into
    the first all-reduce. Each device's contribution is ``P q_d^T`` with its own ``q_d = M_d^T P``,
    so error feedback keeps ``M_d - P q_d^T`` (Vogels et al., Alg. 2). The state (one ``Q`` per
    compressed leaf, float32, replicated) is part of the optimizer state and checkpoints with it.

    Leaves are told apart by their shapes, so use ``granularity="model"`` (the default), which
    also fuses every leaf's ``P`` into one all-reduce and every ``Q`` into another. Matrices of
    one view are worked on together (:func:`batches`), so a model of many repeated layers
    compiles and runs one batched iteration per view, not one per matrix.

    Its quality, and the settings that keep it near dense: docs/training.md, "Optimizers that
    know they are compressed".

    Args:
      rank: the approximation's rank ``r``, an integer >= 1 (PyTorch's
        ``matrix_approximation_rank``; default 1 as there).
      start_iter: steps aggregated densely before PowerSGD starts (PyTorch's
        ``start_powerSGD_iter``; default 0 here, as :func:`jaxcomp.compress`'s ``warmup_steps``
        does the same for every method).
      min_compression_rate: a matrix ``rows x cols`` is compressed only when
        ``rows * cols >= min_compression_rate * rank * (rows + cols)`` (default 2, as PyTorch),
        at least 1.
      allreduce: how the cost model costs the two all-reduces, ``"ring"`` (default) or ``"tree"``.
      dtype: what the factors (and the leaves sent as they are) cross the wire as:
        ``"float32"`` (default), or ``"float16"`` / ``"bfloat16"`` (aliases ``"fp16"``,
        ``"bf16"``), 2 bytes a value by :func:`jaxcomp.methods.cast.narrow_sum`, float16 behind a
        shared power-of-two scale; PyTorch's ``fp16_compress_wrapper`` around its PowerSGD hook.
        Half the bytes; each device's ``Q`` is fed back as the wire rounded it. The power
        iteration itself stays float32. Names: ``"powersgd_fp16"``, ``"powersgd_bf16"``.

    Example:
      >>> from jaxcomp.methods import PowerSGD
      >>> m = PowerSGD(rank=4)
      >>> m.kept(256 * 128 + 128, shapes=((256, 128), (128,)))  # 4 * (256 + 128) + the bias
      1664

    References:
      Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
      Distributed Optimization", NeurIPS 2019 (Alg. 1 and 2); PyTorch's ``PowerSGDState`` hook.
    """

    rank: int = 1
    start_iter: int = 0
    min_compression_rate: float = 2.0
    allreduce: str = "ring"
    dtype: str = "float32"

    name = "powersgd"
    shorthand = {
        "powersgd": {},
        "powersgd_fp16": {"dtype": "float16"},
        "powersgd_bf16": {"dtype": "bfloat16"},
    }
    pieces = True  # totals and contributions made per matrix: handed over per leaf

    def __post_init__(self):
        object.__setattr__(self, "rank", _checks.static_int(self.rank, "rank", 1, 1 << 16))
        object.__setattr__(self, "start_iter", _checks.static_int(self.start_iter, "start_iter", 0))
        rate = self.min_compression_rate
        if (
            isinstance(rate, bool)
            or not isinstance(rate, (int, float))
            or not math.isfinite(rate)
            or rate < 1
        ):
            raise ValueError(
                f"min_compression_rate must be a number >= 1 (how many times smaller the rank-r "
                f"factors must be than a matrix to compress it), got {rate!r}"
            )
        object.__setattr__(self, "min_compression_rate", float(rate))
        _checks.check_choice(self.allreduce, "allreduce", ALLREDUCE_ALGORITHMS)
        object.__setattr__(self, "dtype", _factor_dtype(self.dtype))

    @property
    def label(self):
        narrow = "" if self.dtype == "float32" else f"_{cast.NARROW_TYPES[self.dtype][0]}"
        variant = "" if self.allreduce == "ring" else f"_{self.allreduce}"
        return f"{self.name}{narrow}{variant}"

    def _sum(self, values, axis_name):
        """``(total, sent)`` of one of the two all-reduces, in :attr:`dtype` on the wire."""
        from jaxcomp import collectives

        if self.dtype == "float32":
            return collectives.psum(values, axis_name)
        return cast.narrow_sum(values, axis_name, self.dtype, scaled=self.scaled)

    @property
    def scaled(self) -> bool:
        """Whether the factors cross behind a shared power-of-two scale: float16's (its range
        ends at 65504), as :attr:`jaxcomp.methods.cast.Cast.scaled` by default."""
        return self.dtype == "float16"

    @property
    def setting(self):
        return self.rank

    @property
    def dense_steps(self):
        return self.start_iter

    def compresses(self, shape) -> bool:
        """Whether a leaf of ``shape`` is sent as rank-``rank`` factors (else as it is)."""
        view = matrix_view(shape)
        if view is None:
            return False
        rows, cols = view
        return self.rank <= min(
            rows, cols
        ) and rows * cols >= self.min_compression_rate * self.rank * (rows + cols)

    def _shapes(self, n: int, shapes) -> tuple[tuple[int, ...], ...]:
        """The leaves' shapes, checked against ``n``; without shapes (the cost model's question
        about ``n`` values) one square matrix."""
        if shapes is None:
            side = max(1, math.isqrt(int(n)))
            return ((side, side), (int(n) - side * side,)) if n > side * side else ((side, side),)
        shapes = tuple(tuple(int(d) for d in shape) for shape in shapes)
        if sum(math.prod(s) for s in shapes) != n:
            raise ValueError(
                f"shapes {shapes} hold {sum(math.prod(s) for s in shapes)} values, not the "
                f"vector's {n}"
            )
        return shapes

    def _split(self, shapes):
        """(compressed (rows, cols) in order, the dense values' count)."""
        matrices = [matrix_view(s) for s in shapes if self.compresses(s)]
        dense = sum(math.prod(s) for s in shapes if not self.compresses(s))
        return matrices, dense

    def kept(self, n, shapes=None):
        matrices, dense = self._split(self._shapes(n, shapes))
        return sum(self.rank * (rows + cols) for rows, cols in matrices) + dense

    def init_state(self, shapes):
        import jax
        import jax.numpy as jnp

        shapes = self._shapes(sum(math.prod(s) for s in shapes), shapes)
        matrices, _ = self._split(shapes)
        if not matrices:
            views = [matrix_view(s) for s in shapes if matrix_view(s) is not None]
            if not views:
                raise ValueError(
                    "PowerSGD compresses matrix-shaped leaves, and these gradients have none "
                    f"(shapes {list(shapes)}): use another method, or jaxcomp.Dense"
                )
            rows, cols = max(views, key=min)
            raise ValueError(
                f"rank={self.rank} compresses none of the gradients' matrices (the largest, "
                f"{rows}x{cols}, needs rank <= {min(rows, cols)} and rank * (rows + cols) * "
                f"min_compression_rate={self.min_compression_rate:g} <= rows * cols): pass a "
                "smaller rank"
            )
        # The same Q on every device: drawn from a fixed key, one per compressed leaf.
        keys = jax.random.split(jax.random.key(0), len(matrices))
        return tuple(
            jax.random.normal(key, (cols, self.rank), jnp.float32)
            for key, (_, cols) in zip(keys, matrices)
        )

    def aggregate(
        self, x, axis_name, *, step, key, sparse=False, state=None, shapes=None, pieces=False
    ):
        """The two all-reduces of one power iteration, warm-started from ``state`` (one ``Q`` per
        compressed leaf, from :meth:`init_state` for these ``shapes`` or the previous step):
        ``(total, sent, new_state)``, the new state being this step's summed ``Q``. With
        ``pieces``, ``total`` and ``sent`` are :class:`jaxcomp.ops.pieces.Pieces` cut as
        :meth:`piece_sizes` says, never joined into a vector."""
        from jaxcomp.ops import flat
        from jaxcomp.ops.pieces import Pieces

        if state is None:
            raise ValueError(
                "PowerSGD keeps state across steps: pass state=method.init_state(shapes) (or the "
                "state the previous step returned), as jaxcomp.compress does"
            )
        shapes = self._shapes(x.shape[0], shapes)
        totals, sents, q_total = self._power_iteration(x, shapes, state, axis_name)
        totals = [t.astype(x.dtype) for t in totals]
        sents = [s.astype(x.dtype) for s in sents]
        if pieces:
            return Pieces(totals), Pieces(sents), q_total
        return flat.concat(totals), flat.concat(sents), q_total

    def piece_sizes(self, shapes) -> list[int]:
        """The parts :meth:`aggregate` returns with ``pieces=True``, in values: each compressed
        matrix, and each run of consecutive leaves sent as they are.

        Args:
          shapes: the leaves' shapes, in order.

        Returns:
          Values per part, in order (they add up to the leaves').

        Example:
          >>> PowerSGD(rank=1).piece_sizes([(3,), (4,), (8, 8), (2,)])
          [7, 64, 2]
        """
        return [sum(math.prod(shapes[i]) for i in run) for _, run in self._runs(shapes)]

    def _runs(self, shapes):
        """``(compressed, leaf indices)`` per part: one compressed leaf, or a run of consecutive
        leaves sent as they are."""
        runs = []
        for i, shape in enumerate(shapes):
            compressed = self.compresses(shape)
            if compressed or not runs or runs[-1][0]:
                runs.append((compressed, [i]))
            else:
                runs[-1][1].append(i)
        return runs

    def _power_iteration(self, x, shapes, state, axis_name):
        """Per part (:meth:`piece_sizes`) its total and this device's contribution (flat,
        float32), and the new ``Q`` s: one warm-started power iteration over the compressed
        leaves, the other leaves summed as they are in the first all-reduce. Matrices of one
        view are worked on together (:func:`batches`): one orthogonalization of their stacked
        ``P`` s, and for small matrices one batched product each."""
        import jax.numpy as jnp

        from jaxcomp.ops import flat

        runs = self._runs(shapes)
        parts = _parts(x.astype(jnp.float32), self.piece_sizes(shapes))
        mats = [p.reshape(matrix_view(shapes[r[0]])) for (c, r), p in zip(runs, parts) if c]
        plain = [p for (c, _), p in zip(runs, parts) if not c]
        groups = [_Group.of(b, mats) for b in batches([m.shape for m in mats])]
        # All-reduce 1: every P = M Q, and the leaves sent as they are.
        ps = [g.times(g.stack(state)) for g in groups]
        first, first_sent = self._sum(flat.concat(ps + plain), axis_name)
        sizes_first = [p.size for p in ps] + [p.size for p in plain]
        summed = _parts(first, sizes_first)
        # 16 bits: the leaves sent as they are, as the wire rounded them (float32: themselves).
        narrow = self.dtype != "float32"
        plain_sent = _parts(first_sent, sizes_first)[len(ps) :] if narrow else plain
        p_hat = [_orthogonalize_stack(t.reshape(p.shape)) for t, p in zip(summed, ps)]
        # All-reduce 2: every Q = M^T P.
        local_q = [g.transposed_times(p) for g, p in zip(groups, p_hat)]
        second, second_sent = self._sum(flat.concat(local_q), axis_name)
        q_sizes = [q.size for q in local_q]
        q_total = [t.reshape(q.shape) for t, q in zip(_parts(second, q_sizes), local_q)]
        if narrow:  # each device's Q as the wire rounded it, so error feedback keeps the rest
            local_q = [t.reshape(q.shape) for t, q in zip(_parts(second_sent, q_sizes), local_q)]
        total_of, sent_of, new_q = ([None] * len(mats) for _ in range(3))
        for g, p, q, mine in zip(groups, p_hat, q_total, local_q):
            for j, (i, total, sent) in enumerate(zip(g.members, g.outer(p, q), g.outer(p, mine))):
                total_of[i], sent_of[i], new_q[i] = total.ravel(), sent.ravel(), q[j]
        compressed = iter(zip(total_of, sent_of))
        plain_totals = iter(zip(summed[len(ps) :], plain_sent))
        totals, sents = [], []
        for c, _ in runs:
            total, sent = next(compressed) if c else next(plain_totals)
            totals.append(total)
            sents.append(sent)
        return totals, sents, tuple(new_q)

    def wire_bytes(self, n, n_devices, *, dtype_bytes=4, inner_size=None, shapes=None):
        """Two all-reduces: every ``P`` (``rows x r``) with the leaves sent as they are, then
        every ``Q`` (``cols x r``), of float32, or of :attr:`dtype` as
        :func:`jaxcomp.methods.cast.narrow_bytes` counts them. Without ``shapes``: one square
        matrix of ``n`` values."""
        n, _ = _checks.check_message(n, dtype_bytes)
        N = _checks.check_devices(n_devices)
        if N == 1:
            return 0.0
        matrices, dense = self._split(self._shapes(n, shapes))
        first = sum(self.rank * rows for rows, _ in matrices) + dense
        second = sum(self.rank * cols for _, cols in matrices)
        if self.dtype != "float32":
            return sum(
                cast.narrow_bytes(v, N, scaled=self.scaled, allreduce=self.allreduce)
                for v in (first, second)
            )
        return sizes.allreduce_bytes(4 * first, N, self.allreduce) + sizes.allreduce_bytes(
            4 * second, N, self.allreduce
        )

    def message_steps(self, n_devices, *, inner_size=None):
        steps = sizes.allreduce_steps(_checks.check_devices(n_devices), self.allreduce)
        return (4 if self.scaled else 2) * steps  # each scale's pmax too

    def local_work(self, n_values, n_devices):
        import jax.numpy as jnp

        (rows, cols), *_ = self._shapes(n_values, None)
        q = jnp.ones((cols, self.rank), jnp.float32)

        def codec(x):
            m = x[: rows * cols].reshape(rows, cols)
            p = orthogonalize(m @ q)
            return (p @ (m.T @ p).T).ravel()

        return codec


def _factor_dtype(dtype) -> str:
    """PowerSGD's ``dtype``: ``"float32"``, or the canonical name of a 16-bit float."""
    if cast.dtype_name(dtype) in ("float32", "f32", "fp32"):
        return "float32"
    try:
        return cast.canonical_dtype(dtype)
    except ValueError:
        raise ValueError(
            f"dtype must be float32, float16 or bfloat16 (what PowerSGD's factors cross the wire "
            f"as; aliases fp16, bf16), got {dtype!r}"
        ) from None


#: A matrix of at most this many values is stacked with the others of its view for batched
#: products: their per-matrix work (and its compilation) costs more than the stack's copy. Larger
#: matrices keep one product each and are not copied.
STACK_MAX_VALUES = 1 << 18


def batches(views) -> list[tuple[int, ...]]:
    """The matrices PowerSGD works on together: the indices of each view ``(rows, cols)``, in
    order of first appearance.

    Each view's ``P`` s are orthogonalized in one batched pass, and its small matrices
    (:data:`STACK_MAX_VALUES`) multiplied in batched products, instead of one of each per matrix
    (docs/performance.md, "PowerSGD in batches").

    Args:
      views: each compressed matrix's ``(rows, cols)``, in order.

    Returns:
      Tuples of indices into ``views``, each tuple one view, every index once.

    Example:
      >>> batches([(64, 64), (16, 8), (64, 64)])
      [(0, 2), (1,)]

    References:
      Vogels et al., NeurIPS 2019, Alg. 1 (the power iteration is the same for every matrix).
    """
    groups = {}
    for i, view in enumerate(views):
        groups.setdefault(tuple(view), []).append(i)
    return [tuple(members) for members in groups.values()]


@dataclasses.dataclass(frozen=True)
class _Group:
    """The matrices of one view. ``batched``: small ones, stacked into ``mats[0]`` (``G x rows x
    cols``) for batched products; else ``mats`` holds each ``rows x cols`` matrix apart (no copy).
    Every ``P`` and ``Q`` of the group is stacked (``G x rows x r``, ``G x cols x r``)."""

    members: tuple[int, ...]
    mats: tuple
    batched: bool

    @classmethod
    def of(cls, members, all_mats):
        mats = [all_mats[i] for i in members]
        if len(mats) > 1 and mats[0].size <= STACK_MAX_VALUES:
            return cls(tuple(members), (_stacked(mats),), True)
        return cls(tuple(members), tuple(mats), False)

    def stack(self, per_matrix):
        """The group's entries of a per-matrix sequence, stacked: ``G x ...``."""
        return _stacked([per_matrix[i] for i in self.members])

    def _each(self, f, stacked):
        """``f(M, X)`` per matrix with ``X`` from ``stacked`` (``G x ...``), stacked."""
        if self.batched:
            return f(self.mats[0], stacked)
        return _stacked([f(m, x) for m, x in zip(self.mats, stacked)])

    def times(self, q):
        """``M Q`` per matrix: ``G x rows x r``."""
        return self._each(lambda m, x: m @ x, q)

    def transposed_times(self, p):
        """``M^T P`` per matrix: ``G x cols x r``."""
        import jax.numpy as jnp

        return self._each(lambda m, x: jnp.swapaxes(m, -1, -2) @ x, p)

    def outer(self, p, q):
        """``P Q^T`` per matrix, a list of ``rows x cols``: one batched product when batched,
        else one product per matrix (a large one is written once, not sliced out of a stack)."""
        import jax.numpy as jnp

        if self.batched:
            products = p @ jnp.swapaxes(q, -1, -2)
            return [products[j] for j in range(len(self.members))]
        return [p[j] @ q[j].T for j in range(len(self.members))]


def _stacked(arrays):
    """``jnp.stack(arrays)`` (arrays of one shape) written by :func:`jaxcomp.ops.flat.concat`:
    a stack of at most 8 would be a fused concatenate, which XLA:CPU writes slowly."""
    from jaxcomp.ops import flat

    return flat.concat(arrays).reshape(len(arrays), *arrays[0].shape)


def _orthogonalize_stack(p):
    """:func:`orthogonalize` of each ``p[j]`` (``G x rows x r``), in one batched pass."""
    import jax

    return jax.vmap(orthogonalize)(p)


def _parts(vector, sizes):
    """``vector``'s consecutive slices of ``sizes`` values."""
    from jaxcomp.ops.pieces import Pieces

    return Pieces.split(vector, sizes).parts
