"""Issue 24, item 5: resuming a data_parallel state (orbax) on another number of devices.

Saved on 8 devices, restored onto 4 and 2 with ``dp.restore`` (or ``state_shapes(params,
n_devices=8)`` + ``dp.resize``): params and replicated state kept bit for bit, the optimizer's
shards re-split exactly, the error-feedback residuals summed and spread so that the residual mass
of the next aggregate is kept; 8 -> 8 is bit-identical to not resizing.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import need_devices
from jax.sharding import Mesh

import jaxcomp
from jaxcomp.optim import sharding
from jaxcomp.training import resize

N = 8

CASES = {
    "dense": ("dense", None, {}),
    "ar_topk": ("ar_topk", None, {"ratio": 0.1}),
    "powersgd": ("powersgd", None, {"rank": 2}),
    "zfp-params": ("zfp", "params", {"rate": 8}),
    "ar_topk-optimizer": ("ar_topk", "optimizer", {"ratio": 0.1}),
}


def _mesh(n):
    need_devices(N)
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def _loss(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return batch["scale"] * jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def _params():
    rng = np.random.default_rng(0)
    return {  # 228, 19 and 57 values: none splits evenly over 8, 4 or 2 devices
        "w1": jnp.asarray(rng.normal(size=(12, 19)) / 4, jnp.float32),
        "b1": jnp.zeros(19, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(19, 3)) / 4, jnp.float32),
    }


def _batches(steps, rows=32, scale=1.0):
    rng = np.random.default_rng(1)
    for _ in range(steps):
        x = rng.normal(size=(rows, 12)).astype(np.float32)
        yield {
            "x": jnp.asarray(x),
            "y": jnp.asarray(np.stack([x[:, 0], x[:, 1] * x[:, 2], -x[:, 3]], 1)),
            "scale": jnp.full((rows,), scale, jnp.float32),
        }


def _loss_rows(params, batch):
    return _loss(params, {**batch, "scale": batch["scale"][0]})


def _dp(case, n, inner=None):
    method, shard, options = CASES[case]
    tx = optax.chain(jaxcomp.compress(method, **options), inner or optax.adam(1e-2))
    return jaxcomp.data_parallel(_loss_rows, tx, _mesh(n), shard=shard)


def _saved(case, path, steps=3, inner=None):
    """A state trained on 8 devices, saved with orbax at ``path``."""
    dp = _dp(case, N, inner)
    state = dp.init(_params())
    for batch in _batches(steps):
        state, _ = dp.step(state, batch)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, state)
    checkpointer.wait_until_finished()
    return dp, state


def _residual_mass(state, n):
    """sum_d r_d / n of every residual leaf (what the next mean aggregate adds)."""
    found = jaxcomp.find_compress_state(state.opt_state)
    return jax.tree.map(lambda r: np.asarray(r).sum(0) / n, found.residual)


def _whole_shards(dp, state):
    """Every per-device optimizer shard leaf, gathered into its flat values (padding dropped)."""
    avals = dp.layout.whole_avals(state.params)
    _, mask = dp.layout.per_device_mask(avals)
    roles = resize._roles(dp.layout, state.opt_state, mask)
    leaves = jax.tree.leaves(state.opt_state)
    return [np.asarray(x).reshape(-1) for x, role in zip(leaves, roles) if role == "shard"]


# Every case from 8 devices to 2; to 4 (which splits each of 8's shards in two, not in four) for
# the two sharded cases, where the split is what differs.
FEWER = [(case, 2) for case in CASES] + [("zfp-params", 4), ("ar_topk-optimizer", 4)]


@pytest.mark.parametrize("case, n", FEWER)
def test_resume_on_fewer_devices(case, n, tmp_path):
    dp8, state8 = _saved(case, tmp_path / "ckpt")
    dp = _dp(case, n)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing here is re-initialized: no warning
        state = dp.restore(tmp_path / "ckpt", _params())
    # The params, step and every replicated leaf (adam's moments, PowerSGD's Q) as saved.
    for a, b in zip(jax.tree.leaves(dp.params(state)), jax.tree.leaves(dp8.params(state8))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(state.step) == int(state8.step) == 3
    old, new = (
        jaxcomp.find_compress_state(state8.opt_state),
        jaxcomp.find_compress_state(state.opt_state),
    )
    for a, b in zip(jax.tree.leaves(old.method_state), jax.tree.leaves(new.method_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # PowerSGD's Q
    np.testing.assert_array_equal(np.asarray(old.key), np.asarray(new.key))
    assert int(old.step) == int(new.step)
    # The residual mass of the next (mean) aggregate: sum_j r'_j / n == sum_d r_d / 8.
    for a, b in zip(
        jax.tree.leaves(_residual_mass(state, n)), jax.tree.leaves(_residual_mass(state8, N))
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # The optimizer's shards: the same values at the same flat positions (every value of a leaf
    # lies before k; beyond is padding, which a lossy method such as zfp may have made non-zero).
    for a, b in zip(_whole_shards(dp, state), _whole_shards(dp8, state8)):
        k = min(a.size, b.size)
        np.testing.assert_array_equal(a[:k], b[:k])
    # Training goes on.
    losses = []
    for batch in _batches(8):
        state, metrics = dp.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("case", ["ar_topk", "ar_topk-optimizer"])
def test_first_step_after_resize_applies_the_same_residual_mass(case, tmp_path):
    """With zero gradients and sgd(1), a step moves the params by -aggregate, and error feedback
    keeps aggregate + sum_j r'_j / n == sum_d r_d / N (mean): the resized run's first step sees
    the same residual mass as the 8-device run's next step."""
    dp8, state8 = _saved(case, tmp_path / "ckpt", inner=optax.sgd(1.0))
    zero = next(_batches(1, scale=0.0))

    def applied(dp, state):
        before = dp.params(state)
        after_state, _ = dp.step(state, zero)
        after = dp.params(after_state)
        moved = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b), before, after)
        kept = _residual_mass(after_state, dp.n_devices)
        return jax.tree.map(lambda m, k: m + k, moved, kept)

    want = _residual_mass(state8, N)
    for n in (N, 4, 2):
        dp = _dp(case, n, optax.sgd(1.0))
        got = applied(dp, dp.restore(tmp_path / "ckpt", _params()))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_residual_rule_for_summed_gradients():
    """mean=False: the aggregate sums, so the new residuals keep the sum itself."""
    stacked = jnp.arange(24.0).reshape(8, 3)
    for n in (4, 2, 16):
        mean = resize.redistribute_residual(stacked, n, mean=True)
        summed = resize.redistribute_residual(stacked, n, mean=False)
        np.testing.assert_allclose(np.asarray(mean).sum(0) / n, np.asarray(stacked).sum(0) / 8)
        np.testing.assert_allclose(np.asarray(summed).sum(0), np.asarray(stacked).sum(0))


