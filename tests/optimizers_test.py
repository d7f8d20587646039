"""jaxcomp.adam / adamw (1-bit Adam): against optax.adam in the warm-up and a numpy reference of
the compression stage, on 1, 2, 3 and 8 devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import adam_bound, need_devices
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcomp

B1, B2, EPS, LR = 0.9, 0.999, 1e-8, 0.05


def _run(tx, grads, params=None):
    """Runs ``tx`` for ``len(grads)`` steps on ``grads[t]: [devices, n]``; returns every step's
    update (replicated) and the final state of device 0."""
    n_dev = grads.shape[1]
    mesh = Mesh(np.array(jax.devices()[:n_dev]), ("data",))
    p = jnp.zeros(grads.shape[-1]) if params is None else params

    def steps(g):
        def step(state, g_t):
            u, state = tx.update(g_t[0], state, p)
            return state, u

        # A scan compiles the later steps once, where a Python loop compiled each of them (the
        # first step runs before it: it makes the state's leaves vary over the devices).
        state, first = step(tx.init(p), g[0])
        state, outs = jax.lax.scan(step, state, g[1:])
        return jnp.concatenate([first[None], outs]), state.mu, state.nu, state.count

    f = jax.jit(
        jax.shard_map(
            steps,
            mesh=mesh,
            in_specs=P(None, "data"),
            out_specs=(P(), P(), P(), P()),
        )
    )
    return f(grads)


def _grads(steps, devices, n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(steps, devices, n)).astype(np.float32) * (
        1 + np.arange(n, dtype=np.float32)
    )


def _reference(grads, warmup, select, weight_decay=0.0, params=None, refresh=None):
    """numpy 1-bit Adam: dense Adam for ``warmup`` steps, then each device sends
    ``select(b1 m + (1-b1) g_i + residual_i)`` (what it keeps), the mean of what was sent is the
    momentum, and the variance (and its bias correction) stays frozen."""
    steps, devices, n = grads.shape
    m, v = np.zeros(n), np.zeros(n)
    residual = np.zeros((devices, n))
    p = np.zeros(n) if params is None else np.asarray(params, np.float64)
    outs = []
    for t in range(steps):
        g = grads[t].astype(np.float64)
        if t < warmup:
            mean = g.mean(0)
            m, v = B1 * m + (1 - B1) * mean, B2 * v + (1 - B2) * mean**2
        elif refresh and (t - warmup) % refresh == refresh - 1:
            mean, decay = g.mean(0), B2**refresh
            m, v = B1 * m + (1 - B1) * mean, decay * v + (1 - decay) * mean**2
        else:
            fed = B1 * m + (1 - B1) * g + residual
            sent = np.stack([select(row) for row in fed])
            residual = fed - sent
            m = sent.mean(0)
        m_hat = m / (1 - B1 ** (t + 1))
        stands_for = min(t + 1, warmup) + (refresh or 0) * (
            max(t + 1 - warmup, 0) // (refresh or 1)
        )
        if t >= warmup:
            v = np.maximum(v, (1 - B2**stands_for) * m_hat**2 / adam_bound(t + 1))
        v_hat = v / (1 - B2**stands_for)
        outs.append(-LR * (m_hat / (np.sqrt(v_hat) + EPS) + weight_decay * p))
    return np.stack(outs), m, v


def _topk(k):
    def select(row):
        kept = np.zeros_like(row)
        top = np.argsort(-np.abs(row))[:k]
        kept[top] = row[top]
        return kept

    return select


@pytest.mark.parametrize("devices", [1, 2, 3, 8])
def test_topk_against_numpy_reference(devices):
    need_devices(devices)
    grads = _grads(7, devices, 20)
    tx = jaxcomp.adam(LR, jaxcomp.TopK(0.25), warmup_steps=3)
    outs, mu, nu, count = _run(tx, jnp.asarray(grads))
    want, m, v = _reference(grads, 3, _topk(5))
    np.testing.assert_allclose(np.asarray(outs), want, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(mu), m, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(nu), v, rtol=2e-4, atol=1e-9)
    assert int(count) == 7


def test_variance_refresh_against_numpy_reference():
    need_devices(3)
    grads = _grads(10, 3, 20, seed=4)
    tx = jaxcomp.adam(LR, jaxcomp.TopK(0.25), warmup_steps=2, refresh_every=3)
    outs, mu, nu, count = _run(tx, jnp.asarray(grads))
    want, m, v = _reference(grads, 2, _topk(5), refresh=3)
    np.testing.assert_allclose(np.asarray(outs), want, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(nu), v, rtol=2e-4, atol=1e-9)
    assert int(count) == 10


@pytest.mark.parametrize("host_branches", [False, True])
def test_a_refresh_step_reports_dense_bytes(host_branches):
    """Refreshes at steps 3 and 5; with the branch picked on the host, the warm-up's dense
    steps last one step longer (jaxcomp.training.branches)."""
    need_devices(8)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    loss = lambda w, batch: jnp.sum((batch @ w) ** 2)  # noqa: E731
    tx = jaxcomp.adam(0.01, "ar_topk", ratio=0.1, warmup_steps=2, refresh_every=2)
    dp = jaxcomp.data_parallel(loss, tx, mesh, host_branches=host_branches)
    # 80 values: k = 8, one index a device under SPLIT (40 would round k/N = 0.5 up to 1).
    state, sent = dp.init(jnp.ones(80)), []
    for _ in range(6):
        state, metrics = dp.step(state, jnp.ones((8, 80)))
        sent.append(float(metrics["bytes_sent"]))
    dense, compressed = sent[0], sent[4]
    assert compressed < dense / 4
    late = dense if host_branches else compressed
    assert sent == [dense, dense, late, dense, compressed, dense]


def test_warmup_is_optax_adam_and_dense_freezes_the_variance():
    need_devices(8)
    grads = _grads(6, 8, 16, seed=1)
    outs, _, nu, _ = _run(jaxcomp.adam(LR, jaxcomp.Dense(), warmup_steps=4), jnp.asarray(grads))
    adam = optax.adam(LR)
    state, want = adam.init(jnp.zeros(16)), []
    for t in range(4):
        u, state = adam.update(jnp.asarray(grads[t].mean(0)), state)
        want.append(u)
    np.testing.assert_allclose(np.asarray(outs[:4]), np.stack(want), rtol=1e-5, atol=1e-7)
    # After the warm-up, Dense sends the mean momentum and the variance stays where it was.
    ref, _, v = _reference(grads, 4, lambda row: row)
    np.testing.assert_allclose(np.asarray(outs), ref, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(nu), v, rtol=1e-5)


def test_adamw_decays_the_params():
    need_devices(2)
    grads = _grads(5, 2, 8, seed=2)
    params = jnp.linspace(-1.0, 1.0, 8)
    tx = jaxcomp.adamw(LR, "ar_topk", ratio=0.5, weight_decay=0.1, warmup_steps=2)
    outs, *_ = _run(tx, jnp.asarray(grads), params)
    # AR-Topk sends one index set, chosen by one device: compare the warm-up with optax.adamw.
    adamw = optax.adamw(LR, weight_decay=0.1)
    state = adamw.init(params)
    for t in range(2):
        want, state = adamw.update(jnp.asarray(grads[t].mean(0)), state, params)
        np.testing.assert_allclose(np.asarray(outs[t]), np.asarray(want), rtol=1e-5, atol=1e-7)
    assert np.isfinite(np.asarray(outs)).all()


def test_trains_with_data_parallel_and_reports_metrics():
    need_devices(8)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    loss = lambda w, batch: jnp.mean((batch["x"] @ w - batch["y"]) ** 2)  # noqa: E731
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype(np.float32)
    batch = {"x": x, "y": x @ np.linspace(-1, 1, 16).astype(np.float32)}
    dp = jaxcomp.data_parallel(loss, jaxcomp.adam(0.05, "ar_topk", ratio=0.1, warmup_steps=5), mesh)
    state = dp.init(jnp.zeros(16))
    for _ in range(60):
        state, metrics = dp.step(state, batch)
    # 60 steps: the warm-up, 54 compressed steps and one variance refresh (step 54).
    assert float(metrics["loss"]) < 0.1 * float(loss(jnp.zeros(16), batch))
    # The metrics are the momentum's compression: AR-Topk's bytes, not dense's.
    assert float(metrics["bytes_sent"]) < 16 * 4 * 2


def test_a_skipped_step_keeps_the_moments():
    need_devices(2)
    grads = _grads(3, 2, 8, seed=3)
    grads[1, 0, 0] = np.nan
    tx = jaxcomp.adam(LR, jaxcomp.TopK(0.5), warmup_steps=1, nonfinite="skip")
    outs, mu, nu, count = _run(tx, jnp.asarray(grads))
    assert int(count) == 2 and not np.asarray(outs[1]).any()
    kept = np.delete(grads, 1, axis=0)
    want, m, _ = _reference(kept, 1, _topk(4))
    np.testing.assert_allclose(np.asarray(outs)[[0, 2]], want, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(mu), m, rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"b1": 1.0}, "b1 must be"),
        ({"b2": 0}, "b2 must be"),
        ({"eps": -1.0}, "eps must be"),
        ({"weight_decay": -0.1}, "weight_decay must be"),
        ({"warmup_steps": 0}, "warmup_steps"),
        ({"momentum_correction": 0.9}, "momentum_correction= is the optimizer's own"),
        ({"ratio": 2.0}, "ratio"),
        ({"refresh_every": 0}, "refresh_every"),
        ({"method": "auto"}, "method 'auto' cannot run jaxcomp.adam's dense warm-up"),
    ],
)
def test_bad_arguments_raise_before_anything_runs(kwargs, match):
    method = kwargs.pop("method", "allgather_topk")
    with pytest.raises(ValueError, match=match):
        jaxcomp.adam(1e-3, method, **kwargs)


def test_weight_decay_needs_params():
    need_devices(1)
    tx = jaxcomp.adamw(1e-3, jaxcomp.Dense())
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    f = jax.shard_map(
        lambda g: tx.update(g, tx.init(g))[0], mesh=mesh, in_specs=P("data"), out_specs=P()
    )
    with pytest.raises(ValueError, match="weight_decay needs the params"):
        f(jnp.ones(4))


@pytest.mark.parametrize("shard", ["optimizer", "params"])
def test_sharded_training_is_refused_with_a_clear_error(shard):
    need_devices(2)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    dp = jaxcomp.data_parallel(lambda w, b: jnp.sum(w), jaxcomp.adam(1e-3), mesh, shard=shard)
    with pytest.raises(ValueError, match="cannot update 1/N shards"):
        dp.init(jnp.zeros(4))
