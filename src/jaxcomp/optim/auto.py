"""``compress_auto``: error-feedback aggregation that picks the cheapest method as the network
changes.

It compiles one branch per candidate method (a ratio-tunable candidate once per candidate ratio
when a :class:`RatioSearch` is given) and picks one per step with ``lax.switch`` on a traced
index, so choices never recompile. Each branch's time is predicted with the α-β model
(:func:`jaxcomp.costmodel.cost.sync_seconds`: message steps times α plus bytes times β, the same
formula
:func:`jaxcomp.costmodel.cost.choose` uses on the host) plus the branch's measured local work, on
the network in its :class:`AutoState`. :func:`jaxcomp.data_parallel` compiles one step per branch
instead and dispatches the chosen one (:mod:`jaxcomp.optim.pinning`): under ``lax.switch`` a
sparse candidate loses its in-place residual.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from jaxcomp import methods
from jaxcomp.costmodel import cost, ratio_choice
from jaxcomp.methods import Method
from jaxcomp.ops import _checks
from jaxcomp.optim import pinning
from jaxcomp.optim.auto_state import AutoState, calibrated, init_auto
from jaxcomp.optim.config import (
    UNSET,
    FeedbackConfig,
    default_buckets,
    default_feedback,
    deprecated_keywords,
)
from jaxcomp.optim.feedback import feedback_transformation
from jaxcomp.optim.stages.aggregate import AggregateState
from jaxcomp.optim.stages.aggregation import (
    Aggregation,
    Groups,
    rounds_only,
    run_branch,
    static_cost,
)
from jaxcomp.optim.stages.flight import InFlight

#: How long ``compress_auto`` keeps a choice: it re-decides every this many steps by default,
#: and at once when the network moves by :data:`NETWORK_TOLERANCE` or more.
DEFAULT_DECIDE_EVERY = 100

#: Steps a :class:`RatioSearch` runs each candidate ratio while exploring.
DEFAULT_EXPLORE_STEPS = 10

#: Relative change of latency or bandwidth that makes ``compress_auto`` re-decide at once.
NETWORK_TOLERANCE = 0.1


@dataclasses.dataclass(frozen=True)
class RatioSearch:
    """Paper 000 §3-E's search for the compression ratio, for :func:`compress_auto`.

    Candidate ratios from ``ratio_range`` spaced by ``factor``
    (:func:`jaxcomp.costmodel.ratio_choice.candidate_ratios`); an exploration runs each for
    ``explore_steps`` steps (highest density first) measuring the compression gain, then keeps the
    knee of (local work, predicted communication, 1 / gain)
    (:func:`jaxcomp.costmodel.ratio_choice.knee`); a new exploration starts when the mean gain of
    the last ``explore_steps`` steps moves by 10%, and a moved network re-chooses from the stored
    measurements. Every candidate with a ratio (:meth:`jaxcomp.methods.Method.with_ratio`) runs at
    the searched ratios; its own ratio is not used.

    Args:
      ratio_range: ``(low, high)`` densities, default ``(0.001, 0.1)``.
      explore_steps: steps per candidate ratio while exploring, and the window of the gain check.
      factor: spacing of the candidate ratios, > 1.

    Example:
      >>> [round(r, 4) for r in RatioSearch().ratios]
      [0.1, 0.0333, 0.0111, 0.0037, 0.001]

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-E.
    """

    ratio_range: tuple[float, float] = ratio_choice.DEFAULT_RATIO_RANGE
    explore_steps: int = DEFAULT_EXPLORE_STEPS
    factor: float = 3.0

    def __post_init__(self):
        object.__setattr__(
            self,
            "ratio_range",
            tuple(self.ratio_range)
            if isinstance(self.ratio_range, (list, tuple))
            else self.ratio_range,
        )
        object.__setattr__(self, "explore_steps", _checks.check_explore_steps(self.explore_steps))
        _ = self.ratios  # validates the range and the factor

    @property
    def ratios(self) -> tuple[float, ...]:
        """The candidate densities, highest first."""
        return ratio_choice.candidate_ratios(self.ratio_range, self.factor)


@dataclasses.dataclass(frozen=True)
class _Branches:
    """The branches of a candidate list: one per candidate, or per (candidate, ratio)."""

    methods: tuple[Method, ...]
    table: (
        np.ndarray
    )  # i32[C, R]: the branch of candidate c at ratio r (a candidate without a ratio fills its row)
    tunable: np.ndarray  # bool[C]: candidates that run at the searched ratios

    @classmethod
    def of(cls, candidates, ratios):
        out, rows = [], []
        tunable = np.array(
            [bool(ratios) and m.with_ratio(ratios[0]) is not None for m in candidates]
        )
        for m, tune in zip(candidates, tunable):
            row = []
            for r in ratios if tune else (None,):
                out.append(m.with_ratio(r) if tune else m)
                row.append(len(out) - 1)
            rows.append(row * (max(1, len(ratios)) if not tune else 1))
        return cls(tuple(out), np.array(rows, np.int32), tunable)


class _Plan:
    """The branches with their static costs, built while tracing one update."""

    def __init__(
        self, branches: _Branches, search: RatioSearch | None, decide_every: int, groups: Groups
    ):
        self.b, self.search, self.decide_every = branches, search, decide_every
        costs = np.array([static_cost(m, groups) for m in branches.methods], np.float64)
        self.bytes, self.kept, self.steps = (costs[:, i].astype(np.float32) for i in range(3))
        self.tunable_rows = np.flatnonzero(branches.tunable).astype(np.int32)
        self.tunable_branch = np.zeros(len(branches.methods), bool)
        self.tunable_branch[branches.table[self.tunable_rows].ravel()] = True

    def sync_per_ratio(self, comm):
        """Predicted communication seconds of each candidate ratio by its cheapest tunable
        candidate."""
        comm = jnp.where(jnp.isfinite(comm), comm, 0.0)  # no network yet: time counts as flat
        return jnp.min(comm[self.b.table[self.tunable_rows, :]], axis=0)

    def decide(self, auto: AutoState, step):
        """Re-decides when due; returns (new AutoState, branch to run, predicted comm seconds per
        branch)."""
        known = jnp.all(jnp.isfinite(auto.network))
        moved = jnp.any(
            ratio_choice.moved(auto.decided, auto.network, NETWORK_TOLERANCE, jnp)
        ) | ~jnp.all(jnp.isfinite(auto.decided))
        due = known & ((step % self.decide_every == 0) | moved)
        decided = jnp.where(due, auto.network, auto.decided)
        # The cost model's one formula, on the network the choice is made with.
        comm = cost.sync_seconds(
            jnp.asarray(self.steps), jnp.asarray(self.bytes), decided[0], decided[1]
        )
        # Whole steps a trial measured (data_parallel's) stand in for their predictions.
        predicted = calibrated(comm + auto.overhead, auto.measured)
        ratio = auto.ratio
        if self.search is not None:
            # A moved network re-chooses the ratio from the last exploration, without exploring.
            ratio = ratio_choice.where_tree(
                due & moved, ratio_choice.ratio_redecide(ratio, self.sync_per_ratio(comm)), ratio
            )
            r = ratio.index
            # While exploring, a tunable candidate competes at its lowest density: could it pay at
            # all?
            r_judge = jnp.where(ratio.exploring, len(self.search.ratios) - 1, r)
        else:
            r = r_judge = 0
        table = jnp.asarray(self.b.table)
        choice = jnp.where(due, jnp.argmin(predicted[table[:, r_judge]]), auto.choice).astype(
            jnp.int32
        )
        row = choice
        if self.search is not None and self.tunable_rows.size:
            # A tunable choice runs the cheapest tunable candidate at the ratio of this step.
            best = jnp.asarray(self.tunable_rows)[
                jnp.argmin(predicted[table[self.tunable_rows, r]])
            ]
            row = jnp.where(jnp.asarray(self.b.tunable)[choice], best, choice)
        branch = table[row, r]
        auto = auto._replace(decided=decided, choice=choice, ratio=ratio, comm=comm)
        return auto, branch, comm

    def observe(self, auto: AutoState, branch, gain, comm) -> AutoState:
        """Feeds a tunable branch's gain to the ratio controller."""
        if self.search is None:
            return auto
        observed = ratio_choice.ratio_observe(
            auto.ratio, gain, auto.overhead[branch], jnp.nan, self.sync_per_ratio(comm)
        )
        # A gain that could not be measured (NaN or Inf: the sums overflowed) teaches nothing.
        learn = jnp.asarray(self.tunable_branch)[branch] & jnp.isfinite(gain)
        return auto._replace(ratio=ratio_choice.where_tree(learn, observed, auto.ratio))


