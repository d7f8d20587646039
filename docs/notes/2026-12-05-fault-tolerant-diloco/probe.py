"""What JAX's own fault tolerance does on the CPU backend with gloo: the probes of the note
``2026-12-05-fault-tolerant-diloco.md``.

    flock /tmp/jaxcomp-tests.lock timeout 300 python probe.py run SCENARIO --out results.json

starts a job of ``--processes`` processes (one CPU device each) on 127.0.0.1 that all-reduce
(``psum`` under ``shard_map``) a vector of ones every 0.2 s, SIGKILLs one of them before a given
step (while the others wait in that step's psum), and records every process's events with
``time.monotonic()`` (one clock for the whole machine), exit code and JAX's fatal log lines. The
scenarios (``SCENARIOS``):

* ``plain-kill-3``: JAX as it is (no recoverability), heartbeat timeout 10 s; process 3 killed.
* ``recoverable-kill-3-restart``: ``jax_enable_recoverability``; each step runs inside
  ``multihost_utils.live_devices`` on the live devices only; process 3 killed, then started again
  (a new incarnation) 15 s later.
* ``recoverable-kill-0``: as above, process 0 (the coordination service's host) killed.
* ``service-apart-kill-0-restart``: as above, but the coordination service runs in a helper
  process of its own (as ``jaxcomp.distributed.launch`` does); process 0 killed and started again.

Each scenario's record is merged into ``--out`` (a JSON object keyed by scenario).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

HEARTBEAT_SECONDS = 10
STEP_PAUSE_SECONDS = 0.2

#: scenario: (recoverable, live_devices loop, faulty process, restart after s, service apart)
SCENARIOS = {
    "plain-kill-3": (False, False, 3, None, False),
    "recoverable-kill-3-restart": (True, True, 3, 15.0, False),
    "recoverable-kill-0": (True, True, 0, None, False),
    "service-apart-kill-0-restart": (True, True, 0, 15.0, True),
    # as recoverable-kill-3-restart, with gloo's collectives bounded (XLA_FLAGS below)
    "recoverable-timeout-kill-3-restart": (True, True, 3, 15.0, False),
}
#: scenarios run with ``--xla_cpu_collective_timeout_seconds`` (what jaxcomp sets)
COLLECTIVE_TIMEOUT = {"recoverable-timeout-kill-3-restart": 10}


def _log(event, **fields):
    print(json.dumps({"t": round(time.monotonic(), 3), "event": event, **fields}), flush=True)


def _worker(args) -> None:
    """One process of the job: steps until ``args.until`` (monotonic), killing itself if faulty."""
    faulthandler.register(signal.SIGUSR1)  # the driver asks for the stacks before killing
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_enable_recoverability", bool(args.recoverable))
    _log("initializing", incarnation=args.incarnation)
    jax.distributed.initialize(
        args.coordinator,
        num_processes=args.processes,
        process_id=args.process,
        initialization_timeout=60,
        heartbeat_timeout_seconds=HEARTBEAT_SECONDS,
        shutdown_timeout_seconds=5,
        # With the service apart, this process's own (always started for process 0) listens on
        # a port nobody uses; jaxcomp.distributed.launch does the same.
        coordinator_bind_address="127.0.0.1:0" if args.service_apart else None,
    )
    _log("initialized", devices=len(jax.devices()))
    compiled = {}

    def all_reduce(devices):
        ids = tuple(d.id for d in devices)
        mesh = Mesh(np.array(devices), ("i",))
        if ids not in compiled:
            compiled[ids] = jax.jit(
                jax.shard_map(
                    lambda x: jax.lax.psum(x, "i"), mesh=mesh, in_specs=P("i"), out_specs=P()
                )
            )
        x = jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("i")), np.ones(len(jax.local_devices()), np.float32)
        )
        return float(np.asarray(jax.block_until_ready(compiled[ids](x)).addressable_data(0))[0])

    step = 0
    while time.monotonic() < args.until:
        if args.process == args.faulty and step == args.at_step and args.incarnation == 0:
            _log("killing-self", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        began = time.monotonic()
        try:
            if args.live_devices:
                with multihost_utils.live_devices(jax.devices()) as devices:
                    processes = sorted({d.process_index for d in devices})
                    total = all_reduce(devices)
            else:
                processes = list(range(args.processes))
                total = all_reduce(jax.devices())
        except Exception as e:  # noqa: BLE001 (the probe records whatever is raised)
            _log(
                "error",
                step=step,
                kind=type(e).__name__,
                message=str(e)[:400],
                seconds=round(time.monotonic() - began, 3),
            )
            time.sleep(0.5)
            continue
        _log(
            "step",
            step=step,
            processes=processes,
            total=total,
            seconds=round(time.monotonic() - began, 3),
        )
        step += 1
        time.sleep(STEP_PAUSE_SECONDS)
    _log("done", step=step)
    sys.stdout.flush()
    os._exit(0)  # not JAX's exit-time shutdown barrier, which waits for the dead


def _service(args) -> None:
    """JAX's coordination service, recoverable, in a process of its own."""
    from jaxlib import _jax

    service = _jax.get_distributed_runtime_service(
        args.coordinator.replace("127.0.0.1", "[::]"),
        args.processes,
        heartbeat_timeout=HEARTBEAT_SECONDS,
        shutdown_timeout=5,
        recoverable=True,
    )
    _log("service-ready")
    while time.monotonic() < args.until:
        time.sleep(0.2)
    del service
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(role, args, process, incarnation, until, coordinator):
    recoverable, live, faulty, _, apart = SCENARIOS[args.scenario]
    command = [
        sys.executable,
        os.path.abspath(__file__),
        role,
        "--coordinator",
        coordinator,
        "--processes",
        str(args.processes),
        "--process",
        str(process),
        "--faulty",
        str(faulty),
        "--at-step",
        str(args.at_step),
        "--incarnation",
        str(incarnation),
        "--until",
        repr(until),
    ]
    command += ["--recoverable"] * recoverable + ["--live-devices"] * live
    command += ["--service-apart"] * apart
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    if args.scenario in COLLECTIVE_TIMEOUT:
        seconds = COLLECTIVE_TIMEOUT[args.scenario]
        env["XLA_FLAGS"] = f"--xla_cpu_collective_timeout_seconds={seconds}"
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _fatal_lines(stderr: str) -> list[str]:
    keep = ("Terminating", "F0", "E0", "Error", "error", "abort")
    lines = [line for line in stderr.splitlines() if any(k in line for k in keep)]
    return [line[:400] for line in lines[-8:]]


