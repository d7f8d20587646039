"""What a process of a launched job does when a peer fails
(:func:`jaxcomp.distributed.launch.initialize`).

A peer lost after the rendezvous makes :class:`jaxcomp.distributed.rendezvous.PeerLostError` rise
in the main thread, a stalled one :class:`jaxcomp.distributed.rendezvous.PeerStalledError`, after
the user's ``on_failure`` hook (:func:`raise_peer_lost_later`); a peer that dies between the
rendezvous and JAX's own start-up ends the process with a message (:func:`initialize_watchdog`)
before JAX aborts it; an uncaught exception names the peers that do not check in and exits at once
(:func:`exit_promptly_on_failure`) instead of waiting in JAX's exit-time barrier.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import re
import sys
import threading
import time

from jaxcomp.distributed import rendezvous

# Warnings and errors reach stderr even where logging is not configured (Python's last-resort
# handler): a process that dies says why.
_LOG = logging.getLogger("jaxcomp.distributed")

# Seconds between hearing that a peer was lost and raising PeerLostError in the main thread: time
# for the collective that normally fails first to raise its own exception.
LOSS_GRACE_SECONDS = 2.0
# Seconds after raising it, with the main thread still inside the same C call, before JAX's
# distributed client is shut down to end that call (:func:`_unblock_main_thread`).
_STUCK_SECONDS = 2.0
_client_shut_down = []  # [True] once this process shut JAX's distributed client down


def raise_peer_lost_later(exiting: threading.Event, grace: float, on_failure=None):
    """``(on_loss, on_stall)`` callbacks for :func:`~jaxcomp.distributed.rendezvous.check_in`.

    The first failure heard (unless this process is already on its way out) runs
    ``on_failure(error)`` in a helper thread, then, ``grace`` s after it was heard (or when the hook
    returns, if later), raises ``error``'s class (PeerLostError or PeerStalledError) in the main
    thread; later failures raise nothing more. A main thread stuck inside one C call gets it when
    the call returns; :func:`_unblock_main_thread` makes the calls that wait on JAX's coordination
    service return.
    """
    fired = []
    lock = threading.Lock()

    def fire(kind, lost, message, heard):
        if on_failure is not None:
            _run_hook(on_failure, kind(message, lost))
        left = max(0.0, heard + grace - time.monotonic())
        if exiting.wait(left) or not threading.main_thread().is_alive():
            return
        _LOG.warning(
            "jaxcomp.distributed.launch: %s; raising %s in the main thread", message, kind.__name__
        )
        where = _main_thread_position()
        _raise_in_main_thread(kind, message, lost)
        if not exiting.wait(_STUCK_SECONDS) and where and _main_thread_position() == where:
            _unblock_main_thread(kind.__name__)

    def deliver(kind, lost, message):
        with lock:
            if fired or exiting.is_set():
                return
            fired.append(True)
        args = (kind, lost, message, time.monotonic())
        threading.Thread(target=fire, args=args, name="jaxcomp-peer-lost", daemon=True).start()

    return (
        lambda lost, message: deliver(rendezvous.PeerLostError, lost, message),
        lambda stalled, message: deliver(rendezvous.PeerStalledError, stalled, message),
    )


def _run_hook(on_failure, error) -> None:
    """``on_failure(error)``; an exception of its own is logged, not raised."""
    _LOG.warning("jaxcomp.distributed.launch: %s; running the on_failure hook", error)
    try:
        on_failure(error)
    except BaseException as e:  # the hook's failure must not hide the peer's
        _LOG.error(
            "jaxcomp.distributed.launch: the on_failure hook raised %s: %s", type(e).__name__, e
        )


def _main_thread_position():
    """``(frame, instruction)`` of the main thread's innermost Python frame, or None."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return None if frame is None else (frame, frame.f_lasti)


def _unblock_main_thread(name: str) -> None:
    """Shuts JAX's distributed client down, so that a main thread blocked in one of its waits
    returns with an error, and the pending exception ``name`` rises.

    Such waits have long timeouts of their own: the CPU backend's topology exchange with every
    process (2 to 5 min, at the first JAX op: a peer killed right after
    ``jax.distributed.initialize``) and gloo's connection set-up (30 s, at the first collective).
    With the coordination service recoverable, the shutdown does not wait for the lost peer.
    """
    try:
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            return
        _LOG.warning(
            "jaxcomp.distributed.launch: the main thread is still blocked in a call; shutting down "
            "JAX's distributed client so that it returns and %s rises",
            name,
        )
        _client_shut_down.append(True)
        client.shutdown()
    except Exception as e:  # the exception stays pending: it rises when the call returns
        _LOG.error(
            "jaxcomp.distributed.launch: shutting down JAX's distributed client failed: %s", e
        )