def compress_auto(
    candidates,
    *,
    axis_name="data",
    ratio_search: RatioSearch | None = None,
    network: cost.Network | None = None,
    decide_every: int = DEFAULT_DECIDE_EVERY,
    error_feedback="auto",
    granularity="model",
    mean=UNSET,
    seed=UNSET,
    nonfinite="zero",
    mask=None,
    min_size=0,
    guardrail=True,
    bucket_mb="auto",
):
    """Aggregates gradients like :func:`jaxcomp.compress`, choosing the cheapest of ``candidates``.

    Each candidate is compiled in once; the one predicted fastest on the state's network runs,
    re-chosen every ``decide_every`` steps and when the network moves (docs/training.md).

    Args:
      candidates: distinct methods with replicated totals; the first runs until a network is known.
      ratio_search: a :class:`RatioSearch` to choose the ratio too, or None (each keeps its own).
      network: a :class:`jaxcomp.costmodel.cost.Network`, or None (``data_parallel`` probes it).
      decide_every: steps between decisions (default :data:`DEFAULT_DECIDE_EVERY`, 100).
      error_feedback: as for :func:`jaxcomp.compress`; ``"auto"``: as ``bucket_mb``, else on if
        any candidate's is.
      axis_name, granularity, nonfinite, mask, min_size, mean, seed: as for ``compress``.
      guardrail: as for :func:`jaxcomp.compress`; its fallback runs the ``Dense`` candidate, if any.
      bucket_mb: as for :func:`jaxcomp.compress`; ``"auto"``: each candidate's own in a step
        compiled for it alone (:func:`jaxcomp.data_parallel`'s), else only if all bucket.

    Returns:
      An optax transformation; its state: a :class:`jaxcomp.CompressState` with an AutoState.

    Raises:
      ValueError: candidates it cannot switch between; TypeError: ones that are not methods.

    Example:
      >>> import jaxcomp
      >>> slow = jaxcomp.costmodel.cost.Network.parse("1ms", "100mbit")
      >>> tx = jaxcomp.compress_auto([jaxcomp.Dense(), jaxcomp.Zfp(8)], network=slow)

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-D (choice of collective, Eqn 5a-5c), §3-E (the ratio).
    """
    listed = candidates if isinstance(candidates, (list, tuple)) else ()  # (checked below)
    mean, seed = deprecated_keywords("compress_auto", 2, mean=mean, seed=seed)
    config = FeedbackConfig.check(
        axis_name,
        default_feedback(error_feedback, listed),
        granularity,
        mean,
        seed,
        nonfinite,
        mask,
        min_size,
        guardrail=guardrail,
        bucket_mb=default_buckets(bucket_mb, False),  # "auto": set by _own_defaults
    )
    candidates = _check_candidates(candidates, config.axes)
    ratios = _check_ratio_search(ratio_search, candidates)
    decide_every = _checks.static_int(decide_every, "decide_every", 1)
    _check_network(network)
    branches = _Branches.of(candidates, ratios)
    config = _own_defaults(config, bucket_mb, error_feedback, branches.methods)
    keeps_residual = config.error_feedback and not all(m.sends_everything for m in branches.methods)
    dense = _dense_branch(branches)
    fallback_branch = dense if config.guardrail is not None else None  # the guardrail's fallback
    return feedback_transformation(
        config,
        branches.methods,
        keeps_residual,
        _aggregation(config, branches, ratio_search, decide_every, fallback_branch),
        init_auto=functools.partial(init_auto, network, len(branches.methods), ratio_search),
        falls_back=fallback_branch is not None,
        alone=dense,
    )


