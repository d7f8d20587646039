"""The pieces of :func:`jaxcomp.diloco`'s step: its state, the fragment schedule, and one step on
every device (:func:`diloco_step`).

One step is one ``jax.shard_map`` over the whole mesh (``jax.jit`` around it is the caller's).
Each worker (a position on the outer axis) takes one inner step on its own batch shard with its
own params and inner optimizer state; with an inner axis, the gradient is averaged over it
(:mod:`.inner`: an all-reduce, or with ``shard="optimizer"`` a reduce-scatter to the shards' owners
and an all-gather of the updated params). Then, fragment by fragment, two
``lax.cond`` s keyed on the traced step counter: the *exchange* (the pseudo-gradient through the
outer ``compress``, the only collective over the outer axis) and the *application* (the outer
optimizer on the global params, and the workers' restart from them). A step whose counter
schedules neither runs neither branch: it sends no byte over the outer axis. On a step without a
sync the conditional's other branch only passes its operands through.

With a delay (Streaming DiLoCo's tau >= 1) an exchange due after inner step ``c`` runs in the
compiled step of ``c + 1``, from that step's input, *before* its gradient: the same values (its
fragment is applied no earlier than after step ``c + 1``), but in a program where the exchange's
collectives depend on nothing the forward and backward passes compute, so XLA's runtime runs
them beside the inner step instead of after it (docs/training.md, section 7). Its bytes and the
``synced`` metric are reported by the step that runs it.

A model's own state (``has_state=True``: BatchNorm's running averages) is each worker's own
between syncs, averaged over its inner axis every step (its devices split one batch block), and
over the workers at every step that exchanges a fragment (:func:`_model_state`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxcomp.collectives import small
from jaxcomp.optim.nonfinite import keep_finite, skipped_or_none
from jaxcomp.optim.stages import guard
from jaxcomp.optim.vma import cast_varying, cond_typed_alike
from jaxcomp.training import boundary, gradients
from jaxcomp.training import model_state as model_states
from jaxcomp.training._eager import eager_rounds
from jaxcomp.training._exchange import (
    Fragment,
    exchange,
    like,
    nonfinite_count,
    outer_update,
    unsent,
)


class DiLoCoState(NamedTuple):
    """State of a :func:`jaxcomp.diloco` run: one pytree, checkpointed as a whole."""

    # the params of the last outer step (replicated): what params(state) returns
    global_params: Any
    # each worker's params: every leaf [n_workers, *shape], sharded over the outer axis
    local_params: Any
    # inner_tx's state per worker: every leaf [n_workers, ...], sharded over the outer axis; with
    # shard="optimizer", per device of its shards: [n_workers * n_inner, ...] over both axes
    inner_state: Any
    # per fragment: outer_tx's state of the fragment's leaves (a list), replicated
    outer_state: tuple
    # per fragment: the outer compress's state; its per-worker leaves (the error-feedback
    # residual) [n_workers, ...] sharded over the outer axis, the rest replicated; with a split
    # exchange every leaf has a row per device (of its blocks): [n_workers * n_inner, ...] over
    # both axes, or [n_inner, ...] over the inner axis for the leaves the workers share
    compress_state: tuple
    # per fragment, with delay > 0: the aggregated pseudo-gradient (a list of leaves,
    # replicated) waiting to be applied; with eager: (that list, each worker's start: a list of
    # leaves [n_workers, *shape] sharded over the outer axis); () otherwise
    pending: tuple
    step: jax.Array  # i32[]: inner steps taken; the fragment schedule is a function of it
    # with has_state=True, each worker's model state (BatchNorm's running averages): every leaf
    # [n_workers, *shape], sharded over the outer axis, the workers' mean after a sync; else None
    model_state: Any = None


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Schedule:
    """When each fragment is exchanged and applied (static; the step counter is traced).

    Fragment ``f`` is exchanged after inner step ``c`` (counting from 1) when ``c >= offset_f``
    and ``(c - offset_f) % sync_every == 0``, with ``offset_f = ((f + 1) * sync_every) //
    fragments``: each fragment every ``sync_every`` steps, the fragments staggered evenly, the
    last one on multiples of ``sync_every``. Its result is applied ``delay`` steps later.

    Attributes:
      sync_every: H, inner steps between two exchanges of a fragment.
      fragments: F, how many fragments.
      delay: tau, inner steps between a fragment's exchange and its application.
      groups: per fragment, the indices of its leaves in ``jax.tree.leaves(params)``.
      eager: each fragment's round runs after its next exchange's due step, one round late,
        with the workers' eager restart (:mod:`._eager`); ``delay`` is then 0.
    """

    sync_every: int
    fragments: int
    delay: int
    groups: tuple
    eager: bool = False

    def offset(self, fragment: int) -> int:
        """The first inner step (from 1) after which ``fragment`` is exchanged."""
        return ((fragment + 1) * self.sync_every) // self.fragments

    def exchanges(self, count, fragment: int):
        """Whether ``fragment`` is exchanged after inner step ``count`` (traced bool)."""
        return self._due(count, self.offset(fragment))

    def applies(self, count, fragment: int):
        """Whether ``fragment``'s exchanged result is applied after inner step ``count``."""
        return self._due(count, self.offset(fragment) + self.delay)

    def _due(self, count, first):
        return (count >= first) & ((count - first) % self.sync_every == 0)


