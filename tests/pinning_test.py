"""A branch chosen on the host (:mod:`jaxcomp.optim.pinning`, :mod:`jaxcomp.training.branches`):
a step compiled for one branch computes what the device's ``lax.switch`` step computes when it
chooses that branch, without the switch; ``data_parallel`` runs the branch each step reported,
a fixed number of calls later, on 1, 2, 3 and 8 devices."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import need_devices
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.costmodel import cost
from jaxcomp.optim import pinning
from jaxcomp.training import branches as host_branches

DIM = 300
SLOW = cost.Network.parse("1ms", "1mbit")  # top-k beats dense by far


def _mesh(n):
    need_devices(n)
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def _batches(n, rows=24):
    rng = np.random.default_rng(0)
    w = rng.normal(size=DIM).astype(np.float32)
    out = []
    for _ in range(n):
        x = rng.normal(size=(rows, DIM)).astype(np.float32)
        out.append({"x": x, "y": x @ w})
    return out


TRANSFORMATIONS = {
    "warmup": lambda: jaxcomp.compress("ar_topk", ratio=0.05, warmup_steps=4),
    "fallback": lambda: jaxcomp.compress(
        "allgather_topk", ratio=0.05, guardrail=jaxcomp.Guardrail(dense_fallback=True)
    ),
    "auto": lambda: jaxcomp.compress_auto(
        [jaxcomp.Dense(), jaxcomp.TopK(0.05, collective="ar")], network=SLOW
    ),
}


def _update(tx, mesh, branch):
    """The jitted update of ``tx`` over ``mesh``, traced with ``branch`` pinned (or not)."""

    def update(g, state):
        with pinning.pinned(branch):
            return tx.update(jax.lax.pcast(g, "data", to="varying"), state)

    spec = (P(), P())
    return jax.jit(jax.shard_map(update, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


@pytest.mark.parametrize("name", sorted(TRANSFORMATIONS))
@pytest.mark.parametrize("step", [0, 6])
def test_pinned_update_equals_the_switched_one(name, step):
    tx = TRANSFORMATIONS[name]()
    mesh = _mesh(2)
    grads = {"w": jnp.asarray(np.random.default_rng(step).normal(size=DIM), jnp.float32)}
    state = tx.init(grads)
    state = state._replace(step=jnp.int32(step), residual={"w": 0.3 * grads["w"][::-1]})
    if name == "fallback" and step:  # inside the guardrail's window
        state = state._replace(divergence=state.divergence._replace(left=jnp.int32(3)))
    switched = _update(tx, mesh, None)(grads, state)
    ran = int(switched[1].metrics.method)
    assert ran == int(pinning.next_branch(state)) or name == "auto"  # auto decides in the step
    pinned = _update(tx, mesh, ran)(grads, state)
    assert int(pinned[1].metrics.method) == ran
    for a, b in zip(jax.tree.leaves(switched), jax.tree.leaves(pinned)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_a_pinned_sparse_branch_compiles_without_the_switch():
    """The switched step holds the switch's conditional besides AR-Topk's own (its leader's);
    the step pinned to top-k holds only AR-Topk's and carries no dense all-reduce."""
    tx = TRANSFORMATIONS["warmup"]()
    grads = {"w": jnp.ones(DIM)}
    state = tx.init(grads)
    texts = [_update(tx, _mesh(2), b).lower(grads, state).compile().as_text() for b in (None, 1)]
    assert texts[0].count(" conditional(") == texts[1].count(" conditional(") + 1
    assert not re.search(rf"f32\[{DIM}\][^\n]*all-reduce", texts[1])


def test_next_branch_reads_the_state():
    warm = TRANSFORMATIONS["warmup"]().init({"w": jnp.zeros(DIM)})
    assert [int(pinning.next_branch(warm._replace(step=jnp.int32(s)))) for s in (0, 3, 4)] == [
        0,
        0,
        1,
    ]
    back = TRANSFORMATIONS["fallback"]().init({"w": jnp.zeros(DIM)})
    assert int(pinning.next_branch(back)) == 0
    falling = back._replace(divergence=back.divergence._replace(left=jnp.int32(2)))
    assert int(pinning.next_branch(falling)) == 1  # dense, last
    auto = TRANSFORMATIONS["auto"]().init({"w": jnp.zeros(DIM)})
    assert int(pinning.next_branch(auto._replace(auto=auto.auto._replace(choice=1)))) == 1
    # Nothing to choose, nothing sparse to gain from, or a branch that moves with the ratio
    # search: the device decides.
    assert pinning.next_branch(jaxcomp.compress("quantized", bits=4).init(jnp.zeros(4))) is None
    assert pinning.next_branch(jaxcomp.compress("ar_topk", ratio=0.1).init(jnp.zeros(4))) is None
    search = jaxcomp.compress("auto", adaptive_ratio=True).init({"w": jnp.zeros(DIM)})
    assert pinning.next_branch(search) is None


def test_pinned_rejects_what_is_not_a_branch():
    with pytest.raises(TypeError, match="branch must be an int or None"):
        with pinning.pinned(1.0):
            pass
    tx = TRANSFORMATIONS["warmup"]()
    grads = {"w": jnp.ones(DIM)}
    with pytest.raises(ValueError, match="pinned branch 5 is not one of the 2 branches"):
        _update(tx, _mesh(1), 5)(grads, tx.init(grads))


def _train(tx, mesh, batches, pinned=True, max_in_flight=8, auto_trial=None):
    # No trial of compress_auto's candidates (tests/trial_test.py): the branches here are the
    # reports'.
    dp = jaxcomp.data_parallel(
        _loss,
        optax.chain(tx, optax.sgd(0.02)),
        mesh,
        max_steps_in_flight=max_in_flight,
        auto_trial=auto_trial,
    )
    state = dp.init({"w": jnp.zeros(DIM)})
    step = dp.step if pinned else dp._jit_step(None)
    ran, losses = [], []
    for batch in batches:
        state, metrics = step(state, dp.shard_batch(batch))[:2]
        ran.append(int(jaxcomp.find_compress_state(state.opt_state).metrics.method))
        losses.append(float(metrics["loss"]))
    return ran, np.array(losses), dp


@pytest.mark.parametrize("n_devices", [1, 2, 3, 8])
def test_data_parallel_runs_the_reported_branch_a_fixed_delay_later(n_devices):
    """Warm-up 4: a call runs the branch reported 2 calls before (for the call before it), so the
    dense steps are 4 + 1; the run is the one of a switched step with a warm-up of 5."""
    mesh, batches = _mesh(n_devices), _batches(14, rows=6 * n_devices)
    ran, losses, dp = _train(TRANSFORMATIONS["warmup"](), mesh, batches)
    assert ran == [0] * 5 + [1] * 9
    assert set(dp.step._jitted._jitted) == {0, 1}  # one compiled step per branch, no switch
    tx = jaxcomp.compress("ar_topk", ratio=0.05, warmup_steps=5)
    switched_ran, switched, _ = _train(tx, mesh, batches, pinned=False)
    assert switched_ran == ran
    np.testing.assert_allclose(losses, switched, rtol=1e-5)


def test_auto_runs_its_choice_and_the_first_call_reads_the_state():
    """compress_auto starts on its first candidate; the device chooses top-k at step 0, and the
    host runs it from the call the report reaches."""
    ran, losses, dp = _train(TRANSFORMATIONS["auto"](), _mesh(8), _batches(8))
    assert ran == [0, 0, 1, 1, 1, 1, 1, 1]
    assert dp.step._jitted.branch == 1 and np.all(np.isfinite(losses))


def test_a_state_that_cannot_say_keeps_the_switched_step():
    tx = jaxcomp.compress("auto", adaptive_ratio=True, explore_steps=2)
    _, losses, dp = _train(tx, _mesh(2), _batches(3))
    assert list(dp.step._jitted._jitted) == [None] and np.all(np.isfinite(losses))
    assert not host_branches.pinnable(tx.init({"w": jnp.zeros(DIM)}))
