"""The casts' step makes no pass over the gradient that nothing reads: without error feedback the
ring never builds what each device sent (``Method.rounds_only``: the metrics take the error-fed
vector for it, with a gain of 1)."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import need_devices

import jaxcomp
from jaxcomp.methods import Cast, Dense, TopK
from jaxcomp.optim.stages.aggregation import rounds_only

N_DEVICES = 8


def _step(method, error_feedback, n=8 * 4099):
    """A compiled data_parallel step of compress(method) and sgd, its state and a batch."""
    import jax
    from jax.sharding import Mesh

    need_devices(N_DEVICES)
    mesh = Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))
    tx = optax.chain(jaxcomp.compress(method, error_feedback=error_feedback), optax.sgd(1.0))
    dp = jaxcomp.data_parallel(lambda w, b: jnp.sum(w * jnp.mean(b, axis=0)), tx, mesh)
    batch = np.random.default_rng(0).standard_normal((N_DEVICES, n)).astype(np.float32)
    return dp, dp.init(jnp.zeros(n)), batch


def _hlo(dp, state, batch) -> str:
    return dp.step.lower(state, batch).compile().as_text()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_cast_without_error_feedback_never_builds_its_sent(dtype):
    """The ring writes each device's sent chunk by chunk (dynamic-update-slice) only when error
    feedback reads it: the metrics alone do not (checked against the code before: 4 such writes
    of a gradient-sized vector a step, and two copies of it)."""
    plain, fed = (_step(Cast(dtype), feedback) for feedback in (False, True))
    assert "dynamic-update-slice" in _hlo(*fed)
    assert "dynamic-update-slice" not in _hlo(*plain)


@pytest.mark.parametrize("error_feedback", [False, True])
def test_a_casts_gain_is_one_and_its_step_trains(error_feedback):
    """The gain is 1 (what was sent is the fed vector, rounded) and the update is the mean of the
    gradients, to the ring's roundings (each partial sum of up to 8 values, at 2**-8 of it)."""
    dp, state, batch = _step(Cast("bfloat16"), error_feedback)
    state, metrics = dp.step(state, batch)
    assert float(metrics["gain"]) == 1.0 and float(metrics["nonfinite"]) == 0.0
    np.testing.assert_allclose(
        -np.asarray(state.params), batch.mean(0), rtol=0, atol=2**-8 * np.abs(batch).sum(0).max()
    )


def test_rounds_only_needs_every_method_to_round_or_send_all():
    assert rounds_only([Cast("bf16"), Cast("fp16"), Dense()])
    assert not rounds_only([Cast("bf16"), TopK(0.01)])
    assert not rounds_only([TopK(0.01)])


def test_a_casts_buckets_are_not_held_by_the_guardrails_switch():
    """The guardrail's dense fallback gives the cast a second branch. Chosen on the device
    (``lax.switch``), the ring of every bucket would sit in one conditional that waits for the
    whole backward pass; data_parallel compiles the cast's branch alone instead, so the ring's
    hops run in the step itself, bucket by bucket."""
    from jaxcomp.optim import pinning

    dp, state, batch = _step(Cast("bfloat16"), False, n=2 * 2**20)
    compress_state = jaxcomp.find_compress_state(state.opt_state)
    assert len(compress_state.branches.methods) == 2 and compress_state.branches.buckets
    assert pinning.can_pin(compress_state)
    entry = _hlo(dp, state, batch).split("\nENTRY ")[1]
    assert "collective-permute(" in entry
