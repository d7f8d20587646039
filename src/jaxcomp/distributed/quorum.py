"""A quorum per sync for workers that may die, on JAX's coordination service.

Each worker is a JAX program of its own (no job-wide ``jax.distributed`` client: no XLA program
spans workers) that reaches the service (:func:`host_service`, or the rendezvous server's helper)
through jaxlib's ``DistributedRuntimeClient`` alone, in a child process: the service's death is
a :class:`ServiceLostError` (then :meth:`Quorum.reconnect`), not the worker's. At each sync every
worker calls :meth:`Quorum.members`, a barrier among the live workers that returns the same sorted
``(worker, incarnation)`` list to each; they exchange bytes with :meth:`Quorum.put` and
:meth:`Quorum.get` under keys private to that quorum; :meth:`Quorum.commit` then tells every member
alike whether the sync counts (members and incarnations unchanged). Every wait is bounded.
docs/failures.md and docs/notes/2026-12-05-fault-tolerant-diloco.md explain the design.
"""

from __future__ import annotations

import hashlib
import math
from typing import NamedTuple

from jaxcomp.distributed import _checks
from jaxcomp.distributed._service_client import ClientProcess, ServiceGone, wait_listening
from jaxcomp.distributed.rendezvous_server import split_address

# The client methods the quorum calls (jaxlib 0.10's DistributedRuntimeClient).
_CLIENT_METHODS = (
    "connect shutdown get_live_nodes key_value_set key_value_set_bytes key_value_try_get "
    "blocking_key_value_get_bytes key_value_delete"
).split()


class Member(NamedTuple):
    """One live worker of a quorum.

    Attributes:
      worker: its rank in ``[0, num_workers)``.
      incarnation: the service's id of this run of it; a restarted worker gets a new one.
    """

    worker: int
    incarnation: int


class QuorumError(RuntimeError):
    """The coordination service refused a quorum call, or an earlier call left the quorum
    unusable."""


class QuorumTimeoutError(QuorumError, TimeoutError):
    """A bounded wait of the quorum ran out.

    Attributes:
      waiting_for: the workers (a barrier) or the key (a get) waited for.
    """

    def __init__(self, message: str, waiting_for):
        super().__init__(message)
        self.waiting_for = waiting_for


class QuorumMismatchError(QuorumError):
    """A worker joined the barrier (each worker's first barrier, a restarted one's), or was at
    another sync or phase: every member of that barrier gets this error.

    Attributes:
      sync: the largest sync any member of the barrier was at: call ``members(sync)`` again.
    """

    def __init__(self, message: str, sync: int):
        super().__init__(message)
        self.sync = sync


class ServiceLostError(QuorumError):
    """The coordination service is gone (it died, or its host did): every call of this quorum
    fails so until :meth:`Quorum.reconnect` reaches a service again. The worker's own state is
    intact (jaxlib's client ran in a process of its own)."""


def _runtime():
    """jaxlib's ``_jax``, checked for what the quorum calls: the one place that touches it."""
    from jaxlib import _jax

    client = getattr(_jax, "DistributedRuntimeClient", None)
    missing = ["get_distributed_runtime_client", "get_distributed_runtime_service"]
    missing = [f for f in missing if not hasattr(_jax, f)] + [
        f"DistributedRuntimeClient.{f}" for f in _CLIENT_METHODS if not hasattr(client, f)
    ]
    if missing:
        from importlib.metadata import version

        raise QuorumError(
            f"jaxcomp.distributed.quorum needs jaxlib's {', '.join(missing)}, which jax "
            f"{version('jax')} does not have (a jaxlib internal that moved; jaxcomp is tested "
            "with jax 0.10)"
        )
    return _jax


def _wait_listening(address, seconds) -> None:
    """Waits for ``address`` to accept TCP connections: jaxlib's ``connect`` aborts its process,
    with no Python error, when nothing is there."""
    if not wait_listening(split_address(address), seconds):
        raise QuorumError(f"no coordination service at {address} after {seconds:g} s")


