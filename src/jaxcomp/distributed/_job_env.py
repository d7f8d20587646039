"""The environment that tells a launched process its place in the job: what
:func:`jaxcomp.distributed.launch.launch` (or a :class:`jaxcomp.distributed.cluster.Cluster`) sets
and :func:`jaxcomp.distributed.launch.initialize` reads."""

from __future__ import annotations

import os
import re

from jaxcomp.distributed import rendezvous
from jaxcomp.distributed._checks import port as _check_port
from jaxcomp.distributed._checks import positive_seconds as _check_timeout

COORDINATOR = "JAXCOMP_COORDINATOR_ADDRESS"
NUM_PROCESSES = "JAXCOMP_NUM_PROCESSES"
PROCESS_ID = "JAXCOMP_PROCESS_ID"
LOCAL_DEVICES = "JAXCOMP_LOCAL_DEVICES"
INTERFACE = "JAXCOMP_INTERFACE"
FAILURE_TIMEOUT = "JAXCOMP_FAILURE_TIMEOUT"
RENDEZVOUS_PORT = "JAXCOMP_RENDEZVOUS_PORT"

DEFAULT_FAILURE_TIMEOUT = 60.0


def process_env(
    coordinator: str,
    num_processes: int,
    process_id: int,
    devices: int,
    *,
    interface: str | None = None,
    base: dict | None = None,
    failure_timeout: float | None = None,
    rendezvous_port: int | None = None,
) -> dict:
    """The environment that makes :func:`jaxcomp.distributed.launch.initialize` join a job as
    ``process_id``.

    Args:
      coordinator: ``"host:port"`` of process 0's coordinator.
      num_processes: processes in the job.
      process_id: this process's id.
      devices: CPU devices this process gets.
      interface: network interface for gloo, or None.
      base: the environment to extend (default ``os.environ``).
      failure_timeout: seconds after which ``initialize`` makes a missing peer an error, or None
        for its default (60).
      rendezvous_port: port of the rendezvous server on the coordinator's host, or None for
        ``initialize``'s default (the coordinator's port + 1).

    Returns:
      A new dict.

    Example:
      >>> env = process_env("10.0.0.1:7733", 2, 1, 4, base={})
      >>> env["JAXCOMP_PROCESS_ID"], env["XLA_FLAGS"]
      ('1', '--xla_force_host_platform_device_count=4')
    """
    env = dict(os.environ if base is None else base)
    env.update(
        {
            COORDINATOR: coordinator,
            NUM_PROCESSES: str(num_processes),
            PROCESS_ID: str(process_id),
            LOCAL_DEVICES: str(devices),
            "XLA_FLAGS": with_flag(
                env.get("XLA_FLAGS", ""), "xla_force_host_platform_device_count", devices
            ),
        }
    )
    if interface:
        env[INTERFACE] = interface
    else:
        env.pop(INTERFACE, None)
    if failure_timeout is not None:
        env[FAILURE_TIMEOUT] = repr(_check_timeout(failure_timeout, "failure_timeout"))
    if rendezvous_port is not None:
        env[RENDEZVOUS_PORT] = str(_check_port(rendezvous_port, "rendezvous_port"))
    else:
        env.pop(RENDEZVOUS_PORT, None)
    return env


def with_flag(flags: str, name: str, value: int) -> str:
    """``flags`` with ``--name=value`` replacing any earlier setting of ``name``."""
    flags = " ".join(re.sub(rf"--{name}=\S*", "", flags).split())
    return f"{flags} --{name}={value}".strip()


def failure_timeout_from_env() -> float:
    """``JAXCOMP_FAILURE_TIMEOUT`` (the launcher's ``--failure-timeout``), else the default,
    checked."""
    text = os.environ.get(FAILURE_TIMEOUT, str(DEFAULT_FAILURE_TIMEOUT))
    try:
        failure_timeout = float(text)
    except ValueError:
        raise ValueError(f"{FAILURE_TIMEOUT} must be a number of seconds, got {text!r}") from None
    return _check_timeout(failure_timeout, FAILURE_TIMEOUT)


def rendezvous_port_from_env(coordinator: str) -> int:
    """``JAXCOMP_RENDEZVOUS_PORT`` (the launcher's ``--rendezvous-port``), else the
    coordinator's + 1."""
    text = os.environ.get(RENDEZVOUS_PORT)
    if not text:
        return rendezvous.default_port(coordinator)
    if not text.isdigit():
        raise ValueError(f"{RENDEZVOUS_PORT} must be a port number, got {text!r}")
    return _check_port(int(text), RENDEZVOUS_PORT)
