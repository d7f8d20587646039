"""The error-feedback stage: what a device did not send is added to its next gradient.

``g_e = g + residual`` before aggregation, ``residual = g_e - sent`` after; the residual is the
state of this stage (:attr:`jaxcomp.CompressState.residual`), one float32 array per
compressed leaf, different on every device. On the way in the stage packs each group's
error-fed vector (on the CPU in one pass that also zeroes and counts the non-finite entries
and sums the energies the metrics and the guardrail read); without error feedback it packs the
same way with no residual. A trigger of the guardrail clears the residual.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomp.costmodel import ratio_choice
from jaxcomp.ops import flat, pieces
from jaxcomp.ops.pieces import Pieces
from jaxcomp.optim import packing, vma
from jaxcomp.optim.stages import guard
from jaxcomp.optim.stages.flight import InFlight, Stage, init_nested, wrapped


class FeedbackState(NamedTuple):
    """The error-feedback stage's state: like the gradients, the residual of each compressed leaf
    (``optax.MaskedNode()`` elsewhere, and everywhere when nothing is kept)."""

    residual: Any
    inner: Any = None


def feedback_stage(
    inner: Stage,
    keeps_residual: bool,
    packs: bool,
    compressed,
    axes,
    decay: float = 1.0,
    feeds=None,
) -> Stage:
    """Error feedback around ``inner``: ``g_e = g + decay residual`` in, ``g_e - sent`` kept out.

    Args:
      inner: the stage it wraps.
      keeps_residual: whether a residual is kept (a method that can lose something).
      packs: whether it packs the error-fed vectors (else the aggregation packs the leaves as
        they are: the dense route).
      compressed: ``params -> positions`` of the compressed leaves.
      axes: the mesh axes (the residual is typed per device over them).
      decay: the residual's scale before it is added (1: plain error feedback; below 1:
        SparseLoCo's decaying accumulator, one more pass over the residual).
      feeds: ``record -> bool``: whether a step of the state whose static record is ``record``
        feeds back (False: it neither adds nor updates the residual, which stays as it was:
        ``compress_auto``'s cast branch, compiled alone); None: every step with a residual.

    Returns:
      A :class:`~jaxcomp.optim.stages.flight.Stage` with a :class:`FeedbackState`.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> state = jaxcomp.compress("allgather_topk", ratio=0.5).init({"w": jnp.zeros(4)})
      >>> state.residual["w"].shape
      (4,)

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1; Seide et al., "1-Bit SGD", Interspeech 2014;
      Sarfi et al., "SparseLoCo", arXiv 2508.15706 (the decay).
    """

    def init(params):
        leaves, treedef = jax.tree.flatten(params)
        chosen = compressed(params)
        residual = [
            jnp.zeros(leaf.shape, jnp.float32)
            if keeps_residual and i in chosen
            else optax.MaskedNode()
            for i, leaf in enumerate(leaves)
        ]
        return init_nested(stage, params, residual=treedef.unflatten(residual))

    def update(flight: InFlight, state: FeedbackState):
        if flight.alone is not None or not packs:
            flight, state = wrapped(inner, flight, state)
            if flight.alone is not None:  # typed per device as every other route leaves it
                residual = jax.tree.map(
                    lambda r: vma.cast_varying(r, frozenset(axes)), state.residual
                )
                state = state._replace(residual=residual)
            return flight, state
        keeps = keeps_residual and (feeds is None or feeds(flight.record))
        residuals = flight.treedef.flatten_up_to(state.residual)
        fed_back = _decayed(residuals, decay) if keeps else None
        flight = _packed(flight, fed_back)
        flight, state = wrapped(inner, flight, state)
        if not keeps or flight.result.sends_everything:
            return flight, state
        return flight, state._replace(residual=_residual_after(flight, residuals))

    stage = Stage(init, update, FeedbackState, inner)
    return stage


def _residual_after(flight: InFlight, residuals: list):
    """The new residual tree: each group's ``fed - sent`` split into its leaves, its overflowed
    entries dropped, all of it cleared on a trigger of the guardrail."""
    grads = flight.grads
    new = list(residuals)
    for (positions, _), fed, sent in zip(grads.layout.groups, flight.feds, flight.result.sents):
        kept = remaining(fed, sent, flight.result.sparse)
        packing.keep(
            new,
            residuals,
            grads.leaves,
            positions,
            kept,
            None,
            grads.shards,
            cleared=flight.trigger,
            drop=True,
        )
    return flight.treedef.unflatten(new)


def _decayed(residuals, decay: float) -> list:
    """The residuals scaled by ``decay`` (as they are for plain error feedback, ``decay=1``)."""
    if decay == 1.0:
        return residuals
    return [r if isinstance(r, optax.MaskedNode) else decay * r for r in residuals]


def _packed(flight: InFlight, residuals) -> InFlight:
    """The flight with each group's error-fed vector, the one-pass packing of each (None where
    the group was packed otherwise) and the non-finite counts.

    Non-finite entries (NaN, ±Inf) count as 0 before anything else sees them: never sent, never
    stored in the residual, and the residual's own entry at that index is kept.
    """
    grads, counts, feds, packs = flight.grads, list(flight.counts), [], []

    def fed_leaf(i):
        if flight.values is not None:  # DGC's velocity, made finite by the momentum stage
            g = flight.values[i]
        else:
            g, count = guard.finite(grads.leaves[i])
            counts.append(count)
        return add_residual(g, residuals[i]) if residuals is not None else g

    for (positions, _), row in zip(grads.layout.groups, grads.rows):
        if grads.shards is not None or flight.values is not None:
            packs.append(None)
            feds.append(packing.pack([fed_leaf(i) for i in positions], grads.shards, row))
            continue
        # One pass on the CPU: the non-finite select, the residual's add, the join and the
        # energies the metrics and the guardrail read.
        packed = fused(
            [grads.leaves[i] for i in positions],
            [residuals[i] for i in positions] if residuals is not None else None,
        )
        counts.append(packed.nonfinite)
        packs.append(packed)
        feds.append(packed.vector)
    return flight._replace(feds=feds, packs=packs, counts=counts)


def add_residual(g, residual):
    """The error-fed gradient of a leaf: ``g + residual``.

    Args:
      g: the leaf's finite gradient (or DGC velocity), float32.
      residual: the state's residual of the leaf.

    Returns:
      ``g + residual``.

    Example:
      >>> import jax.numpy as jnp
      >>> add_residual(jnp.array([1.0]), jnp.array([0.5])).tolist()
      [1.5]

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1; Seide et al., "1-Bit SGD", Interspeech 2014.
    """
    return g + residual


def fused(grads, residuals):
    """A group's error-fed vector in one pass: each gradient's non-finite entries as 0, its
    residual added, the leaves joined, and the energies the metrics and the guardrail read
    (:func:`jaxcomp.ops.flat.pack_error_fed`).

    Args:
      grads: the group's gradient leaves.
      residuals: their residuals, or None without error feedback.

    Returns:
      A :class:`jaxcomp.ops.flat.Packed`: the vector, the non-finite count, the gradient's energy
      and the vector's (scaled by :data:`~jaxcomp.costmodel.ratio_choice.ENERGY_SCALE`).

    Example:
      >>> import jax.numpy as jnp
      >>> packed = fused([jnp.array([1.0, jnp.nan])], [jnp.array([0.5, 0.5])])
      >>> packed.vector.tolist(), float(packed.nonfinite)
      ([1.5, 0.5], 1.0)

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 and §3-C3 (fused compression).
    """
    return flat.pack_error_fed(grads, residuals, ratio_choice.ENERGY_SCALE)


def remaining(fed, sent, sparse: bool):
    """What the device did not send: ``fed - sent``, the next residual.

    Args:
      fed: a group's error-fed vector (float32).
      sent: this device's contribution: dense, :class:`jaxcomp.ops.pieces.Pieces` of it (the
        residual then comes back as the same parts, never joined),
        :class:`jaxcomp.ops.sign.ScaledSigns`, or ``(indices, values)``.
      sparse: ``sent`` is ``(indices, values)``.

    Returns:
      The group's new residual vector.

    Example:
      >>> import jax.numpy as jnp
      >>> fed = jnp.array([1.0, 2.0, 3.0])
      >>> remaining(fed, (jnp.array([1]), jnp.array([2.0])), True).tolist()
      [1.0, 0.0, 3.0]

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1.
    """
    if sparse:
        indices, values = sent
        # fed[i] + (-v) is fed[i] - v exactly: the same residual as fed - dense(sent).
        return fed.at[indices].add(-values.astype(jnp.float32), mode="drop", unique_indices=True)
    if isinstance(sent, Pieces):
        fed = Pieces.split(fed, sent.sizes)
        return Pieces([f - s.astype(jnp.float32) for f, s in zip(fed.parts, sent.parts)])
    return fed - pieces.joined(sent).astype(jnp.float32)