def _whole_seconds(seconds: float) -> int:
    return max(1, math.ceil(seconds))


def host_service(bind_address: str, num_workers: int, failure_timeout: float = 60.0):
    """Hosts JAX's coordination service for ``num_workers`` workers in this process,
    recoverable (a worker that stops heartbeating is dropped, the others are not aborted), until
    ``shutdown()``. Host it where no worker runs (a launcher, the rendezvous server's helper):
    when it dies, every worker gets :class:`ServiceLostError` until one is back.

    Args:
      bind_address: ``"HOST:PORT"`` to listen on, e.g. ``"[::]:7733"``.
      num_workers: workers of the run (the ranks ``0 .. num_workers - 1``).
      failure_timeout: seconds without a heartbeat after which a worker is dead (rounded up).

    Returns:
      jaxlib's service object; call ``shutdown()`` on it to stop the service.

    Raises:
      ValueError: a bad argument (before anything starts).
      QuorumError: jaxlib lacks the service, or it could not start.

    Example:
      >>> service = host_service("[::]:7733", 4, failure_timeout=10)  # doctest: +SKIP
      >>> service.shutdown()  # doctest: +SKIP

    References:
      JAX, "Fault Tolerant Distributed JAX" (``jax_enable_recoverability``).
    """
    split_address(bind_address)
    _checks.positive_int(num_workers, "num_workers")
    failure_timeout = _checks.positive_seconds(failure_timeout, "failure_timeout")
    _jax = _runtime()
    try:
        return _jax.get_distributed_runtime_service(
            bind_address,
            num_workers,
            heartbeat_timeout=_whole_seconds(failure_timeout),
            shutdown_timeout=_whole_seconds(failure_timeout),
            recoverable=True,
        )
    except Exception as e:
        raise QuorumError(f"cannot host the coordination service on {bind_address}: {e}") from e


def quorum_id(sync: int, members) -> str:
    """The name of a quorum: the sync's index and a digest of its members and incarnations.

    Args:
      sync: the sync's index.
      members: the quorum's :class:`Member` list.

    Returns:
      ``"<sync>-<16 hex digits>"``; two quorums have the same id only if they have the same sync,
      workers and incarnations.

    Example:
      >>> quorum_id(3, [Member(0, 11), Member(2, 12)])
      '3-...'

    References:
      torchft's ``quorum_id`` (meta-pytorch/torchft, ``docs/source/protocol.rst``).
    """
    text = ",".join(f"{m.worker}:{m.incarnation}" for m in sorted(members))
    return f"{sync}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _workers(ids) -> str:
    """``"worker 1"``, ``"workers 1, 3"``."""
    ids = list(ids)
    return f"worker{'s' * (len(ids) != 1)} {', '.join(map(str, ids)) or 'none'}"


