"""Worker of fault_test.py: steps a 2-process psum until the fault FAULT (argv[1]) hits.

Usage (under the environment ``jaxcomp.distributed.launch.process_env`` makes): python tests/fault_worker.py
FAULT PROCESS STEP [STEPS], with FAULT one of ``kill`` (SIGKILL itself), ``kill-idle`` (SIGKILL
itself while the others spend 30 s in Python code without a collective), ``stall`` (sleep for
10 min) or ``none``; process PROCESS does it before step STEP. Every process prints ``step N`` as
it goes, for STEPS steps (default 200).
"""

import os
import signal
import sys
import time

from jaxcomp.distributed import launch, rendezvous

fault, faulty, at_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 200
try:
    process_id = launch.initialize()
except rendezvous.MissingProcessError as e:  # a Python exception: the script can catch it
    print(f"caught MissingProcessError, missing={list(e.missing)}", flush=True)
    raise

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

mesh = Mesh(jax.devices(), ("data",))
total = jax.jit(
    jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P())
)
x = jax.make_array_from_process_local_data(
    NamedSharding(mesh, P("data")), jnp.ones(len(jax.local_devices()))
)
for step in range(steps):
    if process_id != faulty and step == at_step and fault == "kill-idle":
        print("idle", flush=True)
        until = time.monotonic() + 30
        while time.monotonic() < until:  # e.g. loading data: no collective for a while
            time.sleep(0.01)
    if process_id == faulty and step == at_step:
        if fault in ("kill", "kill-idle"):
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault == "stall":
            time.sleep(600)
    total(x).block_until_ready()
    print(f"step {step}", flush=True)
    time.sleep(0.05)
