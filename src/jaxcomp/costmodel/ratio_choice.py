"""The adaptive compression ratio of paper 000 §3-E (this module was ``jaxcomp.adaptive``).

Which compression ratio (top-k density) ``compress_auto`` runs, decided while training; which
method runs is the cost model's choice (:func:`jaxcomp.costmodel.cost.choose`), and
:func:`moved` tells both when the network changed enough to decide again.

Paper 000 §3-E treats the compression ratio (CR, the density ``k / n``) as a multi-objective
problem: minimize compression time, communication time and ``1 / gain``, where the compression
gain ``E‖g_c‖² / E‖g_e‖²`` measures how much of the error-fed gradient the compressed one keeps.
Candidate ratios are a fixed geometric ladder (so each is one static shape, compiled once); a
short exploration runs each candidate for a few steps, and the knee of the three objectives is
kept until the gain moves by 10% or more (explore again) or the network changes (re-decide from
the stored measurements with re-predicted communication times).

The controller (:func:`ratio_init`, :func:`ratio_observe`, :func:`ratio_redecide`) is pure
``jnp``: :func:`jaxcomp.compress_auto` runs it inside the compiled step and feeds the chosen
ratio's *index* into ``lax.switch`` over precompiled branches, so no decision recompiles.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.costmodel.gain import (  # noqa: F401  (re-exported: importable from here too)
    ENERGY_SCALE,
    PLAIN_ENERGY_LIMIT,
    compression_gain,
    gain_from_energies,
    scaled_energy,
)

#: The paper's exploration range of densities (paper 000 §3-E: c_low = 0.001, c_high = 0.1).
DEFAULT_RATIO_RANGE = (0.001, 0.1)


def candidate_ratios(ratio_range=DEFAULT_RATIO_RANGE, factor: float = 3.0) -> tuple[float, ...]:
    """Candidate densities from the top of ``ratio_range`` down, each ``factor`` times smaller.

    The range's two ends are always candidates: the bottom replaces the last rung when that rung
    is within ``sqrt(factor)`` of it, and is added below it otherwise, so the last step is in
    ``[sqrt(factor), factor * sqrt(factor))``. For the paper's range this is its list
    ``[0.1, 0.033, 0.011, 0.0037, 0.001]``.

    Args:
      ratio_range: ``(low, high)`` with ``0 < low <= high <= 1``.
      factor: spacing between neighbours, > 1.

    Returns:
      The densities, highest first.

    Example:
      >>> [round(r, 4) for r in candidate_ratios((0.001, 0.1))]
      [0.1, 0.0333, 0.0111, 0.0037, 0.001]

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-E (candidate CRs scaled by a factor of 3).
    """
    low, high = _check_range(ratio_range)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        raise ValueError(f"factor must be a number > 1, got {factor!r}")
    ratios = [high]
    while ratios[-1] / factor >= low * (1 + 1e-9):
        ratios.append(ratios[-1] / factor)
    if ratios[-1] > low * (1 + 1e-9):
        if ratios[-1] / low < math.sqrt(factor) and len(ratios) > 1:
            ratios[-1] = low
        else:
            ratios.append(low)
    return tuple(float(r) for r in ratios)


def knee(t_comp, t_sync, gain, *, base_seconds: float = 0.0, flat_tolerance: float = 0.1) -> int:
    """The knee of (compression time, communication time, 1 / gain) over the candidates.

    Each objective is scaled to ``[0, 1]`` across the candidates, except that an objective whose
    spread is below ``flat_tolerance`` of its scale counts as flat (all zero): the times' scale is
    the slowest candidate's whole step, ``base_seconds + t_comp + t_sync``, and the gain's is the
    largest ``1 / gain``. Among the Pareto-optimal candidates, the one nearest the ideal point
    (every objective at its best) is the knee; ties go to the earlier candidate.

    So when the gain barely varies the fastest candidate wins, when the network is too fast for
    the ratio to matter the best gain wins, and otherwise the two are balanced.

    Args:
      t_comp: seconds to compress and decompress, one per candidate (zeros if unknown).
      t_sync: seconds to communicate, one per candidate.
      gain: compression gain, one per candidate, each > 0.
      base_seconds: the rest of the step (forward and backward), >= 0.
      flat_tolerance: relative spread below which an objective is ignored, in ``[0, 1)``.

    Returns:
      The index of the chosen candidate.

    Example:
      >>> knee([0, 0, 0], [1.0, 0.3, 0.1], [0.5, 0.2, 0.01])
      1

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-E, Eqn (6) (the knee of the Pareto front).
    """
    t_comp, t_sync, gain = _check_measurements(t_comp, t_sync, gain)
    if (
        not isinstance(base_seconds, (int, float))
        or isinstance(base_seconds, bool)
        or not base_seconds >= 0
    ):
        raise ValueError(f"base_seconds must be a number >= 0, got {base_seconds!r}")
    if not isinstance(flat_tolerance, (int, float)) or not 0 <= flat_tolerance < 1:
        raise ValueError(f"flat_tolerance must be in [0, 1), got {flat_tolerance!r}")
    return int(_knee_index(t_comp, t_sync, gain, base_seconds, flat_tolerance, np))


def _knee_index(t_comp, t_sync, gain, base_seconds, flat_tolerance, xp):
    """:func:`knee` without the checks, for numpy (``xp=np``) and inside a step (``xp=jnp``)."""
    objectives = xp.stack([t_comp, t_sync, 1.0 / gain], axis=1)
    step_scale = base_seconds + xp.max(t_comp + t_sync)
    scales = xp.stack([step_scale, step_scale, xp.max(objectives[:, 2])])
    low = objectives.min(axis=0)
    spread = objectives.max(axis=0) - low
    significant = spread > flat_tolerance * scales
    normalized = xp.where(significant, (objectives - low) / xp.where(spread > 0, spread, 1.0), 0.0)
    distance = xp.sqrt(xp.sum(normalized**2, axis=1))
    distance = xp.where(_pareto_optimal(objectives, xp), distance, xp.inf)
    return xp.argmin(distance)


def _gain_moved(reference, gain, tolerance):
    # The relative slack keeps an exact 10% change (0.9 of 1.0, inexact in binary) a change.
    return abs(gain - reference) >= tolerance * reference * (1 - 1e-9)


def moved(old, new, tolerance, xp=np):
    """Elementwise: ``new`` differs from ``old`` by ``tolerance`` of the larger magnitude, or more.

    A relative change of β is the same relative change of the bandwidth (``|b1-b2| / max(b1, b2)``
    is symmetric under ``b -> 1/b``), so (α, β) pairs compare as (α, bandwidth) would. Runs on
    numpy (``xp=np``) and inside a step (``xp=jnp``).

    Args:
      old: the values decided with (numpy or jnp array).
      new: the values measured now, same shape.
      tolerance: relative change that counts.
      xp: ``np`` on the host, ``jnp`` inside a step.

    Returns:
      A boolean array, True where the value moved.

    Example:
      >>> import numpy as np
      >>> moved(np.array([1e-3, 8e-9]), np.array([1e-3, 1e-8]), 0.1).tolist()  # 10 -> 8 Gbit/s
      [False, True]

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-E (re-decide when α or β changes by 10%).
    """
    return (xp.abs(new - old) >= tolerance * xp.maximum(xp.abs(old), xp.abs(new))) & (old != new)


class RatioState(NamedTuple):
    """State of the compression-ratio controller (paper 000 §3-E), as arrays.

    It lives inside :class:`jaxcomp.AutoState` of a ``compress_auto(..., ratio_search=...)``,
    where :func:`ratio_observe` runs inside the compiled step. ``R`` is the number of candidate
    ratios, ``E`` the steps per candidate.
    """

    index: jax.Array  # i32[]: the candidate ratio to run next
    exploring: jax.Array  # bool[]: an exploration is under way
    count: jax.Array  # i32[]: steps recorded at `index` in this exploration
    gain_sum: jax.Array  # f32[R]: sum of the gains each candidate had in the last exploration
    comp_sum: jax.Array  # f32[R]: sum of their compression times
    sync_sum: jax.Array  # f32[R]: sum of their measured communication times
    sync_count: jax.Array  # i32[R]: how many of those were measured (0: predict instead)
    recent: jax.Array  # f32[E]: the last E gains since the decision (a ring buffer)
    recent_count: jax.Array  # i32[]: gains recorded since the decision
    reference: jax.Array  # f32[]: the gain the current ratio was chosen with


def ratio_init(n_candidates: int, explore_steps: int) -> RatioState:
    """A controller about to explore ``n_candidates`` ratios for ``explore_steps`` steps each.

    Args:
      n_candidates: the number of candidate ratios, >= 1.
      explore_steps: steps per candidate, and the window of the gain check, >= 1.

    Returns:
      A :class:`RatioState` at the start of an exploration (index 0, the highest density).

    Example:
      >>> int(ratio_init(5, 10).index), bool(ratio_init(5, 10).exploring)
      (0, True)

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-E.
    """
    zeros_f, zeros_i = jnp.zeros(n_candidates, jnp.float32), jnp.zeros(n_candidates, jnp.int32)
    return RatioState(
        index=jnp.zeros((), jnp.int32),
        exploring=jnp.ones((), bool),
        count=jnp.zeros((), jnp.int32),
        gain_sum=zeros_f,
        comp_sum=zeros_f,
        sync_sum=zeros_f,
        sync_count=zeros_i,
        recent=jnp.zeros(explore_steps, jnp.float32),
        recent_count=jnp.zeros((), jnp.int32),
        reference=jnp.ones((), jnp.float32),
    )


def where_tree(condition, a, b):
    """``a`` where ``condition`` holds, else ``b``, leaf by leaf over two pytrees of one structure.

    Args:
      condition: a boolean scalar (traced or not).
      a: the pytree taken where it holds.
      b: the pytree taken elsewhere, same structure.

    Returns:
      The selected pytree.

    Example:
      >>> import jax.numpy as jnp
      >>> where_tree(jnp.bool_(True), (jnp.ones(2),), (jnp.zeros(2),))[0].tolist()
      [1.0, 1.0]

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-E (the controller's state machine, in jnp).
    """
    return jax.tree.map(lambda x, y: jnp.where(condition, x, y), a, b)


def _decide(state: RatioState, predicted_sync, base_seconds, flat_tolerance) -> RatioState:
    """The knee of the last exploration's means; a measured t_sync beats a predicted one."""
    steps = state.recent.shape[0]
    gains = state.gain_sum / steps
    t_comp = state.comp_sum / steps
    t_sync = jnp.where(
        state.sync_count > 0, state.sync_sum / jnp.maximum(state.sync_count, 1), predicted_sync
    )
    index = _knee_index(t_comp, t_sync, gains, base_seconds, flat_tolerance, jnp).astype(jnp.int32)
    return state._replace(
        index=index,
        exploring=jnp.zeros((), bool),
        reference=gains[index],
        recent=jnp.zeros_like(state.recent),
        recent_count=jnp.zeros((), jnp.int32),
    )


def ratio_observe(
    state: RatioState,
    gain,
    t_comp,
    t_sync,
    predicted_sync,
    *,
    gain_tolerance: float = 0.1,
    base_seconds: float = 0.0,
    flat_tolerance: float = 0.1,
) -> RatioState:
    """Records one step run at ``state.index``; returns the state that says what runs next.

    While exploring, each candidate (highest density first) collects ``E`` steps; after the last
    one the knee (:func:`knee`) of the mean compression time, communication time (measured where
    given, else ``predicted_sync``) and ``1 / gain`` is chosen. Once chosen, the mean gain of the
    last ``E`` steps is compared with the gain the choice was made with; a change of
    ``gain_tolerance`` or more starts a new exploration. Pure ``jnp``: it runs inside ``jit``
    (the transformation calls it in every step) and eagerly.

    Args:
      state: the :class:`RatioState`.
      gain: the step's compression gain, >= 0 (0 is counted as 1e-12: the worst).
      t_comp: the step's compression time in seconds.
      t_sync: the step's measured communication time, or NaN to use ``predicted_sync``.
      predicted_sync: f32[R], predicted communication seconds of each candidate.
      gain_tolerance: relative gain change that starts a new exploration.
      base_seconds: the rest of the step (see :func:`knee`).
      flat_tolerance: see :func:`knee`.

    Returns:
      The next :class:`RatioState`.

    Example:
      >>> import jax.numpy as jnp
      >>> s = ratio_init(2, 1)
      >>> s = ratio_observe(s, 0.9, 0.0, jnp.nan, jnp.array([2.0, 1.0]))  # candidate 0 done
      >>> # candidate 1: same gain, faster
      >>> s = ratio_observe(s, 0.9, 0.0, jnp.nan, jnp.array([2.0, 1.0]))
      >>> int(s.index), bool(s.exploring)
      (1, False)

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-E.
    """
    gain = jnp.maximum(jnp.asarray(gain, jnp.float32), 1e-12)
    t_comp = jnp.asarray(t_comp, jnp.float32)
    t_sync = jnp.asarray(t_sync, jnp.float32)
    predicted_sync = jnp.asarray(predicted_sync, jnp.float32)
    explored = _explore(state, gain, t_comp, t_sync, predicted_sync, base_seconds, flat_tolerance)
    settled = _settle(state, gain, gain_tolerance)
    return where_tree(state.exploring, explored, settled)


def _explore(state, gain, t_comp, t_sync, predicted_sync, base_seconds, flat_tolerance):
    """:func:`ratio_observe` while exploring: records the step at the current candidate, moves on
    after ``E`` steps, and decides after the last candidate's."""
    n_candidates, steps = state.gain_sum.shape[0], state.recent.shape[0]
    here = jnp.arange(n_candidates) == state.index
    measured = jnp.isfinite(t_sync)
    recorded = state._replace(
        count=state.count + 1,
        gain_sum=state.gain_sum + jnp.where(here, gain, 0.0),
        comp_sum=state.comp_sum + jnp.where(here, t_comp, 0.0),
        sync_sum=state.sync_sum + jnp.where(here & measured, t_sync, 0.0),
        sync_count=state.sync_count + (here & measured).astype(jnp.int32),
    )
    candidate_done = recorded.count >= steps
    last = state.index == n_candidates - 1
    moved_on = recorded._replace(
        index=jnp.where(candidate_done, state.index + 1, state.index),
        count=jnp.where(candidate_done, 0, recorded.count),
    )
    return where_tree(
        candidate_done & last,
        _decide(recorded, predicted_sync, base_seconds, flat_tolerance),
        moved_on,
    )


def _settle(state, gain, gain_tolerance):
    """:func:`ratio_observe` once settled: keeps the last ``E`` gains, and explores again when
    their mean moved from the reference."""
    n_candidates, steps = state.gain_sum.shape[0], state.recent.shape[0]
    window = state._replace(
        recent=state.recent.at[state.recent_count % steps].set(gain),
        recent_count=state.recent_count + 1,
    )
    full = window.recent_count >= steps
    gain_moved = full & _gain_moved(state.reference, jnp.mean(window.recent), gain_tolerance)
    return where_tree(gain_moved, ratio_init(n_candidates, steps), window)


def ratio_redecide(
    state: RatioState, predicted_sync, *, base_seconds: float = 0.0, flat_tolerance: float = 0.1
) -> RatioState:
    """The network changed: forget measured communication times and, if settled, choose again.

    The new choice comes from the stored exploration (gains and compression times) with
    ``predicted_sync`` for the new network; no exploration runs.

    Args:
      state: the :class:`RatioState`.
      predicted_sync: f32[R], each candidate's predicted communication seconds on the new network.
      base_seconds: see :func:`knee`.
      flat_tolerance: see :func:`knee`.

    Returns:
      The next :class:`RatioState`.

    Example:
      >>> import jax.numpy as jnp
      >>> s = ratio_init(2, 1)
      >>> for _ in range(2):
      ...     s = ratio_observe(s, 0.9, 0.0, jnp.nan, jnp.array([2.0, 1.0]))
      >>> int(ratio_redecide(s, jnp.array([1.0, 1.0])).index)  # equal gains and times: the first
      0

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-E (re-solve when α or β changes).
    """
    cleared = state._replace(
        sync_sum=jnp.zeros_like(state.sync_sum), sync_count=jnp.zeros_like(state.sync_count)
    )
    decided = _decide(
        cleared, jnp.asarray(predicted_sync, jnp.float32), base_seconds, flat_tolerance
    )
    return where_tree(state.exploring, cleared, decided)


def _check_range(ratio_range):
    try:
        low, high = ratio_range
    except (TypeError, ValueError):
        raise ValueError(f"ratio_range must be a pair (low, high), got {ratio_range!r}") from None
    for value in (low, high):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"ratio_range must hold numbers, got {ratio_range!r}")
    if not 0 < low <= high <= 1:
        raise ValueError(f"ratio_range must satisfy 0 < low <= high <= 1, got {ratio_range!r}")
    return float(low), float(high)


