"""``RandomK``: random-k sparsification with a seed every device shares, summed by one
all-reduce."""

from __future__ import annotations

import dataclasses

from jaxcomp.collectives import sizes
from jaxcomp.methods.base import Fraction, Method
from jaxcomp.methods.dense import ALLREDUCE_ALGORITHMS
from jaxcomp.ops import _checks


def shared_indices(key, n: int, k: int):
    """``k`` distinct indices of ``0..n-1`` drawn from ``key``: one per stratum of ``s = n // k``
    values, rotated by a random offset, so every index is equally likely (``k / n``) and the draw
    costs ``O(k)``, not a permutation of ``n``. Equal keys give equal indices on every device.

    Args:
      key: a ``jax.random`` key (typed or raw), the same on every device.
      n: the vector's length.
      k: how many indices, ``1 <= k <= n``.

    Returns:
      int32[k], distinct, in ``[0, n)``.

    Example:
      >>> import jax, numpy as np
      >>> idx = np.asarray(shared_indices(jax.random.key(0), 100, 10))
      >>> len(set(idx.tolist())), bool(((0 <= idx) & (idx < 100)).all())
      (10, True)

    References:
      Stich et al., "Sparsified SGD with Memory", NeurIPS 2018 (random-k with error feedback).
    """
    import jax
    import jax.numpy as jnp

    stride = n // k
    jitter_key, offset_key = jax.random.split(key)
    within = jax.random.randint(jitter_key, (k,), 0, stride, dtype=jnp.int32)
    offset = jax.random.randint(offset_key, (), 0, n, dtype=jnp.int32)
    # Strata i*s..(i+1)*s-1 are disjoint and k*s <= n, so the indices stay distinct after the
    # rotation mod n; the uniform rotation gives every index the same chance.
    return ((jnp.arange(k, dtype=jnp.int32) * stride + within + offset) % n).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class RandomK(Fraction, Method):
    """Random-k: every device sends its values at the same ``k`` random indices, drawn from the
    step's key, so one all-reduce of ``k`` values sums them and no index crosses the wire
    (all-reduce compatible, like AR-Topk, with no leader and no selection). What was not sent stays
    in the residual.

    **Quality: not within 3% of dense Adam** on ``benchmarks/quality.py``'s transformer, with
    ``compress`` + ``optax.adam`` or with :func:`jaxcomp.adam` (the best found), at either model
    size and run length: random indices carry far less than the top ones; use it where its bytes
    matter more (docs/training.md, "Optimizers that know they are compressed").

    Args:
      ratio: fraction of the values sent, in ``(0, 1]``: ``k = max(1, round(ratio * n))``.
      k: number of values sent; give exactly one of ``ratio`` and ``k``.
      allreduce: how the cost model costs the all-reduce, ``"ring"`` (default) or ``"tree"``.

    Example:
      >>> from jaxcomp.methods import RandomK
      >>> RandomK(0.01).describe(), RandomK(0.01).wire_bytes(1000, 8)  # 10 float32 in a ring
      ('randomk(0.01)', 70.0)

    References:
      Stich et al., "Sparsified SGD with Memory", NeurIPS 2018; Wangni et al., NeurIPS 2018.
    """

    ratio: float | None = None
    k: int | None = None
    allreduce: str = "ring"

    name = "randomk"
    shorthand = {"randomk": {}}
    sparse = True

    def __post_init__(self):
        self.check_fraction()
        _checks.check_choice(self.allreduce, "allreduce", ALLREDUCE_ALGORITHMS)

    def aggregate(self, x, axis_name, *, step, key, sparse=False, state=None):
        import jax.numpy as jnp

        from jaxcomp import collectives
        from jaxcomp.ops.scatter import SparseTotal

        n = x.shape[0]
        indices = shared_indices(key, n, self.kept(n))
        values = x[indices]
        summed, _ = collectives.psum(values, axis_name)
        total = SparseTotal(indices, summed, n, add=False, dtype=x.dtype)
        if sparse:  # the pairs: error feedback and the update take them as they are
            return total, (indices, values), state
        total = total.dense()
        return total, jnp.zeros_like(x).at[indices].set(values, unique_indices=True), state

    def wire_bytes(self, n, n_devices, *, dtype_bytes=4, inner_size=None):
        """One all-reduce of ``k`` values: ``2 (N-1)/N k d`` as a ring."""
        n, dtype_bytes = _checks.check_message(n, dtype_bytes)
        N = _checks.check_devices(n_devices)
        return (
            0.0 if N == 1 else sizes.allreduce_bytes(self.kept(n) * dtype_bytes, N, self.allreduce)
        )

    def message_steps(self, n_devices, *, inner_size=None):
        return sizes.allreduce_steps(_checks.check_devices(n_devices), self.allreduce)

    def local_work(self, n_values, n_devices):
        import jax

        k = self.kept(n_values)

        def codec(x):
            indices = shared_indices(jax.random.key(0), n_values, k)
            return x.at[indices].add(
                -x[indices]
            )  # the draw, the gather and the in-place error feedback

        return codec
