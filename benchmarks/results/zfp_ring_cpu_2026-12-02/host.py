"""One process of a 4-process localhost run: a method's data_parallel step on a zoo model.

python host.py MODEL METHOD '{"rate": 8}' OUTDIR   (OUTDIR "-": no trace; run it through run.py)
"""

import json
import sys
import time

from jaxcomp.distributed import launch

launch.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomp  # noqa: E402
from jaxcomp.training import zoo  # noqa: E402


def main():
    model_name, method, options, out = (
        sys.argv[1],
        sys.argv[2],
        json.loads(sys.argv[3]),
        sys.argv[4],
    )
    model = zoo.build(model_name)
    rng = np.random.default_rng(jax.process_index())
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    local = model.make_batch(rng, 2)
    batch = jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local)
    tx = optax.chain(jaxcomp.compress(method, **options), optax.sgd(0.01))
    dp = jaxcomp.data_parallel(model.loss_fn, tx, mesh)
    state = dp.init(model.params)
    for _ in range(3):
        state, _ = dp.step(state, batch)
        jax.block_until_ready(state)
    wall, cpu = [], []
    for _ in range(5):
        start, start_cpu = time.perf_counter(), time.process_time()
        state, _ = dp.step(state, batch)
        jax.block_until_ready(state)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    print(jax.process_index(), method, "step", np.median(wall), "cpu", np.median(cpu), flush=True)
    tracing = jax.process_index() == 0 and out != "-"
    if tracing:
        jax.profiler.start_trace(out)
    for _ in range(3):
        state, _ = dp.step(state, batch)
        jax.block_until_ready(state)
    if tracing:
        jax.profiler.stop_trace()


main()
