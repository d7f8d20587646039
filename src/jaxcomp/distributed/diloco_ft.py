"""DiLoCo whose workers may die and come back: :func:`diloco_ft` and :class:`FaultTolerantDiLoCo`.

Each worker is a JAX program of its own (one process; no ``jax.distributed``, no XLA program that
spans workers): its inner steps are jitted on its own devices, and the outer exchange leaves XLA
for the :class:`jaxcomp.distributed.quorum.Quorum`'s key-value store. Sync ``k`` (the ``k``-th
sync this worker's state has committed, after every ``sync_every`` inner steps) is:

1. ``members = quorum.members(k)``; on ``QuorumMismatchError`` (a worker joined, or this one is
   new) ``k = error.sync`` and again. A member whose state has committed fewer than ``k`` syncs
   is *behind* (a started or restarted worker).
2. Every member puts ``delta/<rank>``: a header (its committed syncs and inner steps) and, unless
   behind, its pseudo-gradient (global minus local params) as float32, or as a ``codec``'s
   payload (:mod:`jaxcomp.distributed.ft_codecs`, with an error-feedback residual); it gets
   every member's.
3. When a member is behind, the lowest-ranked member that is not puts ``state``: its global
   params, outer optimizer state and counters; the members behind get it.
4. The average of the pseudo-gradients of the members that trained, summed in rank order (the
   same bits on every member), goes through ``outer_tx`` (jitted) onto the global params.
5. ``quorum.commit(k)``: True on every member alike, the sync counts: every member restarts its
   local params from the new global ones (one behind also takes the sender's step count and
   ``inner_tx.init``). False (a member died, restarted or joined): the sync is dropped and
   redone from step 1 with the new quorum; the dead worker's pseudo-gradient is not in it.

Every wait is bounded: the barriers by ``sync_timeout`` (they wait for the others' inner steps),
a dead worker by the service's heartbeat timeout, every get by the quorum's ``failure_timeout``.
No consensus is written here: the quorum decides. docs/failures.md and
docs/notes/2026-12-05-fault-tolerant-diloco.md explain the design. With ``eager=True`` the same
sync runs on a host thread beside the next round's inner steps
(:mod:`jaxcomp.distributed.diloco_ft_eager`).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp.distributed import _checks
from jaxcomp.distributed.diloco_ft_eager import EagerRounds
from jaxcomp.distributed.quorum import QuorumError, QuorumMismatchError, ServiceLostError
from jaxcomp.training._diloco_arguments import warn_eager_momentum

__all__ = ["FTState", "FaultTolerantDiLoCo", "diloco_ft"]

# magic, the sender's committed syncs, its inner steps; then the body
_HEADER = struct.Struct("<4sqq")
_MAGIC = b"jft1"
# A sync that the quorum drops this often in a row (workers dying or joining each time) fails.
_MAX_ATTEMPTS = 8
_QUORUM_METHODS = ("members", "commit", "put", "get", "reconnect")


class FTState(NamedTuple):
    """One worker's state of a :func:`diloco_ft` run (host-side counters, arrays on its devices)."""

    global_params: Any  # the params of the last committed sync: what params(state) returns
    local_params: Any  # this worker's params
    inner_state: Any  # inner_tx's state of this worker
    outer_state: Any  # outer_tx's state (the same on every member after a sync)
    step: int  # inner steps taken (a joining worker takes its peers' count)
    sync: int  # syncs committed: the index of the next one
    residual: Any = None  # with a codec: what it did not send yet (float32, the params' size)
    start: Any = None  # eager: the params this worker last restarted from


class _Exchange(NamedTuple):
    """What one attempt at a sync brought: the state to apply the average to, and the average."""

    global_params: Any
    outer_state: Any
    step: int
    average: np.ndarray  # float32, the flattened params' size
    trained: tuple  # the ranks whose pseudo-gradients are in the average


def _pack(sync: int, step: int, body: bytes) -> bytes:
    return _HEADER.pack(_MAGIC, sync, step) + body


def _unpack(blob: bytes, what: str) -> tuple[int, int, bytes]:
    if len(blob) < _HEADER.size or blob[:4] != _MAGIC:
        raise ValueError(f"{what} is not a diloco_ft payload ({len(blob)} bytes)")
    _, sync, step = _HEADER.unpack_from(blob)
    return sync, step, blob[_HEADER.size :]


