"""Worker of multihost_test.py: a few data-parallel steps, run under jaxcomp.distributed.launch or
alone.

Usage: python tests/multihost_worker.py OUT.npz. Under the launcher each process feeds its own
rows of the global batch; process 0 writes the final params of every method to OUT.npz.
"""

import sys

from jaxcomp.distributed import launch

launch.initialize()  # before any JAX op

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from jaxcomp.costmodel.cost import Network  # noqa: E402
from jaxcomp.optim.transform import compress, find_compress_state  # noqa: E402
from jaxcomp.training.trainer import data_parallel  # noqa: E402
from jaxcomp.training.trial import Trial  # noqa: E402

STEPS = 3
GLOBAL_BATCH = 32
# "auto" on a given slow network: every process must run the same branch (each process picks
# it on the host from the same report, jaxcomp.training.branches).
# label: (method, its options, data_parallel's shard=); the sharded runs reduce-scatter the
# gradient and all-gather the params across the two processes.
METHODS = {
    "dense": ("dense", {}, None),
    "ar_topk": ("ar_topk", {"ratio": 0.05}, None),
    "auto": (
        "auto",
        {"ratio": 0.05, "network": Network.parse("1ms", "1gbit"), "decide_every": 2},
        None,
    ),
    "dense_optimizer": ("dense", {}, "optimizer"),
    "quantized_params": ("quantized", {"bits": 8}, "params"),
}


def loss_fn(params, batch):
    logits = jax.numpy.tanh(batch["x"] @ params["w1"]) @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def global_batches():
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        x = rng.normal(size=(GLOBAL_BATCH, 12)).astype(np.float32)
        yield {"x": x, "y": x[:, :5].argmax(axis=1).astype(np.int32)}


def run():
    """Final params per method; the same whether 1 process or several share the 8 devices."""
    # Process-major device order: process p's devices hold rows [p * rows, (p + 1) * rows).
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices), ("data",))
    rows = GLOBAL_BATCH // jax.process_count()
    lo = jax.process_index() * rows
    rng = np.random.default_rng(1)
    params = {
        "w1": (rng.normal(size=(12, 16)) / 4).astype(np.float32),
        "w2": (rng.normal(size=(16, 5)) / 4).astype(np.float32),
    }
    out = {}
    for method, (name, options, shard) in METHODS.items():
        tx = optax.chain(compress(name, **options), optax.adam(1e-2))
        # No trial of auto's candidates here: its timings differ between one process and two,
        # and so may the branch it keeps (_check_trial_agrees runs one).
        dp = data_parallel(loss_fn, tx, mesh, shard=shard, auto_trial=None)
        state, metrics = _train(dp, dp.init(params), lo, rows)
        # Metrics are this process's copies: a training loop logs them on every process.
        out[f"{method}/loss"] = np.float32(float(metrics["loss"]))
        for name, value in dp.params(state).items():
            out[f"{method}/{name}"] = np.asarray(value.addressable_data(0))
        if method == "auto":
            out["auto/method"] = np.asarray(
                find_compress_state(state.opt_state).metrics.method.addressable_data(0)
            )
            # Probing from every process must give every process the same network and codec times.
            auto = find_compress_state(
                dp.reprobe(state, sizes=(1024, 65536), repeats=2).opt_state
            ).auto
            measured = np.concatenate(
                [
                    np.asarray(auto.network.addressable_data(0)),
                    np.asarray(auto.overhead.addressable_data(0)),
                ]
            )
            _same_everywhere(measured, "processes measured different networks")
            # Two candidates, one timed step each: 4 calls. Within 20x: the predictions here
            # span 9x (3 ms to 28 ms).
            wide = data_parallel(
                loss_fn, tx, mesh, auto_trial=Trial(candidates=2, steps=1, within=20.0)
            )
            _check_trial_agrees(wide, params, lo, rows)
    return out


def _train(dp, state, lo, rows, repeat=1):
    for batch in list(global_batches()) * repeat:
        local = {name: value[lo : lo + rows] for name, value in batch.items()}
        state, metrics = dp.step(state, dp.shard_batch(local))
    return state, metrics


def _same_everywhere(values, message):
    everywhere = np.asarray(multihost_utils.process_allgather(np.asarray(values)))
    if not (everywhere == everywhere[:1]).all():
        raise SystemExit(f"{message}: {everywhere}")


def _check_trial_agrees(dp, params, lo, rows):
    """auto's trial (jaxcomp.training.trial) in two processes: each process times the same
    branches, and all of them keep the slowest process's medians and the same branch."""
    state, _ = _train(dp, dp.init(params), lo, rows, repeat=2)
    auto = find_compress_state(state.opt_state)
    if dp.step.in_trial or not (np.asarray(auto.auto.measured.addressable_data(0)) > 0).any():
        raise SystemExit("auto's trial did not finish in 6 steps")
    seen = [auto.auto.measured, auto.auto.choice, auto.metrics.method]
    _same_everywhere(
        np.concatenate([np.ravel(np.asarray(x.addressable_data(0))) for x in seen]),
        "processes ended auto's trial differently",
    )


if __name__ == "__main__":
    result = run()
    if jax.process_index() == 0:
        np.savez(sys.argv[1], **result)
