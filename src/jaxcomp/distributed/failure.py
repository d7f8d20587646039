"""What a process of a launched job does when a peer fails (:func:`jaxcomp.distributed.launch.initialize`).

A peer lost after the rendezvous makes :class:`jaxcomp.distributed.rendezvous.PeerLostError` rise
in the main thread (:func:`_raise_peer_lost_later`); a peer that dies between the rendezvous and
JAX's own start-up ends the process with a message (:func:`_initialize_watchdog`) before JAX
aborts it; an uncaught exception names the peers that do not check in and exits at once
(:func:`_exit_promptly_on_failure`) instead of waiting in JAX's exit-time barrier.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import sys
import threading

from jaxcomp.distributed import rendezvous

# Seconds between hearing that a peer was lost and raising PeerLostError in the main thread: time
# for the collective that normally fails first to raise its own exception.
_LOSS_GRACE_SECONDS = 2.0


def _raise_peer_lost_later(exiting: threading.Event, grace: float):
    """An ``on_loss`` callback: after ``grace`` s, raise PeerLostError in the main thread, once."""
    fired = []

    def on_loss(lost, message):
        if fired or exiting.is_set():
            return
        fired.append(True)

        def fire():
            if exiting.wait(grace) or not threading.main_thread().is_alive():
                return
            print(
                f"jaxcomp.distributed.launch: {message}; raising PeerLostError in the main thread",
                file=sys.stderr,
                flush=True,
            )
            _raise_in_main_thread(rendezvous.PeerLostError, message, lost)

        threading.Thread(target=fire, name="jaxcomp-peer-lost", daemon=True).start()

    return on_loss


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


def _initialize_watchdog(joined, seconds, process_id, num_processes, coordinator):
    if not joined.wait(seconds):
        print(
            f"jaxcomp.distributed.launch: process {process_id} of {num_processes}: not every process of the job connected to "
            f"the coordinator at {coordinator} within {seconds:g} s (failure_timeout): a process was never "
            "started, died while starting, or cannot reach the coordinator; exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)


def _exit_promptly_on_failure(
    process_id: int, num_processes: int, exiting: threading.Event | None = None
) -> None:
    """On an uncaught exception: name the peers that do not check in, then exit(1) at once.

    JAX's exit handler (registered when jax was imported, so it runs after this one) shuts the
    distributed client down through a barrier every process must reach; with a peer dead or stuck
    it waits for the heartbeat timeout and then aborts, hiding the exit code. Handlers registered
    after :func:`initialize` (e.g. a checkpoint manager's) still run before this one.
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
            print(
                f"jaxcomp.distributed.launch: process {process_id} of {num_processes} failed; process(es) "
                f"{', '.join(map(str, missing))} did not check in within {_CHECK_IN_SECONDS} s "
                "(dead or stalled, unless still running without error)",
                file=sys.stderr,
                flush=True,
            )

    def exit_now():
        exiting.set()
        if failed:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    sys.excepthook = excepthook
    atexit.register(exit_now)


_CHECK_IN_SECONDS = 5
_check_ins = itertools.count()


def _missing_processes(process_id: int, num_processes: int) -> list[int]:
    """The processes that do not reach a check-in barrier in time, by id; [] if none or unknown."""
    try:
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
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
