"""jaxlib's client of the coordination service in a process of its own: :class:`ClientProcess`.

jaxlib aborts the process of a client whose service is gone (SIGABRT, no Python error is
possible: its missed-heartbeat callback cannot be a Python function in jaxlib 0.10). The quorum
therefore runs the client in a child process, so that the service's death ends the child, not the
worker: the worker sees :class:`ServiceGone` on every pending and later call, with its training
state intact, and may connect again once a service is back. The child answers each call from a
thread of its own, so that a barrier (``get_live_nodes``) does not hold back a get.

Run as a script, this file is that child; it imports jaxlib alone (not jax, not jaxcomp).
"""

from __future__ import annotations

import collections
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from jaxcomp.distributed._wire import RUN_THIS_FILE

# Seconds close() waits for the child to shut its client down before it kills it.
_CLOSE_SECONDS = 5.0


class ServiceGone(ConnectionError):
    """The client's process ended (the service died, or could not be reached): every call of
    this client fails so from then on."""


def wait_listening(address: tuple[str, int], seconds: float) -> bool:
    """Whether ``address`` accepts TCP connections within ``seconds`` (polled every 0.2 s)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection(address, timeout=1.0).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def _ended(code) -> str:
    if code is None:
        return "it stopped answering"
    if code < 0:
        return f"it died of {signal.Signals(-code).name}"
    return f"it exited with {code}"


class _Pending:
    """One call awaiting the child's answer."""

    def __init__(self):
        self.done = threading.Event()
        self.ok, self.value = False, None


class ClientProcess:
    """jaxlib's ``DistributedRuntimeClient`` for ``rank`` at ``address``, in a child process.

    Args:
      address: the service's ``"HOST:PORT"``.
      rank: the client's node id.
      options: keyword arguments of jaxlib's ``get_distributed_runtime_client``.
    """

    def __init__(self, address: str, rank: int, **options):
        ours, theirs = socket.socketpair()
        with theirs:
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    RUN_THIS_FILE,
                    os.path.abspath(__file__),
                    str(theirs.fileno()),
                ],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stderr=subprocess.PIPE,  # jaxlib's log: its last words go into the error
            )
        self._conn = Connection(ours.detach())
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, _Pending] = {}
        self._gone = None  # why every call fails, once the child ended
        self._log = collections.deque(maxlen=64)  # the child's last stderr lines
        self._conn.send((address, rank, options))
        threading.Thread(target=self._read, name="jaxcomp-service-client", daemon=True).start()
        threading.Thread(target=self._drain, name="jaxcomp-service-log", daemon=True).start()

    def call(self, method: str, *args, timeout: float | None = None):
        """``client.method(*args)`` in the child.

        Raises:
          ServiceGone: the child ended, before or during the call.
          TimeoutError: no answer within ``timeout`` seconds (the call goes on in the child).
          RuntimeError: jaxlib's error, its message kept.
        """
        with self._lock:
            if self._gone is not None:
                raise ServiceGone(self._gone)
            call_id, pending = next(self._ids), _Pending()
            self._pending[call_id] = pending
            try:
                self._conn.send((call_id, method, args))
            except OSError:
                pass  # the reader thread fails the call
        if not pending.done.wait(timeout):
            raise TimeoutError(f"{method} did not answer within {timeout:g} s")
        if not pending.ok:  # UNAVAILABLE: the service is not there (its death, before the abort)
            gone = self._gone is not None or "UNAVAILABLE" in pending.value
            raise (ServiceGone if gone else RuntimeError)(pending.value)
        return pending.value

    def _drain(self) -> None:
        """Reads the child's stderr (jaxlib's log), keeping its last lines."""
        for line in self._process.stderr:
            self._log.append(line.decode(errors="replace").strip())

    def _read(self) -> None:
        """The reader thread: hands each answer to its call; at the end, fails them all."""
        while True:
            try:
                call_id, ok, value = self._conn.recv()
            except (EOFError, OSError):
                break
            pending = self._pending.pop(call_id)
            pending.ok, pending.value = ok, value
            pending.done.set()
        try:
            code = self._process.wait(timeout=_CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            code = None
        status = [
            line.split("absl::Status:", 1)[1] for line in self._log if "absl::Status:" in line
        ]
        with self._lock:
            self._gone = f"jaxlib's client process ended: {_ended(code)}" + "".join(
                f" ({' '.join(status[-1].split())[:200]})" for _ in status[-1:]
            )
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            p.value = self._gone
            p.done.set()

    def close(self) -> None:
        """Shuts the client down (bounded), then ends the child."""
        try:
            self.call("shutdown", timeout=_CLOSE_SECONDS)
        except (ServiceGone, TimeoutError, RuntimeError):
            pass  # the service dropped it already, or is gone
        self._conn.close()
        try:
            self._process.wait(timeout=_CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def _serve(fd: int) -> None:
    """The child: connects jaxlib's client as told, then answers calls until the worker goes."""
    conn = Connection(fd)
    address, rank, options = conn.recv()
    from jaxlib import _jax

    client = _jax.get_distributed_runtime_client(address, rank, **options)
    lock = threading.Lock()

    def answer(call_id, method, args):
        try:
            reply = (call_id, True, getattr(client, method)(*args))
        except Exception as e:  # jaxlib's error, for the worker to read
            reply = (call_id, False, f"{type(e).__name__}: {e}")
        with lock:
            conn.send(reply)

    while True:
        try:
            call_id, method, args = conn.recv()
        except (EOFError, OSError):  # the worker ended: so does its client
            os._exit(0)
        if method == "shutdown":
            answer(call_id, method, args)
            os._exit(0)
        threading.Thread(target=answer, args=(call_id, method, args), daemon=True).start()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
