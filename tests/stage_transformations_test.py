"""Each stage of a compress update (jaxcomp.optim.stages) as a transformation on its own: around a
stub inner stage that records what it was given and returns what the test chooses, against a
numpy reference; tests/transform_test.py checks them composed."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import need_devices
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxcomp.methods import Dense
from jaxcomp.optim._flow import Gradients
from jaxcomp.optim.stages import divergence, mask
from jaxcomp.optim.stages.aggregate import AggregateState, aggregate_stage
from jaxcomp.optim.stages.aggregation import Aggregation, Groups
from jaxcomp.optim.stages.clock import clock_stage
from jaxcomp.optim.stages.error_feedback import feedback_stage
from jaxcomp.optim.stages.flight import InFlight, Stage, nest, unnest
from jaxcomp.optim.stages.guardrail import guardrail_stage
from jaxcomp.optim.stages.metrics import Energies, metrics_stage
from jaxcomp.optim.stages.momentum import momentum_stage
from jaxcomp.optim.stages.nonfinite import nonfinite_stage
from jaxcomp.optim.state import Branches, CompressState


class StubState(NamedTuple):
    touched: Any


def _stub(out=lambda flight: {}, seen=None):
    """An innermost stage that records the flight it gets and returns ``out(flight)``'s fields."""

    def update(flight, state):
        if seen is not None:
            seen.append(flight)
        return flight._replace(**out(flight)), StubState(state.touched + 1)

    return Stage(lambda params: StubState(jnp.int32(0)), update, StubState)


def _flight(leaves, policy="zero", **fields):
    """A flight of ``leaves`` as one group (the model), not sharded, on 2 devices."""
    lay = mask.Layout(list(range(len(leaves))), [(list(range(len(leaves))), "the model")], [])
    groups = Groups([], ["the model"], [], 2, None, 4)
    grads = Gradients(list(leaves), lay, groups, [None], None, jnp.float32, 0.5)
    record = Branches((Dense(),))
    treedef = jax.tree.structure(list(leaves))
    return InFlight(grads, record, policy, list(leaves), [], treedef=treedef, **fields)


def _sent(fraction):
    """The stub's aggregation: each device sends ``fraction`` of its error-fed vector."""

    def out(flight):
        sents = [fed * fraction for fed in flight.feds]
        result = Aggregation(sents, sents, 0.0, 0, 0, False, False)
        return {"result": result}

    return out


def test_clock_tells_the_step_and_its_key_and_counts():
    seen = []
    stage = clock_stage(_stub(seen=seen), seed=3)
    state = stage.init(None)
    assert int(state.step) == 0 and int(state.inner.touched) == 0
    state = state._replace(step=jnp.int32(5))
    flight, state = stage.update(_flight([jnp.ones(2)]), state)
    assert int(seen[0].step) == 5
    key = jax.random.fold_in(jax.random.PRNGKey(3), 5)
    np.testing.assert_array_equal(np.asarray(seen[0].key), np.asarray(key))
    assert int(state.step) == 6 and int(state.inner.touched) == 1


@pytest.mark.parametrize("skipped", [True, False])
def test_nonfinite_keeps_the_inner_state_on_a_skipped_step(skipped):
    stage = nonfinite_stage(_stub(lambda f: {"skipped": jnp.bool_(skipped)}))
    state = stage.init(None)
    assert isinstance(state, StubState)  # no state of its own
    flight, state = stage.update(_flight([jnp.ones(2)], policy="skip"), state)
    assert int(state.touched) == (0 if skipped else 1)
    assert bool(flight.skipped) == skipped


def test_metrics_reports_what_the_inner_stages_measured():
    def out(flight):
        result = Aggregation([], [], 40.0, 3, 1, False, False)
        return {
            "result": result,
            "gain": jnp.float32(0.5),
            "nonfinite": jnp.float32(2),
            "plain": (8.0, 1),
            "fallbacks": (jnp.float32(1), jnp.int32(4)),
        }

    stage = metrics_stage(_stub(out))
    state = stage.init(None)
    assert float(state.metrics.bytes_sent) == 0.0
    _, state = stage.update(_flight([jnp.ones(4), jnp.ones(4)]), state)
    m = state.metrics
    assert float(m.gain) == 0.5 and float(m.bytes_sent) == 48.0
    assert float(m.density) == 0.5 and int(m.method) == 1  # (3 + 1) of 8 values
    assert float(m.nonfinite) == 2 and float(m.fallback) == 1 and float(m.fallbacks) == 4


