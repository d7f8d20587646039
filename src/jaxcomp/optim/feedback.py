"""The error-feedback transformation around an aggregation: :func:`feedback_transformation`.

:func:`jaxcomp.compress` and :func:`jaxcomp.compress_auto` build on it; they differ only in how
they aggregate (one method, a warm-up switch, or a per-step choice). An update is a pipeline of
the stages in :mod:`jaxcomp.optim.stages`, in this order:

1. guard: non-finite gradient entries count as 0 and are counted (:mod:`.stages.guard`);
2. warm-up: dense for the first steps (inside ``aggregate``, :mod:`.stages.warmup`);
3. mask: the leaves left out are summed exactly (:mod:`.stages.mask`);
4. momentum correction: ``u = m u + g`` (:mod:`.stages.momentum`);
5. error feedback: ``g_e = u + residual`` (:mod:`.stages.error_feedback`);
6. aggregation: the method's collective (:mod:`.stages.aggregation`);
7. error feedback and momentum again: keep ``g_e - sent``, clear the sent velocity;
8. metrics (:mod:`.stages.metrics`), and the guard's skip of the whole state.

The guard looks at the result too: a total that is not finite although every device's entries
were (the sum overflowed) and a next residual that is not (a device's own values overflowed)
count in the ``nonfinite`` metric and the policy, as 0 under ``"zero"``. A method that loses
nothing (:class:`jaxcomp.Dense`) takes a shorter route: it sums the leaves as they are and only
looks for non-finite entries when the sum is not finite. Gradient
accumulation is a wrapper around a whole transformation (:func:`jaxcomp.accumulate`), not a
stage.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from jaxcomp.methods import Method
from jaxcomp.ops import flat, pieces, scatter
from jaxcomp.optim import _update_checks, packing, pinning, sharding
from jaxcomp.optim._dense_route import runs_alone, sum_dense, update_alone
from jaxcomp.optim._flow import (
    Aggregated,
    Gradients,
    as_sent,
    filled,
    narrowest,
    next_state,
    prepare,
)
from jaxcomp.optim.config import FeedbackConfig
from jaxcomp.optim.stages import divergence, error_feedback, guard, mask, metrics, momentum
from jaxcomp.optim.stages.aggregation import (
    Aggregation,
    init_method_state,
)
from jaxcomp.optim.state import Branches, CompressState, NonfinitePolicy, init_metrics


def feedback_transformation(
    config: FeedbackConfig,
    branches: tuple[Method, ...],
    keeps_residual: bool,
    aggregate: Callable,
    init_auto: Callable | None = None,
    falls_back: bool = False,
    warmup: int = 0,
    alone: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """The error-feedback transformation around an aggregation step: the stages of this
    module's docstring (:func:`compress` and :func:`jaxcomp.compress_auto` build on it).

    Args:
      config: the shared arguments.
      branches: the methods the state records (:attr:`CompressState.methods`).
      keeps_residual: whether the state keeps a residual (error feedback that can lose anything).
      aggregate: ``(groups, state) -> (Aggregation, auto_after)``; ``auto_after(gain)`` returns
        the new auto state (or is None).
      init_auto: ``() -> auto state`` for the state's ``auto`` field, or None.
      falls_back: with a guardrail, whether ``aggregate`` runs dense while it falls back.
      warmup: the dense steps before the method runs (:func:`jaxcomp.optim.pinning.next_branch`).
      alone: a branch that sends everything, run by the dense route on a mesh of one device
        (:func:`jaxcomp.optim._dense_route.update_alone`); None: every mesh chooses.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`CompressState`.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.compress(jaxcomp.Dense())  # built on this
      >>> tx.init({"w": jnp.zeros(3)}).methods
      (Dense(allreduce='ring'),)

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (error feedback).
    """
    c = config
    uses_auto = init_auto is not None
    policy = NonfinitePolicy(c.nonfinite)
    branches = tuple(branches)
    sends_everything = all(m.sends_everything for m in branches)
    keeps_residual = keeps_residual and not sends_everything
    record = _branches(c, branches, falls_back, warmup)  # the state's static part

    def init_fn(params):
        return _init_state(c, record, params, keeps_residual, init_auto, policy)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        leaves, treedef = jax.tree.flatten(updates)
        residuals, velocities = _state_leaves(c, treedef, state)
        lay = mask.layout(c, updates, sends_everything)
        guarding = c.guardrail is not None and not sends_everything and bool(lay.groups)
        _check_state_is_ours(c, state, uses_auto, record, policy, guarding if lay.floats else None)
        if not lay.floats:
            return updates, state
        mask.check_same_choice(lay, residuals if keeps_residual else velocities)
        grads = prepare(c, branches, leaves, lay)
        if runs_alone(c, grads, alone, state):
            return update_alone(c, grads, aggregate, state, alone, treedef)
        if sends_everything and not uses_auto:
            done = sum_dense(c, grads, aggregate, state)
        else:
            done = _sum_error_fed(
                c, grads, aggregate, state, residuals, velocities, keeps_residual, guarding
            )
        skipped = guard.skip_flag(c.nonfinite, done.nonfinite)
        trigger = _trigger(c, done, skipped, state, branches, falls_back) if guarding else None
        new_residuals, new_velocities = _write_back(
            c, grads, done, skipped, residuals, velocities, keeps_residual, trigger
        )
        new_velocities = None if velocities is None else treedef.unflatten(new_velocities)
        new_state = next_state(c, grads, done, skipped, state, uses_auto, trigger)._replace(
            residual=treedef.unflatten(new_residuals), velocity=new_velocities
        )
        return treedef.unflatten(done.out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, _update_checks.checked_update(update_fn))


def _init_state(c: FeedbackConfig, record: Branches, params, keeps_residual, init_auto, policy):
    """The state before the first update: zero residual and velocity per compressed leaf."""
    branches = record.methods
    if sharding.active() is not None:
        _update_checks.check_scatters(branches)
    leaves, treedef = jax.tree.flatten(params)
    lay = mask.layout(c, params, all(m.sends_everything for m in branches))
    compressed = lay.compressed

    def per_compressed_leaf(keep):
        return treedef.unflatten(
            [
                jnp.zeros(leaf.shape, jnp.float32)
                if keep and i in compressed
                else optax.MaskedNode()
                for i, leaf in enumerate(leaves)
            ]
        )

    shapes = [tuple(leaves[i].shape for i in positions) for positions, _ in lay.groups]
    state = CompressState(
        residual=per_compressed_leaf(keeps_residual),
        step=jnp.zeros((), jnp.int32),
        key=jax.random.PRNGKey(c.seed),
        metrics=init_metrics(),
        auto=init_auto() if init_auto is not None else None,
        policy=policy,
        branches=record,
        velocity=per_compressed_leaf(True) if c.momentum is not None else None,
        method_state=init_method_state(branches, shapes),
        divergence=divergence.init()
        if c.guardrail is not None and not all(m.sends_everything for m in branches) and shapes
        else None,
    )
    return state._replace(asked=pinning.next_branch(state)) if pinning.can_pin(state) else state


def _state_leaves(c: FeedbackConfig, treedef, state: CompressState):
    """The state's residual and velocity per leaf of the updates (None without momentum)."""
    try:
        residuals = treedef.flatten_up_to(state.residual)
        velocities = treedef.flatten_up_to(state.velocity) if c.momentum is not None else None
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"updates do not have the structure of the params compress was initialized with: {e}"
        ) from None
    return residuals, velocities