def _check_measurements(t_comp, t_sync, gain):
    arrays = []
    for name, values in (("t_comp", t_comp), ("t_sync", t_sync), ("gain", gain)):
        values = np.asarray(values, dtype=np.float64)
        if values.ndim != 1 or values.size == 0:
            raise ValueError(f"{name} must be a non-empty 1-D sequence, got shape {values.shape}")
        if not np.all(np.isfinite(values)):
            raise ValueError(f"{name} must be finite, got {values.tolist()}")
        arrays.append(values)
    if not arrays[0].shape == arrays[1].shape == arrays[2].shape:
        raise ValueError(
            f"t_comp, t_sync and gain must have one entry per candidate, got lengths "
            f"{[a.size for a in arrays]}"
        )
    if np.any(arrays[0] < 0) or np.any(arrays[1] < 0):
        raise ValueError("t_comp and t_sync must be >= 0")
    if np.any(arrays[2] <= 0):
        raise ValueError(f"gain must be > 0, got {arrays[2].tolist()}")
    return arrays


def _pareto_optimal(objectives, xp=np):
    """Mask of rows no other row dominates (no worse everywhere, better somewhere; minimizing)."""
    no_worse = xp.all(objectives[None, :, :] <= objectives[:, None, :], axis=2)
    better = xp.any(objectives[None, :, :] < objectives[:, None, :], axis=2)
    dominated = xp.any(no_worse & better, axis=1)
    return ~dominated
