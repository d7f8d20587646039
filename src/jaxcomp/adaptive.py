"""Decisions for "auto" compression: which collective, and which compression ratio.

Paper 000 §3-E treats the compression ratio (CR, the density ``k / n``) as a multi-objective
problem: minimize compression time, communication time and ``1 / gain``, where the compression
gain ``E‖g_c‖² / E‖g_e‖²`` measures how much of the error-fed gradient the compressed one keeps.
Candidate ratios are a fixed geometric ladder (so each is one static shape, compiled once); a
short exploration runs each candidate for a few steps, and the knee of the three objectives is
kept until the gain moves by 10% or more (explore again) or the network changes (re-decide from
the stored measurements with re-predicted communication times).

Everything here runs on the host between steps, in plain Python: the transformation feeds the
chosen *index* into ``lax.switch`` over precompiled branches, so no decision recompiles.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp import cost

#: The paper's exploration range of densities (paper 000 §3-E: c_low = 0.001, c_high = 0.1).
DEFAULT_RATIO_RANGE = (0.001, 0.1)

#: Collectives a sparse gradient can travel by; each ratio uses the cheapest of them.
TOPK_COLLECTIVES = ("allgather_topk", "ar_topk_ring", "ar_topk_tree")


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


def compression_gain(compressed, error_fed):
    """Compression gain ``‖g_c‖² / ‖g_e‖²``: the share of the error-fed gradient's energy kept.

    Args:
      compressed: the gradient as sent (dense, zeros where dropped), any float array or pytree.
      error_fed: the gradient plus the error-feedback residual, same structure.

    Returns:
      A float32 scalar in ``[0, 1]`` for a top-k compressor (1 when ``error_fed`` is all zero).

    Example:
      >>> import jax.numpy as jnp
      >>> round(float(compression_gain(jnp.array([3.0, 0.0]), jnp.array([3.0, 4.0]))), 6)
      0.36

    References:
      Tyagi & Swany, arXiv 2312.02493, §2-C3 (gain from GraVAC).
    """
    def energy(tree):
        return sum(jnp.sum(jnp.square(jnp.asarray(x, jnp.float32))) for x in jax.tree.leaves(tree))

    kept, total = energy(compressed), energy(error_fed)
    return jnp.where(total > 0, kept / jnp.where(total > 0, total, 1.0), jnp.float32(1.0))


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
    if not isinstance(base_seconds, (int, float)) or isinstance(base_seconds, bool) or not base_seconds >= 0:
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


def gain_moved(reference: float, gain: float, tolerance: float = 0.1) -> bool:
    """Whether ``gain`` differs from ``reference`` by ``tolerance`` (relative) or more.

    Args:
      reference: the gain the current ratio was chosen with, > 0.
      gain: the gain observed now.
      tolerance: relative change that triggers a new exploration (paper: 10%).

    Returns:
      True when the ratio should be explored again.

    Example:
      >>> gain_moved(0.5, 0.44), gain_moved(0.5, 0.46)
      (True, False)

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-E (re-evaluate when the gain changes by 10% or more).
    """
    if not reference > 0:
        raise ValueError(f"reference gain must be > 0, got {reference!r}")
    return bool(_gain_moved(reference, gain, tolerance))


def _gain_moved(reference, gain, tolerance):
    # The relative slack keeps an exact 10% change (0.9 of 1.0, inexact in binary) a change.
    return abs(gain - reference) >= tolerance * reference * (1 - 1e-9)


def network_changed(old: cost.Network | None, new: cost.Network, tolerance: float = 0.1) -> bool:
    """Whether latency or bandwidth moved by ``tolerance`` (relative) or more.

    Args:
      old: the Network decisions were made with, or None (always changed).
      new: the newly probed Network.
      tolerance: relative change that counts.

    Returns:
      True when the decision should be re-made.

    Example:
      >>> a = cost.Network.parse("1ms", "10gbit")
      >>> network_changed(a, cost.Network.parse("1ms", "8gbit")), network_changed(a, a)
      (True, False)

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-E (re-decide when α or β changes).
    """
    if not isinstance(new, cost.Network):
        raise TypeError(f"new must be a jaxcomp.cost.Network, got {type(new).__name__}")
    if old is None:
        return True
    return bool(np.any(_moved(np.array([old.alpha, old.beta]), np.array([new.alpha, new.beta]), tolerance, np)))


def _moved(old, new, tolerance, xp):
    """Elementwise: ``new`` differs from ``old`` by ``tolerance`` of the larger magnitude, or more.

    A relative change of β is the same relative change of the bandwidth (``|b1-b2| / max(b1, b2)``
    is symmetric under ``b -> 1/b``), so (α, β) pairs compare as (α, bandwidth) would."""
    return (xp.abs(new - old) >= tolerance * xp.maximum(xp.abs(old), xp.abs(new))) & (old != new)


def choose_auto(nbytes: float, n_workers: int, network: cost.Network, candidates, *, ratio=None, rate=None,
                bits=None, inner_size=None, overhead=None) -> int:
    """Index of the candidate method with the least predicted time: what ``lax.switch`` takes.

    Args:
      nbytes: bytes of the float32 gradient.
      n_workers: the number of workers.
      network: the (probed) :class:`jaxcomp.cost.Network`.
      candidates: the method names the transformation compiled, in branch order.
      ratio: density of the top-k candidates.
      rate: ZFP bits per value.
      bits: quantization bits.
      inner_size: workers per node for ``hierarchical_topk``.
      overhead: optional ``{method: seconds}`` of encode/decode time, added per candidate.

    Returns:
      The branch index.

    Example:
      >>> net = cost.Network.parse("1ms", "1gbit")
      >>> choose_auto(4e8, 8, net, ["dense_ring", "allgather_topk", "ar_topk_ring"], ratio=0.01)
      2

    References:
      Tyagi & Swany, arXiv 2312.02493, Eqn (5a)-(5c); Agarwal et al., MLSys 2022, §4.1.
    """
    if isinstance(candidates, str):
        raise TypeError(f"candidates must be a sequence of method names, got the string {candidates!r}")
    names = tuple(candidates)
    times = cost.predict_all(nbytes, n_workers, network, names, ratio=ratio, rate=rate, bits=bits,
                             inner_size=inner_size, overhead=overhead)
    return int(np.argmin(times))


def sync_plan(nbytes: float, n_workers: int, network: cost.Network, ratios,
              methods=TOPK_COLLECTIVES) -> list[tuple[str, float]]:
    """For each density, the cheapest collective and its predicted seconds.

    Args:
      nbytes: bytes of the float32 gradient.
      n_workers: the number of workers.
      network: the :class:`jaxcomp.cost.Network`.
      ratios: candidate densities.
      methods: the top-k collectives to choose among for each density.

    Returns:
      ``[(method, seconds), ...]``, one per ratio.

    Example:
      >>> sync_plan(4e8, 8, cost.Network.parse("1ms", "10gbit"), [0.01, 0.001])[1][0]
      'allgather_topk'

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-E (the collective follows α, β, M, N and CR).
    """
    plan = []
    for ratio in ratios:
        times = cost.predict_all(nbytes, n_workers, network, methods, ratio=ratio)
        best = int(np.argmin(times))
        plan.append((tuple(methods)[best], times[best]))
    return plan


class RatioState(NamedTuple):
    """State of the compression-ratio controller (paper 000 §3-E), as arrays.

    It lives inside :class:`jaxcomp.CompressState` for ``compress("auto", adaptive_ratio=True)``,
    where :func:`ratio_observe` runs inside the compiled step, and inside :class:`AdaptiveRatio`
    on the host. ``R`` is the number of candidate ratios, ``E`` the steps per candidate.
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
    return RatioState(index=jnp.zeros((), jnp.int32), exploring=jnp.ones((), bool), count=jnp.zeros((), jnp.int32),
                      gain_sum=zeros_f, comp_sum=zeros_f, sync_sum=zeros_f, sync_count=zeros_i,
                      recent=jnp.zeros(explore_steps, jnp.float32), recent_count=jnp.zeros((), jnp.int32),
                      reference=jnp.ones((), jnp.float32))