def _branches(c: FeedbackConfig, branches, falls_back: bool, warmup: int) -> Branches:
    """The state's static record: its methods, whether its guardrail tells the host, whether it
    falls back to dense, its warm-up."""
    on = c.guardrail is not None
    return Branches(
        tuple(branches), on and c.guardrail.callback, on and falls_back, warmup, bool(c.mean)
    )


def _check_state_is_ours(c: FeedbackConfig, state, uses_auto, branches: Branches, policy, guarding):
    """Refuses a state made by another transformation's init (``guarding``: whether this update
    runs the guardrail, None when it has no float leaf)."""
    if guarding is not None and guarding != (state.divergence is not None):
        raise ValueError(
            f"state was made by a compress(guardrail={not guarding}), not by this "
            f"compress(guardrail={guarding})'s init"
        )
    if uses_auto != (state.auto is not None) or state.branches != branches:
        ours = [m.describe() for m in branches.methods]
        raise ValueError(
            f"state was not made by this transformation's init (it runs "
            f"{[m.describe() for m in state.methods]}, this one {ours})"
        )
    if state.policy != policy:
        raise ValueError(
            f"state was made by a compress(nonfinite={state.policy.name!r}), not by this "
            f"compress(nonfinite={c.nonfinite!r})'s init"
        )