def test_error_feedback_packs_counts_and_keeps_what_was_not_sent():
    g = [jnp.array([1.0, jnp.nan]), jnp.array([[2.0, 4.0]])]
    stage = feedback_stage(_stub(_sent(0.25)), True, True, lambda p: {0, 1}, ("data",))
    state = stage.init(g)
    state = state._replace(residual=[jnp.array([0.5, 0.5]), jnp.array([[1.0, 0.0]])])
    flight, state = stage.update(_flight(g), state)
    fed = np.array([1.5, 0.5, 3.0, 4.0])  # the NaN entry counts as 0, its residual kept
    np.testing.assert_array_equal(np.asarray(flight.feds[0]), fed)
    assert float(sum(flight.counts)) == 1
    residual = np.concatenate([np.ravel(r) for r in state.residual])
    np.testing.assert_allclose(residual, 0.75 * fed)


def test_error_feedback_clears_the_residual_on_a_trigger():
    g = [jnp.array([1.0, 2.0])]
    inner = _stub(lambda f: {**_sent(0.5)(f), "trigger": jnp.bool_(True)})
    stage = feedback_stage(inner, True, True, lambda p: {0}, ("data",))
    _, state = stage.update(_flight(g), stage.init(g))
    np.testing.assert_array_equal(np.asarray(state.residual[0]), [0.0, 0.0])


def test_momentum_feeds_its_velocity_and_clears_what_was_sent():
    g = [jnp.array([1.0, 2.0, jnp.inf])]
    seen = []

    def out(flight):
        seen.append(flight)
        u = flight.values[0]
        sent = u * jnp.array([1.0, 0.0, 0.0])  # the first entry was sent
        return {"result": Aggregation([sent], [sent], 0.0, 0, 0, False, False), "feds": [u]}

    stage = momentum_stage(_stub(out), 0.5, lambda p: {0})
    state = stage.init(g)._replace(velocity=[jnp.array([2.0, 2.0, 2.0])])
    _, state = stage.update(_flight(g), state)
    np.testing.assert_array_equal(np.asarray(seen[0].values[0]), [2.0, 3.0, 1.0])  # m u + g
    assert float(sum(seen[0].counts)) == 1  # the Inf counts as 0
    np.testing.assert_array_equal(np.asarray(state.velocity[0]), [0.0, 3.0, 1.0])


@pytest.mark.parametrize("skipped", [False, True])
def test_guardrail_declares_its_energy_and_decides_after_the_sum(skipped):
    guardrail = divergence.Guardrail(burn_in=1)
    huge = Energies(jnp.float32(1e12), jnp.float32(1e12))

    def out(flight):
        return {"energies": huge, "gain": jnp.float32(1.0), "skipped": jnp.bool_(skipped)}

    seen = []
    stage = guardrail_stage(_stub(out, seen), guardrail, "data", True, lambda p: True)
    state = stage.init(None)
    # one suspect step already: this one is the guardrail's patience-th (2nd) in a row
    mean = divergence.init()._replace(
        mean=jnp.float32(1.0), seen=jnp.int32(50), suspect=jnp.int32(1)
    )
    flight, state = stage.update(_flight([jnp.array([3.0, 4.0])]), state._replace(divergence=mean))
    assert float(seen[0].gradient) == 25.0  # this device's energy, declared for the psum
    assert not bool(seen[0].fallback)
    if skipped:  # never on a skipped step
        assert not bool(flight.trigger) and int(state.divergence.fallbacks) == 0
    else:  # a second step in a row with G a trillion times the mean
        assert bool(flight.trigger) and int(state.divergence.fallbacks) == 1
        assert int(state.divergence.left) == guardrail.window


def test_guardrail_without_anything_compressed_passes_through():
    stage = guardrail_stage(_stub(), divergence.Guardrail(), "data", True, lambda p: False)
    state = stage.init(None)
    assert state.divergence is None
    flight, state = stage.update(_flight([jnp.ones(2)]), state)
    assert flight.trigger is None and int(state.inner.touched) == 1


