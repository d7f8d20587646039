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

import math

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
    import jax

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
    objectives = np.stack([t_comp, t_sync, 1.0 / gain], axis=1)
    step_scale = base_seconds + float(np.max(t_comp + t_sync))
    scales = np.array([step_scale, step_scale, float(np.max(objectives[:, 2]))])
    low = objectives.min(axis=0)
    spread = objectives.max(axis=0) - low
    significant = spread > flat_tolerance * scales
    normalized = np.where(significant, (objectives - low) / np.where(spread > 0, spread, 1.0), 0.0)
    distance = np.sqrt(np.sum(normalized**2, axis=1))
    distance[~_pareto_optimal(objectives)] = np.inf
    return int(np.argmin(distance))


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

    def moved(a, b):
        return abs(b - a) >= tolerance * max(abs(a), abs(b)) and a != b

    return moved(old.alpha, new.alpha) or moved(old.bandwidth, new.bandwidth)


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


class AdaptiveRatio:
    """Host-side controller of the compression ratio (paper 000 §3-E), one call per step.

    It starts by exploring: each candidate ratio (highest density first) runs for
    ``explore_steps`` steps while :meth:`observe` records its gain (and, when given, measured
    compression and communication times; communication time is otherwise predicted from the
    network). Then it keeps the knee (:func:`knee`) until the mean gain over the last
    ``explore_steps`` steps moves by ``gain_tolerance`` from the gain it was chosen with, which
    starts a new exploration. :meth:`update_network` re-decides from the stored measurements
    when the probe reports a changed network, without exploring.

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
        if isinstance(explore_steps, bool) or not isinstance(explore_steps, int) or explore_steps < 1:
            raise ValueError(f"explore_steps must be an integer >= 1, got {explore_steps!r}")
        for name, value in (("gain_tolerance", gain_tolerance), ("network_tolerance", network_tolerance)):
            if not isinstance(value, (int, float)) or not 0 < value < 1:
                raise ValueError(f"{name} must be in (0, 1), got {value!r}")
        if network is not None and not isinstance(network, cost.Network):
            raise TypeError(f"network must be a jaxcomp.cost.Network or None, got {type(network).__name__}")
        self.nbytes, self.n_workers = nbytes, n_workers
        self.methods = tuple(methods)
        self.explore_steps, self.gain_tolerance = explore_steps, gain_tolerance
        self.network_tolerance, self.base_seconds = network_tolerance, base_seconds
        self.network = network
        # Validates nbytes, n_workers and methods once, up front.
        self._plan = sync_plan(nbytes, n_workers, network, self.ratios, self.methods) if network else None
        self._start_exploration()

    @property
    def ratio(self) -> float:
        """The density to run next step."""
        return self.ratios[self.index]

    @property
    def method(self) -> str | None:
        """The cheapest collective for :attr:`ratio` on the current network (None without one)."""
        return self._plan[self.index][0] if self._plan else None

    def observe(self, gain: float, t_comp: float | None = None, t_sync: float | None = None) -> int:
        """Records one step run at :attr:`index` and returns the index for the next step.

        Args:
          gain: the step's compression gain (e.g. from :func:`compression_gain`), > 0.
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
        if not (gain > 0 and math.isfinite(gain)):
            # A zero gain (nothing kept) ranks worst: clamp so 1/gain stays finite.
            if gain == 0:
                gain = 1e-12
            else:
                raise ValueError(f"gain must be a finite number >= 0, got {gain!r}")
        if t_sync is None and self._plan is None:
            raise ValueError("t_sync is required when the controller has no network to predict it from")
        if self.exploring:
            record = self._records[self.index]
            record["gain"].append(gain)
            record["t_comp"].append(0.0 if t_comp is None else float(t_comp))
            if t_sync is not None:
                record["t_sync"].append(float(t_sync))
            if len(record["gain"]) >= self.explore_steps:
                if self.index + 1 < len(self.ratios):
                    self.index += 1
                else:
                    self._decide()
            return self.index
        self._recent.append(gain)
        if len(self._recent) >= self.explore_steps:
            recent_gain = float(np.mean(self._recent[-self.explore_steps:]))
            self._recent = self._recent[-self.explore_steps:]
            if gain_moved(self._reference_gain, recent_gain, self.gain_tolerance):
                self._start_exploration()
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
        for record in self._records:
            record["t_sync"] = []  # measured on the old network: predict from the new one
        if not self.exploring:
            self._decide()
        return self.index

    def _start_exploration(self):
        self.exploring = True
        self.index = 0
        self._records = [{"gain": [], "t_comp": [], "t_sync": []} for _ in self.ratios]
        self._recent = []
        self._reference_gain = None

    def _decide(self):
        gains = [float(np.mean(r["gain"])) for r in self._records]
        t_comp = [float(np.mean(r["t_comp"])) for r in self._records]
        t_sync = [float(np.mean(r["t_sync"])) if r["t_sync"] else self._plan[i][1]
                  for i, r in enumerate(self._records)]
        self.index = knee(t_comp, t_sync, gains, base_seconds=self.base_seconds)
        self._reference_gain = gains[self.index]
        self._recent = []
        self.exploring = False


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


def _pareto_optimal(objectives):
    """Mask of rows no other row dominates (no worse everywhere, better somewhere; minimizing)."""
    no_worse = np.all(objectives[None, :, :] <= objectives[:, None, :], axis=2)
    better = np.any(objectives[None, :, :] < objectives[:, None, :], axis=2)
    dominated = np.any(no_worse & better, axis=1)
    return ~dominated