def strided_groups(n_leaves: int, fragments: int) -> tuple:
    """The leaves of each fragment, strided: leaf ``i`` goes to fragment ``i % fragments``.

    Streaming DiLoCo found strided fragments (every F-th layer) slightly better than contiguous
    blocks of layers; leaves in ``jax.tree.leaves`` order stand in for layers.

    Args:
      n_leaves: how many leaves the params have.
      fragments: how many fragments, ``1 <= fragments <= n_leaves``.

    Returns:
      A tuple of ``fragments`` tuples of leaf indices.

    Example:
      >>> strided_groups(5, 2)
      ((0, 2, 4), (1, 3))

    References:
      Douillard et al., "Streaming DiLoCo with overlapping communication" (arXiv 2501.18512),
      §2.2 (fragment patterns: strided vs sequential).
    """
    return tuple(tuple(range(f, n_leaves, fragments)) for f in range(fragments))


def diloco_step(run, plan, state: DiLoCoState, batch):
    """One inner step on every worker, then each fragment's scheduled exchange and application.

    Args:
      run: the :class:`jaxcomp.training.diloco.DiLoCo` (``inner_tx``, ``outer_tx``,
        ``compress_tx``, axes and mesh).
      plan: the run's plan for these params (``run.plan(avals)``: schedule, specs, the compress
        state's per-worker leaves).
      state: the :class:`DiLoCoState`.
      batch: a pytree whose leading axis is the global batch, split over the outer (and inner)
        axes.

    Returns:
      ``(state, metrics)`` (see :func:`jaxcomp.diloco`).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("workers",))
      >>> run = jaxcomp.diloco(lambda w, b: jnp.mean((b - w) ** 2), optax.sgd(0.5),
      ...                      mesh=mesh, sync_every=2)
      >>> state = run.init(jnp.zeros(()))
      >>> plan = run.plan(jax.ShapeDtypeStruct((), jnp.float32))
      >>> step = jax.jit(lambda s, b: diloco_step(run, plan, s, b))
      >>> state, metrics = step(state, jnp.ones(2))
      >>> float(metrics["loss"]), bool(metrics["synced"])
      (1.0, False)

    References:
      Douillard et al., "DiLoCo" (arXiv 2311.08105), Alg. 1; Douillard et al., "Streaming
      DiLoCo" (arXiv 2501.18512), fragments and delayed application.
    """
    batch_specs = jax.tree.map(lambda _: P(run.data_axes), batch)

    def local_step(state: DiLoCoState, batch):
        local = jax.tree.map(lambda x: x[0], state.local_params)
        inner_state = jax.tree.map(lambda x: x[0], state.inner_state)
        # With a delay or eager rounds, the exchanges due after the previous step start here,
        # from this step's input: nothing in them waits for the gradient below, so XLA runs
        # them beside it.
        started = None
        if plan.schedule.eager:
            local, started = eager_rounds(run, plan, state, local)
        elif plan.schedule.delay:
            started = _started_exchanges(run, plan, state, local)
        model_state = jax.tree.map(lambda x: x[0], state.model_state)
        (loss, aux, grads), new_model_state = _local_gradients(run, local, batch, model_state)
        local, inner_state = run.inner.step(local, grads, inner_state)
        count = state.step + 1
        new_state, sent, synced = _outer_rounds(run, plan, count, state, local, started)
        worker = (jax.tree.map(lambda x: x[0], new_state.local_params), inner_state)
        (local, inner_state), healed = _healed(run, worker, local, new_state, synced)
        model_state = _model_state(run, new_model_state, model_state, synced)
        new_state = new_state._replace(
            local_params=jax.tree.map(lambda x: x[None], local),
            inner_state=jax.tree.map(lambda x: x[None], inner_state),
            model_state=jax.tree.map(lambda x: x[None], model_state),
        )
        return new_state, _metrics(run, loss, aux, sent, synced, healed)

    return boundary.packed_shard_map(
        local_step,
        mesh=run.mesh,
        in_specs=(plan.specs, batch_specs),
        out_specs=(plan.specs, run.metric_specs()),
        in_avals=state,
    )(state, batch)


