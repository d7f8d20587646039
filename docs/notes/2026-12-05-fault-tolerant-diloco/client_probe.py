"""Step 1's client-only probe: can a worker use JAX's coordination service (hosted by jaxcomp's
rendezvous server helper) through jaxlib's ``DistributedRuntimeClient`` alone, with no job-wide
CPU client, for membership with incarnations and a key-value exchange?

    flock /tmp/jaxcomp-tests.lock timeout 120 python client_probe.py > client_probe.jsonl
    PROBE_CALLBACK=1 flock ... python client_probe.py > client_probe_callback.jsonl

Four workers (ranks 0-3) connect with ``_jax.get_distributed_runtime_client``; the service runs in
``rendezvous_server.py serve ... --jax-service`` (recoverable, heartbeat timeout 5 s). Phases:
live nodes; put/get of 1 kB each; a get nobody answers; delete; rank 1 slow (6 s) at the barrier;
rank 3 SIGKILLed, the others ask again; rank 3 restarted; the service killed. With
``PROBE_CALLBACK=1`` the clients get a ``missed_heartbeat_callback``. One JSON line per
event, ``t`` in seconds since the driver started.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

HB, IDS, T0 = 5, [0, 1, 2, 3], float(os.environ.get("PROBE_T0", time.monotonic()))


def log(**e):
    print(json.dumps({"t": round(time.monotonic() - T0, 2), **e}), flush=True)


def timed(rank, what, f, *a):
    began = time.monotonic()
    try:
        out = f(*a)
        log(rank=rank, what=what, ok=True, s=round(time.monotonic() - began, 2), out=out)
        return out
    except Exception as e:  # noqa: BLE001 (the probe records whatever is raised)
        log(
            rank=rank,
            what=what,
            ok=False,
            s=round(time.monotonic() - began, 2),
            err=f"{type(e).__name__}: {str(e)[:300]}",
        )


def worker(address, rank, incarnation):
    from jaxlib import _jax

    callback = lambda status: log(rank=rank, what="missed-heartbeat", status=str(status))  # noqa: E731
    c = _jax.get_distributed_runtime_client(
        address,
        rank,
        init_timeout=20,
        heartbeat_timeout=HB,
        shutdown_on_destruction=False,
        **({"missed_heartbeat_callback": callback} if os.environ.get("PROBE_CALLBACK") else {}),
    )
    timed(rank, "connect", c.connect)
    import jax  # local devices only: no jax.distributed, so no job-wide client

    log(rank=rank, what="jax", devices=len(jax.devices()), processes=jax.process_count())
    live = lambda: {int(k): str(v) for k, v in c.get_live_nodes(IDS).items()}  # noqa: E731
    if incarnation == 0:
        timed(rank, "live", live)
        c.key_value_set_bytes(f"probe/{rank}", bytes([rank]) * 1000)
        timed(
            rank,
            "get-all",
            lambda: [len(c.blocking_key_value_get_bytes(f"probe/{j}", 5000)) for j in IDS],
        )
        timed(rank, "get-missing-1s", c.blocking_key_value_get_bytes, "probe/none", 1000)
        timed(rank, "live-before-delete", live)  # all have read every key
        timed(rank, "delete", c.key_value_delete, f"probe/{rank}")
        timed(rank, "try-get-deleted", c.key_value_try_get_bytes, f"probe/{rank}")
        time.sleep(6 if rank == 1 else 0)
        timed(rank, "live-rank1-slow", live)
        if rank == 3:
            log(rank=rank, what="killing-self")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.5)
        timed(rank, "live-after-kill", live)
    for _ in range(4):  # the restarted rank 3 and the survivors meet here
        timed(rank, "live-again", live)
        time.sleep(1)
    time.sleep(30)  # the driver kills the service meanwhile
    log(rank=rank, what="alive-at-end")
    os._exit(0)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    server = os.path.join(here, "../../../src/jaxcomp/distributed/rendezvous_server.py")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address, env = f"127.0.0.1:{port}", {**os.environ, "JAX_PLATFORMS": "cpu", "PROBE_T0": str(T0)}
    service = subprocess.Popen(  # no worker checks in: the server keeps the service for 90 s
        [
            sys.executable,
            server,
            "serve",
            f"127.0.0.1:{port + 1}",
            "4",
            "90",
            "--jax-service",
            f"[::]:{port}",
            "4",
            str(HB),
            "5",
            "1",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    log(what="service", line=service.stdout.readline().strip())
    start = lambda r, i: subprocess.Popen(  # noqa: E731
        [sys.executable, __file__, "worker", address, str(r), str(i)], env=env
    )
    workers = [start(r, 0) for r in IDS]
    workers[3].wait()
    time.sleep(HB + 4)
    log(what="restarting-3")
    workers.append(start(3, 1))
    time.sleep(12)
    log(what="killing-service")
    service.kill()
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline and any(w.poll() is None for w in workers):
        time.sleep(0.5)
    log(what="exit-codes", codes=[w.poll() for w in workers])
    for w in workers:
        w.kill()


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
elif __name__ == "__main__":
    main()
