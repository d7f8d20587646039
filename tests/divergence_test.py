"""The guardrail (jaxcomp.Guardrail, :mod:`jaxcomp.optim.stages.divergence`): a diverging
compressed run is caught and falls back to dense; a healthy one is left bit for bit as it was.

The detector's statistics are checked against a numpy reference; the forced divergence is random-k
1% with error feedback under SGD momentum 0.9 on a small least-squares problem, where dense
converges and random-k diverges today; the spike is a batch whose targets are 1000x larger.
"""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import need_devices
from jax.sharding import Mesh

import jaxcomp
from jaxcomp.optim.stages import divergence
from jaxcomp.training.branches import REPORT_DELAY

DIM, ROWS, BATCH = 200, 512, 64
# The default, with a window short enough for 120 steps, falling back to dense (random-k's default
# only clears the residual: tested below).
GUARD = jaxcomp.Guardrail(window=20, dense_fallback=True)


def _problem():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(ROWS, DIM)).astype(np.float32)
    y = a @ rng.normal(size=DIM).astype(np.float32) + 0.1 * rng.normal(size=ROWS).astype(np.float32)
    picks = [rng.integers(0, ROWS, BATCH) for _ in range(200)]
    return [{"x": a[i], "y": y[i]} for i in picks]


BATCHES = _problem()


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def _mesh(n):
    need_devices(n)
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def _train(
    compress_tx,
    lr,
    steps,
    n_devices=8,
    spike_at=None,
    momentum=0.9,
    spiked_steps=1,
    adam=False,
    host_branches=True,
):
    """Trains with data_parallel (SGD after compress, or Adam); ``spiked_steps`` batches from
    ``spike_at`` on have 1000x targets. Returns (per-step metrics as numpy, residual after each
    step, params before and after each step)."""
    optimizer = optax.adam(lr) if adam else optax.sgd(lr, momentum=momentum)
    tx = optax.chain(compress_tx, optimizer)
    # No trial of compress_auto's candidates (tests/trial_test.py): on this small model it may
    # keep dense, and these tests force a method to diverge.
    dp = jaxcomp.data_parallel(
        _loss, tx, _mesh(n_devices), host_branches=host_branches, auto_trial=None
    )
    state = dp.init({"w": jnp.zeros(DIM)})
    out, residuals, params = [], [], [np.asarray(state.params["w"])]
    for t in range(steps):
        batch = BATCHES[t]
        if spike_at is not None and spike_at <= t < spike_at + spiked_steps:
            batch = {"x": batch["x"], "y": batch["y"] * 1000.0}
        state, metrics = dp.step(state, batch)
        out.append(metrics)
        residuals.append(jaxcomp.find_compress_state(state.opt_state).residual["w"])
        params.append(state.params["w"])
    jax.effects_barrier()
    metrics = {k: np.array([float(m[k]) for m in out]) for k in ("loss", "fallback", "bytes_sent")}
    metrics["fallbacks"] = np.array([float(m["fallbacks"]) for m in out])
    return metrics, [np.asarray(r) for r in residuals], [np.asarray(p) for p in params]


# ---- the detector against numpy ----------------------------------------------------------------


def _numpy_guardrail(g, gradients, feds, gains):
    """The detector of divergence.py's docstring, in numpy: triggers and the final state."""
    mean, seen, left, fallbacks, streak, calm, suspect = 0.0, 0, 0, 0, 0, 0, 0
    triggers = []
    for energy, fed, gain in zip(gradients, feds, gains):
        limit = g.factor**2 * mean
        bad = not energy <= limit or not fed * gain**2 <= 4 * limit
        bad = seen >= g.burn_in and left == 0 and bad
        overflowed = not (np.isfinite(energy) and np.isfinite(fed))
        trigger = bad and (suspect + 1 >= g.patience or overflowed)
        suspect = suspect + 1 if bad and not trigger else 0
        triggers.append(trigger)
        if not trigger and np.isfinite(energy):
            if seen < g.burn_in:
                new = mean + (energy - mean) / (seen + 1)
            else:
                ceiling = (1.0 if left > 0 else divergence.FOLLOW) * mean
                new = g.decay * mean + (1 - g.decay) * min(energy, ceiling)
            mean, seen = new, seen + 1
        if trigger:
            streak = streak + 1 if fallbacks > 0 and calm < 4 * g.window else 1
            left = g.window * 2 ** min(streak - 1, divergence.MAX_DOUBLINGS)
            fallbacks += 1
            calm = 0
        else:
            calm = 0 if left > 0 else calm + 1
            left = max(left - 1, 0)
    return triggers, (mean, seen, left, fallbacks, streak, calm, suspect)


