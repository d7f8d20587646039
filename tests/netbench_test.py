"""jaxcomp netbench: one small cell end to end on an emulated cluster, the table, the plot, the
CLI."""

import dataclasses
import json

import numpy as np
import pytest

from jaxcomp.cli import _report
from jaxcomp.cli import netbench as netbench_cli
from jaxcomp.distributed import netbench, netbench_worker, netbench_workload


def fake_rows():
    rows = []
    for rate in ("1gbit", "100mbit"):
        slow = 10 if rate == "100mbit" else 1
        for method, step, sync in (
            ("pmean", 1.2 * slow, 1.0 * slow),
            ("dense", 1.2 * slow, 1.0 * slow),
            ("ar_topk", 0.5, 0.3),
        ):
            rows.append(
                {
                    "hosts": 4,
                    "rate": rate,
                    "method": method,
                    "step": step,
                    "compute": 0.2,
                    "sync": sync,
                    "predicted_sync": sync * 0.9,
                    "advise_step": step * 0.9,
                    "wire_tx": 1e6,
                    "bytes_sent": 1e6,
                    "speedup": 1.2 * slow / step,
                    "ran": method,
                }
            )
    return rows


def test_table_has_a_row_per_method_and_the_sync_ratio():
    lines = netbench_cli.table(fake_rows()).splitlines()
    assert len(lines) == 2 + 6
    ar = [line for line in lines if "| ar_topk |" in line and "| 100mbit |" in line][0]
    assert "| 33.3x |" in ar  # dense's sync 10 s over ar_topk's 0.3 s


def test_table_compares_each_model_with_its_own_dense():
    rows = [
        dict(r, model=model, sync=r["sync"] * scale)
        for model, scale in (("gpt2", 1), ("resnet50", 2))
        for r in fake_rows()
    ]
    lines = netbench_cli.table(rows).splitlines()
    assert lines[0].startswith("| model | hosts |") and len(lines) == 2 + 12
    assert all(
        "| 33.3x |" in line for line in lines if "| ar_topk |" in line and "| 100mbit |" in line
    )
    assert all(
        line.startswith("| -") for line in netbench_cli.table(fake_rows()).splitlines()[2:]
    )  # older rows


def test_a_zoo_model_is_what_the_workers_train():
    spec = netbench.Spec(
        params=25e6,
        methods=("pmean",),
        steps=1,
        warmup=0,
        batch=3,
        layers=6,
        out="-",
        rate_bits=None,
        model="mlp4096",
    )
    params, loss_fn, batches, about = netbench_workload.workload(spec, np.random.default_rng(0))
    assert about == {"model": "mlp4096", "leaves": 8, "width": None}
    assert len(batches) == 4 and batches[0]["x"].shape == (3, 1024)
    assert np.isfinite(float(loss_fn(params, batches[0])))
    # Without a model: the MLP of --params, as before the zoo.
    mlp = dataclasses.replace(spec, model=None, params=2e5)
    _, _, batches, about = netbench_workload.workload(mlp, np.random.default_rng(0))
    assert about == {"model": "mlp_6x183", "leaves": 12, "width": 183} and batches[0][
        "y"
    ].shape == (3, 183)


