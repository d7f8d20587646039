"""jaxcomp.costmodel.probe: the α-β fit against a synthetic timing model, and the live probe on CPU
devices."""

import importlib
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from helpers import count_compilations, need_devices, subprocess_env
from jax.sharding import Mesh

from jaxcomp.costmodel import cost

# The module, even once the package exports the function `jaxcomp.costmodel.probe` under the same
# name.
probe = importlib.import_module("jaxcomp.costmodel.probe")

SIZES = (2**10, 2**13, 2**16, 2**19, 2**22)


@pytest.mark.parametrize(
    "alpha,bandwidth", [(5e-4, 1.25e9), (2e-6, 100e9), (1e-2, 1.25e8), (0.0, 1e9)]
)
@pytest.mark.parametrize("n_workers", [2, 8, 64])
@pytest.mark.parametrize("method", ["dense_ring", "dense_tree"])
def test_fit_recovers_alpha_and_beta_from_noisy_synthetic_timings(
    alpha, bandwidth, n_workers, method
):
    """Timings from the α-β model, each multiplied by up to ±10% noise, fit back within 30%."""
    rng = np.random.default_rng(n_workers)
    true = cost.Network(alpha=alpha, bandwidth=bandwidth)
    sizes = np.repeat(SIZES, 3)
    model = np.array([cost.predict(method, float(s), n_workers, true) for s in sizes])
    # A zero-latency model still needs a positive time per call.
    seconds = np.maximum(model, 1e-9) * rng.uniform(0.9, 1.1, size=model.shape)
    fit = probe.fit_alpha_beta(sizes, seconds, n_workers, method)
    assert fit.bandwidth == pytest.approx(bandwidth, rel=0.3)
    assert fit.alpha == pytest.approx(alpha, rel=0.3, abs=1e-7)


def test_fit_is_exact_on_noiseless_timings():
    true = cost.Network(alpha=3e-5, bandwidth=4e9)
    seconds = [cost.predict("dense_ring", s, 4, true) for s in SIZES]
    fit = probe.fit_alpha_beta(SIZES, seconds, 4)
    assert fit.alpha == pytest.approx(true.alpha, rel=1e-9)
    assert fit.bandwidth == pytest.approx(true.bandwidth, rel=1e-9)


def test_fit_clamps_negative_latency_to_zero():
    # Pure bandwidth with the smallest call measured a little fast: unclamped least squares
    # would put α below zero.
    true = cost.Network(alpha=0.0, bandwidth=1e9)
    seconds = np.array([cost.predict("dense_ring", s, 8, true) for s in SIZES])
    seconds[0] *= 0.8
    fit = probe.fit_alpha_beta(SIZES, seconds, 8)
    assert fit.alpha == 0.0
    assert fit.bandwidth == pytest.approx(1e9, rel=0.3)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(sizes=[1024, 1024], seconds=[1e-3, 1e-3], n_workers=8), "distinct"),
        (dict(sizes=[1024, 2048], seconds=[1e-3], n_workers=8), "equal length"),
        (dict(sizes=[1024, 2048], seconds=[1e-3, -1.0], n_workers=8), "seconds"),
        (dict(sizes=[1024, 2048], seconds=[1e-3, 2e-3], n_workers=1), "n_workers"),
        (dict(sizes=[1024, 2048], seconds=[2e-3, 1e-3], n_workers=8), "bandwidth"),
        (
            dict(sizes=[1024, 2048], seconds=[1e-3, 2e-3], n_workers=8, method="allgather_topk"),
            "method",
        ),
    ],
)
def test_fit_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        probe.fit_alpha_beta(**kwargs)


def test_probe_on_virtual_devices_is_cached_per_mesh_and_axis():
    need_devices(8)
    probe.clear_cache()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    sizes = (2**10, 2**16, 2**20)
    net = probe.probe_network(mesh, "data", sizes=sizes, repeats=2)
    assert isinstance(net, cost.Network)
    assert net.alpha >= 0 and 0 < net.bandwidth < float("inf")
    with count_compilations() as compiled:
        again = probe.probe_network(mesh, "data", sizes=sizes, repeats=2)
    assert again is net and compiled[0] == 0
    other_axis = probe.probe_network(mesh, "model", sizes=sizes, repeats=2)
    assert other_axis is not net
    probe.clear_cache()
    assert probe.probe_network(mesh, "data", sizes=sizes, repeats=2) is not net


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(axis_name="nope"), ValueError, "axis_name"),
        (dict(axis_name="one"), ValueError, "at least 2"),
        (dict(axis_name="data", sizes=(1024, 1023)), ValueError, "sizes"),
        (dict(axis_name="data", sizes=(1024,)), ValueError, "sizes"),
        (dict(axis_name="data", repeats=0), ValueError, "repeats"),
    ],
)
def test_probe_rejects_bad_input(kwargs, error, match):
    need_devices(8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(8, 1), ("data", "one"))
    with pytest.raises(error, match=match):
        probe.probe_network(mesh, **kwargs)
    with pytest.raises(TypeError, match="mesh"):
        probe.probe_network(jax.devices(), "data")


