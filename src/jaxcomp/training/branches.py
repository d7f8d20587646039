"""The step of each branch: :class:`PinnedSteps` compiles one step per branch of the state's
compress and dispatches the one the device asked for (:mod:`jaxcomp.optim.pinning`).

A compress state with several branches (a warm-up, the guardrail's dense fallback,
``compress_auto``'s candidates) would otherwise choose on the device, with ``lax.switch``, and a
sparse method under a switch loses its in-place residual, and its update takes markedly longer
(docs/training.md, "Branches picked on the host"). Here each step reports the branch
its state asks for next (:func:`jaxcomp.optim.pinning.next_branch`); the host reads that report
``delay`` calls later, once the step has run, so nothing waits for it, and every process reads
the same report at the same call, so all of them run the same program. A branch therefore starts
``delay - 1`` steps after the device asked for it (one, with :data:`REPORT_DELAY`): the warm-up
lasts that much longer, the guardrail's dense window starts that much later (the trigger step
itself clears the residual), and ``compress_auto``'s new choice runs that much later. Every
branch keeps the state exact.
"""

from __future__ import annotations

import collections

import jax

from jaxcomp.optim.host import local_copy
from jaxcomp.optim.pinning import can_pin, next_branch
from jaxcomp.optim.state import compress_states

#: Calls between a step's report and the call that runs the branch it asked for: the host waits
#: for the step before last (one step in flight beside the one being dispatched), so the branch
#: starts one step after the device asked for it. A longer delay would let more steps queue up,
#: and start the guardrail's dense window later: random-k's forced divergence (tests/
#: divergence_test.py) grew much further with 9 than with 2.
REPORT_DELAY = 2

#: Not known yet (None is "never pinned": the device chooses).
_UNKNOWN = object()


class PinnedSteps:
    """``step(state, batch)`` over one jitted step per branch (``make(branch)`` builds one; its
    third output's ``[2]`` is :func:`pinned_report`'s scalar, or None).

    The first call reads the branch from its input state (one wait, before anything is queued);
    call ``n`` runs the branch that call ``n - delay`` reported. A state that is not
    :func:`pinnable`, or ``delay=None``, runs ``make(None)``, whose step chooses on the device.
    ``lower``, ``trace`` and every other attribute are the jitted step's of the branch the next
    call would run.
    """

    def __init__(self, make, delay: int | None = REPORT_DELAY):
        if delay is not None and delay < 1:
            raise ValueError(f"delay must be >= 1 or None, got {delay}")
        self._make = make
        self._delay = delay
        self._jitted = {}
        self._ran = set()  # branches whose step has been dispatched (so compiled)
        self.restart()

    def restart(self):
        """Forgets the reports: the next call reads its branch from its input state."""
        self._reports = collections.deque()
        self._pin = _UNKNOWN if self._delay is not None else None
        self._last_step = None  # the step counter the last call returned

    @property
    def branch(self):
        """The branch the next call runs (None: the device chooses; unknown before the first)."""
        return None if self._pin is _UNKNOWN else self._pin

    def __call__(self, state, *args, **kwargs):
        if self._last_step is not None and getattr(state, "step", None) is not self._last_step:
            # Not the state the last call returned (a restored checkpoint, an older state): the
            # reports are of another run's steps; its branch is read from it.
            self.restart()
        branch = self._next(state)
        out = self.run(branch, state, *args, **kwargs)
        if branch is not None:
            self._reports.append(out[2][2])
        return out

    def run(self, branch, state, *args, **kwargs):
        """Runs ``branch``'s step (None: the device chooses), whatever the reports say."""
        out = self._step(branch)(state, *args, **kwargs)
        self._ran.add(branch)
        self._last_step = getattr(out[0], "step", None)
        return out

    def compiled(self, branch) -> bool:
        """Whether ``branch``'s step has run already (so its next call does not compile)."""
        return branch in self._ran

    def lower(self, state, *args, **kwargs):
        return self._step(self._peek(state)).lower(state, *args, **kwargs)

    def trace(self, state, *args, **kwargs):
        return self._step(self._peek(state)).trace(state, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._step(self.branch), name)

    def _step(self, branch):
        if branch not in self._jitted:
            self._jitted[branch] = self._make(branch)
        return self._jitted[branch]

    def _next(self, state):
        """The branch of this call: the report of the call ``delay`` before, else the state's."""
        if self._pin is _UNKNOWN:
            self._pin = initial_branch(state, asked=self._delay > 1)
            if self._pin is not None and self._delay > 1:
                # The report the call before would have read next: what this state asks for.
                self._reports.appendleft(jax.jit(pinned_report)(state.opt_state))
        if self._pin is not None and len(self._reports) >= self._delay:
            self._pin = _read(self._reports.popleft())
        return self._pin

    def _peek(self, state):
        """The branch a call with ``state`` would run, without taking a report."""
        if self._pin is not _UNKNOWN:
            return self._pin
        return initial_branch(state) if _concrete(state) else None


def pinnable(opt_state) -> bool:
    """Whether a step may be compiled per branch: one compress state, whose next branch its
    state tells (:func:`jaxcomp.optim.pinning.next_branch`).

    Args:
      opt_state: the optimizer state.

    Returns:
      True or False.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> pinnable(jaxcomp.compress("allgather_topk", ratio=0.1, warmup_steps=3).init(jnp.zeros(4)))
      True

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3 (warm-up).
    """
    states = compress_states(opt_state)
    return len(states) == 1 and can_pin(states[0])


def pinned_record(opt_state):
    """The static record (:attr:`jaxcomp.CompressState.branches`) of the state a step pins.

    Args:
      opt_state: a :func:`pinnable` optimizer state.

    Returns:
      A :class:`jaxcomp.optim.state.Branches`.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> state = jaxcomp.compress("allgather_topk", ratio=0.1, warmup_steps=3).init(jnp.zeros(4))
      >>> [m.describe() for m in pinned_record(state).methods]
      ['dense', 'allgather_topk(0.1)']

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-D.
    """
    return compress_states(opt_state)[0].branches


def pinned_report(opt_state):
    """The scalar a pinned step reports: the branch its new state asks for next.

    Args:
      opt_state: the step's new optimizer state (traced), :func:`pinnable`.

    Returns:
      An int32 scalar.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.compress("allgather_topk", ratio=0.1, warmup_steps=3)
      >>> int(pinned_report(tx.init(jnp.zeros(4))))
      0

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-D.
    """
    return next_branch(compress_states(opt_state)[0])


def initial_branch(state, asked: bool = False):
    """The branch the first step of ``state`` (a :class:`~jaxcomp.training.state.TrainState`)
    runs, read on the host; None when it is not :func:`pinnable`.

    Args:
      state: the training state, concrete arrays.
      asked: the branch the step before asked for (the compress state's ``asked``), which a
        run that reads each report two calls later runs here; else the one this state asks for.

    Returns:
      An int, or None.

    Example:
      >>> import types, jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.compress("allgather_topk", ratio=0.1, warmup_steps=3)
      >>> initial_branch(types.SimpleNamespace(opt_state=tx.init(jnp.zeros(4))))
      0

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-D.
    """
    if not pinnable(state.opt_state):
        return None
    before = compress_states(state.opt_state)[0].asked
    if asked and before is not None:
        return _read(before)
    return _read(jax.jit(pinned_report)(state.opt_state))


def _read(scalar) -> int:
    """This process's copy of a replicated int scalar (waits for it)."""
    return int(local_copy(scalar))


def _concrete(state) -> bool:
    return all(isinstance(x, jax.Array) for x in jax.tree.leaves(state.opt_state))
