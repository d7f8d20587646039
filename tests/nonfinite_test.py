"""compress(nonfinite=...): NaN/Inf gradient entries are never sent nor kept, for every method and
policy.

Each test plants a NaN and a +Inf in device 3's gradient and a -Inf in device 5's (3 entries),
through ``data_parallel`` with ``loss = sum(params * batch row)``, whose gradient is the row. The
references are runs of the same step on the same batch with those entries set to 0 ("zero"), or
without the bad batch at all ("skip").
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal, need_devices
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcomp

N_DEVICES = 8
SHAPES = {"a": (3, 5), "b": (7,), "c": (13,)}
# (leaf, device, index, value): 3 non-finite entries on 2 devices.
PLANTED = [("a", 3, (1, 2), np.nan), ("c", 3, (4,), np.inf), ("b", 5, (0,), -np.inf)]
SLOW = jaxcomp.costmodel.cost.Network.parse("1ms", "10mbit")

METHODS = {
    "dense": {},
    "allgather_topk": {"ratio": 0.25},
    "ar_topk": {"ratio": 0.25},
    "hierarchical_topk": {"ratio": 0.25, "axis_name": ("node", "device")},
    "zfp": {"rate": 8},
    "quantized": {"bits": 8},
    # No "dense" candidate: whichever branch runs compresses.
    "auto": {"ratio": 0.25, "rate": 8, "network": SLOW, "candidates": ("allgather_topk", "zfp")},
}


def _mesh(method):
    need_devices(N_DEVICES)
    devices = np.array(jax.devices()[:N_DEVICES])
    if method == "hierarchical_topk":
        return Mesh(devices.reshape(2, 4), ("node", "device")), ("node", "device")
    return Mesh(devices, ("data",)), "data"


def _loss(params, batch):
    # Each device's shard of the batch is one row: the gradient is that row, NaN and Inf included.
    return sum(jnp.sum(params[name] * batch[name][0]) for name in SHAPES)


def _dp(method, policy, optimizer=None):
    mesh, axis = _mesh(method)
    args = dict(METHODS[method])
    args["axis_name"] = axis
    tx = optax.chain(
        jaxcomp.compress(method, nonfinite=policy, **args), optimizer or optax.sgd(0.1)
    )
    return jaxcomp.data_parallel(_loss, tx, mesh, axis_name=axis)


def _params():
    return {name: jnp.full(shape, 0.5, jnp.float32) for name, shape in SHAPES.items()}


def _batch(seed, bad=None):
    """Per-device gradient rows; ``bad``: "plant" the non-finite entries, "zero" zeros there."""
    rng = np.random.default_rng(seed)
    batch = {
        name: rng.standard_normal((N_DEVICES,) + shape).astype(np.float32)
        for name, shape in SHAPES.items()
    }
    for name, device, index, value in PLANTED:
        if bad == "plant":
            batch[name][(device,) + index] = value
        elif bad == "zero":
            batch[name][(device,) + index] = 0.0
    return batch


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _check_replicas_identical(state):
    """Every replicated leaf (params, the chain's state) holds the same bits on every device."""
    for leaf in jax.tree.leaves(state):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        if leaf.sharding.is_fully_replicated:
            for shard in shards[1:]:
                np.testing.assert_array_equal(shard, shards[0])


def _residuals(state):
    return [
        np.asarray(r)
        for r in jax.tree.leaves(jaxcomp.find_compress_state(state.opt_state).residual)
    ]


def _strip_metrics(opt_state):
    """The optimizer state without compress's metrics (which report the step, bad entries
    included)."""
    return jax.tree.map(
        lambda x: x._replace(metrics=None) if isinstance(x, jaxcomp.CompressState) else x,
        opt_state,
        is_leaf=lambda x: isinstance(x, jaxcomp.CompressState),
    )


def _metrics(metrics):
    return {name: np.asarray(value) for name, value in metrics.items() if name != "loss"}


@pytest.mark.parametrize("method", list(METHODS))
def test_zero_drops_the_entries_and_matches_a_run_with_zeros(method):
    dp = _dp(method, "zero")
    bad_state = clean_state = dp.init(_params())
    for step, bad in enumerate(["plant", None, None]):
        bad_state, bad_metrics = dp.step(bad_state, _batch(step, bad))
        clean_state, clean_metrics = dp.step(clean_state, _batch(step, "zero" if bad else None))
        assert float(bad_metrics["nonfinite"]) == (len(PLANTED) if bad else 0)
        assert float(clean_metrics["nonfinite"]) == 0
        for residual in _residuals(bad_state):
            assert np.all(np.isfinite(residual))
        assert all(np.all(np.isfinite(p)) for p in jax.tree.leaves(_host(bad_state.params)))
        _check_replicas_identical(bad_state)
        # Bit for bit: every method is deterministic given its inputs (quantized's key included).
        assert_trees_equal(_host(bad_state.params), _host(clean_state.params))
        assert_trees_equal(
            _strip_metrics(_host(bad_state.opt_state)), _strip_metrics(_host(clean_state.opt_state))
        )
        got, want = _metrics(bad_metrics), _metrics(clean_metrics)
        got.pop("nonfinite"), want.pop("nonfinite")
        assert_trees_equal(got, want)
        assert np.isfinite(float(bad_metrics["gain"]))


@pytest.mark.parametrize("method", list(METHODS))
def test_skip_keeps_every_state_and_agrees_on_every_device(method):
    dp = _dp(method, "skip", optax.adam(0.1))
    state, _ = dp.step(
        dp.init(_params()), _batch(0)
    )  # adam's moments and the residual are non-zero now
    before = _host(state)
    skipped, metrics = dp.step(state, _batch(1, "plant"))
    assert float(metrics["nonfinite"]) == len(PLANTED)
    _check_replicas_identical(skipped)
    after = _host(skipped)
    assert_trees_equal(after.params, before.params)
    # Everything but compress's metrics (which report the skipped step) and the batch counter.
    assert_trees_equal(_strip_metrics(after.opt_state), _strip_metrics(before.opt_state))
    assert int(after.step) == int(before.step) + 1
    # The next clean step is the one a run that never saw the bad batch takes.
    resumed, resumed_metrics = dp.step(skipped, _batch(2))
    direct, direct_metrics = dp.step(state, _batch(2))
    assert_trees_equal(_host(resumed.params), _host(direct.params))
    assert_trees_equal(_host(resumed.opt_state), _host(direct.opt_state))
    assert_trees_equal(_metrics(resumed_metrics), _metrics(direct_metrics))


@pytest.mark.parametrize("method", list(METHODS))
def test_raise_raises_at_that_step_and_keeps_the_state(method):
    dp = _dp(method, "raise", optax.adam(0.1))
    state, metrics = dp.step(dp.init(_params()), _batch(0))
    assert float(metrics["nonfinite"]) == 0
    with pytest.raises(
        FloatingPointError, match=r"step 1: the gradients held 3 non-finite entries"
    ):
        dp.step(state, _batch(1, "plant"))
    # The state passed in is intact and training goes on from it.
    for leaf in jax.tree.leaves(_host(state.params)) + _residuals(state):
        assert np.all(np.isfinite(leaf))
    state, metrics = dp.step(state, _batch(2))
    assert float(metrics["nonfinite"]) == 0
    _check_replicas_identical(state)


def _local_run(tx, grads_per_device, mesh):
    """One tx.update inside shard_map on given per-device gradients: (updates, state, adam
    count)."""
    state = tx.init({"w": jnp.zeros(grads_per_device.shape[1:], jnp.float32)})

    def step(g):
        updates, new_state = tx.update({"w": g[0]}, state)
        compress_state = jaxcomp.find_compress_state(new_state)
        adam = new_state[1][0]
        adam_count = (
            adam.count if isinstance(adam, optax.ScaleByAdamState) else jnp.zeros((), jnp.int32)
        )
        return updates["w"], compress_state.residual["w"][None], compress_state.metrics, adam_count

    f = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data"), P(), P()))
    )
    return f(jnp.asarray(grads_per_device))


