"""compress("auto"): the choice of collective from the probe, and the adaptive compression ratio."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import count_compilations, need_devices
from jax.sharding import Mesh

import jaxcomp
from jaxcomp.costmodel import cost, ratio_choice
from jaxcomp.methods import Dense, TopK
from jaxcomp.optim.auto_state import set_network
from jaxcomp.optim.transform import compress, find_compress_state
from jaxcomp.training.branches import REPORT_DELAY
from jaxcomp.training.trainer import data_parallel

# compress(mean=False) makes these references exact sums, and compress(seed=) sets the key: both
# deprecated until jaxcomp 0.3, so these tests also keep the old keywords working.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:compress(_auto)?\((mean|seed)=\) is deprecated:DeprecationWarning"
)

N_DEVICES = 8
N_PARAMS = 100_000
SLOW = cost.Network.parse("1ms", "100mbit")
QUIET_MEMORY = cost.Network.parse("20us", "8gbit")  # what the probe measures here when quiet


def _mesh():
    need_devices(N_DEVICES)
    return Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))


def _loss(w, batch):
    """Each device's gradient is the mean of its rows of batch["g"]: a gradient stream we
    control."""
    return jnp.sum(w * jnp.mean(batch["g"], axis=0))


def _trainer(tx, lr=1.0):
    """These tests check each step's choice in that step: the branch is picked on the device
    (the default picks it on the host a step later: pinning_test.py)."""
    return data_parallel(_loss, optax.chain(tx, optax.sgd(lr)), _mesh(), host_branches=False)


def _gaussian(rng, n=N_PARAMS):
    return {"g": rng.standard_normal((N_DEVICES, n)).astype(np.float32)}


def _method(state, metrics):
    """The label of the method that ran."""
    return find_compress_state(state.opt_state).methods[int(metrics["method"])].label


def _with_network(state, network, overhead=None):
    return state._replace(opt_state=set_network(state.opt_state, network, overhead))


def _host_choice(state, n=N_PARAMS):
    """The host's choice (jaxcomp.costmodel.cost.choose) among the state's branches, with its
    network and overheads."""
    compress_state = find_compress_state(state.opt_state)
    alpha, beta = np.asarray(
        compress_state.auto.network, np.float64
    )  # np.asarray: no helper jit to count
    network = cost.Network(alpha, 1.0 / beta)
    branches = list(compress_state.methods)
    overhead = dict(zip(branches, np.asarray(compress_state.auto.overhead, np.float64).tolist()))
    return cost.choose(4 * n, N_DEVICES, network, candidates=branches, overhead=overhead).label


def test_auto_picks_dense_in_memory_and_compression_when_the_probe_reports_a_slow_network():
    dp = _trainer(compress("auto", ratio=0.01))
    state = dp.init(jnp.zeros(N_PARAMS))  # no network= given: init probes the 8 in-memory devices
    auto = find_compress_state(state.opt_state).auto
    alpha, beta = np.asarray(auto.network, np.float64)
    probed = cost.Network(alpha, 1.0 / beta)
    # Memory, not a slow link: a quiet 2-core machine moves ~1e9 bytes/s here, a loaded one
    # (CI runs two test workers and the sanitizer beside them) 2.6e8; SLOW is 1.25e7.
    assert probed.bandwidth > 10 * SLOW.bandwidth
    assert np.all(
        np.asarray(auto.overhead)[1:] > 0
    )  # the top-k branches' measured encode/decode time
    rng = np.random.default_rng(0)
    with count_compilations() as compiles:
        state, metrics = dp.step(state, _gaussian(rng))
        first = compiles[0]
        # What the probe reports depends on the machine's load: under load its latency rises
        # and the all-gather's fewer rounds can win. The step follows the host's cost model.
        assert _method(state, metrics) == _host_choice(state)

        # A quiet probe of these devices (20 us, ~1 GB/s; top-k's encode/decode ~2 ms): dense.
        state = _with_network(state, QUIET_MEMORY, [0.0, 2e-3, 2e-3])
        state, metrics = dp.step(state, _gaussian(rng))
        assert _method(state, metrics) == "dense" == _host_choice(state)
        assert float(metrics["density"]) == 1.0

        state = _with_network(state, SLOW)  # keeps the overheads
        for _ in range(3):
            state, metrics = dp.step(state, _gaussian(rng))
            assert _method(state, metrics) == _host_choice(state)
            assert _method(state, metrics) in ("allgather_topk", "ar_topk")
            assert float(metrics["density"]) == pytest.approx(0.01, rel=1e-6)
    assert compiles[0] == first  # switching methods compiled nothing


def test_auto_without_settings_chooses_among_the_methods_that_keep_quality():
    """``compress("auto")``: dense, the bfloat16 cast and ZFP 8 (no top-k, which loses quality
    with a plain optimizer); dense in memory, a compressed one on a slow network."""
    dp = _trainer(compress("auto"))
    state = dp.init(jnp.zeros(N_PARAMS))
    branches = find_compress_state(state.opt_state).methods
    assert [m.describe() for m in branches] == ["dense", "bf16", "zfp(8)"]
    rng = np.random.default_rng(0)
    state, metrics = dp.step(state, _gaussian(rng))
    assert _method(state, metrics) == _host_choice(state)  # what the probe saw (load-dependent)
    # A quiet probe of these devices; the cast and ZFP's local work as measured there.
    state = _with_network(state, QUIET_MEMORY, [0.0, 2e-3, 6e-3])
    state, metrics = dp.step(state, _gaussian(rng))
    assert _method(state, metrics) == "dense" == _host_choice(state)
    state = _with_network(state, SLOW)
    for _ in range(2):
        state, metrics = dp.step(state, _gaussian(rng))
        assert _method(state, metrics) == _host_choice(state) in ("bf16", "zfp")


def _break_even_bandwidth(alpha, overhead, n=N_PARAMS):
    """Bandwidth at which dense and allgather_topk (ratio 0.01, `overhead` seconds) take equally
    long."""
    dense_bytes = Dense().wire_bytes(n, N_DEVICES)
    topk_bytes = TopK(0.01).wire_bytes(n, N_DEVICES)
    extra_steps = TopK(0.01).message_steps(N_DEVICES) - Dense().message_steps(N_DEVICES)
    return (dense_bytes - topk_bytes) / (overhead + extra_steps * alpha)


def test_auto_keeps_its_choice_for_decide_every_steps_unless_the_network_moves_by_ten_percent():
    alpha, overhead = 1e-5, 2e-3
    bandwidth = _break_even_bandwidth(alpha, overhead)
    below = cost.Network(alpha, 0.97 * bandwidth)  # compression pays
    above = cost.Network(
        alpha, 1.03 * bandwidth
    )  # dense pays: 6% away, under the 10% that re-decides at once
    tx = compress(
        "auto", ratio=0.01, candidates=("dense", "allgather_topk"), network=below, decide_every=4
    )
    dp = _trainer(tx)
    state = _with_network(dp.init(jnp.zeros(N_PARAMS)), below, {"allgather_topk": overhead})
    rng = np.random.default_rng(1)
    ran = []
    for step in range(10):
        if step == 1:
            state = _with_network(state, above)
        if step == 6:
            state = _with_network(state, cost.Network(alpha, bandwidth / 10))  # a real change
        state, metrics = dp.step(state, _gaussian(rng))
        ran.append(_method(state, metrics))
    assert ran == ["allgather_topk"] * 4 + ["dense"] * 2 + ["allgather_topk"] * 4


@pytest.mark.parametrize(
    "candidates", [("dense", "allgather_topk", "ar_topk"), ("quantized", "dense")]
)
def test_error_feedback_stays_exact_across_switches(candidates):
    """Whatever ran, the residual is what was not sent: sum of aggregates = sum of gradients -
    residuals.

    (That identity needs an aggregate equal to the sum of what the devices sent, which ZFP's ring
    does not give: it re-compresses partial sums. Its residual is checked in transform_test.)"""
    fast, slow = cost.Network.parse("1us", "100GB/s"), cost.Network.parse("1ms", "10mbit")
    options = {"ratio": 0.01} if "ar_topk" in candidates else {"bits": 8}
    tx = compress("auto", candidates=candidates, mean=False, decide_every=1000, **options)
    dp = _trainer(tx)
    state = dp.init(jnp.zeros(N_PARAMS))
    # Compression costs 10 ms to encode: dense wins on the fast network, compression on the slow
    # one.
    expensive = {m: 1e-2 for m in candidates if m != "dense"}
    rng = np.random.default_rng(2)
    fed = np.zeros(N_PARAMS, np.float64)
    ran = []
    for step in range(6):
        network = fast if step % 3 == 2 else slow
        state = _with_network(state, network, expensive)
        batch = _gaussian(rng)
        fed += batch["g"].astype(np.float64).sum(axis=0)
        state, metrics = dp.step(state, batch)
        ran.append(_method(state, metrics))
        residual = np.asarray(find_compress_state(state.opt_state).residual)  # [devices, n]
        if ran[-1] == "dense":
            assert not residual.any()  # dense sends everything, the residual included
        # With sgd(1) and mean=False, params = -(sum of every aggregate so far).
        np.testing.assert_allclose(
            -np.asarray(state.params),
            fed - residual.astype(np.float64).sum(axis=0),
            rtol=1e-4,
            atol=2e-4,
        )
    assert "dense" in ran and len(set(ran)) == 2, ran


# --- the adaptive ratio on a controlled synthetic gradient stream ------------------------------


def _concentrated(rng, n=30_000):
    """Ten coordinates carry nearly all the energy: every candidate keeps almost all of it."""
    g = 1e-3 * rng.standard_normal((N_DEVICES, n))
    g[:, ::3000] += 100.0
    return {"g": g.astype(np.float32)}


def test_adaptive_ratio_falls_while_gain_stays_high_and_rises_when_gain_collapses():
    tx = compress("auto", adaptive_ratio=True, network=SLOW, explore_steps=2)
    dp = _trainer(tx, lr=0.0)
    state = dp.init(jnp.zeros(30_000))
    ratios = ratio_choice.candidate_ratios()
    explore = 2 * len(ratios)
    rng = np.random.default_rng(3)

    def run(steps, stream):
        nonlocal state
        densities = []
        for _ in range(steps):
            state, metrics = dp.step(state, stream(rng))
            densities.append(float(metrics["density"]))
            assert _method(state, metrics) in ("allgather_topk", "ar_topk")
        return densities

    def controller():
        return find_compress_state(state.opt_state).auto.ratio

    with count_compilations() as compiles:
        visited = run(explore, _concentrated)
        first = compiles[0]
        # Highest density first, explore_steps steps each.
        np.testing.assert_allclose(visited, np.repeat(ratios, 2), rtol=2e-3)
        assert not bool(controller().exploring)
        low = run(4, _concentrated)
        np.testing.assert_allclose(
            low, min(ratios), rtol=2e-3
        )  # the gain stayed high: lowest density

        run(2, lambda rng: {"g": rng.standard_normal((N_DEVICES, 30_000)).astype(np.float32)})
        assert bool(
            controller().exploring
        )  # the gain collapsed by far more than 10%: explore again
        run(explore, lambda rng: {"g": rng.standard_normal((N_DEVICES, 30_000)).astype(np.float32)})
        assert not bool(controller().exploring)
        chosen = ratios[int(controller().index)]
        assert chosen > min(ratios)  # a flat gradient needs more density
    assert compiles[0] == first  # five ratios, two collectives, one compilation


def test_adaptive_ratio_waits_while_dense_runs():
    """On a fast network dense wins even against the lowest density: no exploration runs."""
    tx = compress(
        "auto", adaptive_ratio=True, network=cost.Network.parse("1us", "100GB/s"), explore_steps=1
    )
    dp = _trainer(tx)
    state = _with_network(
        dp.init(jnp.zeros(N_PARAMS)),
        cost.Network.parse("1us", "100GB/s"),
        lambda method: 0.0 if method.sends_everything else 1e-2,
    )
    rng = np.random.default_rng(4)
    for _ in range(3):
        state, metrics = dp.step(state, _gaussian(rng))
        assert _method(state, metrics) == "dense"
    ratio = find_compress_state(state.opt_state).auto.ratio
    assert int(ratio.index) == 0 and bool(ratio.exploring) and not np.asarray(ratio.gain_sum).any()


def test_auto_on_two_axes_includes_hierarchical_topk_and_matches_the_cost_model():
    need_devices(N_DEVICES)
    mesh = Mesh(np.array(jax.devices()[:N_DEVICES]).reshape(2, 4), ("node", "device"))
    slow = cost.Network.parse("1ms", "1gbit")
    tx = compress("auto", ratio=0.01, axis_name=("node", "device"), network=slow)
    # The cost model's choice, not a trial's (tests/trial_test.py): no trial.
    dp = data_parallel(
        _loss,
        optax.chain(tx, optax.sgd(1.0)),
        mesh,
        axis_name=("node", "device"),
        auto_trial=None,
    )
    state = dp.init(jnp.zeros(N_PARAMS))
    candidates = ("dense", "allgather_topk", "ar_topk", "hierarchical_topk")
    (branches,) = jaxcomp.auto_branches(state.opt_state)
    assert [m.label for m in branches] == list(candidates)
    want = cost.choose(4 * N_PARAMS, N_DEVICES, slow, candidates=branches, inner_size=4).label
    rng = np.random.default_rng(5)
    state, metrics = dp.step(state, _gaussian(rng))
    assert branches[int(find_compress_state(state.opt_state).auto.choice)].label == want
    # The host runs the choice from the call it reaches (jaxcomp.training.branches).
    for _ in range(REPORT_DELAY):
        state, metrics = dp.step(state, _gaussian(rng))
    assert _method(state, metrics) == want


def test_state_round_trips_and_branches_are_listed():
    tx = compress("auto", ratio=0.01, rate=8, bits=4)
    state = tx.init({"w": jnp.zeros(10)})
    assert [[m.describe() for m in group] for group in jaxcomp.auto_branches(state)] == [
        ["dense", "allgather_topk(0.01)", "ar_topk(0.01)", "zfp(8)", "quantized(4)"]
    ]
    tx = compress(
        "auto", adaptive_ratio=True, ratio_range=(0.01, 0.1), candidates=("ar_topk", "dense")
    )
    (branches,) = jaxcomp.auto_branches(tx.init({"w": jnp.zeros(10)}))
    assert [m.label for m in branches] == ["ar_topk"] * 3 + ["dense"]
    assert [m.setting for m in branches[:3]] == pytest.approx([0.1, 0.1 / 3, 0.01], rel=1e-6)
    assert branches[3].setting is None
    assert (
        int(tx.init({"w": jnp.zeros(10)}).metrics.method) == 0
    )  # the first branch until it decides


def test_set_network_checks_its_arguments():
    state = compress("auto", ratio=0.01).init({"w": jnp.zeros(10)})
    net = cost.Network.parse("1ms", "1gbit")
    updated = set_network(state, net, [0.0, 1e-3, 2e-3])
    np.testing.assert_allclose(np.asarray(updated.auto.overhead), [0.0, 1e-3, 2e-3])
    np.testing.assert_allclose(np.asarray(updated.auto.network), [1e-3, 8e-9], rtol=1e-6)
    np.testing.assert_allclose(
        np.asarray(set_network(updated, net, {"ar_topk": 5.0}).auto.overhead), [0, 1e-3, 5]
    )
    with pytest.raises(TypeError, match="network"):
        set_network(state, (1e-3, 1e9))
    with pytest.raises(ValueError, match="no compress"):
        set_network(compress("dense").init({"w": jnp.zeros(3)}), net)
    with pytest.raises(ValueError, match="3 branches"):
        set_network(state, net, [1.0])
    with pytest.raises(ValueError, match="zfp"):
        set_network(state, net, {"zfp": 1.0})
    with pytest.raises(ValueError, match="finite seconds"):
        set_network(state, net, [0.0, -1.0, 0.0])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(leader="var"), ValueError, "leader= goes with none of the candidates"),
        (dict(k=10), ValueError, "ratio="),
        (dict(ratio=0.01, adaptive_ratio=True), ValueError, "remove ratio="),
        (dict(ratio=0.01, ratio_range=(0.01, 0.1)), ValueError, "adaptive_ratio=True only"),
        (dict(adaptive_ratio="yes"), TypeError, "adaptive_ratio"),
        (dict(adaptive_ratio=True, ratio_range=(0.5, 0.1)), ValueError, "ratio_range"),
        (dict(ratio=0.01, candidates="dense"), TypeError, "candidates"),
        (dict(ratio=0.01, candidates=("dense", "auto")), ValueError, "candidates"),
        (dict(ratio=0.01, candidates=("dense", "dense")), ValueError, "candidates"),
        (dict(ratio=0.01, candidates=("dense", "zfp")), ValueError, "rate="),
        (dict(bits=8, candidates=("quantized", "ar_topk")), ValueError, "ratio="),
        (dict(ratio=0.01, candidates=("hierarchical_topk",)), ValueError, "outer, inner"),
        (dict(ratio=0.01, decide_every=0), ValueError, "decide_every"),
        (dict(ratio=0.01, explore_steps=0), ValueError, "explore_steps"),
        (dict(ratio=0.01, network=(1e-3, 1e9)), TypeError, "network"),
        (dict(rate=8, algorithm="recursive_doubling"), ValueError, "ring"),
        (dict(ratio=0.01, hadamard=False), ValueError, "hadamard"),
    ],
)
def test_auto_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        compress("auto", **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(decide_every=5),
        dict(network=SLOW),
        dict(adaptive_ratio=True),
        dict(candidates=("dense",)),
        dict(ratio_range=(0.01, 0.1)),
        dict(explore_steps=3),
    ],
)
def test_auto_arguments_are_refused_for_fixed_methods(kwargs):
    with pytest.raises(ValueError, match="applies to method 'auto' only"):
        compress("ar_topk", ratio=0.01, **kwargs)


def test_reprobe_needs_an_auto_state():
    dp = _trainer(compress("dense"))
    with pytest.raises(ValueError, match="no compress"):
        dp.reprobe(dp.init(jnp.zeros(4)))


def test_auto_on_one_device_runs_dense_without_probing():
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    dp = data_parallel(_loss, optax.chain(compress("auto", ratio=0.01), optax.sgd(1.0)), mesh)
    state = dp.init(jnp.zeros(100))
    assert np.isnan(np.asarray(find_compress_state(state.opt_state).auto.network)).all()
    state, metrics = dp.step(state, {"g": np.ones((1, 100), np.float32)})
    assert _method(state, metrics) == "dense"
    np.testing.assert_array_equal(np.asarray(state.params), -np.ones(100))
    with pytest.raises(ValueError, match="1 device"):
        dp.reprobe(state)


@pytest.mark.parametrize(
    "options",
    [{"min_size": 1000}, {"mask": {"big": True, "small": False}}],
    ids=["min_size", "mask"],
)
def test_auto_on_one_device_sums_the_plain_leaves_too(options):
    """Leaves left out of compression (``min_size=``, ``mask=``) are updated alike, non-finite
    entries dropped and counted."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))

    def loss(p, b):
        return jnp.sum(p["big"] * b["g"][0, :3000]) + jnp.sum(p["small"] * b["g"][0, 3000:])

    dp = data_parallel(loss, optax.chain(compress("auto", **options), optax.sgd(1.0)), mesh)
    state = dp.init({"big": jnp.zeros(3000), "small": jnp.zeros(5)})
    g = np.ones((1, 3005), np.float32)
    g[0, 3001] = np.nan
    state, metrics = dp.step(state, {"g": g})
    assert float(metrics["nonfinite"]) == 1 and float(metrics["density"]) == 1.0
    np.testing.assert_array_equal(np.asarray(state.params["small"]), [-1, 0, -1, -1, -1])
    np.testing.assert_array_equal(np.asarray(state.params["big"]), -np.ones(3000))


