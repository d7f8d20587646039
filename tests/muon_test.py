"""jaxcomp.muon against a numpy Muon, and as jaxcomp.diloco's inner optimizer (MuLoCo): it
trains with dense and 2-bit pseudo-gradients, matches the worker-by-worker reference, adds no
collective, survives a checkpoint and a heal, and refuses ZeRO's flat shards."""

from __future__ import annotations

import re

import diloco_test as dt
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal, need_devices
from jax.sharding import Mesh

import jaxcomp
from jaxcomp.optim.muon import uses_muon

COEFFS = (3.4445, -4.7750, 2.0315)  # Jordan's quintic Newton-Schulz coefficients


def np_newton_schulz(g, steps=5, eps=1e-8):
    """Jordan's orthogonalization of a matrix, in float64: the wide orientation, Frobenius
    normalization, ``steps`` quintic iterations."""
    x = np.asarray(g, np.float64)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (np.linalg.norm(x) + eps)
    a, b, c = COEFFS
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def np_muon(grads, lr, beta=0.95, rms=0.2):
    """The updates of a matrix leaf over ``grads``: Nesterov momentum with bias correction,
    orthogonalized, times ``rms * sqrt(max(fan_in, fan_out))`` and the rate ``lr``."""
    m, out = np.zeros_like(grads[0], np.float64), []
    for t, g in enumerate(grads, start=1):
        m = beta * m + (1 - beta) * g
        nesterov = beta * m / (1 - beta ** (t + 1)) + (1 - beta) * g / (1 - beta**t)
        out.append(-lr * rms * np.sqrt(max(g.shape)) * np_newton_schulz(nesterov))
    return out


@pytest.mark.parametrize("shape", [(4, 3), (3, 5), (16, 16), (1, 7)])
def test_matrix_updates_match_numpy_newton_schulz(shape):
    """Three steps on a 2-D leaf are the numpy Muon's; the 1-D leaf beside it is AdamW's."""
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=shape).astype(np.float32) for _ in range(3)]
    bias = [rng.normal(size=shape[1]).astype(np.float32) for _ in range(3)]
    tx, adamw = jaxcomp.muon(1e-2), optax.adamw(1e-2, weight_decay=0.0, nesterov=True)
    params = {"w": jnp.zeros(shape), "b": jnp.zeros(shape[1])}
    state, adam_state = tx.init(params), adamw.init(params["b"])
    for g, b, want in zip(grads, bias, np_muon(grads, 1e-2)):
        updates, state = tx.update({"w": jnp.asarray(g), "b": jnp.asarray(b)}, state, params)
        np.testing.assert_allclose(updates["w"], want, rtol=2e-4, atol=2e-6)
        want_b, adam_state = adamw.update(jnp.asarray(b), adam_state, params["b"])
        np.testing.assert_allclose(updates["b"], want_b, rtol=1e-6, atol=1e-7)


def test_orthogonalized_matrix_has_singular_values_near_one():
    """What the iteration is for: the update's singular values lie near 1 (Jordan's quintic
    leaves them in about [0.7, 1.2]) over a spread of 30 in the gradient's."""
    g = np.random.default_rng(1).normal(size=(32, 16)) * np.logspace(-1.5, 0, 16)
    singular = np.linalg.svd(np_newton_schulz(g), compute_uv=False)
    assert singular.min() > 0.6 and singular.max() < 1.2
    tx = jaxcomp.muon(1.0, consistent_rms=None)  # width scaling: sqrt(max(1, 16 / 32)) = 1
    w = jnp.zeros((32, 16))
    updates, _ = tx.update(jnp.asarray(g, jnp.float32), tx.init(w), w)
    np.testing.assert_allclose(-np.asarray(updates), np_newton_schulz(g), rtol=1e-3, atol=1e-4)


def test_stacked_layers_are_orthogonalized_one_by_one():
    """A leaf of 3 dimensions goes to AdamW by default; named by ``dimension_numbers`` (axis 0
    a stack of layers), each layer's matrix is orthogonalized on its own."""
    g = np.random.default_rng(2).normal(size=(3, 6, 4)).astype(np.float32)
    w = jnp.zeros(g.shape)
    by_default = jaxcomp.muon(1e-2)
    updates, _ = by_default.update(jnp.asarray(g), by_default.init(w), w)
    want, _ = optax.adamw(1e-2, weight_decay=0.0, nesterov=True).update(
        jnp.asarray(g), optax.adamw(1e-2).init(w), w
    )
    np.testing.assert_allclose(updates, want, rtol=1e-6)
    numbers = optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    stacked = jaxcomp.muon(1e-2, dimension_numbers=numbers)
    updates, _ = stacked.update(jnp.asarray(g), stacked.init(w), w)
    for layer in range(3):
        want = np_muon([g[layer]], 1e-2)[0]
        np.testing.assert_allclose(updates[layer], want, rtol=2e-4, atol=2e-6)


