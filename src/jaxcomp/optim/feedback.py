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

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomp.methods import Method
from jaxcomp.ops import flat, pieces, scatter
from jaxcomp.optim import _update_checks, packing, pinning, readiness, sharding, vma
from jaxcomp.optim.config import FeedbackConfig
from jaxcomp.optim.stages import divergence, error_feedback, guard, mask, metrics, momentum
from jaxcomp.optim.stages.aggregation import (
    Aggregation,
    Groups,
    as_one_group,
    init_method_state,
)
from jaxcomp.optim.stages.guard import NonfinitePolicy
from jaxcomp.optim.state import Branches, CompressState, init_metrics


class _Gradients(NamedTuple):
    """What every stage of one update reads: the gradients and how they are laid out."""

    leaves: list  # the gradients' leaves
    layout: mask.Layout
    groups: Groups  # the groups, their vectors not yet filled in
    rows: list  # per group: values per device row when sharded, else None
    shards: int | None  # sharded training: the devices sharing the shards, else None
    comm_dtype: Any  # the dtype the collectives carry
    scale: float  # 1 / devices for the mean, else 1


class _Aggregated(NamedTuple):
    """What the stages before the write-back produced."""

    out: list  # the update's leaves, the plain ones written
    result: Aggregation
    auto_after: Callable | None  # gain -> new auto state, or None
    feds: list  # per group: this device's error-fed vector (None on the dense route)
    remainings: list  # per group: g_e - sent, the next residual (None when everything is sent)
    momenta: dict  # leaf -> its new velocity (momentum correction)
    gain: Any  # f32[]
    nonfinite: Any  # f32[]: summed over the devices
    plain_bytes: Any  # bytes of the plain leaves' sum
    plain_kept: int  # values of the plain leaves
    energies: Any = None  # metrics.Energies summed over the devices (with a guardrail)


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
    """The error-feedback transformation around an aggregation step (what :func:`compress` and
    :func:`jaxcomp.compress_auto` build on); its update runs the stages of this module's
    docstring.

    Args:
      config: the shared arguments.
      branches: the methods the state records (:attr:`CompressState.methods`).
      keeps_residual: whether the state keeps a residual (error feedback that can lose anything).
      aggregate: ``(groups, state) -> (Aggregation, auto_after)`` run inside the update, where
        ``auto_after(gain)`` returns the new auto state (or is None).
      init_auto: ``() -> auto state`` for the state's ``auto`` field, or None.
      falls_back: with ``config.guardrail``, whether ``aggregate`` runs dense while the state's
        :attr:`~jaxcomp.CompressState.divergence` says so (else the guardrail only clears the
        residual); for the host's message.
      warmup: the dense steps before the method runs (:func:`jaxcomp.optim.pinning.next_branch`).
      alone: a branch that sends everything, run on a mesh of one device instead of choosing
        (``compress_auto``'s dense candidate; without momentum correction, not sharded): nothing
        is sent there, so it takes the dense route, with no packing of error-fed vectors, and
        the residual stays as it is. None: every mesh chooses.

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

    def guards(lay: mask.Layout) -> bool:  # the guardrail runs: something is compressed
        return c.guardrail is not None and not sends_everything and bool(lay.groups)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        leaves, treedef = jax.tree.flatten(updates)
        residuals, velocities = _state_leaves(c, treedef, state)
        lay = mask.layout(c, updates, sends_everything)
        if lay.floats and guards(lay) != (state.divergence is not None):
            raise ValueError(
                f"state was made by a compress(guardrail={not guards(lay)}), not by this "
                f"compress(guardrail={guards(lay)})'s init"
            )
        _check_state_is_ours(c, state, uses_auto, record, policy)
        if not lay.floats:
            return updates, state
        mask.check_same_choice(lay, residuals if keeps_residual else velocities)
        grads = _prepare(c, branches, leaves, lay)
        if _runs_alone(c, grads, alone, state):
            return _update_alone(c, grads, aggregate, state, alone, treedef)
        if sends_everything and not uses_auto:
            done = _sum_dense(c, grads, aggregate, state)
        else:
            done = _sum_error_fed(
                c, grads, aggregate, state, residuals, velocities, keeps_residual, guards(lay)
            )
        skipped = guard.skip_flag(c.nonfinite, done.nonfinite)
        trigger = _trigger(c, done, skipped, state, branches, falls_back) if guards(lay) else None
        new_residuals, new_velocities = _write_back(
            c, grads, done, skipped, residuals, velocities, keeps_residual, trigger
        )
        new_state = _next_state(c, grads, done, skipped, state, uses_auto, trigger)._replace(
            residual=treedef.unflatten(new_residuals),
            velocity=treedef.unflatten(new_velocities) if velocities is not None else None,
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
    return CompressState(
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
    return Branches(tuple(branches), on and c.guardrail.callback, on and falls_back, warmup)


def _check_state_is_ours(c: FeedbackConfig, state, uses_auto, branches: Branches, policy):
    """Refuses a state made by another transformation's init."""
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


