"""Local multi-process runs under ``jax.distributed``: a launcher and its worker-side half.

    python -m jaxcomp.launch -n 2 --devices-per-process 4 train.py --steps 10

starts ``train.py`` twice, as processes 0 and 1 of one JAX job with 4 CPU devices each (8 in all),
coordinated on a free localhost port. The script calls :func:`initialize` before any JAX op;
outside the launcher that is a no-op, so the same script runs single-process too. CPU collectives
between processes go through gloo (JAX's default). For real multi-host runs, start one process
per host yourself and call ``jax.distributed.initialize(...)`` with your cluster's coordinator.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import time

_COORDINATOR = "JAXCOMP_COORDINATOR_ADDRESS"
_NUM_PROCESSES = "JAXCOMP_NUM_PROCESSES"
_PROCESS_ID = "JAXCOMP_PROCESS_ID"
_LOCAL_DEVICES = "JAXCOMP_LOCAL_DEVICES"


def initialize() -> int:
    """Joins the job :func:`launch` started (no-op when not launched); call before any JAX op.

    Sets this process's CPU device count and calls ``jax.distributed.initialize`` with the
    coordinator, process count and id the launcher put in the environment.

    Returns:
      This process's id (0 when not launched).

    Example:
      >>> from jaxcomp import launch
      >>> launch.initialize()  # not under the launcher: nothing to join
      0

    References:
      JAX multi-process programming (``jax.distributed``); the data-parallel setting of Tyagi &
      Swany, arXiv 2312.02493.
    """
    if _COORDINATOR not in os.environ:
        return 0
    import jax

    jax.config.update("jax_num_cpu_devices", int(os.environ[_LOCAL_DEVICES]))
    process_id = int(os.environ[_PROCESS_ID])
    jax.distributed.initialize(os.environ[_COORDINATOR], num_processes=int(os.environ[_NUM_PROCESSES]),
                               process_id=process_id)
    return process_id


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_device_count(flags: str, count: int) -> str:
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
    return f"{flags} --xla_force_host_platform_device_count={count}".strip()


def launch(command, num_processes: int, devices_per_process: int = 1, port: int | None = None,
           timeout: float | None = None) -> int:
    """Runs ``python *command`` as ``num_processes`` processes of one ``jax.distributed`` job.

    Args:
      command: arguments after ``python``: a script and its arguments, or ``["-m", module, ...]``.
      num_processes: number of processes, ``>= 1``.
      devices_per_process: CPU devices each process gets, ``>= 1``.
      port: coordinator port on 127.0.0.1 (default: a free one).
      timeout: seconds to wait for all processes (default: no limit); on expiry all are killed.

    Returns:
      0 when every process exits with 0; else the first non-zero exit code (the others are
      terminated), or 124 on timeout.

    Example:
      >>> from jaxcomp.launch import launch
      >>> launch(["-c", "from jaxcomp import launch; launch.initialize()"], num_processes=2)  # doctest: +SKIP
      0

    References:
      JAX multi-process programming (``jax.distributed``).
    """
    command = list(command)
    if not command:
        raise ValueError("command must name a script (or -m module) to run")
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive integer, got {num_processes!r}")
    if isinstance(devices_per_process, bool) or not isinstance(devices_per_process, int) or devices_per_process < 1:
        raise ValueError(f"devices_per_process must be a positive integer, got {devices_per_process!r}")
    address = f"127.0.0.1:{port or _free_port()}"
    processes = []
    for process_id in range(num_processes):
        env = dict(os.environ)
        env.update({_COORDINATOR: address, _NUM_PROCESSES: str(num_processes), _PROCESS_ID: str(process_id),
                    _LOCAL_DEVICES: str(devices_per_process),
                    "XLA_FLAGS": _with_device_count(env.get("XLA_FLAGS", ""), devices_per_process)})
        processes.append(subprocess.Popen([sys.executable, *command], env=env))
    deadline = None if timeout is None else time.monotonic() + timeout
    code = 0
    try:
        while any(p.poll() is None for p in processes):
            failed = [p.returncode for p in processes if p.returncode not in (None, 0)]
            if failed:
                code = failed[0]
                break
            if deadline is not None and time.monotonic() > deadline:
                code = 124
                break
            time.sleep(0.05)
        else:
            code = next((p.returncode for p in processes if p.returncode), 0)
    finally:
        # One process failing leaves the others waiting on collectives forever: stop them.
        for p in processes:
            if p.poll() is None:
                p.terminate()
        for p in processes:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return code


def main(argv=None) -> int:
    """``python -m jaxcomp.launch -n N [--devices-per-process D] [--port P] script.py [args...]``."""
    parser = argparse.ArgumentParser(prog="python -m jaxcomp.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--num-processes", type=int, required=True)
    parser.add_argument("--devices-per-process", type=int, default=1)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=None, help="seconds before all processes are killed")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="script.py [args...] or -m module [args...]")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("name a script to run")
    try:
        return launch(args.command, args.num_processes, args.devices_per_process, args.port, args.timeout)
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
