"""A rendezvous before ``jax.distributed``: every process checks in, or each one that did gets an
error.

``jax.distributed.initialize`` waits for a process that never starts for ``initialization_timeout``
seconds and then aborts every other process from C++ (no Python exception, exit code -6).
:func:`check_in` runs first, over its own TCP port: process 0 starts a small helper process (the
*rendezvous server*, :mod:`jaxcomp.distributed.rendezvous_server`) that listens there; every process
connects and says its id; once all have, each gets the go-ahead, else every process that did
start raises :class:`MissingProcessError` naming the ids that did not, within ``timeout``::

    from jaxcomp.distributed.rendezvous import check_in
    membership = check_in("10.0.0.1:7734", num_processes=2, process_id=pid, timeout=60)
    jax.distributed.initialize("10.0.0.1:7733", 2, pid)

(:func:`jaxcomp.distributed.launch.initialize` does both.) The connections stay open for the whole
job: when a process's connection drops without a clean goodbye (it was killed, or exited on an
error), the server tells every other process at once (:attr:`Membership.lost`, and an ``on_loss``
callback). With ``stall_timeout``, every process also pings the server about every second from a
helper thread; a process that sends nothing for ``stall_timeout`` seconds (stopped with SIGSTOP,
frozen with the GIL held, its host cut off) is declared *stalled* and the others are told
(:attr:`Membership.stalled`, an ``on_stall`` callback, :class:`PeerStalledError`).

**The port.** ``address`` is ``"HOST:PORT"``; HOST is process 0's host (the JAX coordinator's),
PORT any free port, by convention the coordinator's port + 1 (:func:`default_port`). The server
binds HOST's address when it is one of this machine's, else every interface.

**Hosting JAX's coordination service.** Normally process 0 runs JAX's coordination service, and
when process 0 dies the service dies with it and JAX aborts every other process at once
("Terminating process because the JAX distributed service detected fatal errors", SIGABRT).
``check_in(..., jax_service=JaxService(...))`` makes the rendezvous server host that service
instead, so it outlives process 0 (not process 0's host): the other processes then fail with a
Python exception. Process 0 must then call ``jax.distributed.initialize`` with
``coordinator_bind_address`` pointing at an unused port (:attr:`Membership.hosts_jax_service`
says whether the server hosts it); :func:`jaxcomp.distributed.launch.initialize` does this.

**Its log.** The server's messages and JAX's coordination service's go to the file named by
``JAXCOMP_RENDEZVOUS_LOG``, by default nowhere (not to process 0's stderr: a reader of that pipe
would wait for the server to exit as well).

**Wire format.** Lines of ASCII: ``HELLO <protocol> <num_processes> <process_id>`` from each
process; ``GO``, ``MISSING <ids>``, ``WAITING <ids>`` (the answer to ``STATUS``), ``LOST <ids>``,
``STALLED <id> <seconds>`` or ``ERROR <text>`` from the server; ``PING`` from a process, about
every second, and ``BYE`` from a process leaving normally.
"""

from __future__ import annotations

import os
import re
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from jaxcomp.distributed import _checks, rendezvous_server
from jaxcomp.distributed.rendezvous_server import (  # noqa: F401  (the documented names, here too)
    PROTOCOL,
    JaxService,
    serve,
    split_address,
)

