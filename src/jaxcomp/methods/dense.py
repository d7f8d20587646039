"""``Dense``: the plain all-reduce, the baseline every compressed method must beat."""

from __future__ import annotations

import dataclasses

from jaxcomp.collectives import sizes
from jaxcomp.methods.base import Method
from jaxcomp.ops import _checks

#: How the cost model may cost an all-reduce: as a ring or as a tree (reduce up, broadcast down).
ALLREDUCE_ALGORITHMS = ("ring", "tree")


@dataclasses.dataclass(frozen=True)
class Dense(Method):
    """Dense aggregation: one all-reduce (:func:`jaxcomp.collectives.psum`) of the whole gradient;
    nothing is lost.

    Args:
      allreduce: how the cost model costs the all-reduce, ``"ring"`` (default; ``2(N-1)`` steps,
        ``2(N-1)/N`` of the bytes) or ``"tree"`` (``2 ceil(log2 N)`` steps and times the bytes).
        The collective itself is XLA's psum either way.

    Example:
      >>> from jaxcomp.methods import Dense
      >>> Dense().wire_bytes(1000, 8), Dense(allreduce="tree").message_steps(8)
      (7000.0, 6)

    References:
      The dense baseline of Tyagi & Swany, arXiv 2312.02493, Table I (ring and tree all-reduce).
    """

    allreduce: str = "ring"

    name = "dense"
    shorthand = {"dense": {}, "dense_ring": {}, "dense_tree": {"allreduce": "tree"}}
    sends_everything = True
    buckets_by_default = True

    def __post_init__(self):
        _checks.check_choice(self.allreduce, "allreduce", ALLREDUCE_ALGORITHMS)

    def aggregate(self, x, axis_name, *, step, key, sparse=False, state=None):
        from jaxcomp import collectives

        return (*collectives.psum(x, axis_name), state)

    def wire_bytes(self, n, n_devices, *, dtype_bytes=4, inner_size=None):
        n, dtype_bytes = _checks.check_message(n, dtype_bytes)
        n_devices = _checks.check_devices(n_devices)
        return (
            0.0
            if n_devices == 1
            else sizes.allreduce_bytes(n * dtype_bytes, n_devices, self.allreduce)
        )

    def message_steps(self, n_devices, *, inner_size=None):
        return sizes.allreduce_steps(_checks.check_devices(n_devices), self.allreduce)

    def reduce_scatter(self, x, axis_name, *, step, key, size, sparse=False):
        from jaxcomp import collectives

        return collectives.psum_scatter(x, axis_name)

    def reduce_scatter_bytes(self, n, n_devices, *, dtype_bytes=4):
        n, dtype_bytes = _checks.check_message(n, dtype_bytes)
        return sizes.reduce_scatter_bytes(n * dtype_bytes, _checks.check_devices(n_devices))

    def reduce_scatter_steps(self, n_devices):
        return sizes.reduce_scatter_steps(_checks.check_devices(n_devices))
