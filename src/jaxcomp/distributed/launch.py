r"""Multi-process runs under ``jax.distributed``: a launcher and its worker-side half.

    python -m jaxcomp.distributed.launch -n 2 --devices-per-process 4 train.py --steps 10

starts ``train.py`` twice, as processes 0 and 1 of one JAX job with 4 CPU devices each (8 in all),
coordinated on a free localhost port. The script calls :func:`initialize` before any JAX op;
outside the launcher that is a no-op, so the same script runs single-process too. CPU collectives
between processes go through gloo (JAX's default).

On several hosts, run the same command on every host with ``--coordinator HOST0:PORT --num-hosts
M --host-id I`` and ``--interface eth0`` (the interface gloo binds to; in containers the hostname
often resolves to ``127.0.0.1``, where gloo's connections fail). Host 0 also listens on the
coordinator's port + 1 (jaxcomp's rendezvous, :mod:`jaxcomp.distributed.rendezvous`;
``--rendezvous-port`` picks another). ``--allocator tuned`` starts every process with
:data:`jaxcomp.ops.allocator.ENVIRONMENT`. docs/network.md ("Several hosts") is the guide.
"""

from __future__ import annotations

import argparse
import atexit
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from jaxcomp.distributed import rendezvous
from jaxcomp.distributed._checks import port as _check_port
from jaxcomp.distributed._checks import positive_int as _positive_int
from jaxcomp.distributed._checks import positive_seconds as _check_timeout
from jaxcomp.distributed._cpu_backend import configure_cpu, use_gloo_interface
from jaxcomp.distributed._failure import (
    LOSS_GRACE_SECONDS,
    exit_promptly_on_failure,
    initialize_watchdog,
    raise_peer_lost_later,
)
from jaxcomp.distributed._job_env import (
    COORDINATOR,
    DEFAULT_FAILURE_TIMEOUT,
    INTERFACE,
    NUM_PROCESSES,
    PROCESS_ID,
    failure_timeout_from_env,
    process_env,
    rendezvous_port_from_env,
)
from jaxcomp.ops import allocator as allocator_module

__all__ = [
    "DEFAULT_FAILURE_TIMEOUT",
    "STOP_GRACE_SECONDS",
    "initialize",
    "launch",
    "main",
    "process_env",
    "use_gloo_interface",
    "wait_all",
]


def initialize(
    interface: str | None = None,
    *,
    failure_timeout: float | None = None,
    rendezvous_port: int | None = None,
    on_failure: Callable[[rendezvous.PeerLostError], None] | None = None,
) -> int:
    """Joins the job :func:`launch` started (no-op when not launched); call before any JAX op.

    Sets this process's CPU device count, checks in at jaxcomp's rendezvous
    (:func:`jaxcomp.distributed.rendezvous.check_in`), then calls ``jax.distributed.initialize``
    with the coordinator, process count and id the launcher put in the environment and with
    timeouts of ``failure_timeout``: a dead, never-started or stalled peer becomes a Python
    exception on every surviving process within about that (JAX's defaults abort the process),
    and a process that ends on an uncaught exception names the peers that do not check in and
    exits with code 1 at once. docs/training.md ("When a process dies, never starts or stalls")
    has every case. When ``jax.distributed`` is already initialized, this does nothing and returns
    ``jax.process_index()``.

    Args:
      interface: network interface gloo binds to (e.g. ``"eth0"``); default: the launcher's
        ``--interface`` (``JAXCOMP_INTERFACE``), else gloo's own choice, the address the
        hostname resolves to.
      failure_timeout: seconds, ``> 0``, after which a missing peer is an error; default: the
        launcher's ``--failure-timeout`` (``JAXCOMP_FAILURE_TIMEOUT``), else 60. Raise it when
        the first step's compilation can take longer than that on some process.
      rendezvous_port: the rendezvous server's port on the coordinator's host; default: the
        launcher's ``--rendezvous-port`` (``JAXCOMP_RENDEZVOUS_PORT``), else the coordinator's
        port + 1.
      on_failure: called once as ``on_failure(error)``, from a helper thread, when the rendezvous
        hears that a peer was lost or stalled (``error``: the PeerLostError or PeerStalledError
        about to be raised in the main thread, which waits for the hook): e.g. save a checkpoint.
        Not called when this process is already exiting on an exception of its own.

    Returns:
      This process's id (0 when not launched).

    Raises:
      jaxcomp.distributed.rendezvous.MissingProcessError: a process of the job did not start within
        ``failure_timeout`` (the message and ``.missing`` name it).

    Example:
      >>> from jaxcomp.distributed import launch
      >>> launch.initialize()  # not under the launcher: nothing to join
      0

    References:
      JAX multi-process programming (``jax.distributed``); the data-parallel setting of Tyagi &
      Swany, arXiv 2312.02493.
    """
    if failure_timeout is not None:
        failure_timeout = _check_timeout(failure_timeout, "failure_timeout")
    if rendezvous_port is not None:
        _check_port(rendezvous_port, "rendezvous_port")
    if COORDINATOR not in os.environ:
        return 0
    failure_timeout = failure_timeout or failure_timeout_from_env()
    coordinator = os.environ[COORDINATOR]
    rendezvous_port = rendezvous_port or rendezvous_port_from_env(coordinator)
    import jax

    if jax.distributed.is_initialized():  # the script joined the job itself
        return jax.process_index()
    seconds = max(1, math.ceil(failure_timeout))
    configure_cpu(interface or os.environ.get(INTERFACE) or None, seconds)
    process_id = int(os.environ[PROCESS_ID])
    num_processes = int(os.environ[NUM_PROCESSES])
    exiting = threading.Event()  # set once this process is on its way out: no PeerLostError then
    membership = _check_in(
        coordinator, rendezvous_port, failure_timeout, seconds, exiting, on_failure
    )
    _join_jax(coordinator, membership, failure_timeout, seconds)
    # atexit runs last-registered first: on failure exit_promptly_on_failure's handler exits
    # before the goodbye (the others must hear of the loss); on a normal exit the goodbye is said
    # before JAX's shutdown barrier.
    atexit.register(membership.leaving)
    exit_promptly_on_failure(process_id, num_processes, exiting, membership)
    _memberships.append(membership)
    return process_id