@pytest.mark.parametrize("policy", ["zero", "skip"])
def test_aggregate_sums_the_groups_and_every_declared_scalar_once(policy):
    need_devices(2)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))

    def aggregate(groups, flight, state):
        total = jax.lax.psum(groups.vectors[0], "data")
        sent = groups.vectors[0]
        return Aggregation([total], [sent], 8.0, 2, 0, False, False, state.method_state), None

    stage = aggregate_stage(aggregate, "data", False, lambda p: AggregateState((None,)))

    def run(x, count):
        flight = _flight([x], policy=policy)._replace(
            feds=[x], packs=[None], counts=[count[0]], gradient=jnp.sum(x * x)
        )
        flight, _ = stage.update(flight, stage.init(None))
        skipped = jnp.bool_(False) if flight.skipped is None else flight.skipped
        return flight.result.totals[0], flight.nonfinite, flight.energies.gradient, skipped

    f = jax.shard_map(run, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P())
    x = jnp.array([1.0, 2.0, 3.0, 4.0])
    total, count, gradient, skipped = f(x, jnp.array([0.0, 1.0]))
    np.testing.assert_array_equal(np.asarray(total), [4.0, 6.0])
    assert float(count) == 1 and float(gradient) == 30.0
    assert bool(skipped) == (policy == "skip")


def test_nest_and_unnest_are_inverse_on_compress_states():
    stages = clock_stage(Stage(None, None, AggregateState), 0)
    flat = CompressState(residual=[], step=jnp.int32(7), key=jnp.zeros(2, jnp.uint32), metrics=None)
    nested = nest(stages, flat)
    assert isinstance(nested.inner, AggregateState) and int(nested.step) == 7
    fields = unnest(nested)
    assert set(fields) == {"step", "key", "method_state", "auto"}
    assert all(fields[name] is getattr(flat, name) for name in fields)


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_error_feedback_with_a_decay_keeps_decay_residual_plus_gradient_minus_sent(decay):
    g = [jnp.array([1.0, 2.0, 3.0, 4.0])]
    stage = feedback_stage(_stub(_sent(0.25)), True, True, lambda p: {0}, ("data",), decay)
    state = stage.init(g)._replace(residual=[jnp.array([4.0, 0.0, 2.0, 8.0])])
    flight, state = stage.update(_flight(g), state)
    fed = np.array([1.0, 2.0, 3.0, 4.0]) + decay * np.array([4.0, 0.0, 2.0, 8.0])
    np.testing.assert_allclose(np.asarray(flight.feds[0]), fed)
    np.testing.assert_allclose(np.asarray(state.residual[0]), 0.75 * fed)


def test_compress_error_feedback_decay_is_checked_and_one_is_plain():
    import jaxcomp

    for bad in (0, 1.5, -0.1, "x", 1):
        with pytest.raises(TypeError, match="error_feedback must be"):
            jaxcomp.compress(jaxcomp.TopK(0.5), error_feedback=bad)
    tx = jaxcomp.compress(jaxcomp.TopK(0.5), error_feedback=0.9)
    assert tx.init({"w": jnp.zeros(4)}).residual["w"].shape == (4,)


def test_compress_with_a_decay_sends_what_its_decayed_residual_holds():
    """Through compress on 2 devices, two steps: the sum of what was sent (N x the mean) plus
    the new residuals is the gradients plus the decayed old residuals."""
    import jaxcomp

    need_devices(2)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    tx = jaxcomp.compress(jaxcomp.TopK(k=2), error_feedback=0.8, guardrail=False)

    def two_steps(g1, g2):
        state = tx.init(jnp.zeros(6))
        u1, state = tx.update(g1, state)
        r1 = state.residual
        u2, state = tx.update(g2, state)
        return u1, u2, r1, state.residual

    run = jax.shard_map(
        two_steps,
        mesh=mesh,
        in_specs=(P("data"), P("data")),
        out_specs=(P(), P(), P("data"), P("data")),
    )
    rng = np.random.default_rng(0)
    g1, g2 = (rng.normal(size=12).astype(np.float32) for _ in range(2))
    u1, u2, r1, r2 = (np.asarray(x).reshape(-1, 6) for x in run(g1, g2))
    np.testing.assert_allclose(2 * u1[0] + r1.sum(0), g1.reshape(2, 6).sum(0), atol=1e-5)
    want = g2.reshape(2, 6).sum(0) + 0.8 * r1.sum(0)
    np.testing.assert_allclose(2 * u2[0] + r2.sum(0), want, atol=1e-5)
    assert np.abs(r1).sum() > 0  # something was held back, so the decay mattered
