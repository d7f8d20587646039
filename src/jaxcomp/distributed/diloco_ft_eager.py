"""Eager rounds for :func:`jaxcomp.distributed.diloco_ft.diloco_ft` (``eager=True``): each
sync's exchange runs on a host thread while the next ``sync_every`` inner steps run, and its
average is applied one round late (Kale et al., "Eager Updates For Overlapped Communication and
Computation in DiLoCo", arXiv 2502.12996; the algorithm of :func:`jaxcomp.diloco` with
``eager=True``, docs/training.md, "Eager rounds").

The exchange leaves XLA in ``diloco_ft`` (the quorum's store), so here it overlaps the inner
steps on any backend: the steps are XLA programs on the devices, the exchange is Python and
sockets on a thread. At round ``k`` (after every ``sync_every``-th inner step) a worker:

1. waits for the thread of sync ``k - 1`` (launched a round ago): its average ``avg`` of the
   members' pseudo-gradients (nothing on the first round);
2. takes the consensus's outer step with ``avg`` (the global params, the same bits on every
   member), and restarts its own params from ``global + u(avg + Δ / n)``: ``Δ`` its progress
   since it last restarted, ``u`` the outer optimizer's update from its state before the round,
   ``n`` the workers averaged (the paper's per-worker eager update, as ``diloco``'s);
3. launches sync ``k``'s thread with ``Δ``: the quorum, the exchange and the commit of
   :class:`jaxcomp.distributed.diloco_ft.FaultTolerantDiLoCo`, unchanged.

A worker that was behind in a sync (restarted, or cut off) takes its peers' consensus and that
sync's average when it waits for the thread, throws away the inner steps it took meanwhile, and
sends nothing in its next sync (an empty payload: a member, not averaged). Only the thread
touches the quorum. The exchange in flight lives in the object, not in the state: a state saved
and restored drops it (on every worker alike when all restore; a lone restored worker is behind
and rejoins). ``params(state)`` waits for it.
"""

from __future__ import annotations

import threading
import time

import jax.numpy as jnp

__all__ = ["EagerRounds"]


class _Flight:
    """One sync's exchange on a daemon thread: :meth:`result` waits and returns or raises what
    ``fn`` did. A daemon thread: a worker whose main thread fails is not kept alive by it."""

    def __init__(self, sync: int, fn):
        self.sync, self._out = sync, None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._started = time.monotonic()
        self._thread.start()

    def _run(self, fn):
        try:
            self._out = (True, fn(), time.monotonic() - self._started)
        except BaseException as e:  # raised again by result(), on the worker's main thread
            self._out = (False, e, time.monotonic() - self._started)

    def wait(self) -> None:
        """Until the exchange is over (it is bounded by the quorum's timeouts)."""
        self._thread.join()

    def result(self):
        """``(value, seconds the exchange took)``; the thread's exception is raised here."""
        self.wait()
        ok, value, seconds = self._out
        if not ok:
            raise value
        return value, seconds


class EagerRounds:
    """The eager rounds of one :class:`jaxcomp.distributed.diloco_ft.FaultTolerantDiLoCo`
    (``eager=True``): the module's steps 1 to 3 at each round, and the exchange in flight."""

    def __init__(self, run):
        self.run = run
        self.flight = None

    def params(self, state):
        """The consensus of ``state`` with the average in flight applied (it waits for it)."""
        flight, run = self.flight, self.run
        if flight is None or flight.sync != state.sync:
            return state.global_params
        (sync, exchanged, _), _ = flight.result()
        base = exchanged if sync > state.sync else state  # this worker was behind: its peers'
        return run._outer(base.global_params, base.outer_state, exchanged.average)[0]

    def round(self, state):
        """``(state, metrics)``: the module's steps 1 to 3 at this round."""
        run, flight, self.flight, done = self.run, self.flight, None, {}
        average, n = jnp.float32(0.0), run.quorum.num_workers
        if flight is not None and flight.sync != state.sync:
            flight.wait()  # not this state's (a restored one): one exchange at a time
        elif flight is not None:
            waited = time.monotonic()
            (sync, exchanged, done), seconds = flight.result()
            done.update(synced=True, exchange_seconds=seconds, waited=time.monotonic() - waited)
            if sync > state.sync:  # behind: the peers' consensus; its own steps are void
                state = run._committed(state, sync, exchanged, state.residual)
                step = exchanged.step + run.sync_every  # the sender's, a round on
                state = state._replace(start=state.global_params, step=step)
                self._launch(state, b"")
                return state, done
            average, n = exchanged.average, len(exchanged.trained)
            state = state._replace(sync=sync + 1)
        delta = run._delta(state.start, state.local_params)
        payload, residual = run._payload(state, delta)
        own = average + delta / n  # the average with this worker's own fresh progress in
        restart, _ = run._outer(state.global_params, state.outer_state, own)
        global_params, outer_state = state.global_params, state.outer_state
        if done:  # the consensus takes the outer step one round late
            global_params, outer_state = run._outer(global_params, outer_state, average)
        state = state._replace(
            global_params=global_params,
            local_params=restart,
            outer_state=outer_state,
            residual=residual,
            start=restart,
        )
        self._launch(state, payload)
        return state, done

    def _launch(self, state, payload: bytes) -> None:
        """Sync ``state.sync``'s exchange of ``payload`` on a thread."""
        self.flight = _Flight(state.sync, lambda: self.run._attempts(state, payload))