def _tree_bytes(tree) -> bytes:
    """Every leaf's bytes, in ``jax.tree.leaves`` order (the hosts' byte order: little-endian on
    every platform JAX supports)."""
    return b"".join(np.ascontiguousarray(np.asarray(x)).tobytes() for x in jax.tree.leaves(tree))


def _tree_from_bytes(body: bytes, like):
    """The pytree of ``like``'s structure, shapes and dtypes whose leaves are ``body``."""
    leaves, treedef = jax.tree.flatten(like)
    out, offset = [], 0
    for x in leaves:
        x = np.asarray(x)
        out.append(np.frombuffer(body, x.dtype, x.size, offset).reshape(x.shape))
        offset += x.nbytes
    if offset != len(body):
        raise ValueError(f"state of {len(body)} bytes does not fit this run's {offset}")
    return treedef.unflatten([jnp.asarray(x) for x in out])


def _average(vectors) -> np.ndarray:
    """The mean of float32 vectors, summed in the given order: the same bits on every member."""
    vectors = iter(vectors)
    total, count = next(vectors).copy(), 1
    for vector in vectors:
        total += vector
        count += 1
    return total / np.float32(count)


class FaultTolerantDiLoCo:
    """The object :func:`diloco_ft` returns: ``init``, ``step`` and ``params`` (see the module's
    docstring for the sync)."""

    def __init__(
        self, loss_fn, inner_tx, outer_tx, quorum, sync_every, sync_timeout, service, codec,
        eager=False,
    ):  # fmt: skip
        self.loss_fn = loss_fn
        self.inner_tx = inner_tx
        self.outer_tx = outer_tx
        self.quorum = quorum
        self.sync_every = sync_every
        self.sync_timeout = sync_timeout
        self.service_timeout = service
        self.codec = codec
        self._inner = jax.jit(self._inner_step)
        self._delta = jax.jit(self._pseudo_gradient)
        self._encoded = jax.jit(self._encode)
        self._outer = jax.jit(self._outer_step)
        self._fresh = jax.jit(inner_tx.init)
        self._eager = EagerRounds(self) if eager else None

    def init(self, params) -> FTState:
        """The state of a worker that starts with ``params`` (every worker of a run passes the
        same; a restarted one takes its peers' at its first sync).

        Args:
          params: a pytree of float arrays.

        Returns:
          An :class:`FTState` with no step and no sync.
        """
        leaves = jax.tree.leaves(params)
        if not leaves or not all(jnp.issubdtype(jnp.result_type(x), jnp.floating) for x in leaves):
            raise ValueError("params must be a pytree with at least one leaf, all float arrays")
        params = jax.tree.map(jnp.asarray, params)
        return FTState(
            global_params=params,
            local_params=params,
            inner_state=self.inner_tx.init(params),
            outer_state=self.outer_tx.init(params),
            step=0,
            sync=0,
            residual=None if self.codec is None else jnp.zeros(_size(params), jnp.float32),
            start=params if self._eager else None,
        )

    def restore(self, path, params) -> FTState:
        """The state a worker saved with ``ocp.StandardCheckpointer().save(path, state)``, its
        counters included: a run whose workers all stopped resumes from their checkpoints (at
        the first sync, those behind the most advanced take its state, as a restarted worker).

        Args:
          path: the checkpoint directory.
          params: the params or their shapes (what :meth:`init` takes).

        Returns:
          The :class:`FTState`, bit for bit as saved.

        Example:
          >>> state = run.restore("/ckpt/worker2/sync40", params)  # doctest: +SKIP
        """
        import orbax.checkpoint as ocp

        target = jax.eval_shape(self.init, params)
        restored = ocp.StandardCheckpointer().restore(path, target)
        return restored._replace(step=int(restored.step), sync=int(restored.sync))

    def params(self, state: FTState):
        """The global params of ``state``: those of the last committed sync (eager: with the
        average in flight applied; it waits for it, so call it before closing the quorum).

        Args:
          state: the newest :class:`FTState` of this run.

        Returns:
          The params pytree.
        """
        return state.global_params if self._eager is None else self._eager.params(state)

    def step(self, state: FTState, batch):
        """One inner step on this worker's ``batch`` (jitted); after every ``sync_every``-th, the
        sync on the host (bounded; it raises ``QuorumError`` when the quorum cannot go on).

        Args:
          state: an :class:`FTState` of this run.
          batch: this worker's batch, what ``loss_fn`` takes.

        Returns:
          ``(state, metrics)``: ``loss`` (this worker's, before the step), ``synced``,
          ``members`` (how many in the sync's quorum), ``trained`` (the ranks averaged),
          ``joined`` (this worker took its peers' state), ``attempts``, ``reconnects`` (the
          service died and came back), ``bytes_sent`` (put into the store by this worker),
          ``exchange_seconds`` (the sync's) and ``waited`` (what this step waited for it). With
          ``eager``, a round reports the sync it applied: the one launched a round before.
        """
        local, inner_state, loss = self._inner(state.local_params, state.inner_state, batch)
        state = state._replace(local_params=local, inner_state=inner_state, step=state.step + 1)
        metrics = dict(synced=False, members=0, trained=(), joined=False, attempts=0)
        metrics.update(reconnects=0, bytes_sent=0, exchange_seconds=0.0, waited=0.0)
        if state.step % self.sync_every == 0:
            state, done = self._sync(state) if self._eager is None else self._eager.round(state)
            metrics.update(done)
        return state, {"loss": loss, **metrics}

    # -- the sync, on the host -----------------------------------------------------------------

    def _sync(self, state: FTState):
        """``(state, metrics)`` after the sync due now (the module's steps 1 to 5)."""
        started = time.monotonic()
        payload, residual = self._payload(
            state, self._delta(state.global_params, state.local_params)
        )
        sync, exchanged, done = self._attempts(state, payload)
        seconds = time.monotonic() - started
        done.update(synced=True, exchange_seconds=seconds, waited=seconds)
        return self._committed(state, sync, exchanged, residual), done

    def _attempts(self, state: FTState, payload: bytes):
        """``(sync, exchange, metrics)``: the sync of ``state`` with this worker's ``payload``
        (empty: nothing to add), redone until a quorum commits it (steps 1 to 4)."""
        quorum, sync, sent, lost = self.quorum, state.sync, 0, 0
        for attempt in range(1, _MAX_ATTEMPTS + 1):
            try:
                members = quorum.members(sync, timeout=self.sync_timeout)
                exchanged, bytes_sent, failure = self._exchange(sync, members, state, payload)
                sent += bytes_sent
                if not quorum.commit(sync):
                    continue  # the quorum changed: redo the sync with the new one
            except QuorumMismatchError as e:
                sync = max(sync, e.sync)  # a worker new to the quorum (maybe this one)
                continue
            except ServiceLostError:  # the service died: wait for it, and redo the sync
                quorum.reconnect(timeout=self.service_timeout)
                lost += 1
                continue
            if failure is not None:  # the quorum held, but this worker missed a payload
                raise QuorumError(
                    f"worker {quorum.rank}: sync {sync} committed without this worker's "
                    f"exchange: {failure}"
                ) from failure
            return (
                sync,
                exchanged,
                dict(
                    members=len(members),
                    trained=exchanged.trained,
                    joined=state.sync < sync,
                    attempts=attempt,
                    reconnects=lost,
                    bytes_sent=sent,
                ),
            )
        raise QuorumError(
            f"worker {quorum.rank}: sync {sync} did not commit in {_MAX_ATTEMPTS} attempts "
            "(workers kept dying or joining)"
        )

    def _exchange(self, sync, members, state: FTState, delta: bytes):
        """``(exchange or None, bytes put, error or None)``: steps 2 to 4 for quorum ``members``
        of ``sync``. A failed put or get is returned, not raised: the commit comes first."""
        quorum, behind = self.quorum, state.sync < sync
        own, sent = _pack(state.sync, state.step, b"" if behind else delta), 0
        try:
            quorum.put(f"delta/{quorum.rank}", own)
            sent = len(own)
            payloads = {
                m.worker: _unpack(quorum.get(f"delta/{m.worker}"), f"worker {m.worker}'s delta")
                for m in members
            }
            # up to date with a payload; an empty one (an eager joiner's first round) adds nothing
            trained = tuple(
                w for w in sorted(payloads) if payloads[w][0] == sync and payloads[w][2]
            )
            if not trained:
                raise QuorumError(f"no member of sync {sync} holds the run's state")
            base = state.global_params, state.outer_state, state.step
            if any(p[0] < sync for p in payloads.values()) and quorum.rank == trained[0]:
                blob = _pack(state.sync, state.step, _tree_bytes(base[:2]))
                quorum.put("state", blob)
                sent += len(blob)
            if behind:
                _, step, body = _unpack(quorum.get("state"), f"worker {trained[0]}'s state")
                base = (*_tree_from_bytes(body, base[:2]), step)
            average = _average(self._decode(payloads[w][2], base[0]) for w in trained)
            return _Exchange(*base, average, trained), sent, None
        except ServiceLostError:
            raise
        except (QuorumError, ValueError) as e:  # a get timed out, a put failed, foreign bytes
            return None, sent, e

    def _payload(self, state: FTState, delta):
        """``(bytes, residual)``: this worker's pseudo-gradient ``delta`` (float32, flat: where
        its params last restarted less its params) as it travels (float32, or the codec's payload
        of it plus the residual), and the residual it leaves."""
        if self.codec is None:
            return np.asarray(delta, "<f4").tobytes(), None
        codes, scales, residual = self._encoded(delta, state.residual)
        return self.codec.to_bytes(codes, scales), residual

    def _decode(self, body: bytes, like) -> np.ndarray:
        """A member's pseudo-gradient, float32, from the bytes it put."""
        if self.codec is None:
            return np.frombuffer(body, "<f4")
        return self.codec.decode(body, _size(like))

    def _committed(self, state: FTState, sync: int, exchanged: _Exchange, residual) -> FTState:
        """The state after committed sync ``sync``: the outer step, every worker restarted."""
        global_params, outer_state = self._outer(
            exchanged.global_params, exchanged.outer_state, exchanged.average
        )
        joined = state.sync < sync
        return FTState(
            global_params=global_params,
            local_params=global_params,
            inner_state=self._fresh(global_params) if joined else state.inner_state,
            outer_state=outer_state,
            step=exchanged.step,
            sync=sync + 1,
            residual=jnp.zeros_like(residual) if joined and residual is not None else residual,
        )

    # -- inside jit ----------------------------------------------------------------------------

    def _inner_step(self, local, inner_state, batch):
        loss, grads = jax.value_and_grad(self.loss_fn)(local, batch)
        updates, inner_state = self.inner_tx.update(grads, inner_state, local)
        return optax.apply_updates(local, updates), inner_state, loss

    def _pseudo_gradient(self, global_params, local):
        leaves = jax.tree.leaves(jax.tree.map(jnp.subtract, global_params, local))
        return jnp.concatenate([x.astype(jnp.float32).ravel() for x in leaves])

    def _encode(self, delta, residual):
        x = delta + residual
        codes, scales = self.codec.encode(x)
        return codes, scales, x - self.codec.decoded(codes, scales, x.size)

    def _outer_step(self, global_params, outer_state, average):
        leaves, treedef = jax.tree.flatten(global_params)
        ends = np.cumsum([x.size for x in leaves])
        pieces = [
            average[end - x.size : end].reshape(x.shape).astype(x.dtype)
            for x, end in zip(leaves, ends)
        ]
        updates, outer_state = self.outer_tx.update(
            treedef.unflatten(pieces), outer_state, global_params
        )
        return optax.apply_updates(global_params, updates), outer_state