_WORKER = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
    from jaxcomp.costmodel.probe import probe_network as probe
    mesh = jax.sharding.Mesh(jax.devices(), ("data",))
    net = probe(mesh, "data", sizes=(2**10, 2**18, 2**21), repeats=3)
    print("NETWORK", repr(net.alpha), repr(net.bandwidth), flush=True)
    jax.distributed.shutdown()
""")


@pytest.mark.multiprocess
def test_every_process_gets_the_same_network(tmp_path):
    """Two processes with 2 CPU devices each probe one 4-device axis and return identical Networks,
    although each timed its own calls."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = subprocess_env(XLA_FLAGS="--xla_force_host_platform_device_count=2")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, f"127.0.0.1:{port}", str(i)],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    for p in procs:
        try:
            # stderr apart: gloo logs there, and a merged stream could split the result line.
            out, err = p.communicate(timeout=120)
        finally:
            p.kill()
        assert p.returncode == 0, err[-3000:]
        outputs.append([line for line in out.splitlines() if line.startswith("NETWORK")])
    assert len(outputs[0]) == 1, outputs
    assert outputs[0] == outputs[1]
    _, alpha, bandwidth = outputs[0][0].split()
    assert float(alpha) >= 0 and float(bandwidth) > 0


@pytest.mark.parametrize(
    "method,options",
    [
        ("allgather_topk", {"ratio": 0.01}),
        ("ar_topk_ring", {"ratio": 0.1}),
        ("zfp_ring", {"rate": 8}),
        ("zfp_recursive_doubling", {"rate": 4}),
    ],
)
def test_codec_seconds_times_the_kernels_once(method, options):
    probe.clear_cache()
    seconds = probe.codec_seconds(method, 3001, repeats=1, **options)
    assert 0 < seconds < float("inf")
    with count_compilations() as compiled:
        assert probe.codec_seconds(method, 3001, repeats=1, **options) == seconds
    assert compiled[0] == 0


def test_codec_seconds_on_a_mesh_runs_every_device_once_per_call():
    need_devices(8)
    probe.clear_cache()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    seconds = probe.codec_seconds("zfp_ring", 1000, rate=8, mesh=mesh, axis_name="data", repeats=1)
    assert 0 < seconds < float("inf")
    with count_compilations() as compiled:
        assert (
            probe.codec_seconds("zfp_ring", 1000, rate=8, mesh=mesh, axis_name="data", repeats=1)
            == seconds
        )
    assert compiled[0] == 0
    with pytest.raises(ValueError, match="axis_name"):
        probe.codec_seconds("zfp_ring", 1000, rate=8, mesh=mesh, axis_name="nope")
    with pytest.raises(TypeError, match="mesh"):
        probe.codec_seconds("zfp_ring", 1000, rate=8, mesh=jax.devices(), axis_name="data")


def test_codec_seconds_of_dense_is_zero_and_bad_input_is_rejected():
    assert probe.codec_seconds("dense_ring", 10) == 0.0
    for kwargs, match in [
        (dict(method="quantized", n_values=10), "quantized"),
        (dict(method="nope", n_values=10), "method"),
        (dict(method="zfp_ring", n_values=0, rate=8), "n_values"),
        (dict(method="zfp_ring", n_values=10), "rate"),
        (dict(method="allgather_topk", n_values=10, ratio=0.0), "ratio"),
        (dict(method="allgather_topk", n_values=10, ratio=0.1, repeats=0), "repeats"),
    ]:
        with pytest.raises(ValueError, match=match):
            probe.codec_seconds(**kwargs)


