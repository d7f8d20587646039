"""jaxcomp.accumulate with non-finite gradients, a schedule below 1, and every_k=1.

Issue 24: a NaN in one micro-step used to stay in the accumulator for good ("skip" never trained
again, "raise" raised on every later step). Now the micro-step that brings the values gets
compress's ``nonfinite=`` policy and the accumulator never holds them. Each run goes through
``data_parallel`` on 8 devices with ``loss = sum(params * batch row)`` (the gradient of a device
is its row) and every_k=2; the bad batch plants a NaN, a +Inf and a -Inf on two devices, as the
first or the last micro-step of the second accumulated step. The references are the same run with
those entries set to 0 ("zero") or without the bad batch at all ("skip", "raise").
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal, need_devices
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcomp

N_DEVICES = 8
EVERY_K = 2
SHAPES = {"a": (16, 12), "b": (7,), "c": (13,)}
# (leaf, device, index, value): 3 non-finite entries on 2 devices.
PLANTED = [("a", 3, (1, 2), np.nan), ("c", 3, (4,), np.inf), ("b", 5, (0,), -np.inf)]
METHODS = {
    "dense": {},
    "ar_topk": {"ratio": 0.25},
    "powersgd": {"rank": 1},
    "quantized": {"bits": 8},
}
# 8 micro-steps (4 updates) of clean batches; the bad one goes in at BAD[position].
CLEAN_STEPS = 8
BAD = {"first": 2, "last": 3}


def _mesh():
    need_devices(N_DEVICES)
    return Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))


def _loss(params, batch):
    return sum(jnp.sum(params[name] * batch[name][0]) for name in SHAPES)


def _tx(method, policy, every_k=EVERY_K):
    chain = optax.chain(
        jaxcomp.compress(method, nonfinite=policy, **METHODS[method]), optax.adam(0.1)
    )
    return jaxcomp.accumulate(chain, every_k)


def _params():
    return {name: jnp.full(shape, 0.5, jnp.float32) for name, shape in SHAPES.items()}


def _batch(seed, bad=None):
    """Per-device gradient rows; ``bad``: "plant" the non-finite entries, "zero" zeros there."""
    rng = np.random.default_rng(seed)
    batch = {
        name: rng.standard_normal((N_DEVICES,) + shape).astype(np.float32)
        for name, shape in SHAPES.items()
    }
    for name, device, index, value in PLANTED:
        if bad is not None:
            batch[name][(device,) + index] = value if bad == "plant" else 0.0
    return batch


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _strip_metrics(opt_state):
    return jax.tree.map(
        lambda x: x._replace(metrics=None) if isinstance(x, jaxcomp.CompressState) else x,
        opt_state,
        is_leaf=lambda x: isinstance(x, jaxcomp.CompressState),
    )


def _run(dp, batches):
    """Steps through ``batches`` (None: a bad step expected to raise); the host params after each
    step, the final state and the metrics of each step (None where it raised)."""
    state = dp.init(_params())
    params, metrics = [], []
    for batch in batches:
        try:
            state, step_metrics = dp.step(state, batch)
        except FloatingPointError as error:
            assert "3 non-finite entries" in str(error)
            step_metrics = None
        params.append(_host(state.params))
        metrics.append(step_metrics)
        acc = jax.tree.leaves(_host(state.opt_state.acc_grads))
        assert all(np.all(np.isfinite(a)) for a in acc), "the accumulator holds a bad value"
    return params, state, metrics


@functools.cache
def _reference(method, policy, position):
    """The reference run of ``policy``: the bad entries as 0 ("zero"), or no bad batch at all."""
    batches = [_batch(s) for s in range(CLEAN_STEPS)]
    if policy == "zero":
        batches.insert(BAD[position], _batch(99, "zero"))
    dp = jaxcomp.data_parallel(_loss, _tx(method, policy), _mesh())
    params, state, _ = _run(dp, batches)
    return params, _host(state.params), _strip_metrics(_host(state.opt_state))


# Every policy with the bad micro-step first (the case that stalled training for good) for dense
# and top-k (a residual); PowerSGD and THC with "zero", the policy that trains on what is left
# (the other two roll the micro-step back whatever the method); the last micro-step (which the
# rollback always handled) with dense and "zero" only, to keep CI short.
BAD_CASES = [
    (method, policy, position)
    for method in METHODS
    for policy in ("zero", "skip", "raise")
    for position in BAD
    if (position == "first" and (method in ("dense", "ar_topk") or policy == "zero"))
    or (method == "dense" and policy == "zero")
]


@pytest.mark.parametrize(
    "method, policy, position", BAD_CASES, ids=["-".join(case) for case in BAD_CASES]
)
def test_a_bad_micro_step_gets_the_policy_and_training_goes_on(method, policy, position):
    bad_at = BAD[position]
    batches = [_batch(s) for s in range(CLEAN_STEPS)]
    batches.insert(bad_at, _batch(99, "plant"))
    dp = jaxcomp.data_parallel(_loss, _tx(method, policy), _mesh())
    params, state, metrics = _run(dp, batches)
    if policy == "raise":
        assert metrics[bad_at] is None
    else:
        assert float(metrics[bad_at]["nonfinite"]) == len(PLANTED)
    for step, step_metrics in enumerate(metrics):
        if step != bad_at:
            assert float(step_metrics["nonfinite"]) == 0
    ref_params, ref_final, ref_opt = _reference(method, policy, position)
    if policy == "zero":
        for got, want in zip(params, ref_params):
            assert_trees_equal(got, want)
    else:
        # The bad micro-step leaves everything as it was and does not count toward every_k.
        assert_trees_equal(params[bad_at], params[bad_at - 1])
        for got, want in zip(params[:bad_at] + params[bad_at + 1 :], ref_params):
            assert_trees_equal(got, want)
    assert_trees_equal(_host(state.params), ref_final)
    assert_trees_equal(_strip_metrics(_host(state.opt_state)), ref_opt)
    # The params keep changing after the bad micro-step: every later update moves them.
    later = params[bad_at:]
    moved = [not np.array_equal(a["a"], b["a"]) for a, b in zip(later, later[1:])]
    assert sum(moved) >= 2


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("policy", ["zero", "skip"])
def test_accumulate_alone_in_a_shard_map_keeps_the_accumulator_finite(policy, check_vma):
    """Without data_parallel: accumulate itself drops ("skip") or zeroes the micro-step, and
    every device agrees (the count is summed over the devices, also untyped)."""
    mesh = _mesh()
    tx = _tx("dense", policy)
    state = tx.init({"w": jnp.zeros(4)})

    def step(g, state):
        updates, new_state = tx.update({"w": g[0]}, state)
        return new_state.mini_step, new_state.acc_grads["w"][None], new_state.inner_opt_state

    f = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P("data"), P()),
            out_specs=(P(), P("data"), P()),
            check_vma=check_vma,
        )
    )
    grads = np.ones((N_DEVICES, 4), np.float32)
    grads[2, 1] = np.nan
    mini_step, acc, inner = f(jnp.asarray(grads), state)
    assert jaxcomp.find_compress_state(inner).metrics.nonfinite == 1
    skipped = jaxcomp.skipped_update(inner)
    assert skipped is None if policy == "zero" else bool(skipped)
    want = np.ones((N_DEVICES, 4), np.float32)
    if policy == "skip":
        assert int(mini_step) == 0
        want[:] = 0
    else:
        assert int(mini_step) == 1
        want[2, 1] = 0
    np.testing.assert_array_equal(np.asarray(acc), want)


@pytest.mark.parametrize("schedule", [lambda step: 0, lambda step: -1, lambda step: jnp.int32(0)])
def test_a_schedule_below_one_is_refused_when_built(schedule):
    with pytest.raises(ValueError, match="every_k: the schedule returned"):
        jaxcomp.accumulate(optax.sgd(1.0), schedule)


def test_a_schedule_that_is_not_a_scalar_is_refused():
    with pytest.raises(ValueError, match="every_k: the schedule must return a scalar"):
        jaxcomp.accumulate(optax.sgd(1.0), lambda step: jnp.ones(2, jnp.int32))


def test_a_later_schedule_value_below_one_emits_instead_of_stalling():
    # Known only at run time (traced): counts as 1, so every micro-step updates.
    tx = jaxcomp.accumulate(optax.sgd(1.0), lambda step: jnp.where(step == 0, 2, 0))
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    emitted = []
    for g in (1.0, 3.0, 5.0, 7.0):
        updates, state = update({"w": jnp.full(2, g)}, state, params)
        emitted.append(float(updates["w"][0]))
    assert emitted == [0.0, -2.0, -5.0, -7.0]


def test_skipped_update_refuses_what_it_cannot_read():
    with pytest.raises(TypeError, match="opt_state is None"):
        jaxcomp.skipped_update(None)
    with pytest.raises(ValueError, match="opt_state holds no jaxcomp.CompressState"):
        jaxcomp.skipped_update(optax.adam(0.1).init({"w": jnp.zeros(2)}))
    with pytest.raises(ValueError, match="opt_state holds no jaxcomp.CompressState"):
        jaxcomp.skipped_update(())
    # A compress that never skips still answers None.
    assert jaxcomp.skipped_update(jaxcomp.compress("dense").init({"w": jnp.zeros(2)})) is None


@pytest.mark.parametrize("policy", ["zero", "skip"])
@pytest.mark.parametrize("method", ["dense", "ar_topk"])
def test_every_k_one_is_the_transformation_bit_for_bit(method, policy):
    """Before, accumulate(tx, 1) differed from tx by rounding: its lax.cond kept XLA from fusing
    the update into the params (p + lr * u as one multiply-add). Now it runs tx as it is; so does
    the optax.MultiSteps(tx, 1) that data_parallel turns into accumulate."""
    mesh = _mesh()
    chain = optax.chain(
        jaxcomp.compress(method, nonfinite=policy, **METHODS[method]), optax.adam(0.1)
    )
    runs = []
    for tx in (chain, jaxcomp.accumulate(chain, 1), optax.MultiSteps(chain, 1)):
        dp = jaxcomp.data_parallel(_loss, tx, mesh)
        state = dp.init(_params())
        params = []
        for step in range(5):
            state, _ = dp.step(state, _batch(step, "plant" if step == 2 else None))
            params.append(_host(state.params))
        runs.append(params)
    for run in runs[1:]:
        for got, want in zip(run, runs[0]):
            assert_trees_equal(got, want)