def test_bad_arguments_raise_clear_errors():
    for kwargs, error, match in [
        ({"learning_rate": -1.0}, ValueError, "learning_rate"),
        ({"learning_rate": "fast"}, TypeError, "learning_rate"),
        ({"learning_rate": float("nan")}, ValueError, "learning_rate"),
        ({"learning_rate": 1e-3, "beta": 1.0}, ValueError, "beta"),
        ({"learning_rate": 1e-3, "ns_steps": 0}, ValueError, "ns_steps"),
        ({"learning_rate": 1e-3, "ns_steps": 2.5}, TypeError, "ns_steps"),
        ({"learning_rate": 1e-3, "weight_decay": -0.1}, ValueError, "weight_decay"),
        ({"learning_rate": 1e-3, "consistent_rms": 0.0}, ValueError, "consistent_rms"),
        ({"learning_rate": 1e-3, "adam_learning_rate": 0}, ValueError, "adam_learning_rate"),
    ]:
        with pytest.raises(error, match=match):
            jaxcomp.muon(**kwargs)
    assert uses_muon(jaxcomp.muon(optax.constant_schedule(1e-3)))
    assert uses_muon(optax.chain(optax.clip_by_global_norm(1.0), optax.contrib.muon(0.02)))
    assert not uses_muon(optax.adamw(1e-3))


# -- as diloco's inner optimizer ------------------------------------------------------------


def test_diloco_with_muon_matches_the_worker_by_worker_reference():
    """Each worker's Muon is its own: the compiled run on 4 workers is the reference that loops
    over them in one process (dense exchange, H = 3, 7 steps)."""
    inner_tx = jaxcomp.muon(0.05, weight_decay=0.1)
    run = jaxcomp.diloco(dt._loss, inner_tx, mesh=dt._mesh(4), sync_every=3)
    batches = dt._batches(7)
    state, _ = dt._run(run, batches)
    outer_tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
    reference = dt.reference_diloco(inner_tx, outer_tx, dt._params(), batches, 4, 3)
    dt._assert_matches(state, reference, rtol=1e-4, atol=1e-5)


def _collectives(run, state, batch) -> list:
    hlo = run.step.lower(state, batch).compile().as_text()
    pattern = r" (all-reduce|all-gather|collective-permute|reduce-scatter|all-to-all)(-start)?\("
    return sorted(m.group(1) for m in re.finditer(pattern, hlo))


@pytest.mark.parametrize("inner", [None, 2], ids=["workers", "two-level"])
def test_muon_adds_no_collective(inner):
    """The compiled step with Muon inside holds the same collectives as with AdamW: the
    Newton-Schulz iterations are local matmuls (on a 4x2 mesh, the row's gradient mean is the
    only inner collective either way)."""
    mesh = dt._mesh(4, inner)
    axis = {"inner_axis": "data"} if inner else {}
    found = []
    for tx in (optax.adamw(1e-2), jaxcomp.muon(1e-2)):
        run = jaxcomp.diloco(dt._loss, tx, mesh=mesh, sync_every=2, **axis)
        found.append(_collectives(run, run.init(dt._params()), dt._batches(1)[0]))
    assert found[0] == found[1] and found[0]


def test_zero_sharding_refuses_muon():
    with pytest.raises(ValueError, match="shard='optimizer' hands inner_tx.*Muon"):
        jaxcomp.diloco(
            dt._loss, jaxcomp.muon(1e-2), mesh=dt._mesh(2, 2), inner_axis="data",
            shard="optimizer",
        )  # fmt: skip
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    tx = optax.chain(jaxcomp.compress("bf16"), jaxcomp.muon(1e-2))  # in a chain too
    for shard in ("optimizer", "params"):
        with pytest.raises(ValueError, match=f"shard='{shard}' hands tx.*Muon"):
            jaxcomp.data_parallel(dt._loss, tx, mesh, shard=shard)
    jaxcomp.data_parallel(dt._loss, tx, mesh)  # whole leaves: taken

    def init(params):  # a tx written for other params: its init of the probe's matrix fails
        return {"count": params["layers"][0]}

    odd = optax.GradientTransformation(init, lambda updates, state, params=None: (updates, state))
    jaxcomp.data_parallel(dt._loss, odd, mesh, shard="optimizer")  # not refused for the probe


# A teacher MLP's regression: big enough that 2 % of its params per sync is a real signal.
IN, HIDDEN, OUT, ROWS = 16, 64, 4, 64


def _mlp_loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - batch["y"]) ** 2)