def test_the_budget_skips_the_sizes_that_would_not_fit(monkeypatch):
    """A slow link (1 MB/s here, faked) must not make the probe run for minutes: sizes whose
    expected time exceeds what is left of the budget are skipped, largest last."""
    timed = []

    def fake_psum(mesh, axis_name, values_per_device, repeats):
        timed.append(values_per_device * 4)
        return 1e-3 + values_per_device * 4 / 1e6

    monkeypatch.setattr(probe, "_time_psum", fake_psum)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    sizes = (2**10, 2**16, 2**20, 2**23)
    net = probe.probe_network(mesh, "data", sizes=sizes, repeats=3, cache=False, budget=5.0)
    # 1 MiB is expected to take ~4.2 s (fits in 5), 8 MiB ~34 s (does not).
    assert timed == [2**10, 2**16, 2**20]
    assert net.bandwidth == pytest.approx(
        1e6, rel=0.05
    )  # 2 devices: the ring moves M bytes, at 1 MB/s
    timed.clear()
    probe.probe_network(mesh, "data", sizes=sizes, repeats=3, cache=False, budget=1.0)
    assert timed == [2**10, 2**16]  # the two smallest always run
    timed.clear()
    probe.probe_network(mesh, "data", sizes=sizes, repeats=3, cache=False, budget=None)
    assert timed == list(sizes)


@pytest.mark.parametrize("budget", [0, -1.0, float("inf"), "5"])
def test_bad_budget(budget):
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    with pytest.raises(ValueError, match="budget"):
        probe.probe_network(mesh, "data", budget=budget)