def _prepare(c: FeedbackConfig, branches, leaves, lay: mask.Layout) -> _Gradients:
    """The :class:`_Gradients` of these gradients, after checking where the update runs."""
    axis_sizes = [_update_checks.bound_axis_size(a) for a in c.axes]
    n_devices = math.prod(axis_sizes)
    shards = _update_checks.shards(c, branches, n_devices)  # sharded training: N, else None
    floats = [leaves[i] for i in lay.floats]
    _update_checks.check_local_gradients(c, floats)
    comm_dtype = _comm_dtype(floats)
    groups = Groups(
        vectors=[],
        names=[name for _, name in lay.groups],
        sizes=[],
        n_devices=n_devices,
        inner_size=axis_sizes[-1] if len(axis_sizes) == 2 else None,
        dtype_bytes=jnp.dtype(comm_dtype).itemsize,
        shapes=[tuple(leaves[i].shape for i in positions) for positions, _ in lay.groups],
        scatter=shards is not None,
        values=[sum(leaves[i].size for i in positions) for positions, _ in lay.groups],
        buckets=None
        if lay.buckets is None
        else readiness.bucket_ranks(
            lay.buckets, [p for p, _ in lay.groups], _ready_order(len(leaves))
        ),
    )
    rows = [
        packing.row(branches, [leaves[i] for i in positions], shards) for positions, _ in lay.groups
    ]
    scale = 1.0 / n_devices if c.mean else 1.0
    return _Gradients(leaves, lay, groups, rows, shards, comm_dtype, scale)


def _ready_order(n_leaves: int) -> tuple | None:
    """:func:`jaxcomp.optim.readiness.ready_order`, if it orders these updates' ``n_leaves``
    leaves (an order read from another tree, e.g. before a wrapper reshaped it, is not used)."""
    order = readiness.ready_order()
    return order if order is not None and len(order) == n_leaves else None


def _filled(groups: Groups, vectors) -> Groups:
    return groups._replace(vectors=vectors, sizes=[v.shape[0] for v in vectors])


def _sum_dense(c: FeedbackConfig, grads: _Gradients, aggregate, state) -> _Aggregated:
    """The route of a method that loses nothing: nothing is kept, so the gradients are summed as
    they are (each large leaf alone, the small ones as one vector: :func:`mask.summed_together`)
    and the guard looks at the sums (:func:`guard.guarded_totals`)."""
    vectors = [
        packing.pack([grads.leaves[i] for i in positions], grads.shards, row).astype(
            grads.comm_dtype
        )
        for (positions, _), row in zip(grads.layout.groups, grads.rows)
    ]
    return _sum_groups(c, grads, _filled(grads.groups, vectors), aggregate, state)