@pytest.mark.parametrize("patience", [1, 2, 3])
def test_detector_statistics_match_numpy(patience):
    g = jaxcomp.Guardrail(factor=3.0, window=4, burn_in=5, decay=0.9, patience=patience)
    rng = np.random.default_rng(1)
    gradients = rng.uniform(1.0, 2.0, 80).astype(np.float32)
    gradients[20:32] *= np.float32(1.5) ** np.arange(12)  # a slow blow-up the mean cannot follow
    gradients[50] = 500.0  # a spike
    gradients[60] = np.inf  # an energy that overflowed
    gradients[64:68] = 30.0  # a spike twice in a row: the window doubles
    feds = gradients * rng.uniform(1.0, 50.0, 80).astype(np.float32)
    feds[40] = 1e6  # a residual far beyond error feedback's bound (gain 0.5)
    gains = np.full(80, 0.5, np.float32)

    @jax.jit
    def run(gradients, feds, gains):
        def step(state, x):
            trigger = divergence.triggered(g, state, *x)
            return divergence.advance(g, state, trigger, *x), trigger

        return jax.lax.scan(step, divergence.init(), (gradients, feds, gains))

    state, triggers = run(gradients, feds, gains)
    want_triggers, want_state = _numpy_guardrail(g, gradients, feds, gains)
    np.testing.assert_array_equal(np.asarray(triggers), want_triggers)
    # The blow-up (20-31) is caught whatever the patience. One step of a runaway residual (40) or
    # of a spike (50) triggers only without patience; with it, an overflowed statistic (60)
    # triggers at once and, once its window of 4 has passed, 3 suspect steps in a row (65-67) at
    # the patience-th.
    assert any(want_triggers[20:32]) and want_triggers[40] == (patience == 1)
    if patience == 1:
        assert sum(want_triggers) >= 4
    else:
        assert not want_triggers[50] and want_triggers[60] and want_triggers[64 + patience]
    np.testing.assert_allclose(float(state.mean), want_state[0], rtol=1e-5)
    assert [int(x) for x in state[1:]] == list(want_state[1:])


# ---- forced divergence --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def randomk_runs():
    """Random-k 1% at lr 0.01: dense converges there, random-k diverges (today's behaviour with
    the guardrail off)."""
    return {
        "dense": _train(jaxcomp.compress("dense"), 0.01, 120),
        "off": _train(jaxcomp.compress("randomk", ratio=0.01, guardrail=False), 0.01, 120),
        "on": _train(jaxcomp.compress("randomk", ratio=0.01, guardrail=GUARD), 0.01, 120),
        "on, device": _train(
            jaxcomp.compress("randomk", ratio=0.01, guardrail=GUARD), 0.01, 120, host_branches=False
        ),
    }


def test_randomk_diverges_without_the_guardrail_and_not_with_it(randomk_runs):
    dense, off, on = (randomk_runs[k][0] for k in ("dense", "off", "on"))
    first = dense["loss"][0]
    assert dense["loss"][-1] < 0.01 * first and dense["fallbacks"][-1] == 0
    assert off["loss"][-1] > 100 * first and off["fallbacks"][-1] == 0  # diverges today
    assert on["fallbacks"][-1] >= 1
    assert on["loss"].max() < 0.2 * off["loss"].max() and on["loss"][-1] < off["loss"][-1] / 10


@pytest.mark.parametrize("run, late", [("on", 1), ("on, device", 0)])
def test_fallback_window_is_dense_and_the_residual_is_cleared(randomk_runs, run, late):
    """With the branch picked on the host (the default for a sparse method,
    jaxcomp.training.branches), the dense steps start ``late`` = 1 step after the device asked
    for them, and last as long."""
    metrics, residuals, params = randomk_runs[run]
    dense = randomk_runs["dense"][0]["bytes_sent"][0]
    trigger = int(np.argmax(metrics["fallbacks"] > 0))
    window = GUARD.window
    assert np.all(metrics["fallback"][trigger : trigger + window + 1] == 1)
    # The triggering step sends nothing dense yet (it ran the method) and applies no update...
    assert np.all(metrics["bytes_sent"][trigger : trigger + late + 1] < dense)
    np.testing.assert_array_equal(residuals[trigger], 0.0)
    # ... the window's steps are dense, and keep no residual.
    dense_steps = slice(trigger + late + 1, trigger + late + window + 1)
    np.testing.assert_array_equal(metrics["bytes_sent"][dense_steps], dense)
    for r in residuals[dense_steps]:
        assert np.abs(r).max() == 0.0
    # Then the method runs again.
    assert metrics["bytes_sent"][trigger + late + window + 1] < dense
    assert metrics["fallback"][trigger + window + 1] == 0