def test_a_token_bucket_does_not_pass_for_bandwidth(monkeypatch):
    """A shaped link lets a burst through at full speed (tc tbf's bucket, here 500 KB at 125 MB/s):
    the probe reads the rate off the largest sizes, where the least-squares line over all sizes
    would overstate it."""
    bucket, rate, alpha = 500e3, 125e6, 2e-4

    def shaped_psum(mesh, axis_name, values_per_device, repeats):
        volume = cost.volume_bytes("dense_ring", 4.0 * values_per_device, 2)
        return (
            alpha * cost.message_steps("dense_ring", 2)
            + max(0.0, volume - bucket) / rate
            + volume / 5e9
        )

    monkeypatch.setattr(probe, "_time_psum", shaped_psum)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    net = probe.probe_network(
        mesh, "data", sizes=(2**10, 2**16, 2**20, 2**23), cache=False, budget=None
    )
    assert net.bandwidth == pytest.approx(1 / (1 / rate + 1 / 5e9), rel=0.01)
    least_squares = probe.fit_alpha_beta(
        (2**10, 2**16, 2**20, 2**23),
        [shaped_psum(None, None, s // 4, 1) for s in (2**10, 2**16, 2**20, 2**23)],
        2,
    )
    assert least_squares.bandwidth > 1.2 * net.bandwidth  # what the plain fit would have said


@pytest.mark.parametrize(
    "method, adds_codec",
    [
        ("ar_topk", False),
        ("randomk", False),
        ("sign", False),
        ("bf16", False),
        ("powersgd", False),
        ("zfp", True),
        ("quantized", True),
    ],
)
def test_overhead_times_the_real_update_for_every_method(monkeypatch, method, adds_codec):
    """Issue 22: a slow packing step made every method 3.5-5x slower than a plain step, and the
    overhead that compress_auto uses only saw it for top-k (the others timed their codec alone).
    Every method's overhead is now its whole update; ZFP and THC, which skip their codec on one
    device, add the codec timed on its own."""
    from jaxcomp import methods
    from jaxcomp.optim import timing

    monkeypatch.setattr(timing._UpdateTimer, "seconds", lambda self, m: 1.0)
    monkeypatch.setattr(timing, "codec_seconds", lambda m, n, **kw: 0.25)
    options = (
        {"ratio": 0.01}
        if method in ("ar_topk", "randomk")
        else {"rate": 8}
        if method == "zfp"
        else {"bits": 4}
        if method == "quantized"
        else {"rank": 2}
        if method == "powersgd"
        else {}
    )
    seconds = timing.overhead_seconds(
        methods.parse(method, **options), {"w": np.zeros((64, 64), np.float32)}
    )
    assert seconds == (1.25 if adds_codec else 1.0)
    assert timing.overhead_seconds(methods.parse("dense"), {"w": np.zeros(8, np.float32)}) == 0.0


def test_update_seconds_sees_a_slow_packing(monkeypatch):
    """The measurement is the real update: a packing made 50 ms slower shows up in it."""
    import time as time_module

    from jaxcomp import methods
    from jaxcomp.ops import flat
    from jaxcomp.optim import timing

    params = {"w": np.zeros((64, 64), np.float32), "b": np.zeros(64, np.float32)}
    fast = timing.update_seconds(methods.parse("sign"), params, repeats=2)

    def slow_pack(grads, residuals=None, energy_scale=1.0):
        out = flat.pack_error_fed_xla(grads, residuals, energy_scale)
        return flat.Packed(
            *jax.pure_callback(lambda *v: (time_module.sleep(0.05), v)[1], tuple(out), *out)
        )

    monkeypatch.setattr(flat, "pack_error_fed", slow_pack)
    assert timing.update_seconds(methods.parse("sign"), params, repeats=2) > fast + 0.04


def test_overheads_of_several_methods_share_one_dense_timing_and_one_gradient(monkeypatch):
    """compress_auto's init times every candidate: the dense update each one is measured against
    is timed once, and the gradient drawn once, not once per candidate."""
    from jaxcomp import methods
    from jaxcomp.optim import timing

    candidates = [
        methods.parse("dense"),
        methods.parse("randomk", ratio=0.01),
        methods.parse("sign"),
    ]
    params = {"w": np.zeros((64, 64), np.float32)}
    draws = []
    real_rng = np.random.default_rng
    monkeypatch.setattr(timing.np.random, "default_rng", lambda *a: draws.append(a) or real_rng(*a))
    real = timing.overhead_seconds_each(candidates, params, repeats=1)
    assert real[0] == 0.0 and all(s >= 0 for s in real)
    assert len(draws) == 1  # one gradient for both timed methods

    timed = []
    seconds_of = {"dense": 0.5, "randomk(0.01)": 0.75, "sign": 2.0}
    clock = _FakeClock(monkeypatch)

    def fake_update(self, method, n_axes):
        timed.append(method.describe())
        return lambda: clock.advance(seconds_of[method.describe()])

    monkeypatch.setattr(timing._UpdateTimer, "_update", fake_update)
    assert timing.overhead_seconds_each(candidates, params) == [0.0, 0.25, 1.5]
    assert timed == ["dense", "randomk(0.01)", "sign"]  # dense built once, for both


class _FakeClock:
    """probe's time.perf_counter, advanced only by the timed calls."""

    def __init__(self, monkeypatch):
        import types

        from jaxcomp.costmodel import probe

        self.now = 0.0
        monkeypatch.setattr(probe, "time", types.SimpleNamespace(perf_counter=lambda: self.now))

    def advance(self, seconds):
        self.now += seconds
        return seconds


def test_excess_seconds_times_in_turns_and_goes_on_while_no_slower(monkeypatch):
    """A top-k update measured no slower than a dense one on a loaded CI machine (dense timed
    first, in a burst of load; the top-k branches then got 0 s of overhead). The two are now
    timed in turns, the fastest of each counts, and rounds go on while the difference is not
    positive."""
    from jaxcomp.costmodel.probe import excess_seconds

    clock = _FakeClock(monkeypatch)
    calls = []

    def timed(name, seconds):
        return lambda: calls.append(name) or clock.advance(seconds.pop(0))

    # baseline's first timed call is slowed by a burst, the second is not: both rounds count.
    baseline = timed("dense", [9.0, 5.0, 1.0])  # warm-up, then two rounds
    run = timed("topk", [9.0, 1.5, 1.5])
    assert excess_seconds(run, baseline, repeats=2) == 0.5
    assert calls == ["dense", "topk"] * 3  # warm-ups, then a dense call and a top-k call a round

    calls.clear()
    same = [1.0] * 10
    assert excess_seconds(timed("topk", list(same)), timed("dense", list(same)), 1, most=3) == 0.0
    assert calls == ["dense", "topk"] * 4  # not slower: three rounds, the most, after the warm-ups


def test_codec_seconds_times_a_bounded_slice_of_a_large_gradient_and_scales_it(monkeypatch):
    """A gradient above MAX_TIMED_VALUES is coded MAX_TIMED_VALUES values at a time, and the time
    scaled: the timing's memory stays bounded (GPT-2's 124M values on 4 emulated hosts ran out of
    memory when each coded all of them)."""
    from jaxcomp.methods import Zfp

    coded = []

    class Recorded(Zfp):
        def local_work(self, n_values, n_devices):
            coded.append(n_values)
            return super().local_work(n_values, n_devices)

    monkeypatch.setattr(probe, "MAX_TIMED_VALUES", 1024)
    monkeypatch.setattr(probe, "best_seconds", lambda run, repeats: 0.5)
    assert probe.codec_seconds(Recorded(8), 4096, repeats=1, cache=False) == 2.0
    assert probe.codec_seconds(Recorded(8), 1000, repeats=1, cache=False) == 0.5
    assert coded == [1024, 1000]
