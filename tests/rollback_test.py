"""data_parallel(rollback=): a run whose guardrail triggers goes back to a state kept before the
divergence and falls back to dense from there; a run that never triggers is not changed."""

import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import need_devices
from jax.sharding import Mesh

import jaxcomp
from jaxcomp.training import rollback
from jaxcomp.training.rollback import RollbackStep, triggered

GUARDRAIL = jaxcomp.Guardrail(burn_in=3, window=4)


def _dp(rollback, guardrail=GUARDRAIL, shard=None, method="sign"):
    need_devices(8)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    tx = optax.chain(jaxcomp.compress(method, guardrail=guardrail), optax.adam(0.05))
    loss = lambda w, batch: jnp.mean((batch - w) ** 2)  # noqa: E731
    return jaxcomp.data_parallel(loss, tx, mesh, rollback=rollback, shard=shard)


def _batch(t, spiked=()):
    rows = np.linspace(-1.0, 1.0, 8 * 16, dtype=np.float32).reshape(8, 16) + 0.01 * t
    return jnp.asarray(rows * (1e4 if t in spiked else 1.0))


def _run(dp, steps, spiked=()):
    state, states = dp.init(jnp.zeros(16)), []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the guardrail's, once a process
        for t in range(steps):
            state, _ = dp.step(state, _batch(t, spiked))
            states.append(state)
    return states


def test_a_run_that_never_triggers_is_the_same_with_rollback():
    plain, kept = _run(_dp(None), 12), _run(_dp(5), 12)
    for a, b in zip(plain, kept):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("shard, method", [(None, "sign"), ("optimizer", jaxcomp.Quantized(4))])
def test_a_trigger_rolls_back_to_the_state_kept_a_check_earlier(shard, method, caplog):
    dp = _dp(5, shard=shard, method=method)
    with caplog.at_level(logging.WARNING, logger="jaxcomp"):
        states = _run(dp, 20, spiked=(12, 13))
    steps = [int(s.step) for s in states]
    # checks before calls 0, 5, 10 keep states 0, 5, 10; the spike triggers at step 13 and the
    # check before call 15 returns the state of step 5, one check before the newest.
    assert steps == list(range(1, 16)) + [6, 7, 8, 9, 10], steps
    assert dp.step.rollbacks == 1
    told = [r.getMessage() for r in caplog.records if "rolling back" in r.getMessage()]
    assert len(told) == 1 and "to step 5" in told[0], told
    # the guardrail's state came along: its trigger is counted and the restored run falls
    # back to dense for the window plus the 10 steps rolled back.
    restored = jaxcomp.find_compress_state(states[15].opt_state)
    assert triggered(states[15].opt_state) == 1 and int(restored.divergence.left) > 4
    # what comes back: the old state's residual cleared, as a trigger clears it (the dense
    # fallback would send it all), and the newest guardrail state, its window 10 steps longer
    carried = rollback._carried(states[4].opt_state, states[14].opt_state, 10)
    kept = jaxcomp.find_compress_state(states[4].opt_state)
    assert any(np.any(np.asarray(leaf)) for leaf in jax.tree.leaves(kept.residual))
    back = jaxcomp.find_compress_state(carried)
    assert not any(np.any(np.asarray(leaf)) for leaf in jax.tree.leaves(back.residual))
    newest = jaxcomp.find_compress_state(states[14].opt_state).divergence
    assert int(back.divergence.left) == int(newest.left) + 10
    assert int(back.divergence.fallbacks) == int(newest.fallbacks) == 1
    # the params went back to step 5's, and stayed finite and near the data's mean.
    assert np.all(np.abs(np.asarray(states[-1].params)) < 1.0)


def test_without_rollback_the_spike_stays_in_adams_variance():
    """What the rollback saves: without it, the spike's gradients stay in Adam's variance
    (and shrink its steps for thousands of steps); with it, the variance is the one of before."""
    plain, kept = _run(_dp(None), 20, (12, 13)), _run(_dp(5), 20, (12, 13))
    nu = [np.asarray(s[-1].opt_state[1][0].nu).max() for s in (plain, kept)]
    assert nu[0] > 1e4 * nu[1], nu


@pytest.mark.parametrize("rollback", [0, -3, 2.5, True, "50"])
def test_rollback_must_be_a_positive_number_of_steps(rollback):
    with pytest.raises(ValueError, match="rollback"):
        _dp(rollback)


def test_rollback_refuses_donation():
    need_devices(8)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    tx = optax.chain(jaxcomp.compress("sign"), optax.adam(0.05))
    with pytest.raises(ValueError, match="rollback .* donate=True"):
        jaxcomp.data_parallel(lambda w, b: jnp.mean(w * b), tx, mesh, rollback=5, donate=True)


def test_the_step_passes_through_other_attributes():
    step = RollbackStep(lambda state, batch: (state, {}), every=3)
    step.extra = 1
    assert step.every == 3 and step.rollbacks == 0


def test_a_state_of_another_history_starts_the_kept_states_again():
    """A state whose guardrail has triggered fewer times than the last check saw (a checkpoint
    restored, a run started again) is not a reason to roll back."""
    dp = _dp(5)
    states = _run(dp, 20, spiked=(12, 13))
    assert dp.step.rollbacks == 1
    state = dp.init(jnp.zeros(16))  # a fresh start, 0 triggers
    for t in range(11):
        state, _ = dp.step(state, _batch(t))
    assert dp.step.rollbacks == 1 and int(state.step) == 11
    assert triggered(states[-1].opt_state) == 1
