"""``compress_auto``'s trial (:mod:`jaxcomp.training.trial`, :mod:`jaxcomp.optim.auto_state`):
measured whole steps replace their predictions, the fastest measured branch runs, the device's
later decisions keep it, and ``data_parallel`` times its leading candidates on 1, 2, 3 and 8
devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import need_devices
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.costmodel import cost
from jaxcomp.distributed import netbench_worker
from jaxcomp.optim import auto_state
from jaxcomp.training import trial as trials

DIM = 400
# On a slow link with little latency the three sparse candidates lie within 3x of each other
# and dense far behind.
SLOW = cost.Network.parse("1us", "1mbit")
CANDIDATES = [
    jaxcomp.Dense(),
    jaxcomp.TopK(0.02),
    jaxcomp.TopK(0.02, collective="ar"),
    jaxcomp.RandomK(0.02),
]


def _mesh(n):
    need_devices(n)
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def _loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def _batch(n_devices, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(4 * n_devices, DIM)).astype(np.float32)
    return {"x": x, "y": x @ np.linspace(-1, 1, DIM).astype(np.float32)}


def _auto(decide_every=100):
    return jaxcomp.compress_auto(CANDIDATES, network=SLOW, decide_every=decide_every)


def _with_comm(comm, overhead=None):
    """An auto state as after a decision that predicted ``comm`` seconds of communication."""
    state = jaxcomp.compress_auto(CANDIDATES[: len(comm)], network=SLOW).init(jnp.zeros(8))
    auto = state.auto._replace(comm=jnp.asarray(comm, jnp.float32))
    if overhead is not None:
        auto = auto._replace(overhead=jnp.asarray(overhead, jnp.float32))
    return state._replace(auto=auto)


# -- the calibration -------------------------------------------------------------------------------


def test_calibrated_puts_the_fastest_measured_first_and_keeps_the_rest():
    predicted = np.array([1.0, 0.05, 0.06, 0.2])
    measured = np.array([0.0, 0.9, 0.7, 0.0])  # the one predicted second is faster
    out = auto_state.calibrated(predicted, measured)
    # The measured branch that exceeds its prediction least (0.06 for 0.7) keeps its prediction;
    # the other one is 0.2 s slower; the unmeasured keep theirs.
    np.testing.assert_allclose(out, [1.0, 0.26, 0.06, 0.2])
    assert int(np.argmin(out)) == 2
    np.testing.assert_allclose(auto_state.calibrated(jnp.asarray(predicted), measured), out)
    nothing = np.zeros(4)
    np.testing.assert_array_equal(auto_state.calibrated(predicted, nothing), predicted)


@pytest.mark.parametrize("seed", range(20))
def test_after_a_trial_of_the_fastest_predicted_the_fastest_measured_wins(seed):
    """Whatever the measurements, when the measured branches are the ones predicted fastest, the
    least calibrated time is the fastest measured branch."""
    rng = np.random.default_rng(seed)
    predicted = rng.uniform(0.01, 2.0, 6)
    tried = np.argsort(predicted)[: rng.integers(1, 5)]
    measured = np.zeros(6)
    measured[tried] = rng.uniform(0.1, 3.0, len(tried))
    assert (
        np.argmin(auto_state.calibrated(predicted, measured)) == tried[np.argmin(measured[tried])]
    )


def test_set_measured_chooses_and_set_network_clears():
    state = _with_comm([0.5, 0.01, 0.02, 0.03])
    chosen = auto_state.set_measured(state, {1: 0.9, 2: 0.6, 3: 0.8})
    assert int(chosen.auto.choice) == 2
    np.testing.assert_allclose(np.asarray(chosen.auto.measured), [0.0, 0.9, 0.6, 0.8])
    predicted = auto_state.predicted_seconds(chosen.auto)
    np.testing.assert_allclose(predicted, [0.5, 0.32, 0.02, 0.22], atol=1e-6)
    cleared = jaxcomp.set_network(chosen, SLOW)
    assert not np.any(np.asarray(cleared.auto.measured))


@pytest.mark.parametrize(
    "state, seconds, message",
    [
        (_with_comm([0.5, 0.01]), {2: 0.1}, "names branch 2"),
        (_with_comm([0.5, 0.01]), {True: 0.1}, "names branch True"),
        (_with_comm([0.5, 0.01]), {1: 0.0}, r"seconds\[1\] must be finite seconds > 0"),
        (_with_comm([0.5, 0.01]), {1: float("nan")}, "finite seconds"),
        (_with_comm([np.nan, np.nan]), {1: 0.1}, "has not decided yet"),
        (jaxcomp.compress("dense").init(jnp.zeros(3)), {0: 0.1}, "exactly one compress_auto"),
        (
            jaxcomp.compress("auto", adaptive_ratio=True).init(jnp.zeros(3)),
            {0: 0.1},
            "without a RatioSearch",
        ),
    ],
)
def test_set_measured_refuses_what_it_cannot_use(state, seconds, message):
    with pytest.raises(ValueError, match=message):
        auto_state.set_measured(state, seconds)


def test_the_device_decides_with_the_measured_steps():
    """A decision due on the device takes the measured branch the host chose (dense, made slow
    here, is not measured)."""
    state = _with_comm([0.5, 0.01, 0.02, 0.03], overhead=[10.0, 0.0, 0.0, 0.0])
    state = auto_state.set_measured(state, {1: 0.9, 2: 0.6, 3: 0.8})
    tx = _auto(decide_every=1)
    mesh = _mesh(2)
    update = jax.jit(
        jax.shard_map(
            lambda g, s: tx.update(jax.lax.pcast(g, "data", to="varying"), s),
            mesh=mesh,
            in_specs=(P(), P()),
            out_specs=(P(), P()),
            check_vma=False,
        )
    )
    grads = jnp.asarray(np.random.default_rng(0).normal(size=8), jnp.float32)
    state = tx.init(grads)._replace(auto=state.auto)
    grads, state = jax.device_put((grads, state), NamedSharding(mesh, P()))
    new = update(grads, state)[1]
    assert int(new.auto.choice) == 2 and int(new.metrics.method) == 2


# -- the trial's plan ------------------------------------------------------------------------------


def test_trial_picks_the_leading_candidates_within_its_factor():
    assert trials.Trial().branches([1.2, 0.05, 0.06, 0.12, 0.4]) == [1, 2, 3]
    assert trials.Trial(candidates=2).branches([1.2, 0.05, 0.06, 0.2]) == [1, 2]
    assert trials.Trial(within=1.1).branches([1.2, 0.05, 0.06, 0.2]) == [1]
    assert trials.Trial().branches([0.0, 0.0, 0.0, 0.0]) == [0, 1, 2]  # one device: no network


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"candidates": 1}, "candidates must be an integer >= 2"),
        ({"candidates": True}, "candidates must be an integer"),
        ({"steps": 0}, "steps must be an integer >= 1"),
        ({"within": 0.5}, "within must be a number >= 1"),
        ({"within": float("inf")}, "within must be a number >= 1"),
    ],
)
def test_trial_refuses_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        trials.Trial(**kwargs)


def test_data_parallel_refuses_a_bad_auto_trial():
    with pytest.raises(TypeError, match="auto_trial must be a jaxcomp.training.trial.Trial"):
        jaxcomp.data_parallel(_loss, _auto(), _mesh(1), auto_trial=3)


def test_wants_trial_only_for_a_pinnable_auto_with_a_network_and_nothing_measured():
    assert trials.wants_trial(_auto().init(jnp.zeros(8)))
    assert not trials.wants_trial(jaxcomp.compress_auto(CANDIDATES).init(jnp.zeros(8)))  # no net
    measured = auto_state.set_measured(_with_comm([0.5, 0.01]), {1: 0.2})
    assert not trials.wants_trial(measured)
    warmup = jaxcomp.compress("ar_topk", ratio=0.1, warmup_steps=3)  # pinnable, not auto
    assert not trials.wants_trial(warmup.init(jnp.zeros(8)))


# -- data_parallel --------------------------------------------------------------------------------


def _run(mesh, calls, auto_trial=trials.Trial(), fake=None, decide_every=100, monkeypatch=None):
    """``calls`` steps of compress_auto in data_parallel; the branch each ran, the state, dp."""
    if fake is not None:
        # The trial's medians, made up per branch (real ones are timings of this machine).
        monkeypatch.setattr(
            trials.TrialSteps, "_measured", lambda self: {b: fake[b] for b in self._times}
        )
    tx = optax.chain(_auto(decide_every), optax.sgd(0.01))
    dp = jaxcomp.data_parallel(_loss, tx, mesh, auto_trial=auto_trial)
    state = dp.init({"w": jnp.zeros(DIM)})
    n = mesh.devices.size
    ran = []
    for i in range(calls):
        state, metrics = dp.step(state, dp.shard_batch(_batch(n, i)))
        ran.append(int(metrics["method"]))
        assert np.isfinite(float(metrics["loss"]))
    return ran, state, dp


@pytest.mark.parametrize("n_devices", [1, 2, 3, 8])
def test_data_parallel_times_the_leading_candidates_and_runs_the_fastest(n_devices, monkeypatch):
    """Call 0 runs candidate 0 and predicts; the three candidates predicted fastest run: one
    untimed step each where a step compiles, then three timed steps each, in turns. They are the
    sparse ones, or on one device (nothing to send, every prediction 0) the first three. The
    fastest of them, by the made-up times here, runs from then on, also where the device
    re-decides every step."""
    fake = {0: 0.7, 1: 0.9, 2: 0.8, 3: 0.5}
    wide = trials.Trial(within=100.0)  # all three, though 8 devices predict 8x between them
    ran, state, dp = _run(_mesh(n_devices), 16, wide, fake, decide_every=1, monkeypatch=monkeypatch)
    tried = [1, 2, 3] if n_devices > 1 else [0, 1, 2]
    fresh = [b for b in tried if b != 0]  # call 0 ran (and compiled) branch 0
    trial = ran[1 : 1 + len(fresh) + 3 * len(tried)]
    order = trial[len(fresh) : len(fresh) + len(tried)]  # fastest predicted first
    assert sorted(order) == tried and trial[: len(fresh)] == [b for b in order if b in fresh]
    assert trial[len(fresh) :] == order * 3
    fastest = min(tried, key=fake.get)
    assert ran[1 + len(trial) :] == [fastest] * (15 - len(trial)) and not dp.step.in_trial
    compress = jaxcomp.find_compress_state(state.opt_state)
    expected = [fake[b] if b in tried else 0.0 for b in range(4)]
    np.testing.assert_allclose(np.asarray(compress.auto.measured), expected, rtol=1e-6)
    assert int(compress.auto.choice) == fastest


def test_real_timings_agree_and_reprobe_runs_the_trial_again(monkeypatch):
    released = []  # the trial's end hands the freed heap back to the system, once
    monkeypatch.setattr(trials, "release_host_memory", lambda: released.append(1))
    ran, state, dp = _run(_mesh(2), 15)
    assert released == [1]
    measured = np.asarray(jaxcomp.find_compress_state(state.opt_state).auto.measured)
    assert np.sum(measured > 0) >= 2 and np.all(np.isfinite(measured))
    assert ran[-1] == int(np.argmin(np.where(measured > 0, measured, np.inf)))
    state = dp.reprobe(state, codec=False)
    assert dp.step.in_trial
    assert not np.any(np.asarray(jaxcomp.find_compress_state(state.opt_state).auto.measured))


def test_no_trial_when_asked_for_none():
    ran, state, dp = _run(_mesh(2), 4, auto_trial=None)
    assert not dp.step.in_trial and ran[2:] == [ran[2]] * 2
    assert not np.any(np.asarray(jaxcomp.find_compress_state(state.opt_state).auto.measured))


def test_netbench_leaves_the_trial_untimed():
    """A benchmark's timed steps start after the warm-up and after the trial."""

    class Job:
        spec = type("Spec", (), {"warmup": 1, "steps": 2})

        @staticmethod
        def global_batch(i):
            return i

    busy = iter([True, False, False])  # asked from the first call after the warm-up of 1 + 1
    seen = []

    def run(state, batch):
        seen.append(batch)
        return state, jnp.zeros(())

    marks = []

    def mark():
        marks.append(len(seen))
        return (10, 20)

    _, _, times, cpu, before = netbench_worker._median_step(
        Job, run, None, 1, lambda: next(busy), mark
    )
    assert seen == [0, 1, 2, 3, 4] and len(times) == 2 and cpu >= 0  # CPU s of the timed steps
    assert marks == [3] and before == (10, 20)  # read once, before the first timed step
