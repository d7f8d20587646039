"""What keeps a run from diverging whatever the optimizer does with a finite gradient:
jaxcomp.adam's variance floor (a coordinate quiet while the variance froze cannot step further
than Adam could), and data_parallel's handling of an update or optimizer state that is not
finite (forced here): its entries dropped (the default) or its step skipped."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import adam_bound, need_devices
from jax.sharding import Mesh

import jaxcomp

B1, B2, LR = 0.9, 0.999, 0.01


def _mesh():
    need_devices(8)
    return Mesh(np.array(jax.devices()), ("data",))


@pytest.mark.parametrize("method", ["dense", "sign"])
def test_a_coordinate_that_wakes_after_the_variance_froze_steps_no_further_than_adam(method):
    """The failure of a frozen variance, forced: coordinate 1's gradient is 0 through the
    warm-up (its variance stays 0), then 1e3. Without the floor its first step would be
    ``LR * m / eps``, about 1e8 LR; with it, at most Adam's own bound, and the run stays
    finite."""
    warmup, steps = 5, 12
    loss = lambda w, batch: jnp.sum(batch * w)  # noqa: E731  (a device's gradient: its rows, summed)
    tx = jaxcomp.adam(LR, method, warmup_steps=warmup, refresh_every=None)
    dp = jaxcomp.data_parallel(loss, tx, _mesh())
    state, params = dp.init(jnp.zeros(2)), [np.zeros(2)]
    for t in range(steps):
        woken = 1e3 if t >= warmup else 0.0
        state, _ = dp.step(state, jnp.tile(jnp.array([[1.0, woken]]), (8, 1)))
        params.append(np.asarray(state.params))
    moves = np.abs(np.diff(np.stack(params)[:, 1]))
    bounds = LR * np.array([np.sqrt(adam_bound(t + 1)) for t in range(steps)])
    assert moves[:warmup].max() == 0
    assert np.all(moves <= bounds * (1 + 1e-4)), (moves / LR, bounds / LR)
    assert moves[warmup:].sum() > 2 * LR  # it does move, as Adam would


def _nan_above(limit):
    """An optax transformation whose update is NaN wherever the (finite) gradient passes
    ``limit``: an optimizer that overflows from a finite gradient."""

    def update(updates, state, params=None):
        return jax.tree.map(lambda u: jnp.where(jnp.abs(u) > limit, jnp.nan, u), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@pytest.mark.parametrize("shard", [None, "optimizer"])
def test_a_non_finite_update_is_rejected_and_the_run_goes_on(shard, caplog):
    mesh = _mesh()
    tx = optax.chain(jaxcomp.compress("dense"), _nan_above(100.0), optax.adam(0.1))
    loss = lambda w, batch: jnp.mean((batch - w) ** 2)  # noqa: E731
    dp = jaxcomp.data_parallel(loss, tx, mesh, shard=shard, nonfinite_updates="skip")
    state, history = dp.init(jnp.zeros(16)), []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # once a process: tested by the log
        for t in range(5):
            before, batch = state, jnp.full((8, 16), 1e3 if t == 2 else 1.0)
            state, metrics = dp.step(state, batch)
            history.append(float(metrics["rejected"]))
            assert np.all(np.isfinite(np.asarray(dp.params(state))))
            for leaf in jax.tree.leaves(state.opt_state):
                assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
            if history[-1]:
                np.testing.assert_array_equal(dp.params(state), dp.params(before))
    assert history == [0, 0, 1, 0, 0]
    told = [r.getMessage() for r in caplog.records if r.name == "jaxcomp"]
    assert len(told) == 1 and "step 2's update" in told[0] and "not finite" in told[0], told
    # Adam's count did not advance on the rejected step.
    adam_state = state.opt_state[2][0]
    assert int(np.asarray(adam_state.count).reshape(-1)[0]) == 4


def _half_nan(limit):
    """An optax transformation whose update is NaN in its first half wherever the (finite)
    gradient passes ``limit``."""

    def update(updates, state, params=None):
        def one(u):
            half = jnp.arange(u.size).reshape(u.shape) < u.size // 2
            return jnp.where(half & (jnp.abs(u) > limit), jnp.nan, u)

        return jax.tree.map(one, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@pytest.mark.parametrize("shard", [None, "optimizer"])
def test_by_default_a_non_finite_entry_is_dropped_and_the_rest_of_the_step_applies(shard):
    """``nonfinite_updates="drop"``: the entries ``tx`` made NaN keep their old params and
    optimizer state; every other entry takes its step; no ``rejected`` metric (no check)."""
    mesh = _mesh()
    tx = optax.chain(jaxcomp.compress("dense"), optax.adam(0.1), _half_nan(0.0))
    loss = lambda w, batch: jnp.mean((batch - w) ** 2)  # noqa: E731
    dp = jaxcomp.data_parallel(loss, tx, mesh, shard=shard)
    state = dp.init(jnp.zeros(16))
    state, metrics = dp.step(state, jnp.ones((8, 16)))
    params = np.asarray(dp.params(state))
    assert "rejected" not in metrics
    # half of each leaf tx sees (the whole vector, or a device's shard) stayed where it was
    assert np.sum(params == 0.0) == 8 and np.all(params[params != 0.0] > 0.05), params
    for leaf in jax.tree.leaves(state.opt_state):
        assert np.all(np.isfinite(np.asarray(leaf, np.float64)))


@pytest.mark.parametrize("nonfinite_updates", ["drop", "skip"])
def test_an_optimizer_state_that_overflows_is_not_kept(nonfinite_updates):
    """A finite update over a state that is not finite: Adam's variance of a gradient of 1e20
    overflows to inf (its update, m / sqrt(inf), is 0); the state must not keep it."""
    mesh = _mesh()
    tx = optax.chain(jaxcomp.compress("dense"), optax.adam(0.1))
    loss = lambda w, batch: jnp.sum(batch * w)  # noqa: E731
    dp = jaxcomp.data_parallel(loss, tx, mesh, nonfinite_updates=nonfinite_updates)
    state = dp.init(jnp.zeros(4))
    state, metrics = dp.step(state, jnp.ones((8, 4)))
    nu = np.asarray(state.opt_state[1][0].nu)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        state, metrics = dp.step(state, jnp.full((8, 4), 1e20))
    if nonfinite_updates == "skip":
        assert float(metrics["rejected"]) == 1
    np.testing.assert_array_equal(state.opt_state[1][0].nu, nu)  # the overflow kept the old
    for leaf in jax.tree.leaves(state.opt_state):
        assert np.all(np.isfinite(np.asarray(leaf, np.float64)))


def test_the_guardrails_dense_fallback_relearns_jaxcomp_adams_variance():
    """A forced divergence: the gradient jumps 1e3-fold for a few steps after the warm-up. The
    guardrail triggers, and on the steps its dense fallback runs the variance takes Adam's step
    from the exact mean gradient (elsewhere it stays frozen), so the coordinates that woke are
    normalized by their new scale, not the warm-up's."""
    mesh = _mesh()
    loss = lambda w, batch: jnp.sum(batch * w)  # noqa: E731  (a device's gradient: its rows, summed)
    tx = jaxcomp.adam(LR, "quantized", bits=4, warmup_steps=5, refresh_every=None)
    dp = jaxcomp.data_parallel(loss, tx, mesh)
    rng = np.random.default_rng(0)
    state, history = dp.init(jnp.zeros(64)), []
    for t in range(60):
        gradient = rng.normal(size=64).astype(np.float32) * (1e3 if 30 <= t < 33 else 1.0)
        before = np.asarray(state.opt_state.nu), np.asarray(state.opt_state.mu)
        state, metrics = dp.step(state, jnp.tile(jnp.asarray(gradient), (8, 1)))
        history.append((gradient, before, metrics, np.asarray(state.opt_state.nu)))
    fallback = [float(m["fallback"]) for _, _, m, _ in history]
    triggered = [
        t for t in range(1, 60) if history[t][2]["fallbacks"] > history[t - 1][2]["fallbacks"]
    ]
    assert len(triggered) == 1 and 30 <= triggered[0] <= 34, (triggered, fallback)
    methods = jaxcomp.find_compress_state(state.opt_state).methods
    dense = next(i for i, m in enumerate(methods) if isinstance(m, jaxcomp.Dense))
    window = [
        t for t in range(triggered[0] + 1, 60) if fallback[t] and history[t][2]["method"] == dense
    ]
    assert len(window) >= 10, fallback
    for t in window:
        gradient, (nu, _), _, new_nu = history[t]
        adam = B2 * nu + (1 - B2) * gradient.astype(np.float64) ** 2
        np.testing.assert_allclose(new_nu, np.maximum(adam, new_nu), rtol=2e-3)  # floor aside
        np.testing.assert_allclose(new_nu, adam, rtol=2e-3, atol=1e-2 * adam.max())
    # Before the spike the variance stayed frozen (up to its floor).
    for t in range(6, 29):
        assert np.all(history[t][3] >= history[t][1][0])
        assert np.mean(history[t][3] == history[t][1][0]) > 0.5