def _sum_error_fed(
    c: FeedbackConfig,
    grads: Gradients,
    aggregate,
    state,
    residuals,
    velocities,
    keeps_residual,
    guarding=False,
) -> Aggregated:
    """Stages 1 and 3 to 6 and the metrics' sums: guard, mask, momentum, error feedback,
    aggregation, and the guard on what came out (totals that overflowed count as 0); with
    ``guarding``, the gradients' energy for the guardrail rides in the metrics' psum."""
    feds, plain_parts, counts, momenta, packs = _error_fed(
        c, grads, residuals, velocities, keeps_residual
    )
    gradient = _gradient_energy(grads, packs) if guarding else None
    out = list(grads.leaves)
    plain_bytes, plain_kept = 0.0, 0
    copies = guard.total_copies(c.axis_name, grads.shards is not None)
    if plain_parts:
        # The leaves mask= and min_size= leave out: summed as they are, in one all-reduce.
        # Written before the skip flag is known, so a skipped step does not zero them (as of
        # 0.1; jaxcomp.skip_nonfinite and data_parallel zero every update of a skipped step).
        groups = grads.groups
        plain_total, plain_bytes, plain_kept = mask.sum_plain(
            plain_parts,
            c.axis_name,
            groups.n_devices,
            groups.dtype_bytes,
            grads.comm_dtype,
            grads.shards,
        )
        (plain_total,), overflowed = guard.finite_totals([plain_total])  # (a few small leaves)
        counts.append(overflowed / copies)  # each device counts a replicated entry
        packing.write(
            out, grads.leaves, grads.layout.plain, plain_total, grads.scale, None, grads.shards
        )
    if feds:
        vectors = [fed.astype(grads.comm_dtype) for fed in feds]
        result, auto_after = aggregate(filled(grads.groups, vectors), state)
        feds = as_sent(feds, result)
    else:  # every leaf is plain
        result = Aggregation([], [], 0.0, 0, 0, False, True, state.method_state)
        auto_after = None
    sharded = grads.shards is not None
    gain, count, energies = metrics.summed_metrics(
        result,
        feds,
        sum(counts),
        c.axis_name,
        lambda: guard.count_totals(_dense(result.totals), c.axis_name, sharded),
        narrowest(grads.comm_dtype, state.methods),
        gradient,
        [None if p is None else p.fed for p in packs],
    )
    if c.nonfinite == "zero":  # an overflowed total counts as 0 (skip/raise zero the update)
        result = result._replace(totals=[_dropped(t) for t in result.totals])
    remainings = _remainings(feds, result) if keeps_residual else [None] * len(feds)
    return Aggregated(
        out,
        result,
        auto_after,
        feds,
        remainings,
        momenta,
        gain,
        count,
        plain_bytes,
        plain_kept,
        energies,
    )


def _dense(totals) -> list:
    """The totals as dense vectors, each part of :class:`~jaxcomp.ops.pieces.Pieces` on its own
    (a sparse total built only where something reads every entry: the rare step whose energies
    allow an overflow)."""
    parts = [p for t in totals for p in (t.parts if isinstance(t, pieces.Pieces) else [t])]
    return [t.dense() if isinstance(t, scatter.SparseTotal) else t for t in parts]


def _dropped(total):
    """The total with its non-finite entries as 0 (a sparse total drops them as it is written)."""
    if isinstance(total, scatter.SparseTotal):
        return total.dropped()
    return pieces.each(flat.dropped, total)


def _gradient_energy(grads: Gradients, packs):
    """This device's energy of the compressed leaves' finite gradient values (the guardrail's):
    from the one-pass packing where every group had it, else summed here (one more read)."""
    if packs and all(p is not None for p in packs):
        return sum(p.gradient for p in packs)
    return sum(flat.finite_energy(grads.leaves[i]) for i in sorted(grads.layout.compressed))


def _remainings(feds, result: Aggregation):
    """Per group, what this device did not send (``g_e - sent``, the next residual), or None when
    everything was sent. Its non-finite entries (the device's own values overflowed, counted in
    the metric) are dropped as it is cut into the leaves (:func:`_write_back`), so the residual
    stays finite under every policy."""
    if result.sends_everything:
        return [None] * len(feds)
    return [
        error_feedback.remaining(fed, sent, result.sparse) for fed, sent in zip(feds, result.sents)
    ]