def _size(params) -> int:
    return sum(int(np.size(x)) for x in jax.tree.leaves(params))


def _check_transformation(tx, name):
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(f"{name} must be an optax.GradientTransformation, got {type(tx).__name__}")
    return tx


def diloco_ft(
    loss_fn: Callable,
    inner_tx: optax.GradientTransformation | None = None,
    outer_tx: optax.GradientTransformation | None = None,
    *,
    quorum,
    sync_every: int,
    sync_timeout: float = 600.0,
    service_timeout: float = 300.0,
    codec=None,
    eager: bool = False,
) -> FaultTolerantDiLoCo:
    """DiLoCo for workers that may die: each worker a JAX program of its own, syncing through a
    :class:`jaxcomp.distributed.quorum.Quorum`; survivors go on, a restarted worker rejoins.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` on this worker's batch.
      inner_tx: each worker's optimizer (default: the DiLoCo paper's AdamW).
      outer_tx: the averaged pseudo-gradient's optimizer (default: Nesterov momentum; eager:
        plain averaging, ``optax.sgd(1.0)``).
      quorum: this worker's connected ``Quorum`` (its ``rank`` is the worker's).
      sync_every: H, the inner steps between two syncs.
      sync_timeout: seconds a sync's barrier waits for the other live workers: more than the
        slowest worker's ``sync_every`` inner steps (and a restarted worker's start-up).
      service_timeout: seconds a worker waits for the coordination service to be back when it
        died (restarted at the same address), before ``QuorumError``.
      codec: how pseudo-gradients travel, e.g. :class:`jaxcomp.distributed.ft_codecs.Int8`
        (with error feedback); default None: float32.
      eager: run each sync's exchange on a host thread beside the next ``sync_every`` inner
        steps and apply it one round late, each worker restarting with its own fresh progress
        in (:mod:`jaxcomp.distributed.diloco_ft_eager`; Kale et al., arXiv 2502.12996).

    Returns:
      A :class:`FaultTolerantDiLoCo`: ``init(params)``, ``step(state, batch)``, ``params``.

    Raises:
      ValueError, TypeError: a bad argument (nothing is sent).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxcomp.distributed.quorum import Quorum
      >>> quorum = Quorum("10.0.0.1:7733", rank, 4, failure_timeout=10)  # doctest: +SKIP
      >>> run = diloco_ft(lambda w, b: jnp.mean((b - w) ** 2), optax.sgd(0.1),
      ...                 quorum=quorum, sync_every=50)  # doctest: +SKIP
      >>> state = run.init(jnp.zeros(3))  # doctest: +SKIP
      >>> state, metrics = run.step(state, batch)  # doctest: +SKIP

    References:
      Douillard et al., "DiLoCo" (arXiv 2311.08105), Alg. 1; torchft's quorum, should_commit
      and healing (meta-pytorch/torchft, ``torchft/manager.py``, ``torchft/local_sgd.py``).
    """
    inner_tx, outer_tx = _optimizers(loss_fn, inner_tx, outer_tx, eager)
    _check_quorum(quorum, eager)
    sync_every = _checks.positive_int(sync_every, "sync_every")
    sync_timeout = _checks.positive_seconds(sync_timeout, "sync_timeout")
    service_timeout = _checks.positive_seconds(service_timeout, "service_timeout")
    methods = ("encode", "decoded", "to_bytes", "decode")
    if codec is not None and not all(callable(getattr(codec, m, None)) for m in methods):
        raise TypeError(
            f"codec must be a jaxcomp.distributed.ft_codecs codec (e.g. Int8()), got {codec!r}"
        )
    warn_eager_momentum(outer_tx, eager, "diloco_ft", stacklevel=3)
    return FaultTolerantDiLoCo(
        loss_fn, inner_tx, outer_tx, quorum, sync_every, sync_timeout, service_timeout, codec,
        eager,
    )  # fmt: skip


def _optimizers(loss_fn, inner_tx, outer_tx, eager):
    """``(inner_tx, outer_tx)``, the defaults where None (eager: plain averaging outside, as
    ``diloco``'s: momentum on an average a round late oscillates), after the type checks."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(eager, bool):
        raise TypeError(f"eager must be True or False, got {eager!r}")
    inner_tx = optax.adamw(4e-4, weight_decay=0.1) if inner_tx is None else inner_tx
    if outer_tx is None:
        outer_tx = optax.sgd(1.0) if eager else optax.sgd(0.7, momentum=0.9, nesterov=True)
    return _check_transformation(inner_tx, "inner_tx"), _check_transformation(outer_tx, "outer_tx")


def _check_quorum(quorum, eager: bool) -> None:
    missing = [m for m in _QUORUM_METHODS if not callable(getattr(quorum, m, None))]
    if missing or not isinstance(getattr(quorum, "rank", None), int):
        raise TypeError(
            f"quorum must be a connected jaxcomp.distributed.quorum.Quorum, got "
            f"{type(quorum).__name__}"
        )
    if eager and not isinstance(getattr(quorum, "num_workers", None), int):
        raise TypeError("eager=True needs the quorum's num_workers (a Quorum has it)")