def _mlp_params(seed):
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.normal(size=(IN, HIDDEN)) / np.sqrt(IN), jnp.float32),
        "b1": jnp.zeros(HIDDEN, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(HIDDEN, OUT)) / np.sqrt(HIDDEN), jnp.float32),
        "b2": jnp.zeros(OUT, jnp.float32),
    }


def _mlp_batches(steps):
    teacher, rng = _mlp_params(99), np.random.default_rng(5)
    out = []
    for _ in range(steps):
        x = jnp.asarray(rng.normal(size=(ROWS, IN)), jnp.float32)
        h = jnp.tanh(x @ teacher["w1"])
        out.append({"x": x, "y": 3.0 * h @ teacher["w2"]})
    return out


def _heldout(params):
    return float(_mlp_loss(params, _mlp_batches(1)[0]))


@pytest.mark.parametrize(
    "compress",
    [None, jaxcomp.TopK(0.02, value_bits=2), jaxcomp.Quantized(bits=2)],
    ids=["dense", "topk-2bit", "quantized-2bit"],
)
def test_diloco_with_muon_trains(compress):
    """8 workers, H = 5, 100 steps of cosine decay: the held-out loss falls below 0.3 of its
    start with dense pseudo-gradients and with 2-bit ones (error feedback keeps what the 2 bits
    drop)."""
    need_devices(8)
    mesh = Mesh(np.array(jax.devices()[:8]), ("workers",))
    run = jaxcomp.diloco(
        _mlp_loss,
        jaxcomp.muon(optax.cosine_decay_schedule(3e-3, 100, alpha=0.1)),
        mesh=mesh,
        sync_every=5,
        compress=compress,
    )
    state = run.init(_mlp_params(0))
    before = _heldout(run.params(state))
    sent = []
    for batch in _mlp_batches(100):
        state, metrics = run.step(state, batch)
        sent.append(float(metrics["bytes_sent"]))
    after = _heldout(run.params(state))
    assert np.isfinite(after) and after < 0.3 * before, (before, after)
    dense_bytes = 4 * sum(x.size for x in jax.tree.leaves(_mlp_params(0)))
    assert 0 < max(sent) < (dense_bytes if compress is not None else 10 * dense_bytes)


def test_muon_state_survives_a_checkpoint(tmp_path):
    """Muon inner, 2-bit top-k exchange: save between syncs, restore with run.restore: the
    Muon momentum comes back bit for bit and the run resumes bit for bit."""
    import orbax.checkpoint as ocp

    run = jaxcomp.diloco(
        dt._loss, jaxcomp.muon(0.05), mesh=dt._mesh(4), sync_every=4,
        compress=jaxcomp.TopK(0.5, value_bits=2),
    )  # fmt: skip
    batches = dt._batches(9)
    state, _ = dt._run(run, batches[:6])  # a sync at step 4, two inner steps since
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    restored = run.restore(tmp_path / "ckpt", dt._params())
    assert_trees_equal(restored, state)
    (muon_state,) = _muon_states(restored.inner_state)
    assert np.abs(np.asarray(muon_state.mu["w"])).min() > 0  # a momentum per worker
    uninterrupted, _ = dt._run(run, batches[6:], state)
    resumed, _ = dt._run(run, batches[6:], restored)
    assert_trees_equal(resumed, uninterrupted)


def _muon_states(tree):
    nodes = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, optax.contrib.MuonState))
    return [x for x in nodes if isinstance(x, optax.contrib.MuonState)]


def test_a_worker_with_non_finite_muon_state_restarts_from_a_fresh_one():
    """Worker 0's Muon state turned NaN: at the next sync it is healed (a quarter of the
    workers), its momentum restarts at zero and its coefficients are Muon's again, and the
    others keep theirs."""
    run = jaxcomp.diloco(dt._loss, jaxcomp.muon(0.05), mesh=dt._mesh(4), sync_every=3)
    batches = dt._batches(6)
    state, _ = dt._run(run, batches[:1])
    sick = jax.tree.map(
        lambda x: x.at[0].set(jnp.nan) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        state.inner_state,
    )
    state = state._replace(inner_state=sick)
    with pytest.warns(RuntimeWarning, match="healed"):
        healed, metrics = dt._run(run, batches[1:3], state)  # the sync is the second step
        jax.block_until_ready(healed)
        later, more = dt._run(run, batches[3:4], healed)  # the host reads the sync's probe
    assert [float(m["healed"]) for m in metrics] == [0.0, 0.25]
    (muon_state,) = _muon_states(healed.inner_state)
    mu = np.asarray(muon_state.mu["w"])
    assert (mu[0] == 0).all() and np.abs(mu[1:]).min() > 0
    np.testing.assert_allclose(np.asarray(muon_state.ns_coeffs)[0], COEFFS, rtol=1e-6)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(later))
    assert np.isfinite(float(more[0]["loss"]))
