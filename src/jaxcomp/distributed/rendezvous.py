"""A rendezvous before ``jax.distributed``: every process checks in, or each one that did gets an
error.

``jax.distributed.initialize`` waits for a process that never starts for ``initialization_timeout``
seconds and then aborts every other process from C++ (no Python exception). :func:`check_in` runs
first, over its own TCP port: process 0 starts a small helper process (the *rendezvous server*,
:mod:`jaxcomp.distributed.rendezvous_server`) that listens there; every process connects and says
its id; once all have, each gets the go-ahead, else every process that did start raises
:class:`MissingProcessError` naming the ids that did not, within ``timeout``::

    from jaxcomp.distributed.rendezvous import check_in
    membership = check_in("10.0.0.1:7734", num_processes=2, process_id=pid, timeout=60)
    jax.distributed.initialize("10.0.0.1:7733", 2, pid)

(:func:`jaxcomp.distributed.launch.initialize` does both.) The connections stay open for the whole
job: a process that leaves without a goodbye is reported to the others (:attr:`Membership.lost`,
``on_loss``), and with ``stall_timeout`` one that sends nothing for that long is declared stalled
(:attr:`Membership.stalled`, ``on_stall``, :class:`PeerStalledError`). The address is process 0's
host and a free port, by convention the coordinator's port + 1 (:func:`default_port`);
``check_in(..., jax_service=JaxService(...))`` makes the server host JAX's coordination service,
so that it outlives process 0. The server's log goes to the file ``JAXCOMP_RENDEZVOUS_LOG`` names
(default: nowhere); the wire format is in :mod:`jaxcomp.distributed._wire`. docs/training.md
("When a process dies, never starts or stalls") explains the mechanics.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Callable

from jaxcomp.distributed import _checks, rendezvous_server
from jaxcomp.distributed._server_process import LOG_VARIABLE, start_server  # noqa: F401
from jaxcomp.distributed._wire import LineReader, parse_ids
from jaxcomp.distributed.rendezvous_server import (  # noqa: F401  (the documented names, here too)
    PROTOCOL,
    JaxService,
    serve,
    split_address,
)

# How long a process waits for the server's answer to STATUS once its own deadline has passed.
_STATUS_SECONDS = 2.0
# Seconds between a process's pings (at most a quarter of the stall timeout).
_PING_SECONDS = 1.0


class MissingProcessError(TimeoutError):
    """Some processes of the job did not check in at the rendezvous in time.

    Attributes:
      missing: the ids of the processes that did not check in, sorted.
    """

    def __init__(self, message: str, missing):
        super().__init__(message)
        self.missing = tuple(sorted(missing))


class PeerLostError(RuntimeError):
    """A process of the job left it without a clean goodbye (killed, or exited on an error).

    Attributes:
      lost: the ids of the processes lost so far, sorted.
    """

    def __init__(self, message: str, lost):
        super().__init__(message)
        self.lost = tuple(sorted(lost))


class PeerStalledError(PeerLostError):
    """A process of the job stopped responding: it sent nothing to the rendezvous server for the
    stall timeout (stopped with SIGSTOP, frozen, or its host cut off), without leaving.

    Attributes:
      lost: the ids of the processes lost or stalled so far, sorted.
    """


def default_port(coordinator: str) -> int:
    """The rendezvous port used when none is given: the JAX coordinator's port + 1.

    Args:
      coordinator: the JAX coordinator's ``"HOST:PORT"``.

    Returns:
      The port.

    Example:
      >>> default_port("10.0.0.1:7733")
      7734

    References:
      JAX multi-process programming (``jax.distributed.initialize``'s ``coordinator_address``).
    """
    port = split_address(coordinator)[1]
    if port == 65535:
        raise ValueError(
            f"coordinator {coordinator!r} uses port 65535: give the rendezvous port explicitly"
        )
    return port + 1


def join_address(host: str, port: int) -> str:
    """``(host, port)`` as ``"HOST:PORT"``, bracketing an IPv6 host.

    Args:
      host: a host name or address.
      port: a port.

    Returns:
      The address.

    Example:
      >>> join_address("::1", 7734)
      '[::1]:7734'

    References:
      RFC 3986 section 3.2.2.
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Membership:
    """This process's place in the job, after :func:`check_in`: the connection to the server stays
    open.

    Attributes:
      address: the rendezvous server's ``"HOST:PORT"``.
      num_processes, process_id: as given to :func:`check_in`.
      hosts_jax_service: True when the server hosts JAX's coordination service (process 0 then
        binds its own, unused, elsewhere).
    """

    def __init__(
        self,
        sock,
        reader,
        address,
        num_processes,
        process_id,
        hosts_jax_service,
        on_loss,
        server,
        stall_timeout=None,
        on_stall=None,
    ):
        self.address = address
        self.num_processes = num_processes
        self.process_id = process_id
        self.hosts_jax_service = hosts_jax_service
        self._sock = sock
        self._reader = reader
        self._on_loss = on_loss
        self._lost: set[int] = set()
        self._stalled: dict[int, float] = {}  # id -> seconds of silence when declared stalled
        self._on_stall = on_stall
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._leaving = False
        self._server = server  # process 0: the server's Popen (kept so it is not reaped as garbage)
        self._watch = threading.Thread(
            target=self._watch_loop, name="jaxcomp-rendezvous-watch", daemon=True
        )
        self._watch.start()
        if stall_timeout is not None:
            threading.Thread(
                target=self._ping_loop,
                args=(min(_PING_SECONDS, stall_timeout / 4),),
                name="jaxcomp-rendezvous-ping",
                daemon=True,
            ).start()

    @property
    def lost(self) -> tuple[int, ...]:
        """The ids of the processes that left without a goodbye so far (sorted)."""
        with self._lock:
            return tuple(sorted(self._lost))

    @property
    def stalled(self) -> tuple[int, ...]:
        """The ids of the processes declared stalled so far (sorted): silent, but still
        connected."""
        with self._lock:
            return tuple(sorted(self._stalled))

    def raise_if_lost(self) -> None:
        """Raises :class:`PeerLostError` when a process was lost, else :class:`PeerStalledError`
        when one stalled."""
        lost, stalled = self.lost, self.stalled
        if lost:
            raise PeerLostError(_lost_message(lost, self.process_id, self.num_processes), lost)
        if stalled:
            with self._lock:
                seconds = max(self._stalled.values())
            raise PeerStalledError(
                _stalled_message(stalled, seconds, self.process_id, self.num_processes), stalled
            )

    def leaving(self) -> None:
        """Tells the server this process is leaving normally (its connection may close any moment).

        The connection itself stays open until the process exits; call :meth:`close` to close it.
        """
        with self._lock:
            if self._leaving:
                return
            self._leaving = True
        self._send(b"BYE\n")

    def _send(self, data) -> bool:
        try:
            with self._send_lock:
                self._sock.sendall(data)
            return True
        except OSError:
            return False

    def _ping_loop(self, interval):
        while True:
            time.sleep(interval)
            with self._lock:
                if self._leaving:
                    return
            if not self._send(b"PING\n"):
                return

    def close(self) -> None:
        """Says goodbye and closes the connection. With a hosted JAX service, do it only after
        ``jax.distributed.shutdown()``: the server stops the service once every process is gone."""
        self.leaving()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _watch_loop(self):
        while True:
            try:
                line = self._reader.readline(None)
            except OSError:
                line = None
            with self._lock:
                leaving = self._leaving
            if (
                line is None
            ):  # the server is gone: it lives as long as any process does, so process 0 went
                if leaving:
                    return
                self._note_loss(
                    [0], "the rendezvous server (process 0's helper) closed the connection"
                )
                return
            words = line.split()
            if words and words[0] == "LOST":
                self._note_loss(parse_ids(words[1:]), None)
            elif len(words) == 3 and words[0] == "STALLED":
                self._note_stall(int(words[1]), float(words[2]))

    def _note_loss(self, ids, why):
        with self._lock:
            new = set(ids) - self._lost - {self.process_id}
            self._lost |= new
            lost = tuple(sorted(self._lost))
        if new and self._on_loss is not None:
            message = _lost_message(lost, self.process_id, self.num_processes)
            if why:
                message += f" ({why})"
            self._on_loss(lost, message)

    def _note_stall(self, stalled_id, seconds):
        with self._lock:
            new = stalled_id not in self._stalled and stalled_id != self.process_id
            self._stalled.setdefault(stalled_id, seconds)
            stalled = tuple(sorted(self._stalled))
        if new and self._on_stall is not None:
            self._on_stall(
                stalled, _stalled_message(stalled, seconds, self.process_id, self.num_processes)
            )


def _stalled_message(stalled, seconds, process_id, num_processes):
    return (
        f"process {process_id} of {num_processes}: process(es) {', '.join(map(str, stalled))} "
        f"stopped responding (no sign of life for {seconds:.0f} s: stopped, e.g. SIGSTOP, frozen, "
        "or its host is cut off)"
    )


def _lost_message(lost, process_id, num_processes):
    return (
        f"process {process_id} of {num_processes}: process(es) {', '.join(map(str, lost))} left "
        "the job without a clean goodbye (killed, crashed, or exited on an error)"
    )


def check_in(
    address: str,
    num_processes: int,
    process_id: int,
    timeout: float = 60.0,
    *,
    jax_service: JaxService | None = None,
    on_loss: Callable[[tuple, str], None] | None = None,
    stall_timeout: float | None = None,
    on_stall: Callable[[tuple, str], None] | None = None,
) -> Membership:
    """Waits until every process of the job has checked in; raises naming the ones that did not.

    Call it on every process before ``jax.distributed.initialize``; process 0 first starts the
    rendezvous server on ``address`` (a helper process that lives until every process has left).

    Args:
      address: ``"HOST:PORT"`` of the server: process 0's host, a free port (by convention the
        JAX coordinator's port + 1, :func:`default_port`).
      num_processes: processes in the job, ``>= 1``.
      process_id: this process's id in ``[0, num_processes)``.
      timeout: seconds, ``> 0``, from this call until every process must have checked in.
      jax_service: process 0 only: make the server host JAX's coordination service too.
      on_loss: called as ``on_loss(lost_ids, message)`` from a helper thread whenever processes
        leave the job without a goodbye after the rendezvous (the ids so far, sorted).
      stall_timeout: seconds, ``> 0``, the same on every process: this process pings the server
        about every second, and a process silent this long is stalled. None: no stall detection.
      on_stall: called as ``on_stall(stalled_ids, message)`` from a helper thread when a process
        is declared stalled (the ids so far, sorted).

    Returns:
      A :class:`Membership` (keep it: its connection tells the server this process is alive).

    Raises:
      MissingProcessError: (a ``TimeoutError``) a process did not check in within ``timeout``;
        its ``missing`` attribute and message name the ids (process 0 if it was never reached).
      ValueError: bad arguments, or processes that disagree on ``num_processes`` or share an id.
      OSError: process 0 cannot listen on ``address`` (the message says how to pick another port).

    Example:
      >>> from jaxcomp.distributed.rendezvous import check_in
      >>> membership = check_in("127.0.0.1:7734", 1, 0, timeout=10)  # doctest: +SKIP

    References:
      JAX multi-process programming (``jax.distributed``); the rendezvous of PyTorch's elastic
      launcher (``torch.distributed.elastic.rendezvous``), which this follows in spirit.
    """
    host, port = split_address(address)
    _check_job(num_processes, process_id, timeout, stall_timeout)
    deadline = time.monotonic() + timeout
    server, hosts_service = None, False
    if process_id == 0:
        server, hosts_service = start_server(
            join_address(host, port), num_processes, jax_service, deadline, stall_timeout
        )
    sock = _connect(host, port, deadline, address, num_processes, process_id, timeout)
    who = f"process {process_id} of {num_processes}"
    reader, line = _hello(sock, deadline, f"{num_processes} {process_id}", who, address)
    if line == "GO":
        return Membership(
            sock,
            reader,
            address,
            num_processes,
            process_id,
            hosts_service,
            on_loss,
            server,
            stall_timeout,
            on_stall,
        )
    sock.close()
    raise _refusal(line, who, address, process_id, timeout)


def _hello(sock, deadline, job, who, address):
    """Says hello (``job``: ``"<num_processes> <process_id>"``): ``(reader, the server's answer)``,
    the answer None when the server said nothing in time."""
    try:
        sock.sendall(f"HELLO {PROTOCOL} {job}\n".encode())
        reader = LineReader(sock)
        line = reader.readline(deadline)
        if line is None and time.monotonic() >= deadline:  # ask the server who it still waits for
            sock.sendall(b"STATUS\n")
            line = reader.readline(time.monotonic() + _STATUS_SECONDS)
    except OSError as e:
        sock.close()
        raise MissingProcessError(
            f"{who}: lost the connection to the rendezvous server at {address} before every "
            f"process checked in ({e}): process 0 died while starting",
            [0],
        ) from None
    return reader, line


def _refusal(line, who, address, process_id, timeout) -> Exception:
    """The error for the server's answer ``line`` other than ``GO`` (None: no answer)."""
    words = (line or "").split(maxsplit=1)
    if words and words[0] in ("MISSING", "WAITING"):
        missing = parse_ids(words[1:])
        return MissingProcessError(
            f"{who}: process(es) {', '.join(map(str, missing))} did not check in at the "
            f"rendezvous on {address} within {timeout:g} s: never started, died while starting, "
            "or cannot reach process 0's host",
            missing,
        )
    if words and words[0] == "ERROR":
        return ValueError(
            f"the rendezvous server at {address} refused process {process_id}: {words[1]}"
        )
    return MissingProcessError(
        f"{who}: the rendezvous server at {address} (process 0) did not answer within "
        f"{timeout:g} s: process 0 died while starting",
        [0],
    )


def _check_job(num_processes, process_id, timeout, stall_timeout) -> None:
    """:func:`check_in`'s numbers, checked: a ValueError names the argument."""
    _checks.positive_int(num_processes, "num_processes")
    if (
        isinstance(process_id, bool)
        or not isinstance(process_id, int)
        or not 0 <= process_id < num_processes
    ):
        raise ValueError(
            f"process_id must be an integer in [0, {num_processes}), got {process_id!r}"
        )
    _checks.positive_seconds(timeout, "timeout")
    if stall_timeout is not None:
        _checks.positive_seconds(stall_timeout, "stall_timeout")


def _connect(host, port, deadline, address, num_processes, process_id, timeout):
    error = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise MissingProcessError(
                f"process {process_id} of {num_processes}: process 0 did not open the rendezvous "
                f"on {address} within {timeout:g} s ({error}): it never started, died while "
                "starting, or is not reachable from this host",
                [0],
            )
        try:
            sock = socket.create_connection((host, port), timeout=min(left, 5.0))
            sock.settimeout(None)
            return sock
        except (
            OSError
        ) as e:  # refused (not listening yet), unreachable, timed out: retry until the deadline
            error = e
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


if __name__ == "__main__":  # the server, under the name it had before it got a file of its own
    sys.exit(rendezvous_server._main())
