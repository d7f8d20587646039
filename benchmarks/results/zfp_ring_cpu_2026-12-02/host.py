"""4-process localhost profile of one method's data_parallel step on a zoo model (process 0 traces).
python host.py MODEL METHOD '{"rate": 8}' OUTDIR"""
import sys, os, time, glob, gzip, json, collections
from jaxcomp.distributed import launch
launch.initialize()
import jax, numpy as np, optax, jaxcomp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxcomp.training import zoo
model_name, method, opts, out = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
model = zoo.build(model_name)
rng = np.random.default_rng(jax.process_index())
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
mesh = Mesh(np.array(devices), ("data",))
sh = NamedSharding(mesh, P("data"))
batch = jax.tree.map(lambda x: jax.make_array_from_process_local_data(sh, x), model.make_batch(rng, 2))
tx = optax.chain(jaxcomp.compress(method, **opts), optax.sgd(0.01))
dp = jaxcomp.data_parallel(model.loss_fn, tx, mesh)
state = dp.init(model.params)
for _ in range(3):
    state, m = dp.step(state, batch); jax.block_until_ready(state)
t = []
c = []
for _ in range(5):
    t0 = time.perf_counter(); c0 = time.process_time()
    state, m = dp.step(state, batch); jax.block_until_ready(state)
    t.append(time.perf_counter() - t0); c.append(time.process_time() - c0)
print(jax.process_index(), method, "step", np.median(t), "cpu", np.median(c), flush=True)
if jax.process_index() == 0 and out != "-":
    jax.profiler.start_trace(out)
for _ in range(3):
    state, m = dp.step(state, batch); jax.block_until_ready(state)
if jax.process_index() == 0 and out != "-":
    jax.profiler.stop_trace()
