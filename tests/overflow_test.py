"""A sum over the devices that overflows although every device's gradient is finite (issue 24).

Every device's gradient holds 3e38 at ``a[1, 2]`` and in all of ``b`` (float32's largest is
3.4e38), so wherever those entries meet in a sum over the 8 devices it overflows. The guard
looks at the aggregated result too: such entries count in the ``nonfinite`` metric, as 0 under
``"zero"``, and skip the step under ``"skip"`` and ``"raise"``; no state ever turns non-finite.
The gain's energies are summed scaled when they would overflow (a gradient of 1e20 squares to
1e40).
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
from jaxcomp.costmodel import ratio_choice
from jaxcomp.optim.stages import guard

N_DEVICES = 8
SHAPES = {"a": (8, 8), "b": (8,)}
HUGE = 3e38

METHODS = {
    "dense": {},
    "ar_topk": {"ratio": 0.25},
    "allgather_topk": {"ratio": 0.25},
    "zfp": {"rate": 8},
    "quantized": {"bits": 8},
    "randomk": {"ratio": 0.25},
    "bf16": {},
    "fp16": {},
    "powersgd": {"rank": 1},
    "sign": {},
}


def _dp(method, policy, optimizer):
    need_devices(N_DEVICES)
    mesh = Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))
    tx = optax.chain(jaxcomp.compress(method, nonfinite=policy, **METHODS[method]), optimizer)
    return jaxcomp.data_parallel(_loss, tx, mesh)


def _loss(params, batch):
    # Each device's shard of the batch is one row: the gradient is that row.
    return sum(jnp.sum(params[name] * batch[name][0]) for name in SHAPES)


def _params():
    return {name: jnp.full(shape, 0.5, jnp.float32) for name, shape in SHAPES.items()}


def _batch(seed, huge=False):
    rng = np.random.default_rng(seed)
    batch = {
        name: rng.standard_normal((N_DEVICES,) + shape).astype(np.float32)
        for name, shape in SHAPES.items()
    }
    if huge:  # finite on every device; their sum is not
        batch["a"][:, 1, 2] = HUGE
        batch["b"][:] = HUGE
    return batch


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _all_finite(tree):
    return all(
        np.all(np.isfinite(leaf))
        for leaf in jax.tree.leaves(_host(tree))
        if np.issubdtype(leaf.dtype, np.floating)
    )


def _check_replicas_identical(state):
    for leaf in jax.tree.leaves(state):
        if leaf.sharding.is_fully_replicated:
            shards = [np.asarray(s.data) for s in leaf.addressable_shards]
            for shard in shards[1:]:
                np.testing.assert_array_equal(shard, shards[0])


def _strip_metrics(opt_state):
    return jax.tree.map(
        lambda x: x._replace(metrics=None) if isinstance(x, jaxcomp.CompressState) else x,
        opt_state,
        is_leaf=lambda x: isinstance(x, jaxcomp.CompressState),
    )


# The lossy methods spread a value of 3e38 over its block or row (quantized, sign) or leave a
# coding error of about 1e36 in the residual, sent on a later step (zfp, bf16): finite updates
# that Adam squares past float32 (1e72). data_parallel drops the optimizer-state entries that
# turn non-finite (nonfinite_updates="drop"), so Adam's moments stay finite with every method.
def _optimizer(method):
    return optax.adam(0.1)


@pytest.mark.parametrize("method", list(METHODS))
def test_zero_drops_the_overflowed_entries_and_trains_on(method):
    dp = _dp(method, "zero", _optimizer(method))
    state, _ = dp.step(dp.init(_params()), _batch(0))
    state, metrics = dp.step(state, _batch(1, huge=True))
    assert float(metrics["nonfinite"]) > 0  # the overflowed entries, counted
    assert np.isfinite(float(metrics["gain"]))
    assert _all_finite(state.params) and _all_finite(state.opt_state)
    _check_replicas_identical(state)
    moved = state.params
    for step in range(2, 5):  # and it keeps training, finite, on ordinary batches
        # (randomk's residual still holds 3e38s it had not sent: their sum overflows when sent)
        state, metrics = dp.step(state, _batch(step))
        assert _all_finite(state.params) and _all_finite(state.opt_state)
    assert not np.array_equal(np.asarray(moved["a"]), np.asarray(state.params["a"]))
    _check_replicas_identical(state)


@pytest.mark.parametrize("method", list(METHODS))
def test_skip_keeps_every_state_when_the_sum_overflows(method):
    dp = _dp(method, "skip", _optimizer(method))
    state, _ = dp.step(dp.init(_params()), _batch(0))
    before = _host(state)
    after, metrics = dp.step(state, _batch(1, huge=True))
    _check_replicas_identical(after)
    assert _all_finite(after.params) and _all_finite(after.opt_state)
    assert float(metrics["nonfinite"]) > 0
    assert_trees_equal(_host(after.params), before.params)
    assert_trees_equal(_strip_metrics(_host(after.opt_state)), _strip_metrics(before.opt_state))
    # The next step is the one a run that never saw the batch takes.
    resumed, _ = dp.step(after, _batch(2))
    direct, _ = dp.step(state, _batch(2))
    assert_trees_equal(_host(resumed.params), _host(direct.params))


# "raise" is "skip" on the devices (tested for every method above) plus data_parallel's host
# check, which no method changes: four methods of different kinds, to keep CI short.
@pytest.mark.parametrize("method", ["dense", "ar_topk", "quantized", "fp16"])
def test_raise_raises_when_the_sum_overflows(method):
    dp = _dp(method, "raise", _optimizer(method))
    state, _ = dp.step(dp.init(_params()), _batch(0))
    with pytest.raises(FloatingPointError, match=r"step 1: the gradients held \d+ non-finite"):
        dp.step(state, _batch(1, huge=True))
    state, metrics = dp.step(state, _batch(2))  # the state passed in is intact
    assert float(metrics["nonfinite"]) == 0 and _all_finite(state.opt_state)


def _local_metrics(method, grads):
    need_devices(N_DEVICES)
    mesh = Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))
    tx = jaxcomp.compress(method, **METHODS[method])
    state = tx.init({"w": jnp.zeros((8, 8), jnp.float32)})

    def step(g):
        _, new_state = tx.update({"w": g[0]}, state)
        return new_state.metrics

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P()))
    return f(jnp.asarray(grads))


@pytest.mark.parametrize("devices", ["one", "all"])
@pytest.mark.parametrize("method", ["dense", "ar_topk", "allgather_topk", "randomk", "sign"])
def test_gain_is_finite_for_a_gradient_of_1e20(method, devices):
    """1e20 squares to 1e40, past float32: the energies are summed scaled, and the gain is the
    one of the same gradients scaled down by 2**-40 (these methods are scale-invariant). (A gain
    below 1e-38 reads 0 in the scaled units: ar_topk's leader does not pick another device's
    1e20.)"""
    grads = np.random.default_rng(5).standard_normal((N_DEVICES, 8, 8)).astype(np.float32)
    grads[3 if devices == "one" else slice(None), 2, 5] = 1e20
    metrics = _local_metrics(method, grads)
    small = _local_metrics(method, grads * np.float32(2.0**-40))
    gain = float(metrics.gain)
    assert np.isfinite(gain) and 0 <= gain
    np.testing.assert_allclose(gain, float(small.gain), rtol=1e-4, atol=1e-30)
    assert float(metrics.nonfinite) == 0
    if method in ("dense", "allgather_topk") or (method, devices) == ("ar_topk", "all"):
        assert gain > 0.5  # the 1e20 is sent


def test_gain_from_energies_mixes_plain_and_scaled_energies():
    x = jnp.array([1e20, 3e19, -2e19], jnp.float32)
    kept, total = ratio_choice.scaled_energy(x[:1]), ratio_choice.scaled_energy(x)
    want = 1e40 / (1e40 + 9e38 + 4e38)
    np.testing.assert_allclose(
        float(ratio_choice.gain_from_energies(0, 0, kept, total)), want, 1e-5
    )
    # A plain energy next to a scaled one is brought into its units, not dropped.
    plain = jnp.float32(2.0**110)  # beyond the plain limit only as a check of the units
    e = ratio_choice.scaled_energy(jnp.array([2.0**55], jnp.float32))
    np.testing.assert_allclose(float(ratio_choice.gain_from_energies(0, plain, e, e)), 0.5, 1e-6)
    assert float(ratio_choice.compression_gain(x[:1], x)) == pytest.approx(want, rel=1e-5)


def test_finite_totals_counts_and_zeroes():
    totals, count = guard.finite_totals([jnp.array([1.0, jnp.inf, -jnp.inf]), jnp.array([jnp.nan])])
    assert [t.tolist() for t in totals] == [[1.0, 0.0, 0.0], [0.0]] and float(count) == 3
    assert float(guard.agreed_count(jnp.float32(2), jnp.float32(24), 8)) == 5
    new = guard.finite_or_old({"q": jnp.array([1.0, 2.0])}, {"q": jnp.array([jnp.inf, 3.0])})
    assert new["q"].tolist() == [1.0, 3.0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_all_finite_against_numpy(dtype):
    # The largest finite values (whose plain sum overflows), zeros of both signs, tiny values.
    big = float(jnp.finfo(dtype).max)
    rng = np.random.default_rng(0)
    for special in (None, np.nan, np.inf, -np.inf):
        x = np.concatenate([rng.standard_normal(1000), [big, big, -big, 0.0, -0.0, 1e-30]])
        if special is not None:
            x[rng.integers(x.size)] = special
        x = jnp.asarray(x, dtype)
        assert bool(guard.all_finite(x)) == bool(np.isfinite(np.asarray(x, np.float32)).all())


@pytest.mark.parametrize("policy", ["zero", "skip"])
def test_a_plain_leaf_whose_sum_overflows(policy):
    """min_size= leaves "b" out of the compression: its exact sum overflows, and is guarded too."""
    need_devices(N_DEVICES)
    mesh = Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))
    tx = optax.chain(
        jaxcomp.compress("ar_topk", ratio=0.25, min_size=10, nonfinite=policy), optax.adam(0.1)
    )
    dp = jaxcomp.data_parallel(_loss, tx, mesh)
    state, _ = dp.step(dp.init(_params()), _batch(0))
    batch = _batch(1)
    batch["b"][:, 3] = HUGE
    after, metrics = dp.step(state, batch)
    assert float(metrics["nonfinite"]) == 1  # once, though every device holds that total
    assert _all_finite(after.params) and _all_finite(after.opt_state)
    if policy == "skip":
        assert_trees_equal(_host(after.params), _host(state.params))