def _check_in(coordinator, rendezvous_port, failure_timeout, seconds, exiting, on_failure=None):
    """The rendezvous (process 0 hands it JAX's coordination service): this process's membership."""

    process_id = int(os.environ[PROCESS_ID])
    num_processes = int(os.environ[NUM_PROCESSES])
    host, port = rendezvous.split_address(coordinator)
    service = rendezvous.JaxService(
        os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or f"[::]:{port}",
        num_processes,
        heartbeat_timeout=seconds,
        shutdown_timeout=seconds,
        # A task that stops heartbeating must not make the service abort the others: jaxcomp's
        # rendezvous names it (PeerLostError, PeerStalledError) and the collectives time out.
        recoverable=True,
    )
    on_loss, on_stall = raise_peer_lost_later(
        exiting, min(LOSS_GRACE_SECONDS, seconds / 2), on_failure
    )
    return rendezvous.check_in(
        rendezvous.join_address(host, rendezvous_port),
        num_processes,
        process_id,
        failure_timeout,
        jax_service=service if process_id == 0 else None,
        on_loss=on_loss,
        stall_timeout=failure_timeout,
        on_stall=on_stall,
    )


def _join_jax(coordinator, membership, failure_timeout, seconds) -> None:
    """``jax.distributed.initialize`` with jaxcomp's timeouts, under a watchdog."""
    import jax

    process_id = int(os.environ[PROCESS_ID])
    num_processes = int(os.environ[NUM_PROCESSES])
    # Every process checked in; a peer that dies now, before connecting to the coordinator, makes
    # JAX abort the process (a C++ fatal error, no Python exception) when initialization_timeout
    # expires; this watchdog ends the process first, with a message and exit code 1.
    joined = threading.Event()
    threading.Thread(
        target=initialize_watchdog,
        daemon=True,
        args=(joined, failure_timeout, process_id, num_processes, coordinator),
    ).start()
    # With the coordination service in the rendezvous server, process 0's own (which
    # jax.distributed.initialize always starts) listens on an unused port nobody connects to.
    bind = "127.0.0.1:0" if process_id == 0 and membership.hosts_jax_service else None
    try:
        jax.distributed.initialize(
            coordinator,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=seconds + _ABORT_MARGIN_SECONDS,
            coordinator_bind_address=bind,
            heartbeat_timeout_seconds=seconds,
            shutdown_timeout_seconds=seconds,
        )
    finally:  # joined, or failed with an exception of its own: either way the watchdog stands down
        joined.set()


# JAX's own abort at the end of initialization comes this much after jaxcomp's watchdog.
_ABORT_MARGIN_SECONDS = 10
_memberships = []  # this process's rendezvous connection, kept open until exit


#: How long :func:`wait_all` lets the processes it stops exit on SIGTERM before it kills them.
STOP_GRACE_SECONDS = 10.0