def _main_stack(stderr: str) -> list[str]:
    """The main thread's innermost frames as faulthandler printed them (empty if it did not)."""
    if "[probe: killed at the deadline]" not in stderr:
        return []
    blocks = stderr.split("hread 0x")  # "Thread 0x..." and "Current thread 0x..."
    main = next((b for b in blocks if "most recent call first" in b and "_worker" in b), "")
    return [line.strip() for line in main.splitlines() if line.strip().startswith("File")][:4]


def _collect(popen, deadline, outputs, i) -> None:
    """Waits for ``popen`` (killed at ``deadline``); ``outputs[i] = (out, err, exit time)``."""
    try:
        out, err = popen.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        popen.send_signal(signal.SIGUSR1)  # its Python stacks, to stderr
        time.sleep(1.0)
        popen.kill()
        out, err = popen.communicate()
        err += "\n[probe: killed at the deadline]"
    outputs[i] = (out, err, round(time.monotonic(), 3))


def _record(role, process, incarnation, popen, out, err, exited) -> dict:
    events = []
    for line in out.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return {
        "role": role,
        "process": process,
        "incarnation": incarnation,
        "returncode": popen.returncode,
        "exited_t": exited,
        "events": events,
        "fatal_log": _fatal_lines(err),
        "stack_at_deadline": _main_stack(err),
    }


def _run(args) -> dict:
    _, _, faulty, restart_after, apart = SCENARIOS[args.scenario]
    coordinator = f"127.0.0.1:{_free_port()}"
    began = time.monotonic()
    until = began + args.seconds
    started = []  # (role, process, incarnation, popen)
    if apart:
        started.append(("service", -1, 0, _start("service", args, -1, 0, until + 20, coordinator)))
        time.sleep(3.0)
    for process in range(args.processes):
        started.append(
            ("worker", process, 0, _start("worker", args, process, 0, until, coordinator))
        )
    if restart_after is not None:
        faulty_popen = started[-args.processes + faulty][3]
        while faulty_popen.poll() is None and time.monotonic() < until:
            time.sleep(0.05)
        killed_at = time.monotonic()
        while time.monotonic() < min(until, killed_at + restart_after):
            time.sleep(0.05)
        if time.monotonic() < until - 5:
            started.append(
                ("worker", faulty, 1, _start("worker", args, faulty, 1, until, coordinator))
            )
    outputs = [None] * len(started)
    threads = [
        threading.Thread(target=_collect, args=(popen, until + 25, outputs, i))
        for i, (_, _, _, popen) in enumerate(started)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    records = [
        _record(role, process, incarnation, popen, *outputs[i])
        for i, (role, process, incarnation, popen) in enumerate(started)
    ]
    return {
        "scenario": args.scenario,
        "processes": args.processes,
        "faulty": faulty,
        "at_step": args.at_step,
        "heartbeat_timeout_seconds": HEARTBEAT_SECONDS,
        "started_t": round(began, 3),
        "records": records,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=("run", "worker", "service"))
    parser.add_argument("scenario", nargs="?", choices=tuple(SCENARIOS))
    parser.add_argument("--out", default="results.json")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--at-step", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=75.0)
    parser.add_argument("--coordinator")
    parser.add_argument("--process", type=int)
    parser.add_argument("--faulty", type=int)
    parser.add_argument("--incarnation", type=int, default=0)
    parser.add_argument("--until", type=float)
    parser.add_argument("--recoverable", action="store_true")
    parser.add_argument("--live-devices", action="store_true")
    parser.add_argument("--service-apart", action="store_true")
    return parser


def main() -> None:
    args = _parser().parse_args()
    if args.role == "worker":
        _worker(args)
    elif args.role == "service":
        _service(args)
    else:
        record = _run(args)
        results = {}
        if os.path.exists(args.out):
            with open(args.out) as f:
                results = json.load(f)
        results[args.scenario] = record
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
