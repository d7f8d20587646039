"""jaxcomp.training.boundary: many small leaves cross the step's shard_map as a few arrays.

The packed step must be the unpacked step bit for bit (the packing only concatenates and
slices), for data_parallel and diloco, replicated and sharded, on 1, 2, 3 and 8 devices; and it
must carry a handful of operands whatever the number of leaves (XLA's partitioner is quadratic
in them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal, need_devices
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.training import boundary
from jaxcomp.training.boundary import Packing


def _leaves():
    rng = np.random.default_rng(0)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    leaves = [
        f32(3, 2),  # replicated, small
        jnp.int32(7),  # replicated scalar of another dtype
        f32(4, 3, 2),  # per-device (4 devices), small
        f32(4, 5),  # per-device, small
        f32(40),  # replicated, too large for max_values=24
        f32(4, 2, 3),  # split along axis 1: travels as it is
        jnp.zeros((0, 3)),  # empty: travels as it is
        f32(2, 2).astype(jnp.bfloat16),  # replicated bfloat16
        f32(4, 1),  # per-device over two mesh axes
        jax.random.key(0),  # a typed key: travels as it is
    ]
    specs = [P(), P(), P("d"), P("d"), P(), P(None, "d"), P(), P(), P(("d", "e")), P()]
    return leaves, specs


def test_packing_round_trips_every_kind_of_leaf():
    leaves, specs = _leaves()
    packing = Packing.plan(leaves, specs, min_leaves=1, max_values=24)
    packed = packing.pack(leaves)
    # Groups: (P(), f32), (P(), i32), (P("d"), f32), (P(), bf16), (P(("d","e")), f32); loose: 4.
    assert len(packing.groups) == 5 and len(packed) == 9 == len(packing.specs)
    assert packed[2].shape == (4, 6 + 5)
    unpacked = packing.unpack(packed)
    assert unpacked[-1] is leaves[-1]
    for got, want in zip(unpacked[:-1], leaves[:-1]):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    # Inside the shard_map a per-device leaf has a leading axis of 1: the same plan applies.
    mine = [x[:1] if s != P() and s != P(None, "d") else x for x, s in zip(leaves, specs)][:-1]
    packing = Packing.plan(leaves[:-1], specs[:-1], min_leaves=1, max_values=24)
    for got, want in zip(packing.unpack(packing.pack(mine)), mine):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_too_few_small_leaves_pack_nothing():
    leaves, specs = _leaves()
    packing = Packing.plan(leaves, specs)  # 7 small leaves, fewer than MANY_SMALL_LEAVES
    assert not packing.groups and packing.specs == specs
    assert all(a is b for a, b in zip(packing.pack(leaves), leaves))


def test_specs_must_match_the_leaves():
    leaves, specs = _leaves()
    with pytest.raises(ValueError, match="specs has 9 entries for 10 leaves"):
        Packing.plan(leaves, specs[:-1])


def _model(n_leaves):
    """A model of ``n_leaves`` small leaves: a chain of tiny layers."""
    rng = np.random.default_rng(1)
    params = {
        f"l{i:03d}": {
            "w": jnp.asarray(rng.standard_normal((4, 4)) * 0.3, jnp.float32),
            "b": jnp.zeros(4),
        }
        for i in range(n_leaves // 2)
    }

    def loss_fn(p, batch):
        h = batch["x"]
        for name in sorted(p):
            h = jnp.tanh(h @ p[name]["w"] + p[name]["b"])
        return jnp.mean((h - batch["y"]) ** 2)

    x = rng.standard_normal((24, 4)).astype(np.float32)
    return params, loss_fn, {"x": jnp.asarray(x), "y": jnp.asarray(np.roll(x, 1, axis=1) * 0.5)}


def _shard_map_operands(jitted, *args):
    """The operands of the one shard_map in ``jitted``'s program."""
    jaxpr = jax.make_jaxpr(jitted)(*args)
    counts = [len(e.invars) for e in jaxpr.eqns if e.primitive.name == "shard_map"]
    assert len(counts) == 1, counts
    return counts[0]


def _train(monkeypatch, min_leaves, n_devices, method, options, shard=None, steps=3):
    monkeypatch.setattr(boundary, "MANY_SMALL_LEAVES", min_leaves)
    params, loss_fn, data = _model(12)
    mesh = Mesh(np.array(jax.devices()[:n_devices]), ("data",))
    tx = optax.chain(jaxcomp.compress(method, **options), optax.adam(3e-2))
    dp = jaxcomp.data_parallel(loss_fn, tx, mesh, shard=shard)
    state, batch = dp.init(params), dp.shard_batch(data)
    operands = _shard_map_operands(dp._step, state, batch)
    history = []
    for _ in range(steps):
        state, metrics = dp.step(state, batch)
        history.append(metrics)
    return (state, history, dp.params(state)), operands


