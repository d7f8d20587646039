"""data_parallel(donate=True): the step writes the new state over the old one.

A donated run is bit for bit the undonated one (every method family, replicated and sharded, on
1, 2, 3 and 8 devices); the state passed in is deleted; the compiled step aliases the state's
buffers to its outputs; the host still hears of a guardrail trigger and of a non-finite step
(whose error carries the unchanged state), though the input it would have read is gone.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal, need_devices
from jax.sharding import Mesh

import jaxcomp

SHAPES = {"w1": (16, 24), "b1": (24,), "w2": (24, 8)}
METHODS = {
    "dense": {},
    "ar_topk": {"ratio": 0.1},
    "allgather_topk": {"ratio": 0.1},
    "randomk": {"ratio": 0.1},
    "powersgd": {"rank": 2},
    "zfp": {"rate": 8},
    "quantized": {"bits": 4},
    "sign": {},
    "bf16": {},
}


def _mesh(n):
    need_devices(n)
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def _params():
    rng = np.random.default_rng(0)
    return {k: jnp.asarray(rng.normal(size=s).astype(np.float32)) for k, s in SHAPES.items()}


def _loss(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def _batch(t, n):
    rng = np.random.default_rng(100 + t)
    rows = 2 * n
    x = rng.normal(size=(rows, 16)).astype(np.float32)
    return {"x": x, "y": rng.normal(size=(rows, 8)).astype(np.float32)}


def _host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def _deleted(state):
    """Whether the state's arrays are deleted (all but the scalars the step never reads: the
    previous step's metrics, which jit leaves out of the program and so does not donate)."""
    return all(leaf.is_deleted() for leaf in jax.tree.leaves(state) if leaf.size > 1)


def _run(method, n, donate, shard=None, steps=3, compress=None):
    tx = optax.chain(compress or jaxcomp.compress(method, **METHODS[method]), optax.adam(0.01))
    dp = jaxcomp.data_parallel(_loss, tx, _mesh(n), shard=shard, donate=donate)
    state = dp.init(_params())
    losses = []
    for t in range(steps):
        before = state
        state, metrics = dp.step(state, _batch(t, n))
        losses.append(float(metrics["loss"]))
        assert _deleted(before) == donate
    return dp, _host(state), losses


# Every method on 3 devices (a ring that does not split evenly); the sparse and the stateful
# method on 1 (no collective), 2 and 8 too. Donation aliases the state's buffers whatever the
# mesh; tests/train_test.py trains every method on 1, 2, 3 and 8 devices.
DONATED_CASES = [(m, 3) for m in METHODS] + [
    pytest.param(m, n, marks=pytest.mark.slow) for n in (1, 2, 8) for m in ("ar_topk", "powersgd")
]


@pytest.mark.parametrize("method, n", DONATED_CASES)
def test_a_donated_run_is_the_undonated_one_bit_for_bit(method, n):
    _, kept, kept_losses = _run(method, n, donate=False)
    _, donated, donated_losses = _run(method, n, donate=True)
    assert_trees_equal(donated, kept)
    assert donated_losses == kept_losses


@pytest.mark.parametrize("shard, method", [("optimizer", "ar_topk"), ("params", "dense")])
def test_sharded_runs_donate_too(shard, method):
    _, kept, _ = _run(method, 8, donate=False, shard=shard)
    _, donated, _ = _run(method, 8, donate=True, shard=shard)
    assert_trees_equal(donated, kept)


def test_the_compiled_step_writes_the_state_over_its_input():
    """XLA aliases the donated state's buffers to the new state's: the compiled step's outputs
    written over its arguments cover at least the params, Adam's two moments and the residual
    (the undonated step's cover nothing)."""
    for donate in (False, True):
        tx = optax.chain(jaxcomp.compress("ar_topk", ratio=0.1), optax.adam(0.01))
        dp = jaxcomp.data_parallel(_loss, tx, _mesh(2), donate=donate)
        state = dp.init(_params())
        stats = dp.step.lower(state, _batch(0, 2)).compile().memory_analysis()
        params_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
        if donate:
            assert stats.alias_size_in_bytes >= 4 * params_bytes, stats
        else:
            assert stats.alias_size_in_bytes == 0, stats