def test_auto_on_one_device_with_leaves_of_two_float_types():
    """Mixed float types travel as float32 (the guard's second sum adds them end to end)."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    loss = lambda p, b: jnp.sum(p["a"] * b["g"][0, :3]) + jnp.sum(p["b"] * b["g"][0, 3:])  # noqa: E731
    dp = data_parallel(loss, optax.chain(compress("auto"), optax.sgd(1.0)), mesh)
    state = dp.init({"a": jnp.zeros(3), "b": jnp.zeros(2, jnp.bfloat16)})
    g = np.array([[1.0, np.inf, 3.0, 4.0, 5.0]], np.float32)
    state, metrics = dp.step(state, {"g": g})
    assert float(metrics["nonfinite"]) == 1 and state.params["b"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(state.params["a"]), [-1.0, 0.0, -3.0])
    np.testing.assert_array_equal(np.asarray(state.params["b"], np.float32), [-4.0, -5.0])


@pytest.mark.parametrize("candidates", [None, (Dense(), TopK(0.05), jaxcomp.Zfp(8))])
def test_auto_on_one_device_sums_each_leaf_as_it_is(candidates):
    """One device sends nothing: ``compress_auto`` runs its dense candidate on each leaf as it is
    (no error-fed vector packed, no collective), the residual stays zero, and a non-finite entry
    is still dropped and counted."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    tx = compress("auto") if candidates is None else jaxcomp.compress_auto(candidates)
    dp = data_parallel(_loss, optax.chain(tx, optax.sgd(1.0)), mesh)
    state = dp.init(jnp.zeros(100))
    g = np.arange(100, dtype=np.float32).reshape(1, 100) - 50
    g[0, 7] = np.nan
    for _ in range(2):
        state, metrics = dp.step(state, {"g": g})
        assert _method(state, metrics) == "dense" and float(metrics["nonfinite"]) == 1
    want = -2 * np.where(np.isfinite(g[0]), g[0], 0)
    np.testing.assert_array_equal(np.asarray(state.params), want)
    assert not np.asarray(find_compress_state(state.opt_state).residual).any()

    def update(w):
        local = jax.lax.pcast(w, "data", to="varying")
        return tx.update(local, tx.init(w))[0]

    step = jax.jit(
        jax.shard_map(
            update,
            mesh=mesh,
            in_specs=jax.sharding.PartitionSpec(),
            out_specs=jax.sharding.PartitionSpec(),
        )
    )
    hlo = step.lower(jnp.ones(100)).compile().as_text()
    assert "jaxcomp_pack" not in hlo and " all-reduce(" not in hlo.replace("f32[] all-reduce(", "")
