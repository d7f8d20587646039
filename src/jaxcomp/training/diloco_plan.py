"""What a :func:`jaxcomp.diloco` run derives from the shapes of its params and its model's
state: :class:`Plan` (the fragment schedule, the outer compress's layout per fragment and where
each leaf of the :class:`~jaxcomp.training.outer.DiLoCoState` lies on the mesh).

Every leaf of a worker's own (its params, inner optimizer state, model state) is stored with a
leading axis of the workers, sharded over the outer axis; the global params and the outer
optimizer's state are replicated; the outer compress's per-worker leaves (the error-feedback
residual) are per worker, or with a split exchange per device of the row (:mod:`.inner`).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxcomp.optim.state import compress_states
from jaxcomp.training.outer import DiLoCoState, Schedule, strided_groups
from jaxcomp.training.state import check_params


class Plan:
    """What a :func:`jaxcomp.diloco` run derives from its params' (and model state's) shapes:
    the schedule, the outer compress's layout per fragment, the state's specs.

    Attributes:
      schedule: the :class:`~jaxcomp.training.outer.Schedule` of the fragments.
      group_avals, block_avals: per fragment, its leaves' avals and what the outer compress
        sees of them (this device's blocks with a split exchange).
      masks: per fragment, the outer compress state's structure and per-device leaves.
      splits: whether the exchange is split over the inner axis.
      specs: the :class:`~jaxcomp.training.outer.DiLoCoState` of ``PartitionSpec`` s.
    """

    def __init__(self, run, avals, model_avals=None):
        check_params(avals)
        leaves = jax.tree.leaves(avals)
        if run.fragments > len(leaves):
            raise ValueError(
                f"fragments={run.fragments} is more than the {len(leaves)} leaves of params: "
                "a fragment is a group of whole leaves; pass fragments <= the number of leaves"
            )
        refuse_inner_compress(run.inner.user_tx, avals)
        groups = strided_groups(len(leaves), run.fragments)
        self.schedule = Schedule(run.sync_every, run.fragments, run.delay, groups, run.eager)
        self.group_avals = [[leaves[i] for i in group] for group in groups]
        # What the outer compress sees: the fragment's leaves, or this device's blocks of them.
        self.block_avals = [run.inner.block_avals(g) for g in self.group_avals]
        try:
            self.masks = [run.compress_layout.per_device_mask(b) for b in self.block_avals]
        except (ValueError, NameError) as error:
            axis_error = ("differ per device", "no such axis")
            if isinstance(error, ValueError) and not any(m in str(error) for m in axis_error):
                raise
            raise ValueError(
                f"compress must aggregate the pseudo-gradients over outer_axis="
                f"{run.outer_axis!r} and return the same average on every worker, e.g. "
                f"jaxcomp.compress('ar_topk', ratio=0.1, axis_name={run.outer_axis!r}) "
                f"(or pass the method alone: diloco builds the compress); {error}"
            ) from None
        self.splits = run.inner.splits
        self.specs = self._specs(run, avals, model_avals)

    def _specs(self, run, avals, model_avals):
        """The :class:`DiLoCoState` of ``PartitionSpec`` s."""
        worker = P(run.outer_axis)
        return DiLoCoState(
            global_params=jax.tree.map(lambda _: P(), avals),
            local_params=jax.tree.map(lambda _: worker, avals),
            inner_state=jax.tree.map(lambda _: run.inner.spec, run.inner.state_avals(avals)),
            outer_state=tuple(
                jax.tree.map(lambda _: P(), jax.eval_shape(run.outer_tx.init, g))
                for g in self.group_avals
            ),
            compress_state=tuple(
                state_def.unflatten([run.inner.exchange_spec(m) for m in mask])
                for state_def, mask in self.masks
            ),
            pending=tuple(_pending_specs(run, g) for g in self.group_avals)
            if run.delay or run.eager
            else (),
            step=P(),
            model_state=jax.tree.map(lambda _: worker, model_avals),
        )

    def compress_rows(self, compress_state, fragment: int, take: bool):
        """The per-worker leaves of a fragment's compress state: this worker's row (``take``) or
        stacked back into a row of ``[n_workers, ...]``."""
        state_def, mask = self.masks[fragment]
        leaves = state_def.flatten_up_to(compress_state)
        stacked = [m or self.splits for m in mask]  # a split exchange stacks every leaf
        return state_def.unflatten(
            [(x[0] if take else x[None]) if r else x for x, r in zip(leaves, stacked)]
        )


def _pending_specs(run, group_avals):
    """A fragment's pending specs: the waiting average replicated, with ``eager`` each worker's
    start over the outer axis."""
    if run.eager:
        return ([P()] * len(group_avals), [P(run.outer_axis)] * len(group_avals))
    return [P()] * len(group_avals)


def refuse_inner_compress(inner_tx, avals):
    """Refuses an ``inner_tx`` that aggregates: a worker's inner steps are its own (and its
    inner axis's, where diloco averages the gradients itself).

    Args:
      inner_tx: the inner optimizer.
      avals: the params' avals.

    Returns:
      None; raises ``ValueError`` where ``inner_tx`` holds a :func:`jaxcomp.compress`.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> refuse_inner_compress(optax.adamw(4e-4), jax.ShapeDtypeStruct((3,), jnp.float32))

    References:
      Douillard et al., "DiLoCo" (arXiv 2311.08105), Alg. 1 (the inner steps of one worker).
    """
    if compress_states(jax.eval_shape(inner_tx.init, avals)):
        raise ValueError(
            "inner_tx holds a jaxcomp.compress: the inner steps of a diloco worker do not "
            "aggregate over the outer axis, and over inner_axis diloco averages the gradients "
            "itself (densely). Pass the plain optimizer, e.g. optax.adamw(4e-4)"
        )