def _own_defaults(config: FeedbackConfig, bucket_mb, error_feedback, branches) -> FeedbackConfig:
    """``config`` with ``"auto"`` resolved per branch where the branches' defaults differ: in a
    step compiled for one branch (:mod:`jaxcomp.optim.pinning`) it buckets and feeds back as
    that branch's ``compress`` would (dense and the casts in DDP's buckets, the casts without
    error feedback; a residual such a step leaves as it was); a ``lax.switch`` buckets only if
    every branch does, and feeds back if any does."""
    auto = lambda x: isinstance(x, str) and x == "auto"  # noqa: E731
    buckets = tuple(
        default_buckets(bucket_mb, m.buckets_by_default and not m.stateful) for m in branches
    )
    feeds = tuple(bool(default_feedback(error_feedback, [m])) for m in branches)
    lossless = all(m.sends_everything for m in branches)
    if auto(bucket_mb):
        mixed = len(set(buckets)) > 1 and not lossless
        config = dataclasses.replace(
            config,
            bucket_mb=None if len(set(buckets)) > 1 else buckets[0],
            branch_buckets=buckets if mixed else None,
        )
    if auto(error_feedback) and config.error_feedback and len(set(feeds)) > 1:
        config = dataclasses.replace(config, branch_feedback=feeds)
    return config