class Quorum:
    """This worker's client of the coordination service: membership per sync, a commit check and
    a key-value exchange among the members (see the module's docstring).

    Connects on construction, within ``failure_timeout``; :meth:`close` (or leaving a ``with``
    block) disconnects. After a barrier timed out, or the service died, every call raises
    :class:`QuorumError` until :meth:`reconnect` (jaxlib's calls cannot be cancelled).

    Args:
      address: the service's ``"HOST:PORT"``.
      rank: this worker's rank, in ``[0, num_workers)``.
      num_workers: workers of the run, as the service was told.
      failure_timeout: seconds: the connection's deadline, the heartbeat timeout, and the default
        wait of every call.
      prefix: the key-value store's directory for this run's keys.

    Raises:
      ValueError: a bad argument (before anything connects).
      QuorumError: the service cannot be reached in time, or jaxlib lacks the client.

    Example:
      >>> with Quorum("10.0.0.1:7733", 1, 4, failure_timeout=10) as q:  # doctest: +SKIP
      ...     members = q.members(sync=5)
      ...     q.put(f"delta/{q.rank}", payload)
      ...     others = [q.get(f"delta/{m.worker}") for m in members]
      ...     counts = q.commit(sync=5)

    References:
      torchft's Lighthouse and Manager (quorum per step, should_commit), meta-pytorch/torchft.
    """

    def __init__(
        self, address, rank, num_workers, failure_timeout=60.0, *, prefix="jaxcomp/quorum"
    ):
        split_address(address)
        self.num_workers = _checks.positive_int(num_workers, "num_workers")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_workers:
            raise ValueError(f"rank must be an integer in [0, {num_workers}), got {rank!r}")
        self.rank = rank
        self.failure_timeout = _checks.positive_seconds(failure_timeout, "failure_timeout")
        self.prefix = _checks.store_key(prefix, "prefix")
        self.address = address
        _runtime()
        self._client = None
        self._connect(self.failure_timeout)

    def _connect(self, seconds) -> None:
        """A new client (a new incarnation to the service) and a fresh quorum state."""
        self._broken = None  # why the quorum is unusable, once it is
        self._lost = False  # it is because the service is gone (ServiceLostError)
        self._current = None  # (sync, members) of the last members() call
        self._previous = None  # the members of the last barrier (members() or commit())
        self._own_keys = []  # (sync, full key) this worker put, deleted two syncs later
        _wait_listening(self.address, seconds)
        whole = _whole_seconds(self.failure_timeout)
        options = dict(init_timeout=_whole_seconds(seconds), heartbeat_timeout=whole)
        self._client = ClientProcess(
            self.address, self.rank, shutdown_on_destruction=False, **options
        )
        try:
            self._client.call("connect")
        except (ServiceGone, RuntimeError) as e:
            raise QuorumError(
                f"worker {self.rank} of {self.num_workers} cannot connect to the coordination "
                f"service at {self.address} within {_whole_seconds(seconds)} s: {e}"
            ) from e

    def reconnect(self, timeout: float | None = None) -> None:
        """Connects anew, e.g. after :class:`ServiceLostError` to the service restarted at the
        same address: a new incarnation to the others (its first barrier is a mismatch).

        Args:
          timeout: seconds to wait for the service to be back; default ``failure_timeout``.

        Raises:
          QuorumError: no service at the address within ``timeout``.

        Example:
          >>> quorum.reconnect(timeout=120)  # doctest: +SKIP
        """
        timeout = self._timeout(timeout)
        self.close()
        self._connect(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Disconnects from the service; the others' barriers drop this worker after
        ``failure_timeout``, as they drop a dead one."""
        client, self._client = self._client, None
        if client is not None:
            client.close()  # bounded; the child ends in any case
        self._broken = self._broken or "the quorum was closed"

    def _call(self, method, *args, timeout=None):
        if self._broken is not None:
            error = ServiceLostError if self._lost else QuorumError
            raise error(f"worker {self.rank}'s quorum is unusable: {self._broken}")
        try:
            return self._client.call(method, *args, timeout=timeout)
        except ServiceGone as e:
            self._broken = f"the coordination service at {self.address} is gone ({e})"
            self._lost = True
            raise ServiceLostError(f"worker {self.rank}: {self._broken}") from None
        except TimeoutError:
            raise
        except Exception as e:
            raise QuorumError(
                f"worker {self.rank}: the coordination service at {self.address} refused "
                f"{method}({', '.join(map(repr, args[:1]))}): {' '.join(str(e).split())[:300]}"
            ) from e

    def _try_get(self, key):
        """The string stored under ``key``, or None when there is none."""
        try:
            return self._call("key_value_try_get", key)
        except QuorumError as e:
            if "NOT_FOUND" in str(e):
                return None
            raise

    def _timeout(self, timeout) -> float:
        positive = _checks.positive_seconds
        return self.failure_timeout if timeout is None else positive(timeout, "timeout")

    def members(self, sync: int, timeout: float | None = None) -> tuple[Member, ...]:
        """The quorum of sync ``sync``: waits for every live worker to call this (not for one
        dead for ``failure_timeout``), and returns the same list to each.

        Args:
          sync: the sync's index, ``>= 0``; every member must pass the same.
          timeout: seconds to wait for the other live workers; default ``failure_timeout``. Give
            more when the others may still be computing (a restarted worker waits for the
            survivors' inner steps).

        Returns:
          The live workers as :class:`Member` tuples, sorted by rank (this worker among them).

        Raises:
          ValueError: a bad argument.
          QuorumMismatchError: a worker joined (always at a worker's first call), or was at another
            sync or phase: every member gets it; call ``members(error.sync)`` again.
          QuorumTimeoutError: a live worker did not come within ``timeout`` (names it); the
            quorum is then unusable.
          QuorumError: the service failed the call.

        Example:
          >>> quorum.members(sync=5)  # doctest: +SKIP
          (Member(worker=0, incarnation=...), Member(worker=1, incarnation=...), ...)

        References:
          JAX's ``multihost_utils.live_devices`` (the same barrier, ``get_live_nodes``).
        """
        sync = _checks.nonnegative_int(sync, "sync")
        members = self._barrier(sync, "members", self._timeout(timeout))
        self._current = (sync, members)
        self._forget_before(sync - 1)
        return members

    def commit(self, sync: int, timeout: float | None = None) -> bool:
        """Whether sync ``sync`` counts: a second barrier, True on every member alike iff the
        members and their incarnations are those :meth:`members` returned for it.

        Call it on every member after the exchange, also when a get timed out.

        Args:
          sync: the sync passed to the last :meth:`members` call.
          timeout: seconds to wait for the other live members; default ``failure_timeout``.

        Returns:
          True when nobody died, restarted or joined since :meth:`members`; False otherwise (then
          every member drops the sync and calls ``members(sync)`` again).

        Raises:
          ValueError: ``sync`` is not that of the last :meth:`members` call.
          QuorumTimeoutError: a live member did not come within ``timeout``.
          QuorumError: the service failed the call.

        Example:
          >>> quorum.commit(sync=5)  # doctest: +SKIP
          True

        References:
          torchft's ``should_commit`` (meta-pytorch/torchft, ``torchft/manager.py``).
        """
        sync = _checks.nonnegative_int(sync, "sync")
        if self._current is None or self._current[0] != sync:
            last = None if self._current is None else self._current[0]
            raise ValueError(f"commit({sync}) needs members({sync}) first; the last was {last}")
        try:
            members = self._barrier(sync, "commit", self._timeout(timeout))
        except QuorumMismatchError:
            return False  # a worker out of step is a new member: the sync does not count
        return members == self._current[1]

    def put(self, key: str, value: bytes) -> None:
        """Stores ``value`` under ``key`` for the other members of the current quorum.

        Args:
          key: a name unique within the quorum, e.g. ``f"delta/{rank}"``.
          value: the bytes.

        Raises:
          ValueError: a bad key, or no :meth:`members` call yet.
          TypeError: ``value`` is not bytes-like.
          QuorumError: the service refused it (the key was already put in this quorum).

        Example:
          >>> quorum.put(f"delta/{quorum.rank}", payload)  # doctest: +SKIP

        References:
          JAX's coordination service key-value store (``key_value_set_bytes``).
        """
        full = self._data_key(_checks.store_key(key, "key"), "put")
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError(f"value must be bytes-like, got {type(value).__name__}")
        try:
            self._call("key_value_set_bytes", full, bytes(value), False)
        except QuorumError as e:
            if "ALREADY_EXISTS" not in str(e):
                raise
            raise QuorumError(f"worker {self.rank}: {key!r} was already put in this quorum") from e
        self._own_keys.append((self._current[0], full))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The bytes a member of the current quorum put under ``key``, waiting for them.

        Args:
          key: the name the member put.
          timeout: seconds to wait; default ``failure_timeout``.

        Returns:
          The bytes.

        Raises:
          ValueError: a bad key or timeout, or no :meth:`members` call yet.
          QuorumTimeoutError: nobody put ``key`` within ``timeout``; the quorum stays usable.
          QuorumError: the service failed the call.

        Example:
          >>> quorum.get("delta/2", timeout=10)  # doctest: +SKIP
          b'...'

        References:
          JAX's coordination service key-value store (``blocking_key_value_get_bytes``).
        """
        full = self._data_key(_checks.store_key(key, "key"), "get")
        timeout = self._timeout(timeout)
        sync, members = self._current
        try:
            return self._call("blocking_key_value_get_bytes", full, max(1, round(timeout * 1e3)))
        except QuorumError as e:
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
            raise QuorumTimeoutError(
                f"worker {self.rank}: no member put {key!r} within {timeout:g} s (quorum of sync "
                f"{sync}: {_workers(m.worker for m in members)})",
                key,
            ) from None

    def _data_key(self, key, what) -> str:
        if self._current is None:
            raise ValueError(f"{what}({key!r}) needs a quorum: call members(sync) first")
        return f"{self.prefix}/data/{quorum_id(*self._current)}/{key}"

    def _barrier(self, sync, phase, timeout) -> tuple[Member, ...]:
        """Announces ``(sync, phase)``, waits at the service's live-nodes barrier, and checks
        that every member was at this worker's previous barrier and announced the same."""
        self._call("key_value_set", f"{self.prefix}/round/{self.rank}/{sync}/{phase}", "1", True)
        self._call("key_value_set", f"{self.prefix}/at/{self.rank}", str(sync), True)
        live = self._live(sync, phase, timeout)
        members = tuple(sorted(Member(int(w), int(i)) for w, i in live.items()))
        # The same on every member: members in step saw the same previous barriers, and keys
        # are written before the barrier. A newcomer (a worker's first barrier) is out of step.
        previous, self._previous = self._previous, members
        known = [m for m in previous or () if self._announced(m.worker, sync, phase)]
        astray = [m.worker for m in members if m not in known]
        if astray:
            at = [self._try_get(f"{self.prefix}/at/{m.worker}") for m in members]
            latest = max([sync] + [int(s) for s in at if s is not None and s.isdigit()])
            raise QuorumMismatchError(
                f"worker {self.rank}: {_workers(astray)} came to sync {sync}'s {phase} barrier "
                f"new (a first call, a restart) or from another step; call members({latest})",
                latest,
            )
        return members

    def _announced(self, worker, sync, phase) -> bool:
        return self._try_get(f"{self.prefix}/round/{worker}/{sync}/{phase}") is not None

    def _live(self, sync, phase, timeout) -> dict:
        """jaxlib's live-nodes barrier, bounded: it has no timeout of its own."""
        try:
            return self._call("get_live_nodes", list(range(self.num_workers)), timeout=timeout)
        except TimeoutError:
            others = (w for w in range(self.num_workers) if w != self.rank)
            absent = tuple(w for w in others if not self._announced(w, sync, phase))
            self._broken = f"its sync {sync} {phase} barrier timed out after {timeout:g} s"
            raise QuorumTimeoutError(
                f"worker {self.rank}: {_workers(absent)} did not reach sync {sync}'s "
                f"{phase} barrier within {timeout:g} s (alive but busy or stopped; a dead one "
                f"is dropped after failure_timeout = {self.failure_timeout:g} s)",
                absent,
            ) from None

    def _forget_before(self, sync) -> None:
        """Deletes this worker's keys of syncs before ``sync`` (best effort: storage only)."""
        old = [key for key_sync, key in self._own_keys if key_sync < sync]
        self._own_keys = [(k_sync, key) for k_sync, key in self._own_keys if k_sync >= sync]
        if sync >= 1:  # the announcements of sync - 1 (a directory)
            old.append(f"{self.prefix}/round/{self.rank}/{sync - 1}")
        for key in old:
            try:
                self._call("key_value_delete", key)
            except QuorumError:
                pass
