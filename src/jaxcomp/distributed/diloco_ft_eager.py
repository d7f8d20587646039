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
and rejoins). :meth:`EagerFaultTolerantDiLoCo.params` waits for it.
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp

from jaxcomp.distributed.diloco_ft import FaultTolerantDiLoCo, FTState

__all__ = ["EagerFaultTolerantDiLoCo"]


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


class EagerFaultTolerantDiLoCo(FaultTolerantDiLoCo):
    """The object :func:`jaxcomp.distributed.diloco_ft.diloco_ft` returns with ``eager=True``
    (see the module's docstring). Its metrics at a round are the applied sync's (the one of the
    round before), plus ``exchange_seconds`` (how long its thread took) and ``waited`` (how long
    this round waited for it: the part of the exchange the inner steps did not hide)."""

    def __init__(self, *args):
        super().__init__(*args)
        self._flight = None
        self._own = jax.jit(self._own_contribution)

    def init(self, params) -> FTState:
        state = super().init(params)
        return state._replace(start=state.global_params)

    def params(self, state: FTState):
        """The consensus of ``state`` with the average in flight applied (it waits for it): the
        global params the next round's outer step gives.

        Args:
          state: the newest :class:`FTState` of this run.

        Returns:
          The params pytree.
        """
        flight = self._flight
        if flight is None or flight.sync != state.sync:
            return state.global_params
        (sync, exchanged, _), _ = flight.result()
        base = exchanged if sync > state.sync else state  # this worker was behind: its peers'
        return self._outer(base.global_params, base.outer_state, exchanged.average)[0]

    def step(self, state: FTState, batch):
        local, inner_state, loss = self._inner(state.local_params, state.inner_state, batch)
        state = state._replace(local_params=local, inner_state=inner_state, step=state.step + 1)
        metrics = dict(synced=False, members=0, trained=(), joined=False, attempts=0)
        metrics.update(reconnects=0, bytes_sent=0, exchange_seconds=0.0, waited=0.0)
        if state.step % self.sync_every == 0:
            state, done = self._round(state)
            metrics.update(done)
        return state, {"loss": loss, **metrics}

    step.__doc__ = FaultTolerantDiLoCo.step.__doc__

    def _round(self, state: FTState):
        """``(state, metrics)``: the module's steps 1 to 3 at this round."""
        flight, self._flight, done = self._flight, None, {}
        average, n = jnp.float32(0.0), self.quorum.num_workers
        if flight is not None and flight.sync != state.sync:
            flight.wait()  # not this state's (a restored one): one exchange at a time
        elif flight is not None:
            waited = time.monotonic()
            (sync, exchanged, done), seconds = flight.result()
            done.update(synced=True, exchange_seconds=seconds, waited=time.monotonic() - waited)
            if sync > state.sync:  # behind: the peers' consensus; its own steps are void
                state = self._committed(state, sync, exchanged, state.residual)
                step = exchanged.step + self.sync_every  # the sender's, a round on
                state = state._replace(start=state.global_params, step=step)
                self._launch(state, b"")
                return state, done
            average, n = exchanged.average, len(exchanged.trained)
            state = state._replace(sync=sync + 1)
        delta, residual = self._payload(state, state.start)
        own = self._own(state.start, state.local_params, average, jnp.float32(n))
        restart, _ = self._outer(state.global_params, state.outer_state, own)
        global_params, outer_state = state.global_params, state.outer_state
        if done:  # the consensus takes the outer step one round late
            global_params, outer_state = self._outer(global_params, outer_state, average)
        state = state._replace(
            global_params=global_params,
            local_params=restart,
            outer_state=outer_state,
            residual=residual,
            start=restart,
        )
        self._launch(state, delta)
        return state, done

    def _launch(self, state: FTState, delta: bytes) -> None:
        """Sync ``state.sync``'s exchange of ``delta`` on a thread."""
        self._flight = _Flight(state.sync, lambda: self._attempts(state, delta))

    def _own_contribution(self, start, local, average, n):
        """``avg + Δ / n``: the average this worker restarts with, its own fresh progress in
        (``average`` a scalar zero on the first round)."""
        return average + self._pseudo_gradient(start, local) / n