def wait_all(processes, timeout: float | None = None, kill=None) -> tuple[list[int], int | None]:
    """Polls every process until all exit; the first failure (or the timeout) stops the others.

    Args:
      processes: ``subprocess.Popen`` objects.
      timeout: seconds before every process still running is stopped (code 124), or None.
      kill: ``kill(popen, signal)`` to stop one (default ``popen.send_signal``).

    Returns:
      ``(codes, failed)``: each process's exit code (124 when stopped at the timeout; a process
      stopped because another failed reports the signal that stopped it, negative), and the
      index of the process that failed first (None when none failed).
    """
    kill = kill or (lambda p, sig: p.send_signal(sig))
    deadline = None if timeout is None else time.monotonic() + timeout
    timed_out, failed = set(), None
    try:
        while True:
            codes = [p.poll() for p in processes]
            failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
            if failed is not None or all(c is not None for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                timed_out = {i for i, c in enumerate(codes) if c is None}
                break
            time.sleep(0.05)
    finally:
        # One process failing leaves the others waiting on collectives forever: stop them. JAX
        # catches SIGTERM (its preemption notifier), so whoever still runs STOP_GRACE_SECONDS
        # later is killed; the grace is shared, not per process.
        for p in processes:
            if p.poll() is None:
                kill(p, signal.SIGTERM)
        grace = time.monotonic() + STOP_GRACE_SECONDS
        for p in processes:
            try:
                p.wait(timeout=max(0.0, grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill(p, signal.SIGKILL)
                p.wait()
    return [124 if i in timed_out else p.returncode for i, p in enumerate(processes)], failed


def _free_port() -> int:
    return _free_ports(1)[0]


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1 (all held open while choosing)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def launch(
    command,
    num_processes: int,
    devices_per_process: int = 1,
    port: int | None = None,
    timeout: float | None = None,
    *,
    coordinator: str | None = None,
    num_hosts: int = 1,
    host_id: int = 0,
    interface: str | None = None,
    failure_timeout: float | None = None,
    rendezvous_port: int | None = None,
    allocator: str = "glibc",
) -> int:
    """Runs ``python *command`` as ``num_processes`` processes of one ``jax.distributed`` job.

    On one machine (the default) the coordinator is a free port on 127.0.0.1. For several hosts,
    run the same call on each with ``coordinator`` (host 0's address and port), ``num_hosts`` and
    this host's ``host_id``; the job then has ``num_hosts * num_processes`` processes.

    Args:
      command: arguments after ``python``: a script and its arguments, or ``["-m", module, ...]``.
      num_processes: processes on this host, ``>= 1``.
      devices_per_process: CPU devices each process gets, ``>= 1``.
      port: coordinator port on 127.0.0.1 for single-host runs (default: a free one).
      timeout: seconds to wait for all processes (default: no limit); on expiry all are stopped.
      coordinator: ``"host:port"`` of the coordinator, reachable from every host (multi-host).
      num_hosts: hosts in the job, each running this launcher.
      host_id: this host's index in ``[0, num_hosts)``; host 0 runs the coordinator.
      interface: network interface gloo binds to on every process (e.g. ``"eth0"``).
      failure_timeout: seconds after which a dead, never-started or stalled process is an error
        in every other process (see :func:`initialize`); default 60.
      rendezvous_port: port of jaxcomp's rendezvous server (:mod:`jaxcomp.distributed.rendezvous`)
        on the coordinator's host; default: a second free port on one host, else the coordinator's
        port + 1. Every host must use the same.
      allocator: ``"glibc"`` (default: glibc's malloc as it is) or ``"tuned"``: every process
        starts with :data:`jaxcomp.ops.allocator.ENVIRONMENT` (large buffers on the heap; see
        :func:`jaxcomp.tune_host_allocator` for the price).

    Returns:
      0 when every process exits with 0; else the first failing process's code (the others are
      stopped as soon as one fails), or 124 on timeout.

    Example:
      >>> from jaxcomp.distributed.launch import launch
      >>> launch(  # doctest: +SKIP
      ...     ["-c", "from jaxcomp.distributed import launch; launch.initialize()"], num_processes=2
      ... )
      0

    References:
      JAX multi-process programming (``jax.distributed``).
    """
    command = list(command)
    if not command:
        raise ValueError("command must name a script (or -m module) to run")
    malloc_env = allocator_module.environment(allocator)  # checks the name first
    _check_job(
        num_processes, devices_per_process, num_hosts, host_id, interface, failure_timeout, timeout
    )
    coordinator, rendezvous_port = _addresses(coordinator, port, num_hosts, rendezvous_port)
    total = num_hosts * num_processes
    processes = []
    for local in range(num_processes):
        env = process_env(
            coordinator,
            total,
            host_id * num_processes + local,
            devices_per_process,
            interface=interface,
            failure_timeout=failure_timeout,
            rendezvous_port=rendezvous_port,
        )
        processes.append(subprocess.Popen([sys.executable, *command], env={**env, **malloc_env}))
    codes, failed = wait_all(processes, timeout)
    return codes[failed] if failed is not None else (124 if 124 in codes else 0)


def _check_job(
    num_processes, devices_per_process, num_hosts, host_id, interface, failure_timeout, timeout
) -> None:
    """:func:`launch`'s counts, interface and timeouts, checked: a ValueError names the argument."""
    _positive_int(num_processes, "num_processes")
    _positive_int(devices_per_process, "devices_per_process")
    _positive_int(num_hosts, "num_hosts")
    if isinstance(host_id, bool) or not isinstance(host_id, int) or not 0 <= host_id < num_hosts:
        raise ValueError(f"host_id must be an integer in [0, {num_hosts}), got {host_id!r}")
    if interface is not None and (not isinstance(interface, str) or not interface):
        raise ValueError(f"interface must be a network interface name, got {interface!r}")
    if failure_timeout is not None:
        _check_timeout(failure_timeout, "failure_timeout")
    if timeout is not None:
        _check_timeout(timeout, "timeout")


def _addresses(coordinator, port, num_hosts, rendezvous_port) -> tuple[str, int | None]:
    """``(coordinator, rendezvous_port)`` of :func:`launch`, checked; on one host without a
    coordinator, 127.0.0.1 and free ports where none is given."""
    if rendezvous_port is not None:
        _check_port(rendezvous_port, "rendezvous_port")
    if coordinator is None:
        if num_hosts > 1:
            raise ValueError(
                "a job of several hosts needs coordinator='HOST:PORT' (host 0's address)"
            )
        if port is not None:
            _check_port(port, "port")
        free = _free_ports(2)
        if port is None:
            port = free[0]
        if rendezvous_port is None:
            rendezvous_port = free[1] if free[1] != port else free[0]
        coordinator = f"127.0.0.1:{port}"
    elif port is not None:
        raise ValueError("give the port inside coordinator='HOST:PORT', not as port=")
    elif not re.fullmatch(r"[^\s:]+:\d{1,5}|\[[0-9a-fA-F:]+\]:\d{1,5}", str(coordinator)):
        raise ValueError(f"coordinator must be 'HOST:PORT', got {coordinator!r}")
    if rendezvous_port is None:
        rendezvous.default_port(coordinator)  # a coordinator on port 65535 needs one given
    if rendezvous_port is not None and rendezvous_port == rendezvous.split_address(coordinator)[1]:
        raise ValueError(
            f"rendezvous_port must differ from the coordinator's port, got {rendezvous_port}"
        )
    return coordinator, rendezvous_port


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxcomp.distributed.launch", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "-n", "--num-processes", type=int, default=1, help="processes on this host (default 1)"
    )
    parser.add_argument("--devices-per-process", type=int, default=1)
    parser.add_argument(
        "--port", type=int, default=None, help="coordinator port on 127.0.0.1 (one host)"
    )
    parser.add_argument(
        "--coordinator", default=None, help="HOST:PORT of host 0's coordinator (several hosts)"
    )
    parser.add_argument(
        "--num-hosts", type=int, default=1, help="hosts in the job, each running this command"
    )
    parser.add_argument(
        "--host-id", type=int, default=0, help="this host's index, 0 on the coordinator's host"
    )
    parser.add_argument(
        "--interface", default=None, help="network interface gloo binds to, e.g. eth0"
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds before all processes are killed"
    )
    parser.add_argument(
        "--failure-timeout",
        type=float,
        default=None,
        help="seconds after which a dead, never-started or stalled process is an error in the "
        f"others (default {DEFAULT_FAILURE_TIMEOUT:g})",
    )
    parser.add_argument(
        "--rendezvous-port",
        type=int,
        default=None,
        help="port of jaxcomp's rendezvous server on the coordinator's host (default: a free one "
        "on one host, else the coordinator's port + 1)",
    )
    parser.add_argument(
        "--allocator",
        choices=allocator_module.ALLOCATORS,
        default="glibc",
        help="the processes' malloc: 'glibc' as it is (the default), or 'tuned': started with "
        "jaxcomp.ops.allocator.ENVIRONMENT, buffers over 32 MB kept on the heap (faster steps "
        "on XLA:CPU; each process keeps its peak heap)",
    )
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="script.py [args...] or -m module [args...]"
    )
    return parser


def main(argv=None) -> int:
    """``python -m jaxcomp.distributed.launch -n N [--devices-per-process D]
    [--coordinator H:P --num-hosts M --host-id I] [--interface IF] [--failure-timeout S]
    [--rendezvous-port P] [--allocator tuned] script.py [args...]``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("name a script to run")
    try:
        return launch(
            args.command,
            args.num_processes,
            args.devices_per_process,
            args.port,
            args.timeout,
            coordinator=args.coordinator,
            num_hosts=args.num_hosts,
            host_id=args.host_id,
            interface=args.interface,
            failure_timeout=args.failure_timeout,
            rendezvous_port=args.rendezvous_port,
            allocator=args.allocator,
        )
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
