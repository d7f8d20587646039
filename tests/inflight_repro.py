"""XLA:CPU aborts a loop that dispatches SPMD steps without reading their results (no jaxcomp).

Minimal reproduction of issue 14, item 6, for reporting upstream: a plain ``jax.jit`` data-parallel
step (a small MLP, one ``psum`` of the gradient through the sharded batch) on 8 virtual CPU
devices, dispatched ``--steps`` times without blocking. With jax/jaxlib 0.10.2 on a 2-core host,
after a few dozen queued steps XLA kills the process (SIGABRT) with::

    Termination timeout for `all reduce RendezvousKey{... num_local_participants=8 ...}` of 40
    seconds exceeded ... Expected 8 threads to join the rendezvous, but only 7 of them arrived on
    time

``--block-every 1`` (read each step's loss) runs the same steps to the end; so does
``jaxcomp.data_parallel``, which waits for the step ``max_steps_in_flight`` back. Run::

    python tests/inflight_repro.py --steps 400                 # aborts after ~1 min (exit -6)
    python tests/inflight_repro.py --steps 400 --block-every 1 # completes

or through pytest (off by default, since it takes minutes and aborts a process)::

    JAXCOMP_INFLIGHT_REPRO=1 pytest tests/train_test.py -k repro
"""

import argparse
import os
import time

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument(
        "--block-every", type=int, default=0, help="read the loss every N steps (0: never)"
    )
    args = parser.parse_args()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def loss_fn(params, x, y):
        hidden = jnp.tanh(x @ params["w1"])
        return jnp.mean((hidden @ params["w2"] - y) ** 2)

    @jax.jit
    def step(params, x, y):
        # GSPMD inserts the all-reduce of the gradient over the 8 devices of the batch axis.
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), loss

    rng = np.random.default_rng(0)
    params = jax.device_put(
        {
            "w1": rng.normal(size=(64, 256)).astype(np.float32) / 8,
            "w2": rng.normal(size=(256, 64)).astype(np.float32) / 16,
        },
        replicated,
    )
    x = jax.device_put(rng.normal(size=(256, 64)).astype(np.float32), sharded)
    y = jax.device_put(rng.normal(size=(256, 64)).astype(np.float32), sharded)
    began = time.perf_counter()
    for i in range(args.steps):
        params, loss = step(params, x, y)
        if args.block_every and (i + 1) % args.block_every == 0:
            loss.block_until_ready()
    print(f"dispatched {args.steps} steps in {time.perf_counter() - began:.1f} s", flush=True)
    print(
        f"loss {float(loss):.6f} after {args.steps} steps, {time.perf_counter() - began:.1f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
