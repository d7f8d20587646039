"""Worker of fault_test.py: steps a 2-process psum until the fault FAULT (argv[1]) hits.

Usage (under the environment ``jaxcomp.launch.process_env`` makes): python tests/fault_worker.py
FAULT PROCESS STEP, with FAULT one of ``kill`` (SIGKILL itself), ``stall`` (sleep for 10 min) or
``none``; process PROCESS does it before step STEP. Every process prints ``step N`` as it goes.
"""

import os
import signal
import sys
import time

from jaxcomp import launch

fault, faulty, at_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
process_id = launch.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

mesh = Mesh(jax.devices(), ("data",))
total = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()))
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), jnp.ones(len(jax.local_devices())))
for step in range(200):
    if process_id == faulty and step == at_step:
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault == "stall":
            time.sleep(600)
    total(x).block_until_ready()
    print(f"step {step}", flush=True)
    time.sleep(0.05)