def _raise_in_main_thread(kind, message, lost):
    """Raises ``kind(message, lost)`` in the main thread at its next Python bytecode.

    CPython's ``PyThreadState_SetAsyncExc`` takes an exception class, instantiated with no
    arguments, so the message goes into a subclass made for it (``except kind`` still catches it).
    A main thread blocked inside a C call (a sleep, a collective) gets it when the call returns.
    """
    import ctypes

    error = type(
        kind.__name__,
        (kind,),
        {
            "__init__": lambda self: kind.__init__(self, message, lost),
            "__module__": kind.__module__,
            "__qualname__": kind.__qualname__,
        },
    )
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(threading.main_thread().ident), ctypes.py_object(error)
    )


def initialize_watchdog(joined, seconds, process_id, num_processes, coordinator):
    if not joined.wait(seconds):
        _LOG.critical(
            "jaxcomp.distributed.launch: process %s of %s: not every process of the job connected "
            "to the coordinator at %s within %g s (failure_timeout): a process was never started, "
            "died while starting, or cannot reach the coordinator; exiting",
            process_id,
            num_processes,
            coordinator,
            seconds,
        )
        os._exit(1)


def exit_promptly_on_failure(
    process_id: int, num_processes: int, exiting: threading.Event | None = None, membership=None
) -> None:
    """On an uncaught exception: name the peers that do not check in, then exit(1) at once.

    JAX's exit handler (registered when jax was imported, so it runs after this one) shuts the
    distributed client down through a barrier every process must reach; with a peer dead or stuck
    it waits for the heartbeat timeout and then aborts, hiding the exit code. Handlers registered
    after :func:`initialize` (e.g. a checkpoint manager's) still run before this one. With
    ``membership`` (the rendezvous's), the peers it heard were lost or stalled are named too.
    """
    failed = []
    previous_hook = sys.excepthook
    exiting = exiting or threading.Event()

    def excepthook(kind, value, traceback):
        exiting.set()
        previous_hook(kind, value, traceback)
        if kind is KeyboardInterrupt:
            return
        failed.append(True)
        missing = _missing_processes(process_id, num_processes)
        if missing:
            _LOG.error(
                "jaxcomp.distributed.launch: process %s of %s failed; process(es) %s did not "
                "check in within %s s (dead or stalled, unless still running without error)",
                process_id,
                num_processes,
                ", ".join(map(str, missing)),
                _CHECK_IN_SECONDS,
            )
        known = _known_failure(membership)
        if known and not isinstance(value, rendezvous.PeerLostError):
            _LOG.error("jaxcomp.distributed.launch: %s", known)

    def exit_now():
        exiting.set()
        if failed:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    sys.excepthook = excepthook
    atexit.register(exit_now)


def _known_failure(membership) -> str | None:
    """What the rendezvous heard about lost or stalled peers, as a message; None if nothing."""
    if membership is None:
        return None
    try:
        membership.raise_if_lost()
    except rendezvous.PeerLostError as e:
        return str(e)
    return None


_CHECK_IN_SECONDS = 5
_check_ins = itertools.count()


def _missing_processes(process_id: int, num_processes: int) -> list[int]:
    """The processes that do not reach a check-in barrier in time, by id; [] if none or unknown."""
    try:
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None or _client_shut_down:
            return []
        # Every surviving process that fails reaches this barrier; a dead or stalled one does not.
        barrier = f"jaxcomp_failure_check_in_{next(_check_ins)}"
        try:
            client.wait_at_barrier(barrier, _CHECK_IN_SECONDS * 1000)
            return []
        except (
            Exception
        ) as e:  # the coordination service's message names the tasks that did not come
            message = str(e)
        # "... Some timed out task names:\n1\n3\nRPC: ..." (XLA's coordination service, jax 0.10)
        names = re.search(r"timed out task names:([\s\d,]*)", message)
        if names:
            late = sorted({int(t) for t in re.findall(r"\d+", names.group(1))} - {process_id})
            if late:
                return late
        return (
            [0] if process_id != 0 else []
        )  # no answer at all: the coordinator (process 0) is gone
    except Exception:
        return []
