"""Reliability, round 4: bad arguments give a clear error naming the argument before anything
runs, numpy scalars of a valid value are accepted, and non-finite hyper-parameters are refused."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import need_devices
from jax.sharding import Mesh

import jaxcomp

# compress(mean=False) makes these references exact sums, and compress(seed=) sets the key: both
# deprecated until jaxcomp 0.3, so these tests also keep the old keywords working.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:compress(_auto)?\((mean|seed)=\) is deprecated:DeprecationWarning"
)


@pytest.mark.parametrize("learning_rate", ["0.1", None, [1e-3]])
def test_adam_names_a_learning_rate_of_the_wrong_kind(learning_rate):
    with pytest.raises(TypeError, match="learning_rate must be a number or an optax schedule"):
        jaxcomp.adam(learning_rate)


@pytest.mark.parametrize("learning_rate", [float("nan"), float("inf"), -float("inf")])
def test_adam_refuses_a_learning_rate_that_is_not_finite(learning_rate):
    with pytest.raises(ValueError, match="learning_rate must be a finite number"):
        jaxcomp.adam(learning_rate)


@pytest.mark.parametrize(
    "name, value, error",
    [
        ("eps", float("inf"), ValueError),
        ("eps", float("nan"), ValueError),
        ("eps", -1e-8, ValueError),
        ("weight_decay", float("inf"), ValueError),
        ("b1", 1.0, ValueError),
        ("b2", float("nan"), ValueError),
        ("b1", "0.9", TypeError),
    ],
)
def test_adam_refuses_hyper_parameters_out_of_range_naming_them(name, value, error):
    with pytest.raises(error, match=name):
        jaxcomp.adam(1e-3, **{name: value})


def test_adam_accepts_numpy_scalars_of_valid_values():
    tx = jaxcomp.adam(
        np.float32(1e-3), b1=np.float32(0.9), b2=np.float64(0.999), eps=np.float32(1e-8)
    )
    assert isinstance(tx, optax.GradientTransformationExtraArgs)


@pytest.mark.parametrize("make", ["compress", "adam"])
def test_warmup_method_of_the_wrong_kind_is_named(make):
    with pytest.raises(TypeError, match="warmup_method must be None, a jaxcomp.methods.Method"):
        if make == "compress":
            jaxcomp.compress("ar_topk", ratio=0.1, warmup_steps=2, warmup_method=object())
        else:
            jaxcomp.adam(1e-3, warmup_method=object())


def test_an_unknown_warmup_method_name_is_named():
    with pytest.raises(ValueError, match="warmup_method='nope'"):
        jaxcomp.compress("ar_topk", ratio=0.1, warmup_steps=2, warmup_method="nope")


def _diloco(**options):
    need_devices(4)
    mesh = Mesh(np.array(jax.devices()[:4]), ("workers",))
    return jaxcomp.diloco(lambda w, x: jnp.mean((x @ w - 1) ** 2), mesh=mesh, **options)


@pytest.mark.parametrize("mixing", [[0.5], "half"])
def test_diloco_names_a_mixing_of_the_wrong_kind(mixing):
    with pytest.raises(TypeError, match="mixing must be a number"):
        _diloco(mixing=mixing, delay=1, sync_every=4)


@pytest.mark.parametrize("mixing", [float("nan"), 1.5])
def test_diloco_refuses_a_mixing_out_of_range(mixing):
    with pytest.raises(ValueError, match="mixing must be"):
        _diloco(mixing=mixing, delay=1, sync_every=4)


def test_diloco_refuses_a_sync_every_past_the_step_counter():
    with pytest.raises(ValueError, match="sync_every must be at most 2147483647"):
        _diloco(sync_every=2**31)


def test_diloco_refuses_a_sync_every_that_splits_an_accumulation():
    with pytest.raises(ValueError, match="sync_every=3 must be a multiple of inner_tx's"):
        _diloco(inner_tx=optax.MultiSteps(optax.sgd(0.1), 2), sync_every=3)
    _diloco(inner_tx=optax.MultiSteps(optax.sgd(0.1), 2), sync_every=4)  # a multiple: accepted


def test_diloco_refuses_an_outer_compress_that_sums():
    """A sum of the pseudo-gradients would step N times too far."""
    with pytest.raises(ValueError, match="must average the pseudo-gradients"):
        _diloco(compress=jaxcomp.compress("dense", axis_name="workers", mean=False))
    _diloco(compress=jaxcomp.compress("dense", axis_name="workers"))  # the mean: accepted


def _sick_worker(state, field):
    """``state`` with worker 0's ``field`` (local params or inner state) NaN: a worker that a
    fault, or a restored bad checkpoint, left with non-finite values."""
    rows = jax.tree.map(
        lambda x: x.at[0].set(jnp.nan) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        getattr(state, field),
    )
    return state._replace(**{field: rows})


def _batch(i):
    return np.random.default_rng(i).normal(size=(8, 3)).astype(np.float32)


def test_diloco_raise_raises_and_keeps_the_global_state():
    run = _diloco(
        sync_every=2, compress=jaxcomp.compress("dense", axis_name="workers", nonfinite="raise")
    )
    state = _sick_worker(run.init(jnp.zeros(3)), "local_params")
    state, _ = run.step(state, _batch(0))  # no sync yet
    with pytest.raises(FloatingPointError, match="nonfinite='raise'") as raised:
        run.step(state, _batch(1))
    kept = raised.value.state
    np.testing.assert_array_equal(np.asarray(run.params(kept)), np.zeros(3))
    assert np.isfinite(np.asarray(run.worker_params(kept))).all()  # restarted from the global


@pytest.mark.parametrize("delay", [0, 1])
def test_diloco_skip_leaves_the_global_and_outer_state_untouched(delay):
    """A dropped sync takes no outer step (Nesterov's momentum does not move the params), and
    the worker that sent NaN is healed, so the next sync runs."""
    options = {"delay": delay} if delay else {}
    run = _diloco(
        sync_every=2,
        compress=jaxcomp.compress("dense", axis_name="workers", nonfinite="skip"),
        **options,
    )
    state = run.init(jnp.zeros(3))
    for i in range(2 + delay):  # a healthy sync: the outer momentum is not zero
        state, _ = run.step(state, _batch(i))
    before = (np.asarray(run.params(state)), jax.tree.map(np.asarray, state.outer_state))
    state = _sick_worker(state, "local_params")
    for i in range(2):  # the sync with a NaN pseudo-gradient comes last
        state, metrics = run.step(state, _batch(10 + i))
    assert float(metrics["nonfinite"]) > 0
    np.testing.assert_array_equal(np.asarray(run.params(state)), before[0])
    jax.tree.map(
        np.testing.assert_array_equal, jax.tree.map(np.asarray, state.outer_state), before[1]
    )
    assert np.isfinite(np.asarray(run.worker_params(state))).all()
    for i in range(2):  # the next sync is healthy again: an outer step
        state, metrics = run.step(state, _batch(20 + i))
    assert float(metrics["nonfinite"]) == 0
    assert not np.array_equal(np.asarray(run.params(state)), before[0])


@pytest.mark.parametrize("delay", [0, 1])
@pytest.mark.parametrize("field", ["local_params", "inner_state"])
def test_a_sick_worker_is_healed_at_the_next_sync_and_told_once(delay, field, caplog):
    from jaxcomp.training import diloco as diloco_module

    diloco_module._HEALED.clear()
    options = {"delay": delay} if delay else {}
    run = _diloco(inner_tx=optax.adam(0.05), sync_every=4, **options)
    state = _sick_worker(run.init(jnp.zeros(3)), field)
    healed = []
    with caplog.at_level("WARNING", logger="jaxcomp"), pytest.warns(RuntimeWarning, match="healed"):
        for i in range(8):
            state, metrics = run.step(state, _batch(i))
            healed.append(float(metrics["healed"]))
        jax.block_until_ready(state)
        run.step(state, _batch(8))  # the host reads a step's probe once it has run
    # worker 0 of 4, at the first sync (with a delay, its exchange runs one step later)
    assert healed[3 + delay] == 0.25 and sum(healed) == 0.25
    assert caplog.text.count("held non-finite entries") == 1
    for leaf in jax.tree.leaves((state.local_params, state.inner_state, state.global_params)):
        assert np.isfinite(np.asarray(leaf)).all()


@pytest.mark.parametrize(
    "row",
    [
        "dp@lr=inf",
        "dp@lr=1e400",
        "dp@lr=nan",
        "diloco-h10@outer=sgd:inf",
        "diloco-h10@outer=nesterov:nan:0.9",
    ],
)
def test_a_row_setting_that_is_not_finite_is_refused(row):
    from jaxcomp.training.to_loss import parse_row

    with pytest.raises(ValueError, match=f"row {row!r}"):
        parse_row(row)


def _exits(main, argv, capsys, match):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err


def test_a_split_exchange_without_inner_devices_is_refused_before_dp_trains(capsys):
    from jaxcomp.cli import to_loss

    _exits(to_loss.main, ["--rows", "dp,diloco-h10@exchange=split"], capsys, "pass --inner N")


@pytest.mark.parametrize("timeout", ["-1", "0", "nan", "inf"])
def test_a_timeout_that_is_not_a_positive_number_is_refused(timeout, capsys):
    from jaxcomp.cli import netbench, to_loss

    _exits(to_loss.main, ["--timeout", timeout], capsys, "--timeout must be a number of seconds")
    _exits(netbench.main, ["--timeout", timeout], capsys, "--timeout must be a number of seconds")


def test_the_guardrail_watches_from_the_first_compressed_step():
    """ZFP at 4 bits through jaxcomp.adam's momentum diverges right after a 4-step warm-up,
    inside the guardrail's 20-step burn-in: the looser burn-in limits catch it at once (before,
    the burn-in's mean took the divergence in, and once the energy overflowed no step counted
    towards the burn-in, so the guardrail never looked)."""
    need_devices(8)
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.normal(size=(64, 16)).astype(np.float32),
        "y": rng.normal(size=(64, 4)).astype(np.float32),
    }
    tx = jaxcomp.adam(1e-2, "zfp", rate=4, warmup_steps=4, refresh_every=5)
    dp = jaxcomp.data_parallel(lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), tx, mesh)
    state = dp.init({"w": jnp.zeros((16, 4))})
    with warnings.catch_warnings():  # (warned once a process: maybe by another test)
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(12):
            state, metrics = dp.step(state, batch)
    guard = jaxcomp.find_compress_state(state.opt_state).divergence
    assert float(metrics["fallbacks"]) >= 1 and float(metrics["loss"]) < 1.0
    assert np.isfinite(float(guard.mean)) and float(guard.mean) < 1e3


def test_an_older_state_stepped_by_the_same_dp_runs_its_own_branch():
    """Restoring step 2 (inside jaxcomp.adam's warm-up) into a dp that has run 10 steps: the
    host's reports were of the later steps; the older state's steps run its own branch (the
    dense warm-up), and match the uninterrupted run's bit for bit."""
    need_devices(8)
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.normal(size=(16, 8)).astype(np.float32),
            "y": rng.normal(size=(16, 2)).astype(np.float32),
        }
        for _ in range(12)
    ]
    tx = jaxcomp.adam(1e-2, "sign", warmup_steps=4, refresh_every=3)
    dp = jaxcomp.data_parallel(lambda p, b: jnp.mean((b["x"] @ p - b["y"]) ** 2), tx, mesh)
    state = dp.init(jnp.zeros((8, 2)))
    states = [state]
    for batch in batches[:10]:
        state, _ = dp.step(state, batch)
        states.append(state)
    resumed = states[2]
    for batch in batches[2:6]:
        resumed, _ = dp.step(resumed, batch)
    np.testing.assert_array_equal(np.asarray(resumed.params), np.asarray(states[6].params))
