"""jaxcomp.training.layout, .mask and .state: the pieces data_parallel's step is built from."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import need_devices
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxcomp.methods import Dense
from jaxcomp.optim.transform import CompressState, compress
from jaxcomp.training.layout import Layout
from jaxcomp.training.mask import per_device_mask
from jaxcomp.training.state import TrainState, avals_of, check_params, tree_key

N_DEVICES = 8
PARAMS = {
    "w": jax.ShapeDtypeStruct((5, 3), jnp.float32),
    "b": jax.ShapeDtypeStruct((3,), jnp.float32),
}


def _mesh():
    need_devices(N_DEVICES)
    return Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))


def _layout(tx, shard=None):
    return Layout(tx, _mesh(), "data", shard)


def test_the_residual_is_per_device_and_adam_is_not():
    layout = _layout(optax.chain(compress("ar_topk", ratio=0.5), optax.adam(0.1)))
    state_def, mask = per_device_mask(layout, PARAMS)
    leaves = state_def.unflatten(mask)
    assert jax.tree.leaves(leaves[0].residual) == [True, True]
    assert not any(jax.tree.leaves(leaves[1]))


def test_without_error_feedback_nothing_is_per_device():
    layout = _layout(optax.chain(compress("dense"), optax.sgd(0.1)))
    assert not any(per_device_mask(layout, PARAMS)[1])


def test_sharded_optimizer_state_is_per_device():
    layout = _layout(optax.chain(compress("dense"), optax.adam(0.1)), shard="optimizer")
    state_def, mask = per_device_mask(layout, PARAMS)
    adam = state_def.unflatten(mask)[1][0]
    assert jax.tree.leaves(adam.mu) == [True, True] and not adam.count


def test_a_tx_whose_aggregate_differs_per_device_is_refused():
    zfp = compress("zfp", rate=8, algorithm="recursive_doubling")
    with pytest.raises(ValueError, match="differ per device"):
        per_device_mask(_layout(optax.chain(zfp, optax.sgd(0.1))), PARAMS)


@pytest.mark.parametrize("shard", [None, "optimizer"])
def test_a_plain_optimizer_gets_a_dense_mean_in_front(shard):
    """A tx with no compress in it (a plain optax optimizer) is averaged densely first, as
    PyTorch's DDP does, instead of each device updating from its own gradient."""
    layout = _layout(optax.sgd(0.1), shard=shard)
    state_def, mask = per_device_mask(layout, PARAMS)
    first = layout.tx.init(PARAMS)[0]  # chain(compress("dense"), sgd)
    assert isinstance(first, CompressState) and first.methods == (Dense(),)
    assert not any(mask)  # nothing differs per device but (sharded) the optimizer's shards


def test_the_mask_is_cached_per_shapes():
    layout = _layout(optax.chain(compress("ar_topk", ratio=0.5), optax.sgd(0.1)))
    first = layout.per_device_mask(PARAMS)
    assert layout.per_device_mask(jax.tree.map(jnp.zeros_like, PARAMS)) is first


def test_state_specs_put_per_device_leaves_on_the_data_axis():
    layout = _layout(optax.chain(compress("ar_topk", ratio=0.5), optax.sgd(0.1)), shard="params")
    specs = layout.state_specs(PARAMS)
    assert isinstance(specs, TrainState) and specs.step == P()
    assert jax.tree.leaves(specs.params, is_leaf=lambda x: isinstance(x, P)) == [P("data")] * 2
    residual = specs.opt_state[0].residual
    assert jax.tree.leaves(residual, is_leaf=lambda x: isinstance(x, P)) == [P("data")] * 2


def test_initial_state_matches_the_specs_shapes():
    layout = _layout(optax.chain(compress("ar_topk", ratio=0.5), optax.sgd(0.1)), shard="params")
    state = jax.eval_shape(layout.initial_state, PARAMS)
    assert state.params["w"].shape == (N_DEVICES, 2)  # ceil(15 / 8)
    assert state.opt_state[0].residual["w"].shape == (N_DEVICES, 5, 3)
    layout.remember_shapes(PARAMS)
    assert layout.whole_avals(state.params) == avals_of(PARAMS)


