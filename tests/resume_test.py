"""Resume is exact at every step: a fresh ``data_parallel`` given a state (restored from a
checkpoint, or copied) continues as the uninterrupted run does, at warm-up boundaries, refreshes
and the guardrail's windows too; and a checkpoint of the state layout before ``asked`` existed
still restores."""

import tempfile
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

STEPS = 9

CASES = {
    "adam-sign": lambda: jaxcomp.adam(1e-2, "sign", warmup_steps=4, refresh_every=3),
    "adam-ar_topk": lambda: jaxcomp.adam(1e-2, "ar_topk", ratio=0.25, warmup_steps=4),
    "allgather_topk": lambda: optax.chain(
        jaxcomp.compress("allgather_topk", ratio=0.25, warmup_steps=4), optax.sgd(0.1)
    ),
    "ar_topk-momentum": lambda: optax.chain(
        jaxcomp.compress("ar_topk", ratio=0.25, warmup_steps=4, momentum_correction=0.9),
        optax.sgd(0.1),
    ),
}


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def _batches(features=8, outputs=2):
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(16, features)).astype(np.float32),
            "y": rng.normal(size=(16, outputs)).astype(np.float32),
        }
        for _ in range(STEPS)
    ]


def _dp(tx):
    need_devices(8)
    return jaxcomp.data_parallel(_loss, tx, Mesh(np.array(jax.devices()[:8]), ("data",)))


PARAMS = {"w": jnp.zeros((8, 2))}


@pytest.mark.parametrize("case", list(CASES))
def test_a_fresh_dp_resumes_bit_for_bit_at_every_step(case):
    batches = _batches()
    dp = _dp(CASES[case]())
    state = dp.init(PARAMS)
    states = [state]
    for batch in batches:
        state, _ = dp.step(state, batch)
        states.append(state)
    for k in range(1, STEPS):
        fresh = _dp(CASES[case]())
        resumed = jax.tree.map(jnp.copy, states[k])  # as a restored checkpoint: a new object
        for batch in batches[k:]:
            resumed, _ = fresh.step(resumed, batch)
        np.testing.assert_array_equal(
            np.asarray(resumed.params["w"]), np.asarray(state.params["w"]), err_msg=f"step {k}"
        )


def _without_asked(state):
    """The state as the layout before ``asked`` saved it."""
    return state._replace(
        opt_state=jax.tree.map(
            lambda s: s._replace(asked=None) if isinstance(s, jaxcomp.CompressState) else s,
            state.opt_state,
            is_leaf=lambda s: isinstance(s, jaxcomp.CompressState),
        )
    )


def test_a_checkpoint_at_the_switch_restores_exactly_and_one_of_before_still_loads():
    batches = _batches()
    dp = _dp(CASES["allgather_topk"]())
    state = dp.init(PARAMS)
    for batch in batches[:4]:  # the last warm-up step
        state, _ = dp.step(state, batch)
    saved = state
    for batch in batches[4:]:
        state, _ = dp.step(state, batch)
    checkpointer = ocp.StandardCheckpointer()
    paths = {}
    for name, tree in (("now", saved), ("before", _without_asked(saved))):
        paths[name] = tempfile.mkdtemp() + "/ckpt"
        checkpointer.save(paths[name], tree)
    checkpointer.wait_until_finished()
    fresh = _dp(CASES["allgather_topk"]())
    resumed = fresh.restore(paths["now"], PARAMS)
    for batch in batches[4:]:
        resumed, _ = fresh.step(resumed, batch)
    np.testing.assert_array_equal(np.asarray(resumed.params["w"]), np.asarray(state.params["w"]))
    old = _dp(CASES["allgather_topk"]()).restore(paths["before"], PARAMS)
    asked = jaxcomp.find_compress_state(old.opt_state).asked
    assert int(asked) == 1  # filled as the host read it before: the state's next branch
    np.testing.assert_array_equal(np.asarray(old.params["w"]), np.asarray(saved.params["w"]))