def _started_exchanges(run, plan, state: DiLoCoState, local):
    """With ``delay > 0``: per fragment, ``(pending, compress_state, bytes_sent, exchanged)``
    after the exchange that is due after inner step ``state.step``, run from the step's input
    state (the worker's params as that step left them), before this step's gradient.

    The values are those an exchange right after that step would produce (the fragment's
    application is at least one step later, and no other fragment's application touches its
    leaves); only the compiled program it runs in is the next step's, where its collectives
    depend on nothing the forward and backward passes compute.
    """
    global_leaves = jax.tree.leaves(state.global_params)
    local_leaves = jax.tree.leaves(local)
    started = []
    for f, group in enumerate(plan.schedule.groups):
        compress_state = plan.compress_rows(state.compress_state[f], f, take=True)

        def start(operands, group=group):
            _, compress_state = operands
            aggregated, compress_state, bytes_sent = exchange(
                run,
                [global_leaves[i] for i in group],
                [local_leaves[i] for i in group],
                compress_state,
            )
            return (aggregated, compress_state), bytes_sent

        exchanged = plan.schedule.exchanges(state.step, f)
        operands = (state.pending[f], compress_state)
        (pending, compress_state), bytes_sent = run.inner.cond(exchanged, start, unsent, operands)
        started.append((pending, compress_state, bytes_sent, exchanged))
    return started


def _outer_rounds(run, plan, count, state: DiLoCoState, local, started=None):
    """``(state, (bytes_sent, nonfinite), synced)``: every fragment's round after inner step
    ``count`` (its bytes, the non-finite entries its exchange counted, whether it exchanged)
    (``state.inner_state`` is left for the caller); with a delay, ``started`` holds the
    exchanges :func:`_started_exchanges` ran."""
    global_leaves, treedef = jax.tree.flatten(state.global_params)
    local_leaves = jax.tree.leaves(local)
    outer, compressed, pending, sent, synced, nonfinite = [], [], [], [], [], []
    for f, group in enumerate(plan.schedule.groups):
        leaves = ([global_leaves[i] for i in group], [local_leaves[i] for i in group])
        if started is None:
            compress_state = plan.compress_rows(state.compress_state[f], f, take=True)
            fragment = Fragment(*leaves, state.outer_state[f], compress_state, None)
            fragment, bytes_sent, exchanged = _sync_round(run, plan.schedule, f, count, fragment)
        elif plan.schedule.eager:  # its round ran before the gradient: the leaves stay
            fragment, bytes_sent, exchanged = started[f]
            fragment = fragment._replace(local_leaves=leaves[1])
        else:
            pending_f, compress_state, bytes_sent, exchanged = started[f]
            fragment = Fragment(*leaves, state.outer_state[f], compress_state, pending_f)
            fragment = _late_application(run, plan.schedule, f, count, fragment)
        for i, g, lo in zip(group, fragment.global_leaves, fragment.local_leaves):
            global_leaves[i], local_leaves[i] = g, lo
        outer.append(fragment.outer_state)
        compressed.append(plan.compress_rows(fragment.compress_state, f, take=False))
        pending.append(fragment.pending)
        sent.append(bytes_sent)
        synced.append(exchanged)
        nonfinite.append(jnp.where(exchanged, nonfinite_count(fragment.compress_state), 0.0))
    new_state = DiLoCoState(
        global_params=treedef.unflatten(global_leaves),
        local_params=jax.tree.map(lambda x: x[None], treedef.unflatten(local_leaves)),
        inner_state=state.inner_state,
        outer_state=tuple(outer),
        compress_state=tuple(compressed),
        pending=tuple(pending) if plan.schedule.delay or plan.schedule.eager else (),
        step=count,
    )
    return new_state, (sent, nonfinite), synced