def test_skip_nonfinite_wraps_a_chain_in_a_custom_step():
    need_devices(N_DEVICES)
    mesh = Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))
    tx = jaxcomp.skip_nonfinite(
        optax.chain(jaxcomp.compress("ar_topk", ratio=0.5, nonfinite="skip"), optax.adam(0.1))
    )
    grads = np.random.default_rng(0).standard_normal((N_DEVICES, 6)).astype(np.float32)
    grads[2, 1] = np.nan
    updates, residual, metrics, count = _local_run(tx, grads, mesh)
    assert np.all(np.asarray(updates) == 0) and int(count) == 0 and float(metrics.nonfinite) == 1
    assert np.all(np.asarray(residual) == 0)  # the residual was not touched
    grads[2, 1] = 0.0
    updates, residual, metrics, count = _local_run(tx, grads, mesh)
    assert np.any(np.asarray(updates) != 0) and int(count) == 1 and float(metrics.nonfinite) == 0


@pytest.mark.parametrize("method", ["allgather_topk", "ar_topk", "zfp", "quantized"])
def test_gain_is_measured_not_one_with_a_nan(method):
    need_devices(N_DEVICES)
    mesh = Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))
    tx = jaxcomp.compress(method, **METHODS[method])
    grads = np.random.default_rng(1).standard_normal((N_DEVICES, 64)).astype(np.float32)
    grads[4, 7] = np.nan
    grads[0, 9] = np.inf
    _, residual, metrics, _ = _local_run(optax.chain(tx, optax.sgd(1.0)), grads, mesh)
    gain = float(metrics.gain)
    assert np.isfinite(gain) and gain != 1.0 and 0.0 < gain
    assert float(metrics.nonfinite) == 2
    assert np.all(np.isfinite(np.asarray(residual)))
    grads[4, 7] = grads[0, 9] = 0.0
    _, _, clean, _ = _local_run(optax.chain(tx, optax.sgd(1.0)), grads, mesh)
    assert gain == float(clean.gain)