def test_jaxcomp_adams_dense_fallback_steps_no_further_than_either_rule():
    """With sign, the fallback averages the momentum exactly (stored so) and steps each
    coordinate along the lesser of exact Adam's momentum and its scaled sign, 1-bit Adam's:
    ``sign(m) min(|m|, mean |m|)`` over a chunk (64 values: one chunk), over ``sqrt(v)``."""
    mesh = _mesh()
    loss = lambda w, batch: jnp.sum(batch * w)  # noqa: E731
    tx = jaxcomp.adam(LR, "sign", warmup_steps=5, refresh_every=None)
    dp = jaxcomp.data_parallel(loss, tx, mesh)
    rng = np.random.default_rng(1)
    state, stepped = dp.init(jnp.zeros(64)), []
    for t in range(60):
        gradient = rng.normal(size=64).astype(np.float32) * (1e3 if 30 <= t < 33 else 1.0)
        params, mu = np.asarray(state.params), np.asarray(state.opt_state.mu)
        state, metrics = dp.step(state, jnp.tile(jnp.asarray(gradient), (8, 1)))
        if not (float(metrics["fallback"]) and int(metrics["method"]) == 0 and t > 33):
            continue
        new_mu, nu = np.asarray(state.opt_state.mu), np.asarray(state.opt_state.nu)
        np.testing.assert_allclose(new_mu, B1 * mu + (1 - B1) * gradient, rtol=1e-4, atol=1e-6)
        least = np.sign(new_mu) * np.minimum(np.abs(new_mu), np.abs(new_mu).mean())
        moved = (params - np.asarray(state.params)) * np.sqrt(nu)  # least, times one scalar
        scale = np.median(moved / least)
        np.testing.assert_allclose(moved, scale * least, rtol=1e-3, atol=1e-3 * np.abs(moved).max())
        assert np.mean(np.abs(new_mu) > np.abs(new_mu).mean()) > 0.2  # the cap is exercised
        stepped.append(t)
    assert len(stepped) >= 10, stepped


