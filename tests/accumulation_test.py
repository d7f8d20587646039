"""jaxcomp.accumulate on its own: the running mean (or sum) against numpy, micro-steps that leave
the inner state alone, schedules, and the argument checks. tests/controls_test.py runs it inside
data_parallel."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp.optim import accumulation


def _gradients(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"w": rng.standard_normal(3).astype(np.float32), "b": np.float32(rng.standard_normal())}
        for _ in range(steps)
    ]


@pytest.mark.parametrize("use_grad_mean", [True, False])
@pytest.mark.parametrize("every_k", [1, 2, 3])
def test_accumulate_against_numpy(every_k, use_grad_mean):
    tx = jaxcomp.accumulate(optax.sgd(1.0), every_k, use_grad_mean=use_grad_mean)
    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    state = tx.init(params)
    grads = _gradients(2 * every_k)
    for step, g in enumerate(grads):
        updates, state = tx.update(g, state, params)
        window = grads[step - step % every_k : step + 1]
        if (step + 1) % every_k:
            assert all(not np.asarray(u).any() for u in updates.values())
            continue
        for name in ("w", "b"):
            stacked = np.stack([np.asarray(w[name]) for w in window])
            want = -(stacked.mean(axis=0) if use_grad_mean else stacked.sum(axis=0))
            np.testing.assert_allclose(np.asarray(updates[name]), want, rtol=1e-5, atol=1e-6)
        assert not np.asarray(state.acc_grads["w"]).any()
    assert int(state.gradient_step) == 2 and int(state.mini_step) == 0


def test_micro_steps_leave_the_inner_state_alone():
    tx = jaxcomp.accumulate(optax.adam(0.1), 3)
    state = tx.init({"w": jnp.zeros(2)})
    for _ in range(2):
        _, state = tx.update({"w": jnp.ones(2)}, state)
        assert int(state.inner_opt_state[0].count) == 0
    _, state = tx.update({"w": jnp.ones(2)}, state)
    assert int(state.inner_opt_state[0].count) == 1


def test_a_schedule_sets_the_micro_steps():
    tx = jaxcomp.accumulate(optax.sgd(1.0), lambda step: jnp.where(step == 0, 1, 2))
    state = tx.init({"w": jnp.zeros(1)})
    emitted = []
    for value in (1.0, 2.0, 4.0, 8.0, 16.0):
        updates, state = tx.update({"w": jnp.full(1, value)}, state)
        emitted.append(float(updates["w"][0]))
    assert emitted == [-1.0, 0.0, -3.0, 0.0, -12.0]


def test_from_multisteps_keeps_the_settings():
    ms = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2, use_grad_mean=False)
    tx = accumulation.from_multisteps(ms)
    state = tx.init({"w": jnp.zeros(1)})
    _, state = tx.update({"w": jnp.ones(1)}, state)
    updates, _ = tx.update({"w": jnp.ones(1)}, state)
    assert float(updates["w"][0]) == -2.0


@pytest.mark.parametrize(
    "args, error, match",
    [
        (("not a transformation", 2), TypeError, "tx must be an optax GradientTransformation"),
        ((optax.sgd(1.0), 0), ValueError, "every_k"),
        ((optax.sgd(1.0), 2.5), (TypeError, ValueError), "every_k"),
    ],
)
def test_bad_arguments_are_named(args, error, match):
    with pytest.raises(error, match=match):
        jaxcomp.accumulate(*args)
    with pytest.raises(TypeError, match="use_grad_mean"):
        jaxcomp.accumulate(optax.sgd(1.0), 2, use_grad_mean="yes")