def _as_one(groups: Groups) -> Groups:
    """The groups of one model cut in buckets, as the one group its static costs are reckoned
    on (leafwise groups cost the same in any order)."""
    return groups._replace(
        vectors=[],
        names=["the model"],
        sizes=[sum(groups.sizes)],
        shapes=None if groups.shapes is None else [tuple(s for g in groups.shapes for s in g)],
        values=None if groups.values is None else [sum(groups.values)],
        buckets=None,
    )


def _check_network(network) -> None:
    if network is not None and not isinstance(network, cost.Network):
        raise TypeError(
            "network must be a jaxcomp.costmodel.cost.Network (e.g. jaxcomp.probe_network(mesh, "
            f"axis)) or None, got {type(network).__name__}"
        )


def _dense_branch(branches: _Branches) -> int | None:
    """The dense candidate's branch, or None: the guardrail's fallback, and what runs alone on
    one device, which sends nothing, so every candidate costs only its local work there and the
    dense one runs statically, with no error-fed packing (docs/performance.md, "One device: no
    collective")."""
    dense = [i for i, m in enumerate(branches.methods) if isinstance(m, methods.Dense)]
    return dense[0] if dense else None


def _check_ratio_search(ratio_search, candidates) -> tuple[float, ...]:
    """The candidate ratios of ``ratio_search`` (none without one), after checking it fits."""
    if ratio_search is not None and not isinstance(ratio_search, RatioSearch):
        raise TypeError(
            f"ratio_search must be a jaxcomp.RatioSearch or None, got {type(ratio_search).__name__}"
        )
    ratios = ratio_search.ratios if ratio_search is not None else ()
    if ratios and not any(m.with_ratio(ratios[0]) is not None for m in candidates):
        raise ValueError(
            f"ratio_search needs a candidate with a ratio (e.g. jaxcomp.TopK), got "
            f"{[m.describe() for m in candidates]}"
        )
    return ratios


def _aggregation(
    config: FeedbackConfig, branches: _Branches, ratio_search, decide_every: int, fallback_branch
):
    """``compress_auto``'s aggregation stage: decide, run the chosen branch (the dense one during
    the guardrail's fallback), learn from its gain."""

    def aggregate(groups: Groups, flight: InFlight, state: AggregateState):
        # Every step decides on the same costs, whichever branch's buckets it runs with.
        own = pinning.pinned_config(config, flight.record).bucket_mb != config.bucket_mb
        whole = own and config.granularity == "model"
        plan = _Plan(branches, ratio_search, decide_every, _as_one(groups) if whole else groups)
        auto, branch, comm = plan.decide(state.auto, flight.step)
        if fallback_branch is not None and flight.fallback is not None:
            branch = jnp.where(flight.fallback, fallback_branch, branch)
        # A step compiled for one branch (data_parallel's, pinning) runs it as compress of that
        # one method would: a sparse method with its in-place residual, no lax.switch.
        branch = pinning.static_choice(flight.record, branch)
        sparse = isinstance(branch, int) and branches.methods[branch].sparse
        totals, sents, method_state, vectors = run_branch(
            branches.methods,
            branch,
            groups,
            config.axis_name,
            flight.step,
            flight.key,
            sparse,
            state.method_state,
            pieces=True,
        )
        result = Aggregation(
            totals,
            sents,
            jnp.asarray(plan.bytes)[branch],
            jnp.asarray(plan.kept)[branch],
            branch,
            sparse=sparse,
            sends_everything=False,
            method_state=method_state,
            vectors=vectors,
            rounds_only=rounds_only(branches.methods, branch),
        )
        return result, lambda gain: plan.observe(auto, branch, gain, comm)

    return aggregate


def _check_candidates(candidates, axes) -> tuple[Method, ...]:
    if isinstance(candidates, (str, Method)) or not hasattr(candidates, "__iter__"):
        raise TypeError(
            f"candidates must be a sequence of jaxcomp.methods objects, got {candidates!r}"
        )
    candidates = tuple(candidates)
    if not candidates or not all(isinstance(m, Method) for m in candidates):
        raise TypeError(
            f"candidates must be a non-empty sequence of jaxcomp.methods objects (use "
            f"jaxcomp.methods.parse for names), got {candidates!r}"
        )
    if len(set(candidates)) != len(candidates):
        raise ValueError(f"candidates must be distinct, got {[m.describe() for m in candidates]}")
    for m in candidates:
        m.check_axes(axes)
        if not m.replicated_total:
            raise ValueError(
                f"candidate {m.describe()} returns a total typed varying, and compress_auto's "
                "branches must agree on replicated totals; leave it out (for Zfp: algorithm='ring')"
            )
    return candidates