def _smallest_norm_so_far():
    """An optax transformation whose state is a scalar sentinel, as ``reduce_on_plateau``'s
    best value (inf before the first): the first update norm below 1e-9, inf until one comes."""

    def init(params):
        return jnp.asarray(jnp.inf, jnp.float32)

    def update(updates, state, params=None):
        norm = optax.global_norm(updates)
        return updates, jnp.where(norm < 1e-9, jnp.minimum(state, norm), state)

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("nonfinite_updates", ["drop", "skip"])
def test_a_sentinel_in_the_optimizer_states_scalars_is_not_a_divergence(nonfinite_updates):
    """A scalar of the state that is not finite by design (inf until it is first set, here
    for good) must not reject every step, nor be replaced."""
    mesh = _mesh()
    tx = optax.chain(jaxcomp.compress("dense"), optax.adam(0.1), _smallest_norm_so_far())
    loss = lambda w, batch: jnp.mean((batch - w) ** 2)  # noqa: E731
    dp = jaxcomp.data_parallel(loss, tx, mesh, nonfinite_updates=nonfinite_updates)
    state = dp.init(jnp.zeros(4))
    for _ in range(3):
        state, metrics = dp.step(state, jnp.ones((8, 4)))
        assert float(metrics.get("rejected", 0)) == 0
    assert not np.isfinite(float(state.opt_state[2]))
    assert float(dp.params(state)[0]) > 0.2  # it trained


def test_diloco_inner_steps_drop_what_the_inner_optimizer_makes_not_finite():
    """DiLoCo's inner step keeps the params and state entries its optimizer makes not finite
    (here half of every update is NaN): the run stays finite and the other entries train."""
    need_devices(2)
    mesh = Mesh(np.array(jax.devices()[:2]), ("workers",))
    loss = lambda w, batch: jnp.mean((batch - w) ** 2)  # noqa: E731
    inner = optax.chain(optax.adam(0.1), _half_nan(0.0))
    run = jaxcomp.diloco(loss, inner, mesh=mesh, sync_every=2)
    state = run.init(jnp.zeros(8))
    for _ in range(4):
        state, _ = run.step(state, jnp.ones((4, 8)))
    params = np.asarray(run.params(state))
    for leaf in jax.tree.leaves(state):
        assert np.all(np.isfinite(np.asarray(leaf, np.float64)))
    assert np.all(params[:4] == 0.0) and np.all(params[4:] > 0.05), params