def _local_gradients(run, local, batch, model_state=None):
    """``((loss, aux, grads), new_model_state)`` of this device's batch shard; with an inner
    axis the params are typed varying over it first, so that ``jax.grad`` sums nothing (the
    inner compress does). Without a model state the new one is None."""
    if run.inner_axis is not None:
        local = jax.lax.pcast(local, run.inner_axis, to="varying")
    if model_state is None:
        return gradients.local_value_and_grad(run.loss_fn, run.has_aux, local, batch), None
    loss_fn = model_states.as_aux(run.loss_fn, run.has_aux, model_state)
    loss, (aux, new), grads = gradients.local_value_and_grad(loss_fn, True, local, batch)
    return (loss, aux, grads), new


def _model_state(run, new, old, synced):
    """This device's worker's model state after the step (None without one): ``new`` averaged
    over the inner axis, and on a step that exchanges a fragment over the workers too (a
    ``lax.cond``: a step without a sync sends nothing over the outer axis). A mean that is not
    finite keeps the worker's value before it; an integer leaf stays each worker's own."""
    if new is None:
        return None
    if run.inner_axis is not None:
        new = model_states.averaged(new, run.inner_axis, old)

    def sync(new):
        return model_states.averaged(new, run.outer_axis, new, own_integers=True)

    return cond_typed_alike(jnp.any(jnp.stack(synced)), sync, lambda new: new, new)


def _sync_round(run, schedule, f: int, count, fragment: Fragment):
    """``(fragment, bytes_sent, exchanged)`` with ``delay = 0``: fragment ``f``'s exchange and
    application together, one ``lax.cond`` on the step counter, after the inner step."""
    exchanged = schedule.exchanges(count, f)

    def sync(operands):
        global_leaves, local_leaves, outer_state, compress_state = operands
        aggregated, compress_state, bytes_sent = exchange(
            run, global_leaves, local_leaves, compress_state
        )
        stepped = outer_update(run, aggregated, outer_state, global_leaves)
        # compress(nonfinite="skip"|"raise") dropped the round: the global params and the outer
        # state stay as they were (no momentum step on a zero update), the workers restart.
        skipped = skipped_or_none(compress_state)
        global_leaves, outer_state = guard.hold(skipped, (global_leaves, outer_state), stepped)
        local_leaves = [like(g, lo) for g, lo in zip(global_leaves, local_leaves)]
        return (global_leaves, local_leaves, outer_state, compress_state), bytes_sent

    operands = (
        fragment.global_leaves,
        fragment.local_leaves,
        fragment.outer_state,
        fragment.compress_state,
    )
    (g, lo, outer_state, compress_state), bytes_sent = run.inner.cond(
        exchanged, sync, unsent, operands
    )
    return Fragment(g, lo, outer_state, compress_state, None), bytes_sent, exchanged