class _TimedOutCluster:
    """A cluster whose job wrote ``written`` (host 0's results so far) and then timed out."""

    written = None

    def __init__(self, n_hosts, rate=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def run(self, argv, timeout, env, stdout, stderr, cwd):
        spec = json.loads(argv[-1])
        if self.written is not None:
            with open(spec["out"], "w") as f:
                json.dump(self.written, f)
        stdout.write("the workers' last words\n")
        return [124, 124]


@pytest.mark.parametrize(
    "steps, plain",
    [
        ({"pmean": 2.0, "pmean_flat": 0.5, "ar_topk": 0.25}, 0.5),  # many small leaves
        ({"pmean": 2.0, "pmean_flat": 6.0, "ar_topk": 0.25}, 2.0),  # ravel_pytree's slow concat
        ({"pmean": 2.0, "ar_topk": 0.25}, 2.0),  # pmean_flat not asked for
    ],
)
def test_speedups_against_pmean_and_the_faster_plain_step(monkeypatch, steps, plain):
    """Neither plain step is fast on every model under XLA:CPU: each row is also compared with the
    faster of the two, and the table shows both."""
    measured = {name: {"step": step, "sync": step / 2} for name, step in steps.items()}
    result = {"params": 10, "compute": 0.1, "probe": None, "methods": measured}
    monkeypatch.setattr(netbench, "_run_cell", lambda *args: result)
    options = dict(params=10, steps=1, warmup=0, batch=2, layers=2)
    bar = _report.progress_bar(total=1, enabled=False)
    rows = netbench._cell_rows(None, 2, "1gbit", tuple(steps), options, bar, 1, None, {})
    by = {r["method"]: r for r in rows}
    assert by["ar_topk"]["speedup"] == pytest.approx(2.0 / 0.25)
    assert by["ar_topk"]["speedup_plain"] == pytest.approx(plain / 0.25)
    assert by["pmean"]["speedup_plain"] == pytest.approx(plain / 2.0)
    for r in rows:
        r.update(predicted_sync=None, wire_tx=1e6, ran=r["method"])
    line = [x for x in netbench_cli.table(rows).splitlines() if "| ar_topk |" in x][0]
    assert f"| {2.0 / 0.25:.2f}x | {plain / 0.25:.2f}x |" in line
    by["ar_topk"]["cpu"] = 0.75  # CPU seconds a step, where the workers measured it
    line = [x for x in netbench_cli.table(rows).splitlines() if "| ar_topk |" in x][0]
    assert "| 0.250 | 0.750 | 0.100 |" in line  # step, CPU, compute


def test_a_job_that_times_out_keeps_the_rows_it_measured(monkeypatch, caplog, tmp_path):
    from jaxcomp.distributed import cluster

    monkeypatch.setattr(cluster, "Cluster", _TimedOutCluster)
    entry = {"step": 0.5, "times": [0.5], "sync": 0.4}
    _TimedOutCluster.written = {
        "params": 10,
        "compute": 0.1,
        "probe": None,
        "methods": {"pmean": entry, "dense": {**entry, "step": 0.25}},
    }
    out = tmp_path / "result.json"
    spec = netbench.Spec(10, ("pmean", "dense", "zfp"), 1, 0, 2, 2, str(out), None)
    run = dict(n_hosts=2, timeout=1, log_path=str(tmp_path / "log"), cwd=str(tmp_path), env={})
    result = netbench._run_cell(spec, **run)
    assert list(result["methods"]) == ["pmean", "dense"]
    assert result["incomplete"] == "exit codes [124, 124]"
    err = caplog.text  # a warning of logger "jaxcomp.distributed" (on stderr by default)
    assert "failed (exit codes [124, 124])" in err and "kept the rows measured before" in err
    assert "the workers' last words" in err
    # Nothing measured (or not even the baseline): the failure is raised.
    for written in (None, {**_TimedOutCluster.written, "methods": {"dense": entry}}):
        _TimedOutCluster.written = written
        out.unlink(missing_ok=True)
        with pytest.raises(cluster.ClusterError, match="the workers' last words"):
            netbench._run_cell(spec, **run)


def test_the_flat_pmean_baseline_sums_one_vector():
    """``pmean_flat``: the plain baseline's sum as one vector (XLA:CPU runs ``pmean``'s merged
    all-reduce as one collective per leaf); the same training, one gradient array all-reduced."""
    import jax
    from helpers import all_reduced_arrays

    rng = np.random.default_rng(0)
    params = {f"w{i:02d}": rng.standard_normal((8, 8), dtype=np.float32) / 3 for i in range(40)}

    def loss_fn(p, batch):
        x = batch
        for key in sorted(p):
            x = jax.numpy.tanh(x @ p[key])
        return jax.numpy.mean(x**2)

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    batch = jax.device_put(
        rng.standard_normal((4, 8), dtype=np.float32),
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
    )
    steps = [netbench_worker._plain_pmean_step(loss_fn, mesh, flat=f) for f in (False, True)]
    arrays = [
        all_reduced_arrays(step._step.lower(*step.init(params), batch).compile().as_text())
        for step in steps
    ]
    assert arrays[0] >= 40 and arrays[1] <= 2, arrays
    assert netbench.METHODS["pmean_flat"] == (None, {"flat": True}, None)
    (a, _), (b, _) = (s.step(s.init(params), batch) for s in steps)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_the_plain_step_donates_its_state_and_keeps_the_callers_params():
    """``--donate``: the plain baseline writes its new params and Adam state over the old ones
    (the state it was given is deleted), trains as without, and leaves the job's params alone
    (init copies them)."""
    import jax

    rng = np.random.default_rng(1)
    params = {"w": jax.numpy.asarray(rng.standard_normal((8, 8), dtype=np.float32))}
    loss_fn = lambda p, x: jax.numpy.mean(jax.numpy.tanh(x @ p["w"]) ** 2)  # noqa: E731
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    batch = jax.device_put(
        rng.standard_normal((4, 8), dtype=np.float32),
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")),
    )
    finals = []
    for donate in (False, True):
        step = netbench_worker._plain_pmean_step(loss_fn, mesh, donate=donate)
        state = step.init(params)
        for _ in range(3):
            before = state
            state, _ = step.step(state, batch)
            assert before[0]["w"].is_deleted() == donate
        finals.append(np.asarray(state[0]["w"]))
    assert not params["w"].is_deleted()
    np.testing.assert_array_equal(finals[0], finals[1])


@pytest.mark.parametrize("models", [(None,), ("gpt2", "many_small")])
def test_plot_writes_a_png(tmp_path, models):
    path = tmp_path / "speedup.png"
    netbench_cli.plot([dict(r, model=m) for m in models for r in fake_rows()], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--hosts", "0"], "--hosts"),
        (["--rates", "fast"], "--rates"),
        (["--methods", "nope"], "--methods"),
        (["--params", "10"], "--params"),
        (["--steps", "0"], "--steps"),
        (["--plot", "/nonexistent/x.png"], "folder"),
        (["--allocator", "jemalloc"], "--allocator"),
        (["--optimizer", "lamb"], "--optimizer"),
        (["--model", "resnet18"], "--model must be among mlp4096,"),
        (["--model", "gpt2,nope"], "--model"),
        (["--model", ","], "--model"),
        (["--model", "gpt2", "--params", "1e6"], "one of --model and --params"),
        # A good --model passes its check: the next flag's error is the one reported.
        (["--model", "gpt2,resnet50", "--steps", "0"], "--steps"),
    ],
)
def test_cli_checks_its_flags_before_running(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        netbench_cli.main(argv)
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err


def test_a_bad_allocator_is_refused_before_any_cluster():
    with pytest.raises(ValueError, match="allocator must be one of"):
        netbench.run_benchmark((2,), ("1gbit",), allocator="jemalloc")


def test_a_bad_donate_is_refused_before_any_cluster():
    with pytest.raises(TypeError, match="donate must be True or False"):
        netbench.run_benchmark((2,), ("1gbit",), donate="yes")


def test_a_bad_optimizer_is_refused_before_any_cluster():
    with pytest.raises(ValueError, match="optimizer must be one of"):
        netbench.run_benchmark((2,), ("1gbit",), optimizer="lamb")


def test_the_workers_optimizers_are_adam_and_plain_sgd():
    """--optimizer sgd runs the step optax.sgd(1e-4) does (plain SGD, the torch rows' default);
    adam, optax.adam(1e-4)'s."""
    import jax.numpy as jnp
    import optax

    from jaxcomp.distributed.netbench_worker import optimizer

    g = jnp.array([2.0, -4.0])
    for name, reference in (("sgd", optax.sgd(1e-4)), ("adam", optax.adam(1e-4))):
        tx = optimizer(name)
        got = tx.update(g, tx.init(g))[0]
        assert jnp.array_equal(got, reference.update(g, reference.init(g))[0])
    sgd = optimizer("sgd")
    assert sgd.update(g, sgd.init(g))[0].tolist() == pytest.approx([-2e-4, 4e-4])
    with pytest.raises(ValueError, match="optimizer must be 'adam' or 'sgd'"):
        optimizer("lamb")


# One job on one cluster (a cluster and its JAX start cost about 20 s): the sharded modes, the
# allocator and the plot, and every method's bytes against the veth counters.
SHARDED = ["dense", "ar_topk", "quantized", "dense@params", "quantized@optimizer"]
EVERY = [
    "allgather_topk",
    "ar_topk_star",
    "bf16",
    "fp16",
    "zfp",
    "powersgd",
    "sign",
    "sign_ring",
    "randomk",
]


@pytest.mark.multiprocess
def test_one_small_cell_on_two_emulated_hosts(tmp_path, monkeypatch):
    """Issue 22: bytes_sent must tell the truth on the CPU cluster (bf16 once claimed half of what
    gloo carried). Every method netbench runs, checked against the veth counters, each step
    donating its state (--donate)."""
    from helpers import cluster_hosts_import_this_jaxcomp

    cluster_hosts_import_this_jaxcomp(monkeypatch)
    out = tmp_path / "rows.json"
    argv = ["--hosts", "2", "--rates", "100mbit", "--params", "2e5", "--steps", "2"]
    argv += ["--methods", ",".join(SHARDED + EVERY), "--allocator", "tuned", "--optimizer", "sgd"]
    argv += ["--donate"]
    code = netbench_cli.main([*argv, "--json", str(out), "--plot", str(tmp_path / "p.png")])
    assert code == 0
    rows = json.loads(out.read_text())
    assert [r["method"] for r in rows] == ["pmean", *SHARDED, *EVERY]
    by = {r["method"]: r for r in rows}
    # Sharded: the params and Adam's state are halves on 2 hosts (dense keeps no residual).
    assert by["dense@params"]["state_bytes"] < 0.6 * by["dense"]["state_bytes"]
    assert all(r["peak_rss"] > 0 for r in rows)  # each method's own peak (VmHWM reset before it)
    assert all(r["allocator"] == "tuned" for r in rows)  # --allocator reached the hosts
    assert all(r["optimizer"] == "sgd" for r in rows)  # so did --optimizer
    assert all(r["donate"] for r in rows)  # and --donate: every step wrote over its state
    # bytes_sent counts the reduce-scatter and the params' all-gather: what the link carried.
    assert by["quantized@optimizer"]["bytes_sent"] > by["quantized"]["bytes_sent"]
    for r in rows:
        # The links carried what jaxcomp says it sends, plus TCP/IP framing (a few %).
        assert r["bytes_sent"] <= r["wire_tx"] <= 1.15 * r["bytes_sent"] + 20_000, r
        assert r["step"] > 0 and r["compute"] > 0 and r["predicted_sync"] > 0
        assert 0 < r["cpu"] < 1e3  # host 0's CPU seconds a step, beside the wall clock
    assert (tmp_path / "p.png").exists()


def test_the_auto_rows_choose_among_every_fixed_method_or_compress_autos_default():
    """``auto``: every fixed method a candidate; ``auto_safe``: what ``compress("auto")`` picks
    from when given no setting (dense, the bfloat16 cast, ZFP 8)."""
    import jaxcomp
    from jaxcomp.methods import QUALITY_SAFE

    fixed, _, _ = netbench.METHODS["auto"]
    assert {"dense", "zfp", "quantized", "randomk"} <= {m.label for m in fixed}
    assert netbench.METHODS["auto_safe"] == (QUALITY_SAFE, {}, None)
    assert netbench.METHODS["auto_safe_bucket"] == (QUALITY_SAFE, {"bucket_mb": 25}, None)
    assert jaxcomp.compress("auto").init({}).methods == QUALITY_SAFE


def test_every_fixed_method_but_powersgd_has_a_row_with_buckets_and_one_without():
    """Dense and the casts are bucketed by default, so their other row is ``<label>_nobucket``
    (one message); every other fixed method but PowerSGD has ``<label>_bucket``, with DDP's 25
    MiB buckets (BENCHMARKS.md, "The codecs in buckets")."""
    fixed, _, _ = netbench.METHODS["auto"]
    for method in [m for m in fixed if m.label != "powersgd"] + [netbench.METHODS["fp16"][0]]:
        if method.label in ("dense", "bf16", "fp16"):
            assert method.buckets_by_default and f"{method.label}_bucket" not in netbench.METHODS
            assert netbench.METHODS[f"{method.label}_nobucket"] == (
                method,
                {"bucket_mb": None},
                None,
            )
        else:
            assert not method.buckets_by_default
            assert netbench.METHODS[f"{method.label}_bucket"] == (method, {"bucket_mb": 25}, None)
    assert fixed[-1].label == "powersgd" and "powersgd_bucket" not in netbench.METHODS
    assert netbench.METHODS["powersgd_fp16"] == (type(fixed[-1])(4, dtype="float16"), {}, None)


def test_the_casts_have_a_row_with_error_feedback():
    """The casts run without error feedback by default (``Method.feeds_back_by_default``); their
    ``<label>_ef`` rows put it back, for the side-by-side measurement in one job."""
    for label in ("bf16", "fp16"):
        method, options, shard = netbench.METHODS[label]
        assert not method.feeds_back_by_default and options == {} and shard is None
        assert netbench.METHODS[f"{label}_ef"] == (method, {"error_feedback": True}, None)