def _sum_groups(c: FeedbackConfig, grads: _Gradients, groups: Groups, aggregate, state):
    """The :class:`_Aggregated` of ``groups`` summed as they are, the guard looking at the sums
    (:func:`guard.guarded_totals`): the dense route's sum, packed or leaf by leaf."""
    result, auto_after = aggregate(groups, state)
    totals, count = guard.guarded_totals(
        result.totals,
        lambda: _sum_as_one(aggregate, groups, _as_sent(groups.vectors, result), state),
        c.axis_name,
        sharded=grads.shards is not None,
    )
    result = result._replace(totals=totals)
    gain = jnp.ones((), jnp.float32)  # everything is sent
    nothing = [None] * len(totals)
    return _Aggregated(
        list(grads.leaves), result, auto_after, nothing, nothing, {}, gain, count, 0.0, 0
    )


def _runs_alone(c: FeedbackConfig, grads: _Gradients, alone: int | None, state) -> bool:
    """Whether this update runs branch ``alone`` by the dense route: one device in all, not
    sharded, no momentum correction (whose velocity the dense route would not send), and no
    other branch pinned for this step (``data_parallel``'s trial times each candidate)."""
    return (
        alone is not None
        and grads.groups.n_devices == 1
        and grads.shards is None
        and c.momentum is None
        and pinning.pinned_branch(state.branches) in (None, alone)
    )


def _update_alone(c: FeedbackConfig, grads: _Gradients, aggregate, state, alone: int, treedef):
    """The update on one device of a state whose branch ``alone`` sends everything: that branch,
    static, on each leaf as it is (a flat view, no packing: the sum of one device is its own
    vector, retyped), with the guard's non-finite handling. Nothing is sent, so no residual is
    made and the one the state holds stays as it is; the guardrail has nothing compressed to
    watch. The metrics report the branch, and the choosing state (``compress_auto``'s) learns
    of its step as of any other."""
    positions = list(grads.layout.floats)  # the plain leaves (mask=, min_size=) too
    leaves = [grads.leaves[i] for i in positions]
    groups = grads.groups._replace(
        vectors=[leaf.reshape(-1).astype(grads.comm_dtype) for leaf in leaves],
        names=[f"leaf {i}" for i in positions],
        sizes=[leaf.size for leaf in leaves],
        shapes=[(leaf.shape,) for leaf in leaves],
        values=[leaf.size for leaf in leaves],
        buckets=None,
    )
    with pinning.pinned(alone, state.branches):
        done = _sum_groups(c, grads, groups, aggregate, state)
    done = done._replace(result=done.result._replace(sends_everything=True))
    skipped = guard.skip_flag(c.nonfinite, done.nonfinite)
    for i, leaf, total in zip(positions, leaves, done.result.totals):
        update = total.reshape(leaf.shape)  # the mean over one device is the sum
        if skipped is not None:
            update = jnp.where(skipped, jnp.zeros_like(update), update)
        done.out[i] = update.astype(leaf.dtype)
    new_state = _next_state(c, grads, done, skipped, state, state.auto is not None)
    # The residual is kept as it was, typed per device as every other route leaves it (the
    # state's layout reads its type from an update traced without a pinned branch).
    axes = frozenset(c.axes)
    residual = jax.tree.map(lambda r: vma.cast_varying(r, axes), state.residual)
    return treedef.unflatten(done.out), new_state._replace(residual=residual)


def _sum_as_one(aggregate, groups: Groups, vectors, state):
    """``(vector, resum, split)`` of :func:`guard.guarded_totals`: ``vectors`` (one per group)
    end to end, summed as one group (one collective however many leaves: a method that sends
    everything sums elementwise), and its total split back into one per group."""
    one, split = as_one_group(groups, vectors)
    resum = lambda vector: aggregate(one._replace(vectors=[vector]), state)[0].totals[0]  # noqa: E731
    return one.vectors[0], resum, split


