"""How far the host may run ahead of the devices: :class:`BoundedStep` around the jitted step.

Why a bound: XLA:CPU runs the collectives of each step as an in-process rendezvous of one thread
per device with a fixed 40 s termination timeout. A loop that never reads a result queues
hundreds of steps; the threads of one device then fall so far behind another's that a
rendezvous times out and XLA aborts the process ("Termination timeout for all reduce
RendezvousKey ... only 7 of 8 arrived"; a reproduction without jaxcomp is
``tests/inflight_repro.py``). Waiting for an output that is ``max_in_flight`` steps old costs
nothing measurable while the queue stays ahead (docs/training.md).
"""

from __future__ import annotations

import collections

import jax

from jaxcomp.optim.host import local_copy

#: Steps :attr:`DataParallel.step` lets run ahead of the host by default
#: (see :func:`data_parallel`).
DEFAULT_MAX_STEPS_IN_FLIGHT = 8


class BoundedStep:
    """A jitted step that blocks on step ``t - max_in_flight``'s output before dispatching step
    ``t``.

    See the module's docstring for why. The jitted step returns ``(state, metrics)``, or
    ``(state, metrics, watch)`` whose ``watch[0]`` is the new step counter (what the bound waits
    on) and whose rest the ``watch`` probe reads; the call returns ``(state, metrics)``. Every
    other attribute (``lower``, ``trace``, ...) is the jitted function's.

    The metrics come back as this process's copy of each (replicated) value, an array on one
    local device: ``float(metrics["loss"])`` works on every process of a multi-process job,
    where the global arrays would span devices this process cannot read. Taking the local copy
    waits for nothing.
    """

    def __init__(self, jitted, max_in_flight, check=None, watch=None):
        self._jitted = jitted
        self._max_in_flight = max_in_flight
        self._in_flight = collections.deque()
        self._check = check  # check(state, metrics): raises on a step the host must not go past
        # watch = (probe, tell): probe(args, out) takes a few scalars of a step as it is
        # dispatched, tell(probe) reads them once the step has run (the guardrail's triggers).
        self._watch = watch

    def __call__(self, *args, **kwargs):
        out = self._jitted(*args, **kwargs)
        probe = self._watch[0](args, out) if self._watch else None
        if self._max_in_flight is not None or probe is not None:
            # One scalar per step, ready when the whole step has run: the new step counter (a
            # copy of its own in a third output, ``(counter, ...)``, where the step donates its
            # input state, as the next step would delete the state's own).
            token = out[2][0] if len(out) > 2 else out[0].step
            self._in_flight.append((token, probe))
            self._retire()
        state, metrics = out[:2]
        metrics = jax.tree.map(local_copy, metrics)
        if self._check is not None:
            self._check(state, metrics)
        return state, metrics

    def _retire(self):
        """Forgets the steps that have run (and tells their probes), waiting for the oldest
        while more than ``max_in_flight`` are queued."""
        while self._in_flight:
            token, probe = self._in_flight[0]
            over = self._max_in_flight is not None and len(self._in_flight) > self._max_in_flight
            if not over and not token.is_ready():
                return
            self._in_flight.popleft()
            token.block_until_ready()
            if probe is not None:
                self._watch[1](probe)

    def __getattr__(self, name):
        return getattr(self._jitted, name)