TXS = {
    "ar_topk + adam": lambda: optax.chain(compress("ar_topk", ratio=0.5), optax.adam(0.1)),
    "powersgd": lambda: optax.chain(compress("powersgd", rank=2), optax.sgd(0.1)),
    "zfp": lambda: optax.chain(compress("zfp", rate=8), optax.sgd(0.1)),
    "topk + momentum": lambda: optax.chain(
        compress("allgather_topk", ratio=0.5, momentum_correction=0.9), optax.sgd(0.1)
    ),
    "sign_ring": lambda: optax.chain(compress("sign_ring"), optax.adam(0.1)),
    "dense": lambda: optax.chain(compress("dense"), optax.adamw(0.1)),
}


@pytest.mark.parametrize("n_devices", [1, 2, 3, 8])
@pytest.mark.parametrize("name", TXS)
def test_unsharded_initial_state_is_the_mapped_one(name, n_devices):
    """Unsharded, the initial state is made outside shard_map (its boundary of one operand per
    leaf costs XLA's partitioner time quadratic in the leaves): the same values, shapes and
    shardings as the shard_map's rows."""
    need_devices(n_devices)
    mesh = Mesh(np.array(jax.devices()[:n_devices]), ("data",))
    layout = Layout(TXS[name](), mesh, "data")
    params = {"w": jnp.arange(15.0).reshape(5, 3), "b": jnp.ones(3), "m": jnp.ones((16, 12))}
    sharding = layout.state_sharding(avals_of(params))
    made = jax.jit(layout.initial_state, out_shardings=sharding)(params)
    mapped = jax.jit(layout.mapped_initial_state, out_shardings=sharding)(params)
    assert jax.tree.structure(made) == jax.tree.structure(mapped)
    for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(mapped)):
        assert a.shape == b.shape and a.dtype == b.dtype and a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(m for m in layout.per_device_mask(avals_of(params))[1]) == (name != "dense")


def test_unknown_shards_are_refused_with_a_way_out():
    layout = _layout(optax.chain(compress("dense"), optax.sgd(0.1)), shard="params")
    with pytest.raises(ValueError, match="init\\(params\\) or state_sharding"):
        layout.whole_avals({"w": jnp.zeros((N_DEVICES, 2))})
    with pytest.raises(ValueError, match="shards for 4 devices"):
        layout.whole_avals({"w": jnp.zeros((4, 2))})


def test_check_state_refuses_a_foreign_optimizer_state():
    layout = _layout(optax.chain(compress("ar_topk", ratio=0.5), optax.sgd(0.1)))
    state = jax.eval_shape(layout.initial_state, PARAMS)
    assert layout.check_state(state) == avals_of(PARAMS)
    other = jax.eval_shape(
        layout.initial_state, {"w": PARAMS["w"], "b": jax.ShapeDtypeStruct((4,), jnp.float32)}
    )
    with pytest.raises(ValueError, match="does not fit state.params"):
        layout.check_state(state._replace(opt_state=other.opt_state))
    with pytest.raises(TypeError, match="TrainState"):
        layout.check_state((state.params, state.opt_state, state.step))


def test_params_are_checked_and_keyed_by_shape():
    with pytest.raises(ValueError, match="no arrays"):
        check_params({})
    with pytest.raises(ValueError, match="no values"):
        check_params({"w": jnp.zeros((0, 3))})
    with pytest.raises(TypeError, match=r"params\['n'\] has dtype int32"):
        check_params({"n": jnp.zeros(2, jnp.int32)})
    assert tree_key(avals_of(jnp.zeros(3))) != tree_key(avals_of(jnp.zeros(3, jnp.bfloat16)))
