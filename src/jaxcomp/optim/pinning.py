"""A branch chosen on the host: one compiled step per branch instead of ``lax.switch``.

A compress state with more than one branch (a warm-up, the guardrail's dense fallback,
:func:`jaxcomp.compress_auto`'s candidates) picks the branch of each step on the device, with
``lax.switch`` over a traced index. Every branch must then return dense totals and sents, so a
sparse method loses its fast path: its residual is no longer updated in place and its sum is no
longer a :class:`jaxcomp.ops.scatter.SparseTotal`, and its update takes markedly longer than the
fixed method's (docs/training.md, "Branches picked on the host").

Traced inside :func:`pinned`, the aggregation runs the given branch as a static choice, exactly as
a ``compress`` of that one method would. The step still computes the branch the device would
choose, and :func:`next_branch` reads it from the new state, so a host can compile one step per
branch and dispatch the one the device asks for (:class:`jaxcomp.training.branches.PinnedSteps`
does, for :func:`jaxcomp.data_parallel`). Any branch keeps the state exact: the residual always
holds what the branch that ran did not send.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax.numpy as jnp

from jaxcomp.methods import Dense
from jaxcomp.optim.stages import divergence

_PINNED: contextvars.ContextVar = contextvars.ContextVar("jaxcomp_pinned_branch", default=None)


@contextlib.contextmanager
def pinned(branch: int | None, record=None):
    """Traces the update of the compress state whose static record is ``record`` inside the
    block with ``branch`` as a static choice.

    Args:
      branch: an index into :attr:`jaxcomp.CompressState.methods`, or None (the device chooses,
        ``lax.switch``).
      record: the state's :attr:`jaxcomp.CompressState.branches`; a compress update of another
        state (a transformation's own inner one) still chooses on the device. None: every
        state's.

    Returns:
      A context manager (it yields None).

    Example:
      >>> with pinned(1):
      ...     pinned_branch()
      1

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-D (one collective chosen per step).
    """
    if branch is not None and (isinstance(branch, bool) or not isinstance(branch, int)):
        raise TypeError(f"branch must be an int or None, got {branch!r}")
    token = _PINNED.set(None if branch is None else (branch, record))
    try:
        yield
    finally:
        _PINNED.reset(token)


def pinned_branch(record=None) -> int | None:
    """The branch :func:`pinned` set for the state of ``record`` while tracing, or None.

    Args:
      record: the state's :attr:`jaxcomp.CompressState.branches`, or None (any state's).

    Returns:
      The pinned index, or None outside :func:`pinned` or for another state.

    Example:
      >>> pinned_branch() is None
      True

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-D.
    """
    pin = _PINNED.get()
    if pin is None or (record is not None and pin[1] is not None and pin[1] != record):
        return None
    return pin[0]


def pinned_config(config, record):
    """The :class:`jaxcomp.optim.config.FeedbackConfig` a step of the state whose static record
    is ``record`` runs with: its pinned branch's own (``config.for_branch``), else ``config``.

    Args:
      config: the transformation's config.
      record: the state's :attr:`jaxcomp.CompressState.branches`.

    Returns:
      A ``FeedbackConfig``.

    Example:
      >>> from jaxcomp.optim.config import FeedbackConfig
      >>> config = FeedbackConfig(("data",), branch_buckets=(25.0, None))
      >>> with pinned(0):
      ...     pinned_config(config, None).bucket_mb
      25.0

    References:
      Li et al., "PyTorch Distributed", VLDB 2020, §3.2.3 (gradient buckets).
    """
    return config.for_branch(pinned_branch(record))


def static_choice(record, wanted):
    """The branch an aggregation runs: the pinned one (a Python int), else ``wanted``.

    Args:
      record: the state's :attr:`jaxcomp.CompressState.branches` (its methods are the branches).
      wanted: the branch the device chose, a traced int32 scalar (or a Python int, or None).

    Returns:
      The pinned branch, checked against the methods, or ``wanted``.

    Example:
      >>> from jaxcomp.methods import Dense, TopK
      >>> from jaxcomp.optim.state import Branches
      >>> with pinned(0):
      ...     static_choice(Branches((Dense(), TopK(0.1))), 1)
      0

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-D.
    """
    branch = pinned_branch(record)
    if branch is None:
        return wanted
    runs = record.methods
    if not 0 <= branch < len(runs):
        raise ValueError(
            f"pinned branch {branch} is not one of the {len(runs)} branches "
            f"{[m.describe() for m in runs]}"
        )
    return branch


def can_pin(state) -> bool:
    """Whether :func:`next_branch` tells ``state``'s next branch: several branches, one among
    them that gains from a static branch (a sparse one, one whose sent comes decoded:
    :attr:`jaxcomp.methods.Method.decoded_sent`, one with defaults of its own:
    :attr:`jaxcomp.optim.state.Branches.own_defaults`, or buckets, which a ``lax.switch`` would
    hold until the whole backward pass is done: :attr:`jaxcomp.optim.state.Branches.buckets`),
    and no :class:`jaxcomp.RatioSearch`. Static: reads no array.

    Args:
      state: a :class:`jaxcomp.CompressState`.

    Returns:
      True or False.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> can_pin(jaxcomp.compress("ar_topk", ratio=0.1, warmup_steps=3).init(jnp.zeros(4)))
      True

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-D.
    """
    runs = state.branches.methods
    searching = state.auto is not None and state.auto.ratio is not None
    gains = (
        state.branches.own_defaults
        or state.branches.buckets
        or any(m.sparse or m.decoded_sent for m in runs)
    )
    return len(runs) >= 2 and gains and not searching


def next_branch(state):
    """The branch the device will choose for the next update of ``state``, as far as the state
    says: the warm-up's step count, the guardrail's fallback window, ``compress_auto``'s last
    choice (a re-decision in that update is only seen one update later).

    Args:
      state: a :class:`jaxcomp.CompressState` (its arrays, traced or not).

    Returns:
      An int32 scalar, or None where the state cannot say or a step per branch would gain
      nothing: a single branch (nothing to choose), no branch that gains from a static choice
      (:func:`can_pin`; a switch over methods that send dense vectors in one message costs
      nothing measurable), or ``compress_auto`` with a
      :class:`jaxcomp.RatioSearch` (its branch moves with the ratio controller every few steps).

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> state = jaxcomp.compress("allgather_topk", ratio=0.1, warmup_steps=3).init(jnp.zeros(4))
      >>> int(next_branch(state)), int(next_branch(state._replace(step=jnp.int32(3))))
      (0, 1)

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3 (warm-up); Tyagi & Swany, arXiv
      2312.02493, §3-D (the choice of collective).
    """
    if not can_pin(state):
        return None
    runs = state.branches.methods
    if state.auto is not None:
        branch = state.auto.choice
    else:
        warmup = state.branches.warmup
        branch = (state.step >= warmup) if warmup else jnp.zeros((), bool)
    branch = jnp.asarray(branch, jnp.int32)
    if state.branches.falls_back and state.divergence is not None:
        dense = next(i for i, m in enumerate(runs) if isinstance(m, Dense))
        branch = jnp.where(divergence.falling_back(state.divergence), dense, branch)
    return branch.astype(jnp.int32)
