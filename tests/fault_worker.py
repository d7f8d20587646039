"""Worker of fault_test.py: steps a 2-process psum until the fault FAULT (argv[1]) hits.

Usage (under the environment ``jaxcomp.distributed.launch.process_env`` makes): python
tests/fault_worker.py FAULT PROCESS STEP [STEPS], with FAULT one of ``kill`` (SIGKILL itself),
``kill-idle`` (SIGKILL itself while the others spend 30 s in Python code without a collective),
``stall`` (sleep for 10 min: its threads keep running), ``sigstop`` (SIGSTOP itself: every thread
stops), ``sigstop-idle`` (SIGSTOP itself while the others spend 30 s in Python code),
``kill-after-init`` (SIGKILL itself right after ``launch.initialize`` returns, before the first
collective) or ``none``; process PROCESS does it before step STEP. Every process prints ``step N``
as it goes, for STEPS steps (default 200), ``stopping T`` / ``raised NAME T`` with T its
``time.monotonic()`` (one clock for every process of the machine), and ``on_failure ...`` from
``launch.initialize``'s hook.
"""

import os
import signal
import sys
import time

from jaxcomp.distributed import launch, rendezvous

fault, faulty, at_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 200


def on_failure(error):  # where a script would save a checkpoint
    print(
        f"on_failure {type(error).__name__} {list(error.lost)} {time.monotonic():.3f}", flush=True
    )


try:
    process_id = launch.initialize(on_failure=on_failure)
except rendezvous.MissingProcessError as e:  # a Python exception: the script can catch it
    print(f"caught MissingProcessError, missing={list(e.missing)}", flush=True)
    raise
if fault == "kill-after-init" and process_id == faulty:
    print(f"stopping {time.monotonic():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P


def run():
    # The first JAX op builds the CPU backend: a topology exchange with every process.
    mesh = Mesh(jax.devices(), ("data",))
    total = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()
        )
    )
    x = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P("data")), jnp.ones(len(jax.local_devices()))
    )
    for step in range(steps):
        if process_id != faulty and step == at_step and fault in ("kill-idle", "sigstop-idle"):
            print("idle", flush=True)
            until = time.monotonic() + 30
            while time.monotonic() < until:  # e.g. loading data: no collective for a while
                time.sleep(0.01)
        if process_id == faulty and step == at_step:
            if fault in ("kill", "kill-idle"):
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault == "stall":
                time.sleep(600)
            elif fault in ("sigstop", "sigstop-idle"):
                print(f"stopping {time.monotonic():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
        total(x).block_until_ready()
        print(f"step {step}", flush=True)
        time.sleep(0.05)


try:
    run()
except BaseException as e:  # the script's own except/finally runs: e.g. save a checkpoint
    print(f"raised {type(e).__name__} {time.monotonic():.3f}", flush=True)
    raise