def test_one_device_mesh_catches_the_divergence():
    metrics, _, _ = _train(jaxcomp.compress("randomk", ratio=0.01), 0.01, 120, n_devices=1)
    assert metrics["fallbacks"][-1] >= 1 and metrics["loss"].max() < 1e6


# ---- an injected spike, the healthy run, the off switch -----------------------------------------


@pytest.mark.parametrize("n_devices, patience", [(1, 2), (8, 2), (8, 1)])
def test_spike_is_caught_and_healthy_steps_are_unchanged(n_devices, patience, caplog):
    """top-k 10% at a stable learning rate: nothing triggers and the run is bit for bit the one
    without the guardrail. One batch with 1000x targets (step 30) triggers: with patience 1 at
    that step, whose update is dropped; with the default patience 2 at the next, because the
    spike persists (SGD's momentum carries the jump into the next gradient, and top-k's residual
    holds 90% of the spike), and the next step's update is dropped."""
    guard = jaxcomp.Guardrail(patience=patience)
    build = lambda on: jaxcomp.compress("ar_topk", ratio=0.1, guardrail=on)  # noqa: E731
    plain, _, plain_params = _train(build(False), 0.005, 40, n_devices)
    healthy, _, healthy_params = _train(build(guard), 0.005, 40, n_devices)
    assert healthy["fallbacks"][-1] == 0 and healthy["fallback"].max() == 0
    np.testing.assert_array_equal(healthy_params[-1], plain_params[-1])
    np.testing.assert_array_equal(healthy["loss"], plain["loss"])
    with caplog.at_level(logging.WARNING, logger="jaxcomp"):
        spiked, residuals, params = _train(build(guard), 0.005, 40, n_devices, spike_at=30)
    at = 29 + patience
    assert spiked["fallbacks"][-1] == 1 and spiked["fallback"][at] == 1
    assert spiked["fallback"][at - 1] == 0
    np.testing.assert_allclose(
        params[at + 1] - params[at], 0.9 * (params[at] - params[at - 1]), rtol=1e-4, atol=1e-7
    )
    np.testing.assert_array_equal(residuals[at], 0.0)
    told = [r.getMessage() for r in caplog.records if f"diverges at step {at}" in r.getMessage()]
    assert len(told) == 1 and "ar_topk(0.1)" in told[0]


def _train_adam(compress_tx, spiked_steps):
    return _train(compress_tx, 0.01, 36, spike_at=30, spiked_steps=spiked_steps, adam=True)


@pytest.mark.parametrize("spiked_steps", [1, 2])
def test_one_outlier_step_is_trained_on_as_without_the_guardrail(spiked_steps):
    """The default patience (2): a bf16 cast under Adam, one batch with 1000x targets. Adam's
    step stays bounded and the cast's residual holds only rounding, so the next step is healthy:
    nothing triggers, and the run is bit for bit the unguarded run on the same data (dense
    training takes that step too). Two such batches in a row trigger at the second, whose update
    is dropped."""
    runs = [
        _train_adam(jaxcomp.compress("bf16", guardrail=on), spiked_steps) for on in (False, True)
    ]
    (plain, _, plain_params), (guarded, residuals, params) = runs
    if spiked_steps == 1:
        assert guarded["fallbacks"][-1] == 0 and guarded["fallback"].max() == 0
        np.testing.assert_array_equal(params[-1], plain_params[-1])
        # Not vacuous: without patience the same step triggers.
        strict = jaxcomp.compress("bf16", guardrail=jaxcomp.Guardrail(patience=1))
        assert _train_adam(strict, 1)[0]["fallback"][30] == 1
        return
    assert guarded["fallback"][30] == 0 and guarded["fallback"][31] == 1
    assert guarded["fallbacks"][-1] == 1
    np.testing.assert_array_equal(params[31], plain_params[31])  # the suspect step trained on
    np.testing.assert_array_equal(residuals[31], 0.0)
    # The dropped update: Adam moves on its first moment alone (the update it got was zero).
    assert not np.array_equal(params[32], plain_params[32])