def test_a_checkpoint_of_another_tx_is_refused_naming_its_arrays():
    dp = _dp(CASES["allgather_topk"]())
    path = tempfile.mkdtemp() + "/ckpt"
    checkpointer = ocp.StandardCheckpointer()
    other = _dp(optax.chain(jaxcomp.compress("allgather_topk", ratio=0.25), optax.adam(0.1)))
    checkpointer.save(path, other.init(PARAMS))
    checkpointer.wait_until_finished()
    with pytest.raises(ValueError, match="another tx, shard= or params"):
        dp.restore(path, PARAMS)


#: Every method, with its options for the sweep below.
METHODS = {
    "dense": {},
    "ar_topk": {"ratio": 0.25},
    "allgather_topk": {"ratio": 0.25},
    "randomk": {"ratio": 0.25},
    "zfp": {"rate": 8},
    "quantized": {"bits": 4},
    "bf16": {},
    "fp16": {},
    "powersgd": {"rank": 1},
    "sign": {},
}

SWEEP_STEPS = 6


def _sweep(step, state, batches):
    """The states of an uninterrupted run, then each one stepped again from a copy (a new
    object, as a restored checkpoint is) by the same ``step``: the final params of each resume."""
    states = [state]
    for batch in batches:
        state, _ = step(state, batch)
        states.append(state)
    finals = []
    for k in range(1, len(batches)):
        resumed = jax.tree.map(jnp.copy, states[k])
        for batch in batches[k:]:
            resumed, _ = step(resumed, batch)
        finals.append((k, resumed))
    return state, finals


@pytest.mark.slow
@pytest.mark.parametrize("context", ["compress", "adam", "diloco"])
@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_resumes_bit_for_bit_at_every_step(method, context):
    batches = _batches(16, 8)[:SWEEP_STEPS]  # a matrix PowerSGD compresses at rank 1
    if context == "diloco":
        need_devices(8)
        run = jaxcomp.diloco(
            _loss,
            optax.adam(1e-2),
            mesh=Mesh(np.array(jax.devices()[:4]), ("workers",)),
            sync_every=2,
            compress=jaxcomp.compress(method, axis_name="workers", **METHODS[method]),
        )
        params = lambda s: run.params(s)  # noqa: E731
    else:
        if context == "adam":
            tx = jaxcomp.adam(1e-2, method, warmup_steps=2, refresh_every=3, **METHODS[method])
        else:
            compress = jaxcomp.compress(method, warmup_steps=2, **METHODS[method])
            tx = optax.chain(compress, optax.sgd(0.1))
        run = _dp(tx)
        params = lambda s: s.params  # noqa: E731
    last, finals = _sweep(run.step, run.init({"w": jnp.zeros((16, 8))}), batches)
    for k, resumed in finals:
        np.testing.assert_array_equal(
            np.asarray(params(resumed)["w"]), np.asarray(params(last)["w"]), err_msg=f"step {k}"
        )


def test_resume_is_exact_across_the_guardrails_fallback_window():
    """A spike triggers the guardrail of a top-k with the dense fallback (a branch the host
    pins); resuming at every step, the window's start and end included, is bit for bit."""
    batches = _batches()
    for batch in batches[3:5]:  # a spike that persists: two suspect steps in a row
        batch["y"] = batch["y"] * 1e3
    guard = jaxcomp.Guardrail(window=2, burn_in=2, dense_fallback=True)
    tx = optax.chain(jaxcomp.compress("ar_topk", ratio=0.25, guardrail=guard), optax.sgd(0.01))
    dp = _dp(tx)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        last, finals = _sweep(dp.step, dp.init(PARAMS), batches)
    assert int(jaxcomp.find_compress_state(last.opt_state).metrics.fallbacks) >= 1
    for k, resumed in finals:
        np.testing.assert_array_equal(
            np.asarray(resumed.params["w"]), np.asarray(last.params["w"]), err_msg=f"step {k}"
        )
