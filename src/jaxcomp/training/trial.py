"""``compress_auto``'s trial: time the whole step of its leading candidates on the cluster, and
keep the fastest.

``compress_auto`` predicts each candidate's seconds from the network it was given (or
:meth:`jaxcomp.DataParallel.reprobe` measured) and each candidate's local work, timed alone on
this process (:func:`jaxcomp.optim.timing.overhead_seconds`). Where candidates lie within a few
percent of each other the choice then rests on those local timings, which a shared machine
makes noisy: on 4 emulated hosts sharing 2 cores, AR-Topk's local work measured several times
longer in one job than in the next, and ``auto`` ran a method slower than the best fixed one
(docs/training.md, "The trial of ``compress_auto``'s candidates").
A step also holds what no local timing sees: how XLA compiles that branch's step, the waits of a
real collective.

So :class:`TrialSteps` times the real thing. After the first step (which makes the
predictions), it runs each of the :attr:`Trial.candidates` branches predicted fastest for
:attr:`Trial.steps` timed steps, in turns (after one untimed step where a branch's step
compiles), waiting for each, and hands the medians (the slowest process's) to
:func:`jaxcomp.optim.auto_state.set_measured`: ``compress_auto`` then runs the fastest measured
branch, and its later decisions use the measured steps in place of their predictions
(:func:`jaxcomp.optim.auto_state.calibrated`) until the network is measured again
(:meth:`jaxcomp.DataParallel.reprobe`, after which the trial runs again). Every trial step is a
training step: the state stays exact whichever branch ran.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time

import jax
import numpy as np

from jaxcomp.costmodel.probe import agree_across_processes
from jaxcomp.ops.allocator import release_host_memory
from jaxcomp.optim.auto_state import predicted_seconds, set_measured
from jaxcomp.optim.host import local_copy
from jaxcomp.optim.state import compress_states
from jaxcomp.training.branches import pinnable

_LOG = logging.getLogger("jaxcomp")


@dataclasses.dataclass(frozen=True)
class Trial:
    """How :func:`jaxcomp.data_parallel` times ``compress_auto``'s leading candidates.

    Args:
      candidates: how many branches to time, those predicted fastest (at least 2; a trial of one
        would teach nothing).
      steps: timed steps per branch (their median counts), taken in turns after one untimed step
        for each branch whose step has not run yet.
      within: only branches predicted at most this many times the fastest prediction's seconds.

    Example:
      >>> Trial(candidates=2, steps=5)
      Trial(candidates=2, steps=5, within=3.0)

    References:
      Agarwal et al., MLSys 2022, §3.1 (a method pays off only if the whole step is faster);
      Tyagi & Swany, arXiv 2312.02493, §3-E (measure, then choose).
    """

    candidates: int = 3
    steps: int = 3
    within: float = 3.0

    def __post_init__(self):
        for name, low in (("candidates", 2), ("steps", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"Trial's {name} must be an integer >= {low}, got {value!r}")
        if not (np.isfinite(self.within) and self.within >= 1):
            raise ValueError(f"Trial's within must be a number >= 1, got {self.within!r}")

    def branches(self, predicted) -> list[int]:
        """The branches to time: the fastest predicted first, at most :attr:`candidates`, each
        within :attr:`within` times the fastest.

        Args:
          predicted: each branch's predicted seconds (finite).

        Returns:
          Branch indices, fastest predicted first; fewer than two means no trial.

        Example:
          >>> Trial().branches([1.2, 0.05, 0.06, 0.12, 0.4])
          [1, 2, 3]
        """
        predicted = np.asarray(predicted, np.float64)
        order = [int(b) for b in np.argsort(predicted, kind="stable")]
        best = predicted[order[0]]
        return [b for b in order[: self.candidates] if predicted[b] <= self.within * best]


def wants_trial(opt_state) -> bool:
    """Whether a run of ``opt_state`` should time its candidates: one ``compress_auto`` state
    whose branch the host picks (:func:`jaxcomp.training.branches.pinnable`), with a network
    and nothing measured on it yet. Reads two small arrays (waits for them).

    Args:
      opt_state: the optimizer state, concrete.

    Returns:
      True or False.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> slow = jaxcomp.costmodel.cost.Network.parse("1ms", "100mbit")
      >>> tx = jaxcomp.compress_auto([jaxcomp.Dense(), jaxcomp.TopK(0.01)], network=slow)
      >>> dense = jaxcomp.compress("dense")
      >>> wants_trial(tx.init(jnp.zeros(3))), wants_trial(dense.init(jnp.zeros(3)))
      (True, False)

    References:
      Agarwal et al., MLSys 2022, §3.1.
    """
    if not pinnable(opt_state):
        return False
    auto = compress_states(opt_state)[0].auto
    if auto is None:
        return False
    network, measured = (np.asarray(local_copy(x)) for x in (auto.network, auto.measured))
    return bool(np.all(np.isfinite(network)) and not np.any(measured > 0))


class TrialSteps:
    """``step(state, batch)`` over :class:`jaxcomp.training.branches.PinnedSteps`, with a
    :class:`Trial` at the start of a ``compress_auto`` run (and after :meth:`restart`).

    Call 1 runs as usual and is waited for; its new state's predictions name the branches to
    time; then each runs (waited for, timed) and the call that ends the trial returns the state
    with the measured steps set, from which the next call runs the fastest. With ``trial=None``,
    or a state that :func:`wants_trial` declines, every call is the pinned step's. Every other
    attribute is the pinned step's.
    """

    def __init__(self, pinned, trial: Trial | None):
        self._pinned = pinned
        self._trial = trial
        self._queue = None  # the branch of each trial call still to come; None: not started
        self._times = {}
        self.restart()

    def restart(self):
        """Runs a trial again from the next call (after the network was measured again)."""
        self._checked = self._trial is None  # whether the state was asked if it wants one
        self._queue = None
        self._times = {}

    @property
    def in_trial(self) -> bool:
        """Whether the next call may be a trial step (untimed work for a benchmark)."""
        return not self._checked or bool(self._queue)

    def __call__(self, state, *args, **kwargs):
        if not self._checked:
            self._checked = True
            if wants_trial(state.opt_state):
                out = self._pinned(state, *args, **kwargs)
                jax.block_until_ready(out[0])
                self._start(out[0])
                return out
        if self._queue:
            return self._timed(state, *args, **kwargs)
        return self._pinned(state, *args, **kwargs)

    def _start(self, state):
        """Plans the trial from the predictions of the step that made them."""
        auto = compress_states(state.opt_state)[0].auto
        branches = self._trial.branches(predicted_seconds(auto))
        if len(branches) < 2:
            return
        # Each new branch's first step (its compile) untimed, then the timed steps in turns, so
        # that a slow drift of the machine (other processes, the allocator warming up) falls on
        # every branch alike.
        compile_first = [b for b in branches if not self._pinned.compiled(b)]
        self._queue = compile_first + branches * self._trial.steps
        self._times = {b: [] for b in branches}

    def _timed(self, state, *args, **kwargs):
        """One trial step: ``branch``'s, waited for; the last one sets the measured steps."""
        branch = self._queue.pop(0)
        warm = self._pinned.compiled(branch)
        start = time.perf_counter()
        out = self._pinned.run(branch, state, *args, **kwargs)
        jax.block_until_ready(out[0])
        if warm:
            self._times[branch].append(time.perf_counter() - start)
        if self._queue:
            return out
        measured = self._measured()
        new_state = out[0]._replace(opt_state=set_measured(out[0].opt_state, measured))
        self._pinned.restart()
        _tell(new_state, measured)
        # The start's probes and trial steps freed what they held; glibc keeps it unless told.
        release_host_memory()
        return (new_state, *out[1:])

    def _measured(self) -> dict[int, float]:
        """Each timed branch's median step, the slowest process's."""
        branches = sorted(self._times)
        medians = np.array([statistics.median(self._times[b]) for b in branches])
        return dict(zip(branches, (float(s) for s in agree_across_processes(medians))))

    def __getattr__(self, name):
        return getattr(self._pinned, name)


def _tell(state, measured: dict[int, float]):
    """Logs the trial's steps and the branch that runs from now on."""
    compress = compress_states(state.opt_state)[0]
    names = [m.describe() for m in compress.methods]
    chosen = int(local_copy(compress.auto.choice))
    _LOG.info(
        "compress_auto: whole steps measured %s; runs %s",
        ", ".join(f"{names[b]} {s:.3f} s" for b, s in sorted(measured.items(), key=lambda x: x[1])),
        names[chosen],
    )