# The rendezvous server's log (its stderr, and JAX's coordination service's messages) goes to the
# file this variable names; by default nowhere.
LOG_VARIABLE = "JAXCOMP_RENDEZVOUS_LOG"
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
                self._note_loss(_parse_ids(words[1:]), None)
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

    Process 0 first starts the rendezvous server on ``address`` (a helper process that lives until
    every process has left). Call it on every process before ``jax.distributed.initialize``.

    Args:
      address: ``"HOST:PORT"`` of the server: process 0's host, a free port (by convention the
        JAX coordinator's port + 1, :func:`default_port`).
      num_processes: processes in the job, ``>= 1``.
      process_id: this process's id in ``[0, num_processes)``.
      timeout: seconds, ``> 0``, from this call until every process must have checked in.
      jax_service: process 0 only: make the server host JAX's coordination service too.
      on_loss: called as ``on_loss(lost_ids, message)`` from a helper thread whenever processes
        leave the job without a goodbye after the rendezvous (the ids so far, sorted).
      stall_timeout: seconds, ``> 0``: this process pings the server about every second, and
        (process 0's server) a process silent this long is declared stalled. Give every process
        the same value (a process that does not ping looks stalled). None: no stall detection.
      on_stall: called as ``on_stall(stalled_ids, message)`` from a helper thread when a process
        is declared stalled (the ids so far, sorted).

    Returns:
      A :class:`Membership` (keep it: its connection tells the server this process is alive).

    Raises:
      MissingProcessError: (a ``TimeoutError``) a process did not check in within ``timeout``;
        its ``missing`` attribute and message name the ids. Process 0 never reached means it
        names process 0.
      ValueError: bad arguments, or processes that disagree on ``num_processes`` or share an id.
      OSError: process 0 cannot listen on ``address`` (the message says how to pick another port).

    Example:
      >>> from jaxcomp.distributed.rendezvous import check_in
      >>> membership = check_in("127.0.0.1:7734", 1, 0, timeout=10)  # doctest: +SKIP
      >>> membership.lost  # doctest: +SKIP
      ()

    References:
      JAX multi-process programming (``jax.distributed``); the rendezvous of PyTorch's elastic
      launcher (``torch.distributed.elastic.rendezvous``), which this follows in spirit.
    """
    host, port = split_address(address)
    _check_job(num_processes, process_id, timeout)
    if stall_timeout is not None:
        _checks.positive_seconds(stall_timeout, "stall_timeout")
    deadline = time.monotonic() + timeout
    server, hosts_service = None, False
    if process_id == 0:
        server, hosts_service = _start_server(
            host, port, num_processes, timeout, jax_service, deadline, stall_timeout
        )
    sock = _connect(host, port, deadline, address, num_processes, process_id, timeout)
    try:
        sock.sendall(f"HELLO {PROTOCOL} {num_processes} {process_id}\n".encode())
        reader = _LineReader(sock)
        line = reader.readline(deadline)
        if line is None and time.monotonic() >= deadline:  # ask the server who it still waits for
            sock.sendall(b"STATUS\n")
            line = reader.readline(time.monotonic() + _STATUS_SECONDS)
    except OSError as e:
        sock.close()
        raise MissingProcessError(
            f"process {process_id} of {num_processes}: lost the connection to the rendezvous "
            f"server at {address} "
            f"before every process checked in ({e}): process 0 died while starting",
            [0],
        ) from None
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
    words = (line or "").split(maxsplit=1)
    if words and words[0] in ("MISSING", "WAITING"):
        missing = _parse_ids(words[1:])
        raise MissingProcessError(
            f"process {process_id} of {num_processes}: process(es) "
            f"{', '.join(map(str, missing))} did not check in at the rendezvous on {address} "
            f"within {timeout:g} s: never started, died while starting, or cannot reach process "
            "0's host",
            missing,
        )
    if words and words[0] == "ERROR":
        raise ValueError(
            f"the rendezvous server at {address} refused process {process_id}: {words[1]}"
        )
    raise MissingProcessError(
        f"process {process_id} of {num_processes}: the rendezvous server at {address} "
        "(process 0) did not answer "
        f"within {timeout:g} s: process 0 died while starting",
        [0],
    )


def _check_job(num_processes, process_id, timeout) -> None:
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


_RUN_THIS_FILE = (
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def _start_server(host, port, num_processes, timeout, jax_service, deadline, stall_timeout=None):
    """Starts the rendezvous server as a helper process; returns (Popen, hosts_jax_service)."""
    # The server's file run as a script, not ``-m``: importing the package would import JAX
    # (seconds); and through runpy, so that the file's folder does not go first on sys.path.
    args = [
        sys.executable,
        "-c",
        _RUN_THIS_FILE,
        os.path.abspath(rendezvous_server.__file__),
        "serve",
        join_address(host, port),
        str(num_processes),
        # the server's deadline is process 0's: it answers the processes still waiting at about then
        repr(max(0.1, deadline - time.monotonic())),
    ]
    if stall_timeout is not None:
        args += ["--stall-timeout", repr(float(stall_timeout))]
    if jax_service is not None:
        args += [
            "--jax-service",
            jax_service.bind_address,
            str(jax_service.num_processes),
            str(int(jax_service.heartbeat_timeout)),
            str(int(jax_service.shutdown_timeout)),
            str(int(bool(jax_service.recoverable))),
        ]
    # Its own session: a Ctrl-C meant for the job does not take the server down before the others
    # leave. Not process 0's stderr: whoever reads that pipe would wait for the server to exit too.
    log = os.environ.get(LOG_VARIABLE)
    with open(log or os.devnull, "ab") as stderr:
        server = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,
        )
    reader = _LineReader(server.stdout)
    line = reader.readline(max(deadline, time.monotonic() + 30.0))  # jaxlib's import can be slow
    server.stdout.close()
    words = (line or "").split(maxsplit=1)
    if words and words[0] == "READY":
        hosts_service = words[1:] == ["jax-service"]
        if jax_service is not None and not hosts_service:
            print(
                "jaxcomp.distributed.rendezvous: the rendezvous server cannot host JAX's "
                "coordination service "
                f"({words[1] if len(words) > 1 else 'unknown reason'}); process 0 hosts it, as JAX "
                "does by default",
                file=sys.stderr,
                flush=True,
            )
        return server, hosts_service
    if server.poll() is None:
        server.kill()
    server.wait()
    why = words[1] if words and words[0] == "FAILED" else f"it exited with code {server.returncode}"
    raise OSError(
        f"process 0 cannot start the rendezvous server on {join_address(host, port)}: {why}. Pick "
        "another port (jaxcomp.distributed.launch: --rendezvous-port, rendezvous_port=, or "
        "JAXCOMP_RENDEZVOUS_PORT)"
    )


def _parse_ids(words):
    return sorted({int(t) for word in words for t in re.findall(r"\d+", word)})


class _LineReader:
    """Reads ``\\n``-terminated ASCII lines from a socket or a pipe, with an optional deadline."""

    def __init__(self, source):
        self.source = source
        self.buffer = b""

    def readline(self, deadline):
        """The next line without its newline; None at EOF or when ``deadline`` (monotonic)
        passes."""
        while b"\n" not in self.buffer:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                with selectors.DefaultSelector() as selector:
                    selector.register(self.source, selectors.EVENT_READ)
                    if not selector.select(left):
                        continue
            chunk = (
                self.source.recv(4096)
                if isinstance(self.source, socket.socket)
                else os.read(self.source.fileno(), 4096)
            )
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode("ascii", "replace").strip()


if __name__ == "__main__":  # the server, under the name it had before it got a file of its own
    sys.exit(rendezvous_server._main())