@pytest.mark.parametrize("callback, warmup", [(False, 0), (False, 2), (True, 2)])
def test_the_step_keeps_jits_fast_dispatch_and_the_host_still_hears_once(callback, warmup, caplog):
    """By default (Guardrail(callback=False)) the guarded data_parallel step holds no host
    callback, so jit dispatches it on its fast C++ path (a callback costs ~15 us per array
    argument on every call); data_parallel tells the host of a trigger from the finished
    step's state instead. With callback=True the step tells the host itself, with the gradient
    norm. Either way a spike is told exactly once, and as what happens: top-k does not fall
    back to dense, even where a warm-up gives its state a dense branch (jaxcomp.adam's)."""
    guard = jaxcomp.Guardrail(callback=callback)
    build = lambda: jaxcomp.compress(  # noqa: E731
        "ar_topk", ratio=0.1, guardrail=guard, warmup_steps=warmup
    )
    dp = jaxcomp.data_parallel(
        _loss, optax.chain(build(), optax.sgd(0.005, momentum=0.9)), _mesh(2)
    )
    state = dp.init({"w": jnp.zeros(DIM)})
    effects = dp.step.trace(state, BATCHES[0]).jaxpr.effects
    assert bool(effects) == callback, effects
    with caplog.at_level(logging.WARNING, logger="jaxcomp"):
        spiked, _, _ = _train(
            build(), 0.005, 40, 2, spike_at=30
        )  # 9 steps after the spike: the 8-step bound retires it before the loop ends
    # The default patience: the spike at 30 persists (momentum, top-k's residual) and triggers
    # at 31.
    assert spiked["fallbacks"][-1] == 1 and spiked["fallback"][31] == 1
    told = [r.getMessage() for r in caplog.records if "diverges at step 31" in r.getMessage()]
    assert len(told) == 1, told
    assert ("gradient norm" in told[0]) == callback and "running RMS" in told[0]
    assert "the guardrail rests for 50 steps" in told[0] and "densely" not in told[0], told[0]


def test_off_switch_keeps_no_state_and_never_falls_back():
    tx = jaxcomp.compress("randomk", ratio=0.01, guardrail=False)
    state = tx.init({"w": jnp.zeros(DIM)})
    assert state.divergence is None and [m.describe() for m in state.methods] == ["randomk(0.01)"]
    on = jaxcomp.compress("randomk", ratio=0.01).init({"w": jnp.zeros(DIM)})
    assert on.divergence is not None
    # A sparse method keeps its in-place residual route: no dense branch unless asked for.
    assert [m.describe() for m in on.methods] == ["randomk(0.01)"]
    on = jaxcomp.compress("randomk", ratio=0.01, guardrail=GUARD).init({"w": jnp.zeros(DIM)})
    assert [m.describe() for m in on.methods] == ["randomk(0.01)", "dense"]
    on = jaxcomp.compress("quantized", bits=4).init({"w": jnp.zeros(DIM)})
    assert [m.describe() for m in on.methods] == ["quantized(4)", "dense"]
    with pytest.raises(ValueError, match="guardrail=False"):
        _train_one_step(jaxcomp.compress("randomk", ratio=0.01), state)


def _train_one_step(tx, state):
    mesh = _mesh(8)
    f = jax.shard_map(
        lambda g: tx.update({"w": g}, state)[0]["w"],
        mesh=mesh,
        in_specs=jax.sharding.PartitionSpec("data"),
        out_specs=jax.sharding.PartitionSpec(),
    )
    return f(jnp.ones(DIM * 8))


def test_dense_and_a_method_that_cannot_switch():
    """Dense has nothing to fall back from: no state, the same compiled step. A transformation
    that cannot switch to dense (ZFP with recursive doubling, a total typed varying; compress_auto
    without a dense candidate) only clears its residual on a spike."""
    for on in (True, False):
        state = jaxcomp.compress("dense", guardrail=on).init({"w": jnp.zeros(3)})
        assert state.divergence is None and len(state.methods) == 1
    assert not divergence.can_fall_back(jaxcomp.Zfp(8, algorithm="recursive_doubling"))
    slow = jaxcomp.costmodel.cost.Network.parse("1ms", "10mbit")
    tx = jaxcomp.compress_auto([jaxcomp.TopK(0.1, collective="ar")], network=slow)
    metrics, residuals, _ = _train(tx, 0.005, 36, spike_at=30, momentum=0.0)
    # The spike at 30 stays in the residual: the second suspect step in a row triggers.
    assert metrics["fallbacks"][-1] == 1 and metrics["fallback"][31] == 1
    np.testing.assert_array_equal(residuals[31], 0.0)
    assert np.all(metrics["bytes_sent"] == metrics["bytes_sent"][0])  # never dense
    assert np.abs(residuals[32]).max() > 0  # the method runs on, with error feedback


