r"""The rendezvous server: the helper process that process 0 of a job starts (:mod:`.rendezvous`).

    python jaxcomp/distributed/rendezvous_server.py serve HOST:PORT N TIMEOUT \
        [--stall-timeout S] [--jax-service ...]

It listens on ``HOST:PORT``, answers every process's ``HELLO`` with ``GO`` once all have checked
in (or ``MISSING <ids>`` at the deadline), tells the others ``LOST <id>`` when a process leaves
without a ``BYE`` and ``STALLED <id> <seconds>`` when a process sent nothing (``PING`` lines
included) for ``--stall-timeout`` seconds, and can host JAX's coordination service for the job's
lifetime, so that it outlives process 0. The wire format is in :mod:`._wire`.

This file is run as a script (process 0 starts it by path, not as ``-m``): it imports nothing
from jaxcomp, so that the server starts without importing the package and JAX.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import selectors
import socket
import sys
import time
from collections.abc import Callable

PROTOCOL = "jaxcomp-rendezvous-1"
# The server's messages: warnings, which reach its stderr (the log file) without configuration.
_LOG = logging.getLogger("jaxcomp.distributed")
# How long the server lingers after a process was lost, for the others to leave (they normally
# leave within seconds: their next collective fails).
_LINGER_MARGIN_SECONDS = 10.0
# How often the server looks for stalled processes (when it has a stall timeout).
_STALL_CHECK_SECONDS = 0.25


@dataclasses.dataclass(frozen=True)
class JaxService:
    """JAX's coordination service, hosted by the rendezvous server (see the module's docstring).

    Attributes:
      bind_address: ``"HOST:PORT"`` it listens on, e.g. ``"[::]:7733"`` (what
        ``jax.distributed.initialize`` binds by default for coordinator port 7733).
      num_processes: tasks in the job.
      heartbeat_timeout: seconds without a heartbeat after which a task is declared dead.
      shutdown_timeout: seconds the exit-time barrier waits.
      recoverable: JAX's ``jax_enable_recoverability``. With it, the service does not abort
        the other tasks when one stops heartbeating (their error poller would otherwise end them
        with SIGABRT); :func:`jaxcomp.distributed.launch.initialize` sets it.
    """

    bind_address: str
    num_processes: int
    heartbeat_timeout: int = 100
    shutdown_timeout: int = 300
    recoverable: bool = False


def split_address(address: str) -> tuple[str, int]:
    """``"HOST:PORT"`` (or ``"[IPv6]:PORT"``) as ``(host, port)``, checked.

    Args:
      address: the address.

    Returns:
      ``(host, port)`` with the brackets of an IPv6 host removed.

    Example:
      >>> split_address("10.0.0.1:7733")
      ('10.0.0.1', 7733)
      >>> split_address("[::1]:7733")
      ('::1', 7733)

    References:
      RFC 3986 section 3.2 (host and port syntax).
    """
    match = re.fullmatch(r"\[([0-9a-fA-F:.]+)\]:(\d{1,5})|([^\s:\[\]]+):(\d{1,5})", str(address))
    if not match:
        raise ValueError(f"address must be 'HOST:PORT', got {address!r}")
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    if not 0 < port < 65536:
        raise ValueError(f"the port of address {address!r} must be in [1, 65535]")
    return host, port


def serve(
    address: str,
    num_processes: int,
    timeout: float,
    jax_service: JaxService | None = None,
    ready: Callable[[str], None] | None = None,
    stall_timeout: float | None = None,
) -> int:
    """Runs the rendezvous server until every process has left (what process 0's helper runs).

    Args:
      address: ``"HOST:PORT"`` to listen on.
      num_processes: processes in the job.
      timeout: seconds until every process must have checked in.
      jax_service: also host JAX's coordination service for the job's lifetime.
      ready: called with ``"READY"`` once listening (``"READY jax-service"`` when hosting the
        service, ``"READY <why not>"`` when asked to and unable), or ``"FAILED <why>"``.
      stall_timeout: seconds after which a process that sent nothing (every process's
        :class:`~jaxcomp.distributed.rendezvous.Membership` pings about every second) is declared
        stalled, and the others are told ``STALLED <id> <seconds>``; None: never.

    Returns:
      0 when every process checked in, 1 when some did not.

    Example:
      >>> import threading
      >>> from jaxcomp.distributed.rendezvous import serve
      >>> threading.Thread(target=serve, args=("127.0.0.1:7734", 1, 10.0)).start()  # doctest: +SKIP

    References:
      Python's ``selectors`` module (one thread multiplexes every connection).
    """
    ready = ready or (lambda line: None)
    host, port = split_address(address)
    try:
        listener = _listen(host, port, num_processes)
    except OSError as e:
        ready(f"FAILED cannot listen on {address}: {e.strerror or e}")
        return 1
    service, hosted = None, ""
    if jax_service is not None:
        try:
            from jaxlib import _jax

            service = _jax.get_distributed_runtime_service(
                jax_service.bind_address,
                jax_service.num_processes,
                heartbeat_timeout=jax_service.heartbeat_timeout,
                shutdown_timeout=jax_service.shutdown_timeout,
                recoverable=jax_service.recoverable,
            )
            hosted = " jax-service"
        except Exception as e:  # not hosted: process 0 hosts it itself, as JAX normally does
            hosted = " " + " ".join(f"{type(e).__name__}: {e}".split())
    ready("READY" + hosted)
    try:
        return _Server(listener, num_processes, timeout, stall_timeout).run()
    finally:
        listener.close()
        if service is not None:
            service.shutdown()


def _listen(host, port, backlog):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for bind_host in (host, "::" if family == socket.AF_INET6 else ""):
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((bind_host, port))
        except OSError as e:
            listener.close()
            # HOST is not one of this machine's addresses (a NAT, a name for another interface):
            # listen on every interface instead. Any other error (port in use) is final.
            if e.errno in (99, 49, -2, -3, -5) or isinstance(
                e, socket.gaierror
            ):  # EADDRNOTAVAIL, resolve errors
                continue
            raise
        listener.listen(max(16, backlog))
        listener.setblocking(False)
        return listener
    raise OSError(99, f"cannot bind {host} nor every interface")


class _Server:
    def __init__(self, listener, num_processes, timeout, stall_timeout=None):
        self.listener = listener
        self.num_processes = num_processes
        self.deadline = time.monotonic() + timeout
        self.linger = timeout + _LINGER_MARGIN_SECONDS
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ)
        self.peers = {}  # socket -> {"id": int | None, "buffer": bytes, "bye": bool}
        self.members = {}  # process id -> socket
        self.ever = set()  # ids that checked in at some point
        self.started = False
        # After a loss, without a stall timeout: stop waiting for the others to leave at this time.
        # With one, the server (and JAX's service) stays while any process still pings: a
        # survivor on its way out must not lose the service (its JAX client would abort).
        self.give_up_at = None
        self.stall_timeout = stall_timeout
        self.heard = {}  # process id -> when it last sent anything (monotonic)
        self.stalled = set()  # ids declared stalled (told to the others once)

    def run(self):
        while True:
            now = time.monotonic()
            if not self.started and now >= self.deadline:
                missing = self.missing()
                self.broadcast(f"MISSING {','.join(map(str, missing))}\n")
                _LOG.warning(
                    "jaxcomp.distributed.rendezvous: process(es) %s of %s did not check in in time",
                    ", ".join(map(str, missing)),
                    self.num_processes,
                )
                return 1
            if self.started and not set(self.members) - self.stalled:
                return 0
            if self.give_up_at is not None and now >= self.give_up_at:
                return 0
            wake = self.give_up_at if self.started else self.deadline
            if self.started and self.stall_timeout is not None:
                wake = min(wake or now + _STALL_CHECK_SECONDS, now + _STALL_CHECK_SECONDS)
                self.check_stalls(now)
            for key, _ in self.selector.select(None if wake is None else max(0.0, wake - now)):
                if key.fileobj is self.listener:
                    self.accept()
                else:
                    self.read(key.fileobj)

    def missing(self):
        """The processes that never checked in; else (all did, some left since) those not here
        now."""
        never = [i for i in range(self.num_processes) if i not in self.ever]
        return never or [i for i in range(self.num_processes) if i not in self.members]

    def accept(self):
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        sock.setblocking(True)
        sock.settimeout(5.0)  # a peer that stops reading must not block the server
        self.peers[sock] = {"id": None, "buffer": b"", "bye": False}
        self.selector.register(sock, selectors.EVENT_READ)

    def read(self, sock):
        peer = self.peers[sock]
        try:
            chunk = sock.recv(4096)
        except OSError:
            chunk = b""
        if not chunk:
            self.drop(sock)
            return
        peer["buffer"] += chunk
        if peer["id"] is not None:
            self.heard[peer["id"]] = time.monotonic()
        while b"\n" in peer["buffer"]:
            line, peer["buffer"] = peer["buffer"].split(b"\n", 1)
            self.handle(sock, peer, line.decode("ascii", "replace").split())
            if sock not in self.peers:
                return

    def handle(self, sock, peer, words):
        if not words:
            return
        if words[0] == "HELLO":
            if (
                len(words) != 4
                or words[1] != PROTOCOL
                or not words[2].isdigit()
                or not words[3].isdigit()
            ):
                self.refuse(sock, f"not a {PROTOCOL} hello: {' '.join(words)[:80]!r}")
                return
            count, process_id = int(words[2]), int(words[3])
            if count != self.num_processes:
                self.refuse(
                    sock,
                    f"process {process_id} says the job has {count} processes, process 0 says "
                    f"{self.num_processes}",
                )
            elif not 0 <= process_id < self.num_processes:
                self.refuse(sock, f"process id {process_id} is not in [0, {self.num_processes})")
            elif self.started:
                self.refuse(
                    sock, f"process {process_id} checked in after the job started (restarted?)"
                )
            elif process_id in self.members:
                self.refuse(
                    sock,
                    f"process id {process_id} checked in twice (two processes given the same id?)",
                )
            else:
                peer["id"] = process_id
                self.members[process_id] = sock
                self.ever.add(process_id)
                if len(self.members) == self.num_processes:
                    self.started = True
                    self.heard = dict.fromkeys(self.members, time.monotonic())
                    self.broadcast("GO\n")
        elif words[0] == "STATUS":
            self.send(
                sock, "GO\n" if self.started else f"WAITING {','.join(map(str, self.missing()))}\n"
            )
        elif words[0] == "PING":
            pass  # a sign of life: read() noted the time
        elif words[0] == "BYE":
            peer["bye"] = True

    def check_stalls(self, now):
        """Tells the others about each process that sent nothing for ``stall_timeout`` s, once."""
        for process_id, sock in list(self.members.items()):
            silent = now - self.heard.get(process_id, now)
            if process_id in self.stalled or self.peers[sock]["bye"] or silent < self.stall_timeout:
                continue
            self.stalled.add(process_id)
            _LOG.warning(
                "jaxcomp.distributed.rendezvous: process %s of %s sent nothing for %.1f s "
                "(stalled); telling the others",
                process_id,
                self.num_processes,
                silent,
            )
            for other, other_sock in list(self.members.items()):
                if other != process_id:
                    self.send(other_sock, f"STALLED {process_id} {silent:.1f}\n")

    def refuse(self, sock, why):
        self.send(sock, f"ERROR {why}\n")
        self.drop(sock, quiet=True)

    def send(self, sock, text):
        try:
            sock.sendall(text.encode())
        except OSError:
            pass

    def broadcast(self, text):
        for sock in list(self.members.values()):
            self.send(sock, text)

    def drop(self, sock, quiet=False):
        peer = self.peers.pop(sock)
        self.selector.unregister(sock)
        sock.close()
        process_id = peer["id"]
        if process_id is None or self.members.get(process_id) is not sock:
            return
        del self.members[process_id]
        if not self.started or peer["bye"] or quiet:
            return  # before the go-ahead a process that leaves is simply missing again
        _LOG.warning(
            "jaxcomp.distributed.rendezvous: process %s of %s left without a goodbye; telling "
            "the others",
            process_id,
            self.num_processes,
        )
        self.broadcast(f"LOST {process_id}\n")
        if self.give_up_at is None and self.stall_timeout is None:
            self.give_up_at = time.monotonic() + self.linger


def _main(argv=None) -> int:
    """``python -m jaxcomp.distributed.rendezvous_server serve HOST:PORT N TIMEOUT
    [--stall-timeout S] [--jax-service BIND N HB SHUTDOWN RECOVERABLE]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    stall_timeout = None
    if len(argv) >= 6 and argv[4] == "--stall-timeout":
        stall_timeout = float(argv[5])
        del argv[4:6]
    if (
        len(argv) not in (4, 10)
        or argv[0] != "serve"
        or (len(argv) == 10 and argv[4] != "--jax-service")
    ):
        _LOG.error("usage: %s", _main.__doc__)
        return 2
    jax_service = None
    if len(argv) == 10:
        jax_service = JaxService(argv[5], int(argv[6]), int(argv[7]), int(argv[8]), argv[9] == "1")

    def ready(line):
        # Tell process 0 (reading stdout), then let go of stdout: process 0 closes its end.
        os.write(1, (line + "\n").encode())
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)

    return serve(argv[1], int(argv[2]), float(argv[3]), jax_service, ready, stall_timeout)


if __name__ == "__main__":
    sys.exit(_main())