def _sum_error_fed(
    c: FeedbackConfig,
    grads: _Gradients,
    aggregate,
    state,
    residuals,
    velocities,
    keeps_residual,
    guarding=False,
) -> _Aggregated:
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
        result, auto_after = aggregate(_filled(grads.groups, vectors), state)
        feds = _as_sent(feds, result)
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
        _narrowest(grads.comm_dtype, state.methods),
        gradient,
        [None if p is None else p.fed for p in packs],
    )
    if c.nonfinite == "zero":  # an overflowed total counts as 0 (skip/raise zero the update)
        result = result._replace(totals=[_dropped(t) for t in result.totals])
    remainings = _remainings(feds, result) if keeps_residual else [None] * len(feds)
    return _Aggregated(
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


def _as_sent(vectors, result: Aggregation) -> list:
    """``vectors`` (per group), each replaced by the one the collectives read where that is the
    same array made to wait for the bucket before (``bucket_mb=``): used after the aggregation
    instead of the original, it needs no copy."""
    if result.vectors is None:
        return vectors
    return [s if s.dtype == v.dtype else v for v, s in zip(vectors, result.vectors)]


def _gradient_energy(grads: _Gradients, packs):
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


def _error_fed(c: FeedbackConfig, grads: _Gradients, residuals, velocities, keeps_residual):
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
    grads: _Gradients,
    done: _Aggregated,
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


def _trigger(c: FeedbackConfig, done: _Aggregated, skipped, state, branches, falls_back):
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


def _next_state(
    c, grads: _Gradients, done: _Aggregated, skipped, state: CompressState, uses_auto, trigger=None
):
    """Stage 7 and the guard's skip: the metrics, and the step, auto, method and guardrail
    states (a skipped step leaves the state as it was; only the metrics report it)."""
    result = done.result
    guarded, fallback, fallbacks = state.divergence, 0.0, 0.0
    if trigger is not None:
        advanced = divergence.advance(c.guardrail, guarded, trigger, *done.energies, done.gain)
        fallback = trigger | divergence.falling_back(guarded)
        guarded = guard.hold(skipped, guarded, advanced)
        fallbacks = guarded.fallbacks
    total_size = sum(grads.leaves[i].size for i in grads.layout.floats)
    step_metrics = metrics.step_metrics(
        done.gain,
        result.bytes_sent + done.plain_bytes,
        result.kept + done.plain_kept,
        result.method,
        done.nonfinite,
        total_size,
        fallback,
        fallbacks,
    )
    new_auto = done.auto_after(done.gain) if done.auto_after is not None else state.auto
    method_state = result.method_state
    if c.nonfinite == "zero":  # overflowed (PowerSGD's Q): the last finite value
        method_state = guard.finite_or_old(state.method_state, method_state)
    return state._replace(
        step=guard.hold(skipped, state.step, state.step + 1),
        metrics=step_metrics,
        auto=guard.hold(skipped, state.auto, new_auto) if uses_auto else None,
        method_state=guard.hold(skipped, state.method_state, method_state),
        divergence=guarded,
    )


def _narrowest(comm_dtype, methods):
    """The dtype whose largest value bounds the sums: the collectives' dtype, or a narrower one
    that a method sums in on the wire (:attr:`jaxcomp.methods.Method.wire_dtype`)."""
    dtypes = [jnp.dtype(comm_dtype)] + [jnp.dtype(m.wire_dtype) for m in methods if m.wire_dtype]
    return min(dtypes, key=lambda d: float(jnp.finfo(d).max))


def _comm_dtype(leaves):
    """The dtype the collectives carry: the gradients' own when they share a 16-bit float, else
    f32."""
    dtypes = {jnp.dtype(leaf.dtype) for leaf in leaves}
    if len(dtypes) == 1 and dtypes <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}:
        return dtypes.pop()
    return jnp.dtype(jnp.float32)