def _late_application(run, schedule, f: int, count, fragment: Fragment) -> Fragment:
    """Fragment ``f``'s delayed application after inner step ``count`` (a ``lax.cond``), from
    its pending aggregate."""
    skipped = skipped_or_none(fragment.compress_state)  # its exchange dropped the round
    applies = schedule.applies(count, f)
    g, lo, outer_state = jax.lax.cond(
        applies if skipped is None else applies & ~skipped,
        lambda ops: _apply_late(run, fragment.pending, *ops),
        lambda ops: ops,
        (fragment.global_leaves, fragment.local_leaves, fragment.outer_state),
    )
    return fragment._replace(global_leaves=g, local_leaves=lo, outer_state=outer_state)


def _apply_late(run, pending, global_leaves, local_leaves, outer_state):
    """The delayed application: the outer step on the global fragment with the aggregated
    pseudo-gradient exchanged ``delay`` steps ago, then each worker's fragment mixed with it,
    ``alpha * local + (1 - alpha) * global`` (Streaming DiLoCo's merge)."""
    global_leaves, outer_state = outer_update(run, pending, outer_state, global_leaves)
    alpha = run.mixing
    local_leaves = [
        like(jnp.where(jnp.isfinite(lo), alpha * lo + (1 - alpha) * g, g).astype(lo.dtype), lo)
        for g, lo in zip(global_leaves, local_leaves)
    ]  # an entry a worker lost to a non-finite value takes the global one: the worker heals
    return global_leaves, local_leaves, outer_state


def _healed(run, worker, before, state: DiLoCoState, synced):
    """``((local, inner_state), healed)``: on a step with a sync, this device's worker's
    entries that are not finite start again, its params' from the global params (a dropped sync,
    or a delayed one, left them), its inner state's from the inner optimizer's initial values;
    ``healed`` is 1 where its params before the sync (``before``) or its inner state held any."""

    def heal(worker):
        local, inner_state = worker
        leaves = jax.tree.leaves((before, inner_state))
        sick = ~guard.all_finite_many([x for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)])
        local = jax.tree.map(
            lambda lo, g: like(jnp.where(jnp.isfinite(lo), lo, g), lo), local, state.global_params
        )
        inner_state = keep_finite(run.inner.fresh_state(local), inner_state)
        return (local, inner_state), sick.astype(jnp.float32)

    def wait(worker):
        return worker, jnp.zeros((), jnp.float32)

    return cond_typed_alike(jnp.any(jnp.stack(synced)), heal, wait, worker)


def _metrics(run, loss, aux, sent, synced, healed):
    """The step's metrics: the loss (over all devices, or per worker), the outer bytes, synced,
    the non-finite entries the outer compress counted, and the fraction of devices whose
    worker state was healed."""
    sent, nonfinite = sent
    axes = frozenset(run.data_axes if isinstance(run.data_axes, tuple) else (run.data_axes,))
    if run.worker_metrics:
        # Per worker: averaged over the inner axis only; nothing crosses the outer axis.
        def reduce(x):
            x = small.metric_mean(x, run.inner_axis) if run.inner_axis else x
            return jnp.asarray(x)[None]
    else:

        def reduce(x):
            return small.metric_mean(x, run.data_axes)

    # The loss and the two counts in one reduction (typed per device first: a replicated count
    # reduces like a per-device one): one scalar all-reduce a step, as with the loss alone.
    scalars = [loss, healed, sum(nonfinite[1:], nonfinite[0])]
    scalars = [cast_varying(jnp.asarray(x, jnp.float32), axes) for x in scalars]
    together = reduce(jnp.stack(scalars, axis=-1))
    metrics = {
        "loss": together[..., 0].astype(jnp.result_type(loss)),
        "bytes_sent": sum(sent[1:], sent[0]),
        "synced": jnp.any(jnp.stack(synced)),
        "healed": together[..., 1],
        "nonfinite": together[..., 2],
    }
    if aux is not None:
        metrics["aux"] = jax.tree.map(reduce, aux)
    return metrics