@pytest.mark.parametrize(
    "method, options, n_devices",
    [
        ("dense", {}, 1),
        ("ar_topk", {"ratio": 0.1}, 8),
        ("zfp", {"rate": 8}, 3),
    ]
    + [
        pytest.param(*case, marks=pytest.mark.slow)
        for case in (
            ("dense", {}, 3),
            ("ar_topk", {"ratio": 0.1}, 1),
            ("ar_topk", {"ratio": 0.1}, 2),
            ("powersgd", {"rank": 1}, 2),
            ("sign_ring", {}, 3),
            ("quantized", {"bits": 4}, 8),
        )
    ],
)
def test_a_packed_step_is_the_unpacked_step(monkeypatch, method, options, n_devices):
    need_devices(n_devices)
    packed = _train(monkeypatch, 1, n_devices, method, options)
    loose = _train(monkeypatch, 10**9, n_devices, method, options)
    assert_trees_equal(packed[0], loose[0])
    assert packed[1] < loose[1], (packed[1], loose[1])


@pytest.mark.parametrize("shard", ["optimizer", "params"])
def test_a_packed_sharded_step_is_the_unpacked_step(monkeypatch, shard):
    """Sharded, ``init`` (``Layout.mapped_initial_state``) and ``params()`` (a gather of each
    leaf's shards) cross their ``shard_map`` packed too."""
    need_devices(3)
    packed = _train(monkeypatch, 1, 3, "ar_topk", {"ratio": 0.1}, shard=shard)
    loose = _train(monkeypatch, 10**9, 3, "ar_topk", {"ratio": 0.1}, shard=shard)
    assert_trees_equal(packed[0], loose[0])
    assert packed[1] < loose[1], (packed[1], loose[1])


def test_a_model_of_many_leaves_crosses_in_a_few_arrays():
    """At the defaults: 600 small leaves, Adam and a residual (2,401 state leaves) cross as a
    handful of packed arrays (one per spec and dtype) and the batch."""
    need_devices(2)
    params, loss_fn, data = _model(600)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    tx = optax.chain(jaxcomp.compress("ar_topk", ratio=0.1), optax.adam(1e-2))
    dp = jaxcomp.data_parallel(loss_fn, tx, mesh)
    state, batch = dp.init(params), dp.shard_batch(data)
    assert len(jax.tree.leaves(state)) > 2400
    assert _shard_map_operands(dp._step, state, batch) <= 8


@pytest.mark.parametrize("workers, inner", [(2, None), (4, 2)])
def test_a_packed_diloco_step_is_the_unpacked_step(monkeypatch, workers, inner):
    need_devices(workers * (inner or 1))
    params, loss_fn, data = _model(12)
    devices = np.array(jax.devices()[: workers * (inner or 1)])
    mesh = (
        Mesh(devices, ("workers",))
        if inner is None
        else Mesh(devices.reshape(workers, inner), ("workers", "data"))
    )
    runs = []
    for min_leaves in (1, 10**9):
        monkeypatch.setattr(boundary, "MANY_SMALL_LEAVES", min_leaves)
        run = jaxcomp.diloco(
            loss_fn,
            optax.adam(3e-2),
            mesh=mesh,
            sync_every=2,
            compress=jaxcomp.Quantized(8),
            inner_axis=None if inner is None else "data",
        )
        state, history = run.init(params), []
        for _ in range(4):
            state, metrics = run.step(state, data)
            history.append(metrics)
        runs.append((state, history))
    assert_trees_equal(*runs)


@pytest.mark.parametrize("shard", [None, "optimizer", "params"])
def test_state_avals_are_the_initial_states(shard):
    need_devices(3)
    params, loss_fn, _ = _model(12)
    mesh = Mesh(np.array(jax.devices()[:3]), ("data",))
    tx = optax.chain(jaxcomp.compress("ar_topk", ratio=0.1), optax.adam(3e-2))
    dp = jaxcomp.data_parallel(loss_fn, tx, mesh, shard=shard)
    want = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), dp.init(params))
    avals = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    assert dp.layout.state_avals(avals) == want
