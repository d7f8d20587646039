"""Eager outer steps for :func:`jaxcomp.diloco` (``eager=True``): each fragment's exchange runs
beside the next round's inner steps and is applied one round late, and each worker restarts as
if its own fresh pseudo-gradient had already joined the average (Kale et al., "Eager Updates
For Overlapped Communication and Computation in DiLoCo", arXiv 2502.12996).

Fragment ``f``'s round runs at the start of the step after its exchange is due (after inner step
``c``), before that step's gradient, from the step's input. With ``Δ_w = start_w − local_w``,
worker ``w``'s progress since it last restarted, and ``avg`` the average exchanged one round
before (zero on the first round):

* the exchange: ``Δ_w`` through the outer ``compress``; its average is the next round's ``avg``.
  Nothing else in the step reads it, so its collectives wait for none of the step's forward and
  backward passes: the program lets them run beside the inner step (XLA:CPU's runtime still runs
  them one after the other, docs/training.md, "Eager rounds");
* the consensus: the global params take the outer step with ``avg`` (one round late; not on the
  first round, nor after an exchange ``nonfinite="skip"`` dropped);
* the eager restart: every worker restarts from ``global + u(avg + Δ_w / n)``, ``u`` the outer
  optimizer's update from its state before this round: the paper's per-worker outer step, which
  for an outer SGD equals the consensus plus the worker's own fresh contribution at weight
  ``1/n`` (its stale one is inside ``avg``). ``start_w`` is that point.

The global params stay one replicated pytree, the consensus; ``params(state)`` applies the
waiting averages to it (:func:`flushed`: the model with every exchanged pseudo-gradient in it).
The state adds, per fragment, the waiting average (replicated) and each worker's start.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomp.optim.nonfinite import skipped_or_none
from jaxcomp.optim.stages import guard
from jaxcomp.training._exchange import Fragment, exchange, like, outer_update, unsent


def eager_rounds(run, plan, state, local):
    """``(local, started)``: every fragment's eager round due after inner step ``state.step``,
    run from the step's input before its gradient. ``local`` is this worker's params with the
    restarted fragments; ``started[f]`` is ``(fragment, bytes_sent, exchanged)``, the
    fragment's global leaves, outer state, compress state (this worker's rows) and pending
    ``(average, start)`` as the state stores them (``start`` stacked ``[1, ...]``)."""
    global_leaves = jax.tree.leaves(state.global_params)
    local_leaves, treedef = jax.tree.flatten(local)
    started = []
    for f, group in enumerate(plan.schedule.groups):
        average, start = state.pending[f]
        fragment = Fragment(
            [global_leaves[i] for i in group],
            [local_leaves[i] for i in group],
            state.outer_state[f],
            plan.compress_rows(state.compress_state[f], f, take=True),
            (average, [x[0] for x in start]),
        )
        fragment, bytes_sent = _round(run, plan.schedule, f, state.step, fragment)
        for i, leaf in zip(group, fragment.local_leaves):
            local_leaves[i] = leaf
        average, start = fragment.pending
        fragment = fragment._replace(pending=(average, [x[None] for x in start]))
        started.append((fragment, bytes_sent, plan.schedule.exchanges(state.step, f)))
    return treedef.unflatten(local_leaves), started


def _round(run, schedule, f: int, step, fragment: Fragment):
    """``(fragment, bytes_sent)``: fragment ``f``'s eager round when its exchange is due after
    inner step ``step``, else the fragment as it was. Two ``lax.cond`` s: the exchange, whose
    result only the next round reads, and the restart, which the step's gradient reads; apart,
    the gradient waits for the restart only, and the runtime may run the exchange beside it."""
    due = schedule.exchanges(step, f)
    late = step > schedule.offset(f)  # an earlier round's average is waiting
    skipped = skipped_or_none(fragment.compress_state)  # that round's exchange was dropped
    late = late if skipped is None else late & ~skipped
    average, start = fragment.pending

    def send(operands):
        _, compress_state = operands
        new_average, compress_state, bytes_sent = exchange(
            run, fragment.global_leaves, fragment.local_leaves, compress_state, start=start
        )
        return (list(new_average), compress_state), bytes_sent

    sent, bytes_sent = run.inner.cond(due, send, unsent, (average, fragment.compress_state))

    def restart(operands):
        global_leaves, local_leaves, outer_state = operands
        n = run.n_workers
        own = [a + (s - lo) / n for a, s, lo in zip(average, start, local_leaves)]
        eager, _ = outer_update(run, own, outer_state, global_leaves)
        eager = [like(r.astype(lo.dtype), lo) for r, lo in zip(eager, local_leaves)]
        stepped = outer_update(run, average, outer_state, global_leaves)
        global_leaves, outer_state = guard.hold(~late, (global_leaves, outer_state), stepped)
        return global_leaves, eager, outer_state, eager  # the workers restart at their start

    operands = (fragment.global_leaves, fragment.local_leaves, fragment.outer_state, start)
    global_leaves, local_leaves, outer_state, start = jax.lax.cond(
        due, lambda operands: restart(operands[:3]), lambda operands: operands, operands
    )
    pending = (sent[0], start)
    return Fragment(global_leaves, local_leaves, outer_state, sent[1], pending), bytes_sent


def flushed(run, plan, state):
    """The consensus of ``state`` with each fragment's waiting average applied: the global
    params the next round's outer step gives (outside the step, under ``jax.jit``)."""
    leaves, treedef = jax.tree.flatten(state.global_params)
    for f, group in enumerate(plan.schedule.groups):
        average, _ = state.pending[f]
        waiting = state.step > plan.schedule.offset(f)  # a round has exchanged
        skipped = skipped_or_none(state.compress_state[f])
        if skipped is not None:  # the workers agree: the count was summed over them
            waiting = waiting & ~jnp.ravel(skipped)[0]
        old = [leaves[i] for i in group]
        stepped, _ = outer_update(run, average, state.outer_state[f], old)
        for i, leaf in zip(group, guard.hold(~waiting, old, stepped)):
            leaves[i] = leaf
    return treedef.unflatten(leaves)