@pytest.mark.parametrize("case", list(CASES))
def test_same_device_count_is_bit_identical(case, tmp_path):
    dp8, state8 = _saved(case, tmp_path / "ckpt")
    fresh = _dp(case, N)
    restored = fresh.restore(tmp_path / "ckpt", _params())
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state8)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    batch = next(_batches(1))
    a, _ = dp8.step(state8, batch)
    b, _ = fresh.step(restored, batch)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_resize_in_memory_and_back_up():
    """dp.resize takes a state of another mesh directly, also onto more devices (2 -> 8)."""
    small = _dp("zfp-params", 2)
    state = small.init(_params())
    for batch in _batches(2):
        state, _ = small.step(state, batch)
    big = _dp("zfp-params", N)
    grown = big.resize(state, _params())
    for a, b in zip(jax.tree.leaves(big.params(grown)), jax.tree.leaves(small.params(state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(
        jax.tree.leaves(_residual_mass(grown, N)), jax.tree.leaves(_residual_mass(state, 2))
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    big.step(grown, next(_batches(1)))


@pytest.mark.parametrize("case", ["ar_topk", "zfp-params", "ar_topk-optimizer"])
def test_stepping_a_state_of_another_device_count_says_how(case):
    state8 = _dp(case, N).init(_params())
    dp = _dp(case, 4)
    dp.init(_params())  # knows the params' shapes
    with pytest.raises(ValueError, match=r"(made on|shards for) 8 devices.*dp\.resize"):
        dp.step(state8, next(_batches(1)))


def test_orbax_shapes_of_the_saved_count(tmp_path):
    """Without dp.restore: orbax restores onto state_shapes(params, n_devices=8), then resize."""
    _, state8 = _saved("ar_topk-optimizer", tmp_path / "ckpt")
    dp = _dp("ar_topk-optimizer", 4)
    target = dp.state_shapes(_params(), n_devices=N)
    assert target.opt_state[0].residual["w1"].shape == (N, 12, 19)
    state = dp.resize(ocp.StandardCheckpointer().restore(tmp_path / "ckpt", target))
    assert state.opt_state[0].residual["w1"].shape == (4, 12, 19)
    assert state.opt_state[1][0].mu["w1"].shape == (4, sharding.shard_length(228, 4))


def test_a_checkpoint_of_another_tx_is_refused_before_orbax(tmp_path):
    _saved("ar_topk", tmp_path / "ckpt")
    other = _dp("ar_topk-optimizer", 4)
    with pytest.raises(ValueError, match="not the state of this data_parallel's tx"):
        other.restore(tmp_path / "ckpt", _params())


def test_compress_auto_warns_to_reprobe():
    tx = optax.chain(
        jaxcomp.compress_auto(
            [jaxcomp.Dense(), jaxcomp.TopK(0.1)],
            network=jaxcomp.costmodel.cost.Network.parse("1ms", "100mbit"),
        ),
        optax.adam(1e-2),
    )
    dp8 = jaxcomp.data_parallel(_loss_rows, tx, _mesh(N))
    dp4 = jaxcomp.data_parallel(_loss_rows, tx, _mesh(4))
    with pytest.warns(UserWarning, match="from 8 to 4 devices.*reprobe"):
        dp4.resize(dp8.init(_params()))


def test_gradient_accumulation_is_refused_clearly():
    """optax.MultiSteps keeps each device's accumulated gradient: not a residual, not a shard."""
    tx = optax.MultiSteps(
        optax.chain(jaxcomp.compress("ar_topk", ratio=0.1), optax.adam(1e-2)), every_k_schedule=2
    )
    dp8 = jaxcomp.data_parallel(_loss_rows, tx, _mesh(N))
    dp4 = jaxcomp.data_parallel(_loss_rows, tx, _mesh(4))
    with pytest.raises(ValueError, match=r"saved on 8 devices.*runs on 4.*acc_grads.*on 8 devices"):
        dp4.resize(dp8.init(_params()))