def _error_fed(c: FeedbackConfig, grads: Gradients, residuals, velocities, keeps_residual):
    """Stages 1, 4 and 5: per group the error-fed vector, the plain leaves' finite values, the
    non-finite counts, the new velocities and per group the :class:`~jaxcomp.ops.flat.Packed`
    of the one-pass packing (None where the group was packed otherwise).

    Non-finite entries (NaN, ±Inf) count as 0 before anything else sees them: never sent, never
    stored in the residual, and the residual's own entry at that index is kept.
    """
    counts, momenta = [], {}

    def finite_part(i):
        values, count = guard.finite(grads.leaves[i])
        counts.append(count)
        return values

    def fed_leaf(i):
        g = finite_part(i)
        if c.momentum is not None:  # DGC: u = m u + g accumulates into the residual
            g = momenta[i] = momentum.accumulate(c.momentum, velocities[i], g)
        return error_feedback.add_residual(g, residuals[i]) if keeps_residual else g

    def fed_group(positions, row):
        if grads.shards is not None or c.momentum is not None:
            packs.append(None)
            return packing.pack([fed_leaf(i) for i in positions], grads.shards, row)
        # One pass on the CPU: the non-finite select, the residual's add, the join and the
        # energies the metrics and the guardrail read.
        packed = error_feedback.fused(
            [grads.leaves[i] for i in positions],
            [residuals[i] for i in positions] if keeps_residual else None,
        )
        counts.append(packed.nonfinite)
        packs.append(packed)
        return packed.vector

    packs = []
    feds = [
        fed_group(positions, row) for (positions, _), row in zip(grads.layout.groups, grads.rows)
    ]
    plain_parts = [finite_part(i) for i in grads.layout.plain]
    return feds, plain_parts, counts, momenta, packs


def _write_back(
    c: FeedbackConfig,
    grads: Gradients,
    done: Aggregated,
    skipped,
    residuals,
    velocities,
    keeps_residual,
    trigger=None,
):
    """Stages 5 and 4 after aggregation: the updates from the totals, the new residual
    (``g_e - sent``) and velocity (cleared where sent); a skipped step keeps the old ones, a step
    that triggers the guardrail sends no update and clears them."""
    result = done.result
    silenced = _either(skipped, trigger)
    new_residuals = list(residuals)
    new_velocities = list(velocities) if velocities is not None else None
    for (positions, _), row, remaining, total, sent in zip(
        grads.layout.groups, grads.rows, done.remainings, result.totals, result.sents
    ):
        packing.write(done.out, grads.leaves, positions, total, grads.scale, silenced, grads.shards)
        if result.sends_everything:
            continue  # everything was sent: no residual
        if keeps_residual:  # (its overflowed entries dropped, all of it cleared on a trigger)
            packing.keep(
                new_residuals,
                residuals,
                grads.leaves,
                positions,
                remaining,
                skipped,
                grads.shards,
                cleared=trigger,
                drop=True,
            )
        if c.momentum is not None:
            # DGC's momentum factor masking: what was sent leaves the momentum too.
            velocity = packing.pack([done.momenta[i] for i in positions], grads.shards, row)
            velocity = momentum.clear_sent(velocity, sent, result.sparse)
            if c.nonfinite == "zero":  # m u + g overflowed: dropped, like the residual
                velocity = flat.dropped(velocity)
            velocity = _cleared(trigger, velocity)
            packing.keep(
                new_velocities, velocities, grads.leaves, positions, velocity, skipped, grads.shards
            )
    return new_residuals, new_velocities


def _either(a, b):
    """``a | b`` of two flags that may be None (never set)."""
    if a is None or b is None:
        return b if a is None else a
    return a | b


def _cleared(trigger, vector):
    """``vector``, or zeros on a step that triggered the guardrail (a select that fuses into the
    vector's own update)."""
    if trigger is None:
        return vector
    return pieces.each(lambda v: flat.cleared(trigger, v), vector)


def _trigger(c: FeedbackConfig, done: Aggregated, skipped, state, branches, falls_back):
    """Whether this step triggers the guardrail (:mod:`.stages.divergence`): never on a skipped
    step; with ``Guardrail(callback=True)`` the host hears of it from the triggered branch."""
    guarded = state.divergence
    trigger = divergence.triggered(c.guardrail, guarded, *done.energies, done.gain)
    if skipped is not None:
        trigger = trigger & ~skipped
    if not c.guardrail.callback:
        return trigger  # the host hears of it from the state (divergence.tell_trigger)
    lossy = [m.describe() for m in branches if not m.sends_everything]
    divergence.report(
        trigger,
        state.step,
        done.energies.gradient,
        guarded.mean,
        divergence.window_length(c.guardrail, guarded)[0],
        c.axis_name,
        "/".join(lossy),
        falls_back,
    )
    return trigger