@pytest.mark.parametrize("method", ["zfp", "quantized", "ar_topk"])
def test_one_bad_entry_leaves_the_others_of_every_device_exact(method):
    """zfp must not spread a NaN to its block, quantized must not turn it into -R, ar_topk must not
    hide it."""
    need_devices(N_DEVICES)
    mesh = Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))
    tx = optax.chain(jaxcomp.compress(method, **METHODS[method]), optax.sgd(1.0))
    grads = np.random.default_rng(2).standard_normal((N_DEVICES, 32)).astype(np.float32)
    clean = grads.copy()
    clean[6, 5] = 0.0
    for value in (np.nan, np.inf):
        grads[6, 5] = value
        got = _local_run(tx, grads, mesh)
        want = _local_run(tx, clean, mesh)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_bfloat16_gradients():
    need_devices(N_DEVICES)
    mesh = Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))
    tx = optax.chain(jaxcomp.compress("allgather_topk", ratio=0.25), optax.sgd(1.0))
    grads = np.random.default_rng(3).standard_normal((N_DEVICES, 16)).astype(np.float32)
    bad = grads.copy()
    bad[1, 3], bad[7, 0] = np.nan, -np.inf
    grads[1, 3] = grads[7, 0] = 0.0
    state = tx.init({"w": jnp.zeros(16, jnp.bfloat16)})

    def run(g):
        def step(g):
            updates, new_state = tx.update({"w": g[0]}, state)
            return updates["w"], new_state[0].residual["w"][None], new_state[0].metrics.nonfinite

        f = jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data"), P()))
        return jax.jit(f)(jnp.asarray(g, jnp.bfloat16))  # eager, op by op, it took 30 s

    got, want = run(bad), run(grads)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert float(got[2]) == 2 and float(want[2]) == 0


def test_nonfinite_argument_is_checked():
    with pytest.raises(
        ValueError, match=r"nonfinite must be one of \('zero', 'skip', 'raise'\).*'ignore'"
    ):
        jaxcomp.compress("dense", nonfinite="ignore")
    state = jaxcomp.compress("dense", nonfinite="skip").init({"w": jnp.zeros(3)})
    assert state.policy == jaxcomp.NonfinitePolicy("skip")
    assert jax.tree.leaves(state.policy) == []  # static: no array in the state


def test_a_state_of_another_policy_is_refused():
    need_devices(N_DEVICES)
    mesh = Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))
    state = jaxcomp.compress("dense", nonfinite="skip").init({"w": jnp.zeros(2)})
    tx = jaxcomp.compress("dense")
    f = jax.shard_map(
        lambda g: tx.update({"w": g}, state)[0]["w"], mesh=mesh, in_specs=P("data"), out_specs=P()
    )
    with pytest.raises(ValueError, match="nonfinite='skip'"):
        f(jnp.ones(2 * N_DEVICES))


def test_adaptive_ratio_learns_from_the_gain_of_huge_gradients():
    need_devices(N_DEVICES)
    mesh = Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))
    tx = jaxcomp.compress("auto", adaptive_ratio=True, candidates=("allgather_topk",), network=SLOW)
    state = tx.init({"w": jnp.zeros(64)})

    def step(g):
        _, new_state = tx.update({"w": g[0]}, state)
        return new_state.metrics, new_state.auto.ratio

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P()))
    grads = np.random.default_rng(4).standard_normal((N_DEVICES, 64)).astype(np.float32)
    grads[3, 2] = np.nan
    metrics, ratio = f(jnp.asarray(grads))
    assert (
        np.isfinite(float(metrics.gain)) and int(ratio.count) == 1
    )  # a NaN entry: the gain of the rest
    # Finite, and the sums of squares would overflow: summed scaled, the gain is still measured.
    big, ratio = f(jnp.asarray(grads * 1e30))
    np.testing.assert_allclose(float(big.gain), float(metrics.gain), rtol=1e-4)
    assert int(ratio.count) == 1 and np.all(np.isfinite(np.asarray(ratio.gain_sum)))