def test_compress_auto_falls_back_to_its_dense_candidate(caplog):
    slow = jaxcomp.costmodel.cost.Network.parse("1ms", "10mbit")
    tx = jaxcomp.compress_auto(
        [jaxcomp.Dense(), jaxcomp.RandomK(0.01)], network=slow, decide_every=1000
    )
    with caplog.at_level(logging.WARNING, logger="jaxcomp"):
        metrics, _, _ = _train(tx, 0.01, 120)
    told = [r.getMessage() for r in caplog.records if "diverges at step" in r.getMessage()]
    assert told and all("it aggregates densely for" in m for m in told), told
    dense = jaxcomp.Dense().wire_bytes(DIM, 8)
    trigger = int(np.argmax(metrics["fallbacks"] > 0))
    # Picked on the host, random-k runs from the call the device's choice reaches (the third),
    # and the window starts a step late (jaxcomp.training.branches).
    late = REPORT_DELAY - 1
    assert metrics["fallbacks"][-1] >= 1 and metrics["bytes_sent"][late + 1] < dense
    np.testing.assert_array_equal(
        metrics["bytes_sent"][trigger + late + 1 : trigger + late + 11], dense
    )


def test_compiled_step_keeps_the_dense_all_reduce_in_the_fallback_branch():
    """Dense compiles to the same step with the guardrail on or off; a compressing method's step
    chosen on the device holds the fallback's dense all-reduce in a branch of its conditional,
    never in ENTRY (picked on the host, the fallback is a step of its own: pinning_test.py)."""

    def compiled(tx):
        tx = optax.chain(tx, optax.sgd(0.01))
        dp = jaxcomp.data_parallel(_loss, tx, _mesh(8), host_branches=False)
        state = dp.init({"w": jnp.zeros(DIM)})
        return dp.step.lower(state, BATCHES[0]).compile().as_text()

    def whole_gradient_sums(text):
        return [
            line
            for line in text.splitlines()
            if (match := re.search(r"=\s*(.*?)\s+all-reduce(?:-start)?\(", line))
            and f"f32[{DIM}]" in match.group(1)
        ]

    dense_on, dense_off = (
        compiled(jaxcomp.compress("dense", guardrail=on)) for on in (True, False)
    )
    assert whole_gradient_sums(dense_on) != []
    # Without op metadata and the stack-frame tables (a step read from the persistent compilation
    # cache, tests/conftest.py, keeps those of the compile that wrote it).
    unlabelled = [
        re.sub(r", metadata=\{[^}]*\}", "", text.split("\nFileNames")[0])
        for text in (dense_on, dense_off)
    ]
    assert unlabelled[0] == unlabelled[1]
    topk = compiled(jaxcomp.compress("ar_topk", ratio=0.01, guardrail=GUARD))
    entry = topk[topk.index("ENTRY") :]
    assert whole_gradient_sums(topk) and not whole_gradient_sums(entry[: entry.index("\n}\n")])
    # By default a sparse method clears its residual instead: no dense all-reduce at all.
    assert not whole_gradient_sums(compiled(jaxcomp.compress("ar_topk", ratio=0.01)))


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: jaxcomp.Guardrail(factor=1.0), "factor must be in"),
        (lambda: jaxcomp.Guardrail(factor="big"), "factor must be a number"),
        (lambda: jaxcomp.Guardrail(window=0), "window must be"),
        (lambda: jaxcomp.Guardrail(burn_in=2.5), "burn_in must be"),
        (lambda: jaxcomp.Guardrail(patience=0), "patience must be"),
        (lambda: jaxcomp.Guardrail(patience=1.5), "patience must be"),
        (lambda: jaxcomp.Guardrail(decay=1.0), "decay must be in"),
        (lambda: jaxcomp.Guardrail(dense_fallback="yes"), "dense_fallback must be"),
        (lambda: jaxcomp.compress("ar_topk", ratio=0.1, guardrail="on"), "guardrail must be"),
        (lambda: jaxcomp.compress_auto([jaxcomp.Dense()], guardrail=3), "guardrail must be"),
    ],
)
def test_bad_arguments_raise_naming_them(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()