def test_many_donated_steps_stay_bounded_in_flight():
    tx = optax.chain(jaxcomp.compress("randomk", ratio=0.1), optax.sgd(0.01))
    dp = jaxcomp.data_parallel(_loss, tx, _mesh(8), donate=True, max_steps_in_flight=4)
    state = dp.init(_params())
    for t in range(40):
        state, metrics = dp.step(state, _batch(t % 5, 8))
    assert np.isfinite(float(metrics["loss"])) and int(state.step) == 40


def test_the_guardrail_is_told_once_with_a_donated_state(caplog):
    """The trigger's scalars are the step's own outputs: the donated input they were once read
    from is gone by the time the host reads them."""
    guard = jaxcomp.Guardrail(window=5, patience=1)  # triggers at the spike itself
    compress = jaxcomp.compress("ar_topk", ratio=0.1, guardrail=guard)
    tx = optax.chain(compress, optax.sgd(0.01, momentum=0.9))
    dp = jaxcomp.data_parallel(_loss, tx, _mesh(2), donate=True)
    state = dp.init(_params())
    with caplog.at_level(logging.WARNING, logger="jaxcomp"):
        for t in range(30):
            batch = _batch(t % 5, 2)
            if t == 20:
                batch = {"x": batch["x"], "y": batch["y"] * 1e4}
            state, metrics = dp.step(state, batch)
        jax.block_until_ready(state)
        state, _ = dp.step(state, _batch(0, 2))  # retires the last steps' probes
    told = [r.getMessage() for r in caplog.records if "diverges at step 20" in r.getMessage()]
    assert len(told) == 1 and "ar_topk(0.1)" in told[0], told
    assert float(metrics["fallbacks"]) == 1


def test_a_nonfinite_step_raises_with_the_unchanged_state():
    tx = optax.chain(jaxcomp.compress("ar_topk", ratio=0.1, nonfinite="raise"), optax.adam(0.01))
    dp = jaxcomp.data_parallel(_loss, tx, _mesh(2), donate=True)
    state, _ = dp.step(dp.init(_params()), _batch(0, 2))
    # A copy on the devices: a numpy view of a CPU buffer (np.asarray) would keep XLA from
    # donating it.
    good = jax.tree.map(jnp.copy, state)
    bad = _batch(1, 2)
    bad["x"][0, 3] = np.nan
    with pytest.raises(FloatingPointError, match="step 1: .*was donated") as caught:
        dp.step(state, bad)
    assert _deleted(state)
    kept = _host(caught.value.state)
    assert_trees_equal(kept.params, _host(good.params))
    assert int(kept.step) == 2
    # Training goes on from the error's state.
    state, metrics = dp.step(caught.value.state, _batch(2, 2))
    assert np.isfinite(float(metrics["loss"]))


def test_donate_must_be_a_bool():
    tx = optax.chain(jaxcomp.compress("dense"), optax.sgd(0.1))
    with pytest.raises(TypeError, match="donate must be True or False"):
        jaxcomp.data_parallel(_loss, tx, _mesh(1), donate="yes")


def test_the_params_given_to_init_survive_a_donated_step():
    """init copies the params into the state, so donating the state leaves the caller's own."""
    params = _params()
    tx = optax.chain(jaxcomp.compress("ar_topk", ratio=0.1), optax.adam(0.01))
    for n in (1, 2):
        dp = jaxcomp.data_parallel(_loss, tx, _mesh(n), donate=True)
        state, _ = dp.step(dp.init(params), _batch(0, n))
        jax.block_until_ready(state)
        assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(params))
