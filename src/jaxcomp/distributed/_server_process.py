"""Process 0's side of the rendezvous server: it starts the server as a helper process
(:mod:`jaxcomp.distributed.rendezvous_server`) and waits for its ``READY``."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

from jaxcomp.distributed import rendezvous_server
from jaxcomp.distributed._wire import RUN_THIS_FILE, LineReader

_LOG = logging.getLogger("jaxcomp.distributed")

# The rendezvous server's log (its stderr, and JAX's coordination service's messages) goes to the
# file this variable names; by default nowhere.
LOG_VARIABLE = "JAXCOMP_RENDEZVOUS_LOG"


def _arguments(address, num_processes, deadline, jax_service, stall_timeout) -> list[str]:
    """The server's command line."""
    args = [
        sys.executable,
        "-c",
        RUN_THIS_FILE,
        os.path.abspath(rendezvous_server.__file__),
        "serve",
        address,
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
    return args


def start_server(address, num_processes, jax_service, deadline, stall_timeout=None):
    """Starts the rendezvous server on ``address`` as a helper process.

    Args:
      address: ``"HOST:PORT"`` it listens on.
      num_processes: processes in the job.
      jax_service: a :class:`~jaxcomp.distributed.rendezvous_server.JaxService` to host, or None.
      deadline: ``time.monotonic()`` by which every process must have checked in.
      stall_timeout: seconds of silence after which a process is stalled, or None.

    Returns:
      ``(popen, hosts_jax_service)``.

    Raises:
      OSError: the server cannot start (the port is taken); the message says how to pick another.
    """
    args = _arguments(address, num_processes, deadline, jax_service, stall_timeout)
    # Its own session: a Ctrl-C meant for the job does not take the server down before the others
    # leave. Not process 0's stderr: whoever reads that pipe would wait for the server to exit too.
    with open(os.environ.get(LOG_VARIABLE) or os.devnull, "ab") as stderr:
        server = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,
        )
    reader = LineReader(server.stdout)
    line = reader.readline(max(deadline, time.monotonic() + 30.0))  # jaxlib's import can be slow
    server.stdout.close()
    words = (line or "").split(maxsplit=1)
    if words and words[0] == "READY":
        hosts_service = words[1:] == ["jax-service"]
        if jax_service is not None and not hosts_service:
            _LOG.warning(
                "jaxcomp.distributed.rendezvous: the rendezvous server cannot host JAX's "
                "coordination service (%s); process 0 hosts it, as JAX does by default",
                words[1] if len(words) > 1 else "unknown reason",
            )
        return server, hosts_service
    if server.poll() is None:
        server.kill()
    server.wait()
    why = words[1] if words and words[0] == "FAILED" else f"it exited with code {server.returncode}"
    raise OSError(
        f"process 0 cannot start the rendezvous server on {address}: {why}. Pick another port "
        "(jaxcomp.distributed.launch: --rendezvous-port, rendezvous_port=, or "
        "JAXCOMP_RENDEZVOUS_PORT)"
    )
