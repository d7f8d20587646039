"""What :func:`jaxcomp.compress_auto` decides with (:class:`AutoState`), and how the host sets it:
the network and each branch's local work (:func:`set_network`), and the whole steps a trial of the
leading candidates measured (:func:`set_measured`, :func:`calibrated`).

The device predicts each branch's seconds with the α-β model plus the branch's local work
(:mod:`jaxcomp.optim.auto`). A prediction misses what the model does not see: how XLA compiles
the branch's step, what it shares with the backward pass, what other processes do to this one's
cores. Whole steps measured on the cluster replace the prediction of the branches they timed
(:func:`calibrated`), so among them the fastest measured one wins, and a branch nobody measured
wins only where the model predicts it faster than that.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.costmodel import cost, ratio_choice
from jaxcomp.methods import Method
from jaxcomp.optim import host
from jaxcomp.optim.state import CompressState, compress_states


class AutoState(NamedTuple):
    """What :func:`compress_auto` decides with; replicated. ``B`` branches, compiled once each
    (:attr:`jaxcomp.CompressState.methods` lists them). Set the network with :func:`set_network`
    (``jaxcomp.data_parallel`` probes it for you)."""

    network: (
        jax.Array
    )  # f32[2]: (alpha seconds, beta seconds per byte) of the latest probe; NaN until one is set
    overhead: jax.Array  # f32[B]: each branch's local work in seconds (0 until measured)
    decided: (
        jax.Array
    )  # f32[2]: the network the current choice was made with (NaN before the first choice)
    choice: jax.Array  # i32[]: the chosen candidate, an index into the candidates
    ratio: Any  # ratio_choice.RatioState with a RatioSearch, else None
    # f32[B]: each branch's predicted communication seconds at the last decision (NaN before)
    comm: Any = None
    # f32[B]: each branch's whole step in seconds, as a trial measured it (0: not measured)
    measured: Any = None


def init_auto(network, n_branches: int, ratio_search) -> AutoState:
    """The :class:`AutoState` before the first step.

    Args:
      network: a :class:`jaxcomp.costmodel.cost.Network` to start from, or None (unknown: NaN).
      n_branches: the number of branches ``B``.
      ratio_search: the :class:`jaxcomp.RatioSearch`, or None.

    Returns:
      An :class:`AutoState`: no local work, nothing predicted or measured, candidate 0 chosen.

    Example:
      >>> init_auto(None, 3, None).measured.tolist()
      [0.0, 0.0, 0.0]

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-D.
    """
    start = np.full(2, np.nan) if network is None else np.array([network.alpha, network.beta])
    return AutoState(
        network=jnp.asarray(start, jnp.float32),
        overhead=jnp.zeros(n_branches, jnp.float32),
        decided=jnp.full(2, jnp.nan, jnp.float32),
        choice=jnp.zeros((), jnp.int32),
        ratio=(
            ratio_choice.ratio_init(len(ratio_search.ratios), ratio_search.explore_steps)
            if ratio_search is not None
            else None
        ),
        comm=jnp.full(n_branches, jnp.nan, jnp.float32),
        measured=jnp.zeros(n_branches, jnp.float32),
    )


def calibrated(predicted, measured):
    """Each branch's predicted seconds, with the branches a trial measured put at their measured
    whole step.

    A measured step holds what every branch does (the forward and backward pass), which the
    prediction leaves out, so the measured steps are shifted down by the smallest gap between a
    measured step and its prediction: the measured branch that exceeds its prediction least keeps
    its prediction, the others keep their measured distance from it. When the measured branches
    are the ones predicted fastest (a trial's), the fastest measured one has the least calibrated
    time, and an unmeasured branch keeps a prediction no smaller than theirs.

    Args:
      predicted: f32[B] predicted seconds (communication plus local work), numpy or jax.
      measured: f32[B] measured whole-step seconds, 0 where not measured.

    Returns:
      f32[B], ``predicted`` where nothing is measured.

    Example:
      >>> calibrated(np.array([1.0, 2.0, 5.0]), np.array([4.0, 3.5, 0.0])).tolist()
      [2.5, 2.0, 5.0]

    References:
      Agarwal et al., MLSys 2022, §3.1 (a method pays off only if the whole step is faster).
    """
    xp = jnp if isinstance(predicted, jax.Array) or isinstance(measured, jax.Array) else np
    known = (measured > 0) & xp.isfinite(measured) & xp.isfinite(predicted)
    base = xp.min(xp.where(known, measured - predicted, xp.inf))
    return xp.where(known, measured - base, predicted)


def auto_branches(opt_state) -> list[list[Method]]:
    """The branches of each :func:`compress_auto` state in ``opt_state``, in branch order.

    Args:
      opt_state: an optimizer state holding one or more :class:`jaxcomp.CompressState`.

    Returns:
      One list of methods per ``compress_auto`` state, in depth-first order; the order
      :func:`set_network`'s ``overhead`` sequence uses.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> state = jaxcomp.compress_auto([jaxcomp.Dense(), jaxcomp.TopK(0.01)]).init(
      ...     {"w": jnp.zeros(3)}
      ... )
      >>> [m.describe() for m in jaxcomp.auto_branches(state)[0]]
      ['dense', 'allgather_topk(0.01)']

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-D and §3-E (the candidates flexible communication picks
      from).
    """
    return [list(state.methods) for state in compress_states(opt_state) if state.auto is not None]


def set_network(opt_state, network: cost.Network, overhead=None):
    """Gives every :func:`compress_auto` state in ``opt_state`` a newly measured network.

    It re-decides in its next step when latency or bandwidth moved by 10% or more
    (:data:`NETWORK_TOLERANCE`), otherwise at its next regular decision. Call it on the host
    between steps (:meth:`jaxcomp.DataParallel.reprobe` does, after probing).

    Args:
      opt_state: an optimizer state holding one or more :class:`jaxcomp.CompressState`.
      network: the :class:`jaxcomp.costmodel.cost.Network`, e.g.
        ``jaxcomp.probe_network(mesh, "data")``.
      overhead: optional seconds of local work per branch: a sequence in :func:`auto_branches`
        order, a dict keyed by branch method or by label (``{"zfp": 0.01}``; missing branches keep
        theirs), or a function ``method -> seconds``. Kept as they are when None.

    Returns:
      ``opt_state`` with the network (and overhead) replaced and the measured steps cleared
      (they were timed on the old network: :class:`jaxcomp.DataParallel` measures them again);
      everything else is untouched.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.compress_auto([jaxcomp.Dense(), jaxcomp.TopK(0.01)])
      >>> state = jaxcomp.set_network(
      ...     tx.init({"w": jnp.zeros(3)}), jaxcomp.costmodel.cost.Network.parse("1ms", "1gbit")
      ... )
      >>> [float(v) for v in state.auto.network]  # alpha seconds, beta seconds per byte
      [0.0010000000474974513, 7.999999773744548e-09]

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-E (re-decide when α or β changes).
    """
    if not isinstance(network, cost.Network):
        raise TypeError(
            f"network must be a jaxcomp.costmodel.cost.Network, got {type(network).__name__}"
        )
    if not any(state.auto is not None for state in compress_states(opt_state)):
        raise ValueError("opt_state holds no compress_auto state to give a network to")
    values = np.array([network.alpha, network.beta], np.float32)

    def replace(node):
        if isinstance(node, CompressState) and node.auto is not None:
            auto = node.auto
            return node._replace(
                auto=auto._replace(
                    network=_like(auto.network, values),
                    overhead=_like(auto.overhead, _overhead_of(overhead, node)),
                    measured=_like(auto.measured, np.zeros(len(node.methods), np.float32)),
                )
            )
        return node

    return jax.tree.map(replace, opt_state, is_leaf=lambda x: isinstance(x, CompressState))


def _overhead_of(overhead, state: CompressState):
    """The overhead seconds per branch of ``state`` that :func:`set_network` sets."""
    auto = state.auto
    if overhead is None:
        return auto.overhead
    current = host.value(auto.overhead).astype(np.float64)
    branches = state.methods
    if callable(overhead):
        seconds = [overhead(m) for m in branches]
    elif isinstance(overhead, dict):
        known = set(branches) | {m.label for m in branches}
        unknown = [key for key in overhead if key not in known]
        if unknown:
            raise ValueError(
                f"overhead names {unknown}, which are not among the branches "
                f"{[m.describe() for m in branches]}"
            )
        seconds = [
            overhead.get(m, overhead.get(m.label, current[b])) for b, m in enumerate(branches)
        ]
    else:
        seconds = list(overhead)
        if len(seconds) != len(branches):
            raise ValueError(
                f"overhead has {len(seconds)} entries for {len(branches)} branches "
                f"{[m.describe() for m in branches]}"
            )
    seconds = np.asarray(seconds, np.float64)
    if seconds.shape != (len(branches),) or not np.all(np.isfinite(seconds)) or np.any(seconds < 0):
        raise ValueError(
            f"overhead must give finite seconds >= 0 per branch, got {seconds.tolist()}"
        )
    return seconds.astype(np.float32)


def _like(old, new):
    """``new`` placed like ``old``."""
    # Keep the old leaf's placement, so a jitted step sees the same input and does not recompile.
    if not isinstance(old, jax.Array) or isinstance(old, jax.core.Tracer):
        return new
    if old.is_fully_addressable:
        return jax.device_put(new, old.sharding)
    # Across processes device_put checks that every process passes the same value, and NaN
    # equals nothing: a constant of the program, the same on every process, instead.
    value = np.asarray(new, old.dtype)
    return jax.jit(lambda: jnp.asarray(value), out_shardings=old.sharding)()


def predicted_seconds(auto: AutoState) -> np.ndarray:
    """Each branch's seconds as the last decision saw them: predicted communication plus local
    work, :func:`calibrated` by the measured steps. Read on the host.

    Args:
      auto: a concrete :class:`AutoState` (``jaxcomp.find_compress_state(opt_state).auto``).

    Returns:
      A float64 array of ``B`` seconds; NaN before the first decision.

    Example:
      >>> import jaxcomp
      >>> state = jaxcomp.compress_auto([jaxcomp.Dense(), jaxcomp.TopK(0.01)]).init(jnp.zeros(3))
      >>> predicted_seconds(state.auto).tolist()
      [nan, nan]

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-D (Eqn 5a-5c).
    """
    comm, overhead, measured = (
        host.value(x).astype(np.float64) for x in (auto.comm, auto.overhead, auto.measured)
    )
    return calibrated(comm + overhead, measured)


def set_measured(opt_state, seconds):
    """Gives the :func:`compress_auto` state in ``opt_state`` whole steps measured on the
    cluster, and chooses now the branch with the least :func:`calibrated` time.

    Call it on the host between steps, after at least one step (which made the predictions).
    :class:`jaxcomp.DataParallel` calls it after timing the leading candidates' first steps.

    Args:
      opt_state: an optimizer state holding one :class:`jaxcomp.CompressState` with an
        :class:`AutoState` and no :class:`jaxcomp.RatioSearch`.
      seconds: ``{branch index: seconds of one whole step}``; branches not named count as not
        measured.

    Returns:
      ``opt_state`` with ``measured`` and ``choice`` replaced; everything else is untouched.

    Example:
      >>> import jaxcomp
      >>> slow = jaxcomp.costmodel.cost.Network.parse("1ms", "100mbit")
      >>> tx = jaxcomp.compress_auto([jaxcomp.Dense(), jaxcomp.TopK(0.01)], network=slow)
      >>> state = tx.init(jnp.zeros(100))
      >>> # as after a step: top-k's predicted time to send a tenth of dense's
      >>> state = state._replace(auto=state.auto._replace(comm=jnp.array([0.1, 0.01])))
      >>> int(set_measured(state, {0: 0.2, 1: 0.3}).auto.choice)  # measured: dense is faster
      0

    References:
      Agarwal et al., MLSys 2022, §3.1 (a method pays off only if the whole step is faster).
    """
    states = [s for s in compress_states(opt_state) if s.auto is not None]
    if len(states) != 1 or states[0].auto.ratio is not None:
        raise ValueError(
            "set_measured needs exactly one compress_auto state without a RatioSearch in "
            f"opt_state, got {len(states)} compress_auto states"
        )
    auto = states[0].auto._replace(measured=_measured_vector(seconds, len(states[0].methods)))
    now = predicted_seconds(auto)
    if not np.all(np.isfinite(now)):
        raise ValueError(
            "set_measured: compress_auto has not decided yet (no network, or no step since "
            "one was set): run a step first"
        )
    auto = auto._replace(
        measured=_like(states[0].auto.measured, auto.measured),
        choice=_like(auto.choice, np.int32(np.argmin(now))),
    )

    def replace(node):
        if isinstance(node, CompressState) and node.auto is not None:
            return node._replace(auto=auto)
        return node

    return jax.tree.map(replace, opt_state, is_leaf=lambda x: isinstance(x, CompressState))


def _measured_vector(seconds, n: int) -> np.ndarray:
    """``{branch: seconds}`` as f32[n], 0 where not measured, after checking it."""
    measured = np.zeros(n, np.float32)
    for branch, value in dict(seconds).items():
        if isinstance(branch, bool) or not (
            isinstance(branch, (int, np.integer)) and 0 <= branch < n
        ):
            raise ValueError(f"seconds names branch {branch!r}; the branches are 0..{n - 1}")
        if not (np.isfinite(value) and value > 0):
            raise ValueError(f"seconds[{branch}] must be finite seconds > 0, got {value!r}")
        measured[branch] = value
    return measured
