"""Time to quality (``jaxcomp netbench --to-loss``, ``benchmarks/time_to_quality.py``): the
time-to-target arithmetic, its flags, its rows, and a quick job on two emulated hosts."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxcomp.cli import to_loss as cli
from jaxcomp.training import charlm
from jaxcomp.training import to_loss as ttq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row(name, points):
    """A result with ``points`` = [(step, seconds, loss)], 1 MB and 2 CPU seconds per step."""
    curve = [dict(step=0, seconds=0.0, cpu=0.0, loss=5.0, bytes=0.0, wire=None)]
    for step, seconds, loss in points:
        curve.append(dict(step=step, seconds=seconds, cpu=2.0 * step, loss=loss, bytes=1e6 * step))
        curve[-1]["wire"] = None
    return dict(name=name, curve=curve, steps=curve[-1]["step"])


DP = _row("dp", [(10, 20.0, 3.0), (20, 40.0, 2.0)])
FAST = _row("fast", [(10, 2.0, 2.5), (20, 4.0, 2.1), (30, 6.0, 1.9)])
NEVER = _row("never", [(10, 1.0, 2.9), (20, 2.0, 2.8), (60, 6.0, 2.7)])


def test_time_to_target_is_the_first_evaluation_at_or_below_it():
    fast = ttq.summarize(FAST, target=2.0, steps=20)
    assert fast["to_target"] == 6.0 and fast["bytes_to_target"] == 30e6
    assert fast["loss_at_steps"] == 2.1  # the same samples as dp's 20 steps
    assert fast["final_loss"] == 1.9 and fast["steps"] == 30
    assert fast["step_seconds"] == pytest.approx(0.2) and fast["step_cpu"] == pytest.approx(2.0)
    never = ttq.summarize(NEVER, target=2.0, steps=20)
    assert never["to_target"] is None and never["bytes_to_target"] is None
    assert never["loss_at_steps"] == 2.8 and never["final_loss"] == 2.7


def test_table_gives_the_speed_up_over_dp_and_says_not_reached():
    table = cli.format_table([DP, FAST, NEVER], steps=20)
    lines = table.splitlines()
    assert "time to dp's loss (2.0000)" in lines[0]
    assert lines[2].startswith("| dp | 40.0 s | 1.00x | 2.0000 | 20 |")
    assert lines[3].startswith("| fast | 6.0 s | 6.67x | 2.1000 | 30 | 1.9000 | 30.00 | - |")
    assert lines[4].startswith("| never | not reached | - | 2.8000 | 60 | 2.7000 | - |")


def test_plot_writes_a_png(tmp_path):
    cli.plot([("1gbit", [DP, FAST]), ("100mbit", [DP, FAST, NEVER])], tmp_path / "p.png", "t")
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_cluster_jobs_get_the_flags_but_not_the_drivers():
    argv = ["--hosts", "4", "--rates=1gbit", "--steps", "5", "--out", "o", "--quick"]
    assert cli._drop_values(argv, ("--hosts", "--rates", "--out")) == ["--steps", "5", "--quick"]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--rows", "dp,nope"], "unknown row 'nope'"),
        (["--rows", "dp@outer=avg"], "@outer=avg is not a setting of it"),
        (["--rows", "diloco-h50@outer=nesterov:1"], "outer optimizer 'nesterov:1'"),
        (["--rows", "diloco-h50@lr=0"], "@lr= takes a finite learning rate > 0"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--steps", "40", "--max-steps", "30"], "--max-steps"),
        (["--steps", "20"], "more than the learning rate's 25 warm-up steps"),
        (["--hosts", "3"], "must divide the model's batch 32"),
        (["--devices", "3"], "must divide the model's batch 32"),
        (["--devices", "16"], "--devices must be <= 8"),
        (["--hosts", "2", "--devices", "2"], "--devices is for one process"),
        (["--hosts", "2", "--inner", "3"], "--hosts 2 x --inner 3 devices must divide"),
        (["--inner", "3"], "--inner 3 must divide the 8 devices"),
        (["--rows", "diloco-h10@exchange=half"], "@exchange= takes split or whole"),
        (["--rows", "diloco-h10@codec=int3"], "@codec= takes none, int8, int8flat, int4, topk"),
        (["--rows", "dp@codec=int8"], "@codec=int8 is not a setting of it"),
        (["--rows", "diloco-h10@metrics=sum"], "@metrics= takes mean or worker"),
        (["--plot", "/nonexistent/p.png"], "--plot '/nonexistent/p.png': the folder /nonexistent"),
        (["--hosts", "2", "--rates", "1gbit,fast"], "--rates: rate must look like '1gbit'"),
    ],
)
def test_flags_are_checked_before_anything_runs(argv, match, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert match in capsys.readouterr().err


def test_a_row_name_sets_the_outer_optimizer_and_the_learning_rate():
    import optax

    name = "diloco-h50-int8@outer=nesterov:1.0:0.3@lr=3e-3"
    options = ttq._row_options(name)
    assert options["outer"] == "nesterov:1.0:0.3" and options["sync_every"] == 50
    assert ttq._row_config(name, charlm.MODELS["small"]).learning_rate == 3e-3
    assert ttq._row_config("dp", charlm.MODELS["small"]) == charlm.MODELS["small"]
    # the spec's optimizer is optax's: the same updates over two steps
    grads = np.array([1.0, -2.0], np.float32)
    for spec, reference in [
        ("nesterov:1.0:0.3", optax.sgd(1.0, momentum=0.3, nesterov=True)),
        ("avg", optax.sgd(1.0)),
        ("sgd:1.3", optax.sgd(1.3)),
    ]:
        ours, theirs = ttq._outer(spec), reference
        a, b = ours.init(grads), theirs.init(grads)
        for _ in range(2):
            (u, a), (v, b) = ours.update(grads, a), theirs.update(grads, b)
            np.testing.assert_array_equal(u, v)


def test_a_row_name_asks_for_the_loss_per_worker():
    """``@metrics=worker``: diloco(worker_metrics=True), no collective over the workers between
    syncs; a quick row trains with it."""
    assert "worker_metrics" not in ttq._row_options("diloco-h10-int8")
    assert ttq._row_options("diloco-h10-int8@metrics=worker")["worker_metrics"] is True
    result = _quick("diloco-h10-int8@metrics=worker")
    assert [p["step"] for p in result["curve"]] == [0, 2, 4] and result["curve"][-1]["bytes"] > 0


def test_a_row_name_sets_the_codec_of_the_pseudo_gradients():
    import jaxcomp

    assert ttq._row_options("diloco-h50-avg-stream4-int8")["compress"] == "int8"
    options = ttq._row_options("diloco-h50-avg-stream4-int8@codec=int8flat")
    assert options["compress"] == "int8flat" and options["fragments"] == 4
    assert ttq.codec(options["compress"]) == jaxcomp.Quantized(8, hadamard=False)
    assert ttq._row_options("diloco-h10-int8@codec=none")["compress"] == "none"
    assert ttq.codec("none") is None and ttq.codec("int8") == jaxcomp.Quantized(8)


def test_a_row_sends_sparseloco_pseudo_gradients():
    """``-topk2r02`` and ``@codec=topkBrDIGITS``: the all-gather top-k of that ratio with B-bit
    values (SparseLoCo's), with error feedback, as DiLoCo's outer compress."""
    import jaxcomp

    options = ttq._row_options("diloco-h50-avg-topk2r02")
    assert options["compress"] == "topk2r02" and options["outer"] == "avg"
    assert options["sync_every"] == 50
    assert ttq.codec("topk2r02") == jaxcomp.TopK(0.02, value_bits=2)
    assert ttq.codec("topk2r01") == jaxcomp.TopK(0.01, value_bits=2)
    assert ttq.codec("topk4r015") == jaxcomp.TopK(0.015, value_bits=4)
    assert ttq.codec("topk1r1") == jaxcomp.TopK(0.1, value_bits=1)
    assert ttq._row_options("diloco-h10-avg@codec=topk2r03")["compress"] == "topk2r03"
    # the outer compress keeps a residual: error feedback is on for top-k
    tx = jaxcomp.compress(ttq.codec("topk2r02"), axis_name="workers")
    assert jaxcomp.find_compress_state(tx.init({"w": np.zeros((64, 64), np.float32)})).residual


@pytest.mark.parametrize(
    "name, match",
    [
        ("diloco-h50-avg-topk2r05", r"unknown row .*@codec=NAME.*topkBrDIGITS"),
        ("diloco-h50-avg@codec=topk5r02", "1 to 4 bits, not 5"),
        ("diloco-h50-avg@codec=topk0r02", "1 to 4 bits, not 0"),
        ("diloco-h50-avg@codec=topk2r00", r"ratio 0\.00 must be > 0"),
        ("diloco-h50-avg@codec=topk2", r"@codec= takes .*topkBrDIGITS.*got 'topk2'"),
        ("diloco-h50-avg@codec=topk2r0.2", r"@codec= takes .*got 'topk2r0\.2'"),
        ("dp@codec=topk2r02", "not a setting of it"),
    ],
)
def test_a_bad_sparseloco_row_or_codec_says_why(name, match):
    with pytest.raises(ValueError, match=match):
        ttq.parse_row(name)


def _quick(row):
    """``row`` trained for 4 quick steps on 2 devices, evaluated every 2."""
    return ttq.train(
        row, charlm.QUICK, charlm.load_corpus(), steps=4, eval_every=2, quick=True, devices=2
    )


@pytest.mark.parametrize("row", ["diloco-h50-avg-eager", "diloco-h50-avg-eager4-int8"])
def test_a_quick_eager_row_trains(row):
    """The eager rows run diloco(eager=True); a quick run exchanges and its loss stays finite."""
    assert ttq._row_options(row)["eager"] is True
    result = _quick(row)
    assert np.isfinite([p["loss"] for p in result["curve"]]).all()
    assert 0 < result["curve"][-1]["bytes"]


@pytest.mark.parametrize("row", ["diloco-h50-avg-muon", "diloco-h50-avg-muon-topk2r02"])
def test_a_quick_muloco_row_trains_its_workers_with_muon(row):
    """MuLoCo's rows: each worker's inner optimizer is jaxcomp.muon (its state holds Muon's),
    and a quick run trains with finite losses."""
    import jax
    import optax

    from jaxcomp.training import charlm as models

    options = ttq._row_options(row)
    tx = ttq._row_tx(row, options, models.QUICK)
    params = {"w": np.zeros((4, 3), np.float32)}
    muon = lambda x: isinstance(x, optax.contrib.MuonState)  # noqa: E731
    assert any(muon(s) for s in jax.tree.leaves(tx.init(params), is_leaf=muon))
    result = _quick(row)
    assert np.isfinite([p["loss"] for p in result["curve"]]).all()


def test_a_quick_sparseloco_row_trains():
    result = _quick("diloco-h50-avg-topk2r02")
    assert np.isfinite([p["loss"] for p in result["curve"]]).all()
    assert 0 < result["curve"][-1]["bytes"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("inner", [1], ids=["one-device-hosts"])
def test_a_quick_job_on_two_emulated_hosts(tmp_path, monkeypatch, inner):
    """The job's default, one device a host. (With --inner 2 each host has 2 devices and is a
    DiLoCo worker of 2, a two-level mesh; tests/diloco_cluster_test.py trains that on the
    cluster, zero-2x2, so CI runs this job once.)"""
    from helpers import cluster_hosts_import_this_jaxcomp

    cluster_hosts_import_this_jaxcomp(monkeypatch)
    row = "diloco-h10-int8@outer=nesterov:1.0:0.3"  # a row with a setting, through the cluster
    argv = ["--quick", "--hosts", "2", "--rates", "100mbit", "--rows", f"dp,{row}"]
    cli.main([*argv, "--inner", str(inner), "--out", str(tmp_path)])
    with open(tmp_path / "time_to_quality.json") as f:
        record = json.load(f)
    ((rate, (dp, diloco)),) = record["panels"]
    assert ("workers of 2 devices" in record["title"]) == (inner == 2)
    assert rate == "100mbit" and [dp["name"], diloco["name"]] == ["dp", row]
    target = dp["curve"][-1]["loss"]
    assert dp["steps"] == 6 and target < dp["curve"][0]["loss"]  # dp trained
    # DiLoCo ran until it reached dp's loss or its cap, 3x dp's steps.
    last = diloco["curve"][-1]
    assert last["loss"] <= target or last["step"] == 18
    for row in (dp, diloco):
        for point in row["curve"][1:]:
            assert point["seconds"] > 0 and point["cpu"] > 0
            # The hosts' eth0 carried at least what jaxcomp counts per device (plus TCP/IP
            # framing), and at most what the host's devices count.
            bound = inner * 1.5 * point["bytes"] + 40_000 * point["step"]
            assert point["bytes"] <= point["wire"] <= bound
    # 8-bit pseudo-gradients every 2 steps against a dense all-reduce every step.
    assert diloco["curve"][3]["bytes"] < dp["curve"][3]["bytes"] / 4
    assert (tmp_path / "time_to_quality.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "name, aggregation", [("adam-sign", "allgather"), ("adam-sign_ring", "ring")]
)
def test_the_onebit_rows_run_jaxcomp_adam_with_a_short_warm_up(name, aggregation):
    """``adam-sign`` / ``adam-sign_ring``: jaxcomp.adam (25 dense steps, a refresh every 100)
    with the momentum as signs, all-gathered or in a ring, built as the job builds them; its
    steps train."""
    import jax
    import jax.numpy as jnp

    import jaxcomp

    options = ttq._row_options(name)
    tx = ttq._row_tx(name, options, charlm.MODELS["small"])
    run = ttq._build(
        options, lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2), tx, np.array(jax.devices())
    )
    state = run.init(jnp.zeros(3))
    compress = jaxcomp.find_compress_state(state.opt_state)
    assert compress.methods == (jaxcomp.Dense(), jaxcomp.Sign(aggregation=aggregation))
    x = np.random.default_rng(0).normal(size=(8 * jax.device_count(), 3)).astype(np.float32)
    batch = run.shard_batch({"x": x, "y": x @ np.array([1.0, -2.0, 0.5], np.float32)})
    losses = []
    for _ in range(30):  # past the 25 warm-up steps
        state, metrics = run.step(state, batch)
        losses.append(float(metrics["loss"]))
    # charlm.schedule warms the learning rate up over these first steps: a slow start
    assert losses[-1] < 0.95 * losses[0] and losses[-1] < losses[24]  # the signed steps train
    assert int(jaxcomp.find_compress_state(state.opt_state).step) == 30


@pytest.mark.parametrize("name, leader", [("ar_topk-dgc", "split"), ("ar_topk_star-dgc", "star")])
def test_the_dgc_rows_run_ar_topk_with_the_recipe(name, leader):
    """``ar_topk-dgc`` / ``ar_topk_star-dgc``: AR-Topk 1% with momentum correction, 50 warm-up
    steps sent as ZFP 8 and Adam with b1 = 0, built as the job builds them; its steps train."""
    import jax
    import jax.numpy as jnp

    import jaxcomp

    options = ttq._row_options(name)
    tx = ttq._row_tx(name, options, charlm.MODELS["small"])
    # Adam's own momentum off (b1 = 0): a zero gradient after a step moves nothing.
    _, adam_state = tx.update(jnp.ones(3), tx.init(jnp.zeros(3)))
    assert not np.any(np.asarray(tx.update(jnp.zeros(3), adam_state)[0]))
    run = ttq._build(
        options, lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2), tx, np.array(jax.devices())
    )
    state = run.init(jnp.zeros(300))
    compress = jaxcomp.find_compress_state(state.opt_state)
    topk = jaxcomp.TopK(0.01, collective="ar", leader=leader)
    assert compress.methods == (jaxcomp.Zfp(8), topk)
    x = np.random.default_rng(0).normal(size=(8 * jax.device_count(), 300)).astype(np.float32)
    batch = run.shard_batch({"x": x, "y": x @ np.linspace(-1, 1, 300).astype(np.float32)})
    losses = []
    for _ in range(55):  # past the 50 warm-up steps
        state, metrics = run.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.9 * losses[0] and int(metrics["method"]) == 1  # top-k's branch


@pytest.mark.slow  # a training run of its own
def test_jaxcomp_netbench_to_loss_runs_a_quick_job_in_one_process(tmp_path):
    """The installed command: a tiny model, dp then DiLoCo on 2 virtual devices; the table, the
    JSON (with the command that made it) and the plot."""
    from helpers import subprocess_env

    argv = ["--to-loss", "--quick", "--devices", "2", "--rows", "dp,diloco-h10-int8"]
    done = subprocess.run(
        [sys.executable, "-m", "jaxcomp", "netbench", *argv, "--out", str(tmp_path)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| dp | " in done.stdout and "| diloco-h10-int8 | " in done.stdout
    with open(tmp_path / "time_to_quality.json") as f:
        record = json.load(f)
    assert record["command"][:3] == ["jaxcomp", "netbench", "--to-loss"]
    ((label, (dp, diloco)),) = record["panels"]
    assert label == "one process" and dp["steps"] == 6 and diloco["name"] == "diloco-h10-int8"
    assert (tmp_path / "time_to_quality.png").stat().st_size > 10_000


def test_the_benchmark_script_and_netbench_name_the_same_command():
    from helpers import subprocess_env

    def run(*argv):
        done = subprocess.run(
            [sys.executable, *argv], env=subprocess_env(), capture_output=True, text=True, cwd=ROOT
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    script = run(os.path.join("benchmarks", "time_to_quality.py"), "--help")
    assert "jaxcomp netbench --to-loss" in script and "--max-steps" in script
    assert "--to-loss" in run("-m", "jaxcomp", "netbench", "--help")
