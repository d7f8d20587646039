"""Issue 24 (reliability, round 3): one test per case, named after it.

The cases of the command lines are in tests/cli_test.py (``--density``, ``--repeats``, ``--hosts``);
every method on 1, 2, 3 and 8 devices is tests/train_test.py's
``test_every_method_trains_on_1_2_3_and_8_devices``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import count_compilations, need_devices
from jax.sharding import Mesh

import jaxcomp


def _mesh(n=8):
    need_devices(n)
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def _batch(rows):
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(rows, 16)).astype(np.float32),
        "y": rng.normal(size=(rows, 4)).astype(np.float32),
    }


def _tx(learning_rate=0.1):
    return optax.chain(jaxcomp.compress("ar_topk", ratio=0.25), optax.sgd(learning_rate))


PARAMS = {"w": jnp.zeros((16, 4), jnp.float32)}


@pytest.mark.parametrize("n_devices", [1, 2, 3])
def test_auto_trains_on_small_meshes(n_devices):
    """``compress("auto")`` raised "switch branches must have equal output types" on 1 device."""
    tx = optax.chain(jaxcomp.compress("auto", ratio=0.25), optax.sgd(0.1))
    dp = jaxcomp.data_parallel(_loss, tx, _mesh(n_devices))
    state = dp.init(PARAMS)
    batch = dp.shard_batch(_batch(8 * n_devices))
    losses = []
    for _ in range(4):
        state, metrics = dp.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def test_gather_dtype_wider_than_jax_computes_is_refused():
    """``gather_dtype="float64"`` without x64 was accepted, and gathered float32 silently."""
    with pytest.raises(ValueError, match="gather_dtype=float64 needs jax_enable_x64"):
        jaxcomp.data_parallel(_loss, _tx(), _mesh(), shard="params", gather_dtype="float64")


@pytest.mark.parametrize("shard", [None, "params"])
def test_params_of_none_is_a_type_error(shard):
    dp = jaxcomp.data_parallel(_loss, _tx(), _mesh(), shard=shard)
    with pytest.raises(TypeError, match="state must be the TrainState that init returns"):
        dp.params(None)


def test_params_of_a_sharded_state_compiles_its_gather_once():
    """``dp.params`` gathered the shards with a jit of a new function at every call: an eval loop
    of a ``shard="params"`` run compiled the gather at every evaluation."""
    dp = jaxcomp.data_parallel(_loss, _tx(), _mesh(), shard="params")
    state = dp.init(PARAMS)
    first = dp.params(state)
    state, _ = dp.step(state, dp.shard_batch(_batch(16)))
    with count_compilations() as compiles:
        second = dp.params(state)
    assert compiles[0] == 0
    assert not np.array_equal(first["w"], second["w"])  # the gather of the new state's shards


def test_params_of_another_data_parallels_state_is_refused():
    """``dp.params(state)`` of another data_parallel returned its shards as if they were params."""
    mesh = _mesh()
    plain = jaxcomp.data_parallel(_loss, _tx(), mesh)
    sharded = jaxcomp.data_parallel(_loss, _tx(), mesh, shard="params")
    other_tx = jaxcomp.data_parallel(
        _loss, optax.chain(jaxcomp.compress("ar_topk", ratio=0.25), optax.adam(0.1)), mesh
    )
    plain_state, sharded_state = plain.init(PARAMS), sharded.init(PARAMS)
    with pytest.raises(ValueError, match="another shard= or mesh"):
        plain.params(sharded_state)
    with pytest.raises(ValueError, match="does not fit state.params"):
        other_tx.params(plain_state)
    with pytest.raises(ValueError, match="shards"):
        sharded.params(plain_state)
    # and its own state still works, in both layouts
    np.testing.assert_array_equal(plain.params(plain_state)["w"], PARAMS["w"])
    np.testing.assert_array_equal(sharded.params(sharded_state)["w"], PARAMS["w"])


EMPTY_LEAF_METHODS = [
    ("dense", {}),
    ("ar_topk", {"ratio": 0.25}),
    ("zfp", {"rate": 8}),
    ("quantized", {"bits": 4}),
    ("bf16", {}),
    ("powersgd", {}),
    # per leaf, the empty leaf is a group of its own: its "sent" is a sparse pair of nothing
    ("allgather_topk", {"ratio": 0.25, "granularity": "leaf"}),
]


# PowerSGD has no reduce-scatter form, so no shard= (refused with its own error elsewhere); the
# per-leaf top-k case is the sparse path (unsharded; with shard= the sum is a reduce-scatter).
EMPTY_LEAF_CASES = [
    (method, options, shard)
    for method, options in EMPTY_LEAF_METHODS
    for shard in (
        [None] if method in ("powersgd", "allgather_topk") else [None, "optimizer", "params"]
    )
]


@pytest.mark.parametrize(
    "method, options, shard", EMPTY_LEAF_CASES, ids=[f"{m}-{s}" for m, _, s in EMPTY_LEAF_CASES]
)
def test_a_leaf_without_values_just_works(method, options, shard):
    """A zero-size leaf raised "n must be in [1, 2147483647], got 0" (dense, any shard=)."""

    def loss(params, batch):
        return _loss(params, batch) + jnp.sum(params["empty"])

    tx = optax.chain(jaxcomp.compress(method, **options), optax.adam(0.1))
    dp = jaxcomp.data_parallel(loss, tx, _mesh(), shard=shard)
    state = dp.init({**PARAMS, "empty": jnp.zeros((0, 3), jnp.float32)})
    state, metrics = dp.step(state, dp.shard_batch(_batch(16)))
    params = dp.params(state)
    assert params["empty"].shape == (0, 3)
    assert np.isfinite(float(metrics["loss"])) and np.abs(np.asarray(params["w"])).sum() > 0