def _select(condition, a, b):
    return jax.tree.map(lambda x, y: jnp.where(condition, x, y), a, b)


def _decide(state: RatioState, predicted_sync, base_seconds, flat_tolerance) -> RatioState:
    """The knee of the last exploration's means; a measured t_sync beats a predicted one."""
    steps = state.recent.shape[0]
    gains = state.gain_sum / steps
    t_comp = state.comp_sum / steps
    t_sync = jnp.where(state.sync_count > 0, state.sync_sum / jnp.maximum(state.sync_count, 1),
                       predicted_sync)
    index = _knee_index(t_comp, t_sync, gains, base_seconds, flat_tolerance, jnp).astype(jnp.int32)
    return state._replace(index=index, exploring=jnp.zeros((), bool), reference=gains[index],
                          recent=jnp.zeros_like(state.recent), recent_count=jnp.zeros((), jnp.int32))


def ratio_observe(state: RatioState, gain, t_comp, t_sync, predicted_sync, *, gain_tolerance: float = 0.1,
                  base_seconds: float = 0.0, flat_tolerance: float = 0.1) -> RatioState:
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
      >>> s = ratio_observe(s, 0.9, 0.0, jnp.nan, jnp.array([2.0, 1.0]))  # candidate 1: same gain, faster
      >>> int(s.index), bool(s.exploring)
      (1, False)

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-E.
    """
    gain = jnp.maximum(jnp.asarray(gain, jnp.float32), 1e-12)
    t_comp = jnp.asarray(t_comp, jnp.float32)
    t_sync = jnp.asarray(t_sync, jnp.float32)
    predicted_sync = jnp.asarray(predicted_sync, jnp.float32)
    n_candidates, steps = state.gain_sum.shape[0], state.recent.shape[0]

    # Exploring: record the step at the current candidate; move on after E steps; decide after the last.
    here = jnp.arange(n_candidates) == state.index
    measured = jnp.isfinite(t_sync)
    recorded = state._replace(
        count=state.count + 1,
        gain_sum=state.gain_sum + jnp.where(here, gain, 0.0),
        comp_sum=state.comp_sum + jnp.where(here, t_comp, 0.0),
        sync_sum=state.sync_sum + jnp.where(here & measured, t_sync, 0.0),
        sync_count=state.sync_count + (here & measured).astype(jnp.int32))
    candidate_done = recorded.count >= steps
    last = state.index == n_candidates - 1
    moved_on = recorded._replace(index=jnp.where(candidate_done, state.index + 1, state.index),
                                 count=jnp.where(candidate_done, 0, recorded.count))
    explored = _select(candidate_done & last, _decide(recorded, predicted_sync, base_seconds, flat_tolerance),
                       moved_on)

    # Settled: keep the last E gains; explore again when their mean moved from the reference.
    window = state._replace(recent=state.recent.at[state.recent_count % steps].set(gain),
                            recent_count=state.recent_count + 1)
    full = window.recent_count >= steps
    moved = full & _gain_moved(state.reference, jnp.mean(window.recent), gain_tolerance)
    settled = _select(moved, ratio_init(n_candidates, steps), window)
    return _select(state.exploring, explored, settled)


def ratio_redecide(state: RatioState, predicted_sync, *, base_seconds: float = 0.0,
                   flat_tolerance: float = 0.1) -> RatioState:
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
    cleared = state._replace(sync_sum=jnp.zeros_like(state.sync_sum), sync_count=jnp.zeros_like(state.sync_count))
    decided = _decide(cleared, jnp.asarray(predicted_sync, jnp.float32), base_seconds, flat_tolerance)
    return _select(state.exploring, cleared, decided)


class AdaptiveRatio:
    """Host-side controller of the compression ratio (paper 000 §3-E), one call per step.

    It starts by exploring: each candidate ratio (highest density first) runs for
    ``explore_steps`` steps while :meth:`observe` records its gain (and, when given, measured
    compression and communication times; communication time is otherwise predicted from the
    network). Then it keeps the knee (:func:`knee`) until the mean gain over the last
    ``explore_steps`` steps moves by ``gain_tolerance`` from the gain it was chosen with, which
    starts a new exploration. :meth:`update_network` re-decides from the stored measurements
    when the probe reports a changed network, without exploring.

    This is the state machine ``compress("auto", adaptive_ratio=True)`` runs inside the step
    (:func:`ratio_observe`), driven from Python: for custom loops and for studying the policy.

    Attributes:
      ratios: the candidate densities (static: the transformation compiles one branch each).
      index: the candidate to run next step.
      exploring: whether the current step is part of an exploration.

    Example:
      >>> net = cost.Network.parse("1ms", "1gbit")
      >>> ctl = AdaptiveRatio(4e8, 8, network=net, explore_steps=1)
      >>> for _ in ctl.ratios:
      ...     index = ctl.observe(gain=0.99)  # the gain stays high at every density
      >>> ctl.ratio == min(ctl.ratios), ctl.exploring
      (True, False)

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-E.
    """

    def __init__(self, nbytes: float, n_workers: int, ratio_range=DEFAULT_RATIO_RANGE, *,
                 network: cost.Network | None = None, explore_steps: int = 10, gain_tolerance: float = 0.1,
                 network_tolerance: float = 0.1, base_seconds: float = 0.0, methods=TOPK_COLLECTIVES):
        """Creates the controller.

        Args:
          nbytes: bytes of the float32 gradient.
          n_workers: the number of workers.
          ratio_range: ``(low, high)`` densities, see :func:`candidate_ratios`.
          network: the probed Network; without one, every :meth:`observe` must pass ``t_sync``.
          explore_steps: steps per candidate during exploration, and the window of the gain check.
          gain_tolerance: relative gain change that starts a new exploration.
          network_tolerance: relative α or bandwidth change that re-decides.
          base_seconds: the rest of the step (see :func:`knee`).
          methods: the top-k collectives each ratio may use.

        Returns:
          None.

        References:
          Tyagi & Swany, arXiv 2312.02493, §3-E.
        """
        self.ratios = candidate_ratios(ratio_range)
        self.explore_steps = _check_explore_steps(explore_steps)
        self.gain_tolerance = _check_tolerance(gain_tolerance, "gain_tolerance")
        self.network_tolerance = _check_tolerance(network_tolerance, "network_tolerance")
        if network is not None and not isinstance(network, cost.Network):
            raise TypeError(f"network must be a jaxcomp.cost.Network or None, got {type(network).__name__}")
        if isinstance(base_seconds, bool) or not isinstance(base_seconds, (int, float)) or not base_seconds >= 0:
            raise ValueError(f"base_seconds must be a number >= 0, got {base_seconds!r}")
        self.nbytes, self.n_workers = nbytes, n_workers
        self.methods = tuple(methods)
        self.base_seconds = float(base_seconds)
        self.network = network
        # Validates nbytes, n_workers and methods once, up front.
        self._plan = sync_plan(nbytes, n_workers, network, self.ratios, self.methods) if network else None
        self._state = ratio_init(len(self.ratios), self.explore_steps)
        options = dict(base_seconds=self.base_seconds)
        self._observe = jax.jit(functools.partial(ratio_observe, gain_tolerance=self.gain_tolerance, **options))
        self._redecide = jax.jit(functools.partial(ratio_redecide, **options))

    @property
    def index(self) -> int:
        """The candidate to run next step."""
        return int(self._state.index)

    @property
    def exploring(self) -> bool:
        """Whether the next step is part of an exploration."""
        return bool(self._state.exploring)

    @property
    def ratio(self) -> float:
        """The density to run next step."""
        return self.ratios[self.index]

    @property
    def method(self) -> str | None:
        """The cheapest collective for :attr:`ratio` on the current network (None without one)."""
        return self._plan[self.index][0] if self._plan else None

    def _predicted_sync(self):
        return np.array([seconds for _, seconds in self._plan] if self._plan else [0.0] * len(self.ratios),
                        np.float32)

    def observe(self, gain: float, t_comp: float | None = None, t_sync: float | None = None) -> int:
        """Records one step run at :attr:`index` and returns the index for the next step.

        Args:
          gain: the step's compression gain (e.g. from :func:`compression_gain`), >= 0.
          t_comp: measured seconds to compress and decompress, if known.
          t_sync: measured seconds to communicate, if known; otherwise predicted.

        Returns:
          The candidate index to run next.

        Example:
          >>> ctl = AdaptiveRatio(4e8, 8, network=cost.Network.parse("1ms", "1gbit"), explore_steps=2)
          >>> ctl.observe(0.9), ctl.observe(0.9)  # two steps at the first candidate, then the next
          (0, 1)

        References:
          Tyagi & Swany, arXiv 2312.02493, §3-E.
        """
        gain = float(gain)
        if not (gain >= 0 and math.isfinite(gain)):
            raise ValueError(f"gain must be a finite number >= 0, got {gain!r}")
        if t_sync is None and self._plan is None:
            raise ValueError("t_sync is required when the controller has no network to predict it from")
        for name, value in (("t_comp", t_comp), ("t_sync", t_sync)):
            if value is not None and not (float(value) >= 0 and math.isfinite(float(value))):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        self._state = self._observe(self._state, gain, 0.0 if t_comp is None else float(t_comp),
                                    math.nan if t_sync is None else float(t_sync), self._predicted_sync())
        return self.index

    def update_network(self, network: cost.Network) -> int:
        """Takes a newly probed Network; re-decides from stored measurements when it changed.

        Args:
          network: the probed :class:`jaxcomp.cost.Network`.

        Returns:
          The candidate index to run next.

        Example:
          >>> ctl = AdaptiveRatio(4e8, 8, network=cost.Network.parse("1ms", "1gbit"), explore_steps=1)
          >>> for _ in ctl.ratios:
          ...     _ = ctl.observe(0.99)
          >>> ctl.update_network(cost.Network.parse("1ms", "1.05gbit")) == ctl.index  # within 10%
          True

        References:
          Tyagi & Swany, arXiv 2312.02493, §3-E (re-solve when α or β changes).
        """
        if not network_changed(self.network, network, self.network_tolerance):
            return self.index
        self.network = network
        self._plan = sync_plan(self.nbytes, self.n_workers, network, self.ratios, self.methods)
        self._state = self._redecide(self._state, self._predicted_sync())
        return self.index


def _check_explore_steps(explore_steps) -> int:
    """Validates ``explore_steps`` (an integer >= 1) and returns it."""
    if isinstance(explore_steps, bool) or not isinstance(explore_steps, (int, np.integer)) or explore_steps < 1:
        raise ValueError(f"explore_steps must be an integer >= 1, got {explore_steps!r}")
    return int(explore_steps)


def _check_tolerance(value, name: str) -> float:
    """Validates a relative tolerance in ``(0, 1)`` and returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return float(value)


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
        raise ValueError(f"t_comp, t_sync and gain must have one entry per candidate, got lengths "
                         f"{[a.size for a in arrays]}")
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
