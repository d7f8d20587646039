"""Fault-tolerant DiLoCo's time to quality on the emulated cluster (``jaxcomp netbench --to-loss
--fault-tolerant``, :mod:`jaxcomp.cli.to_loss_ft`): its flags, and 4 hosts at 100 Mbit, each a
worker process, worker 2 SIGKILLed mid-run and restarted."""

import json
import math
import signal
import time

import pytest

from jaxcomp.cli import to_loss as cli
from jaxcomp.cli import to_loss_ft


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--kill-worker", "0"], "--kill-worker must be in"),
        (["--kill-worker", "4"], "--kill-worker must be in"),
        (["--sync-every", "50", "--eval-every", "75"], "must be a multiple of --sync-every"),
        (["--hosts", "3"], "must divide the model's batch 32"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--restart-after", "-1"], "--restart-after"),
    ],
)
def test_bad_flags_are_errors_before_anything_runs(argv, match, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["--fault-tolerant", *argv])
    assert exit.value.code == 2 and match in capsys.readouterr().err


def test_dp_must_be_of_the_same_model_and_steps(tmp_path):
    record = {"config": {"steps": 300, "width": 128}, "panels": []}
    (tmp_path / "dp.json").write_text(json.dumps(record))
    args = to_loss_ft._parser().parse_args(["--dp-from", str(tmp_path / "dp.json")])
    with pytest.raises(SystemExit, match="another model"):
        to_loss_ft._dp(args, to_loss_ft._config(args))


@pytest.mark.multiprocess
@pytest.mark.parametrize("eager", [False, True])
def test_a_worker_killed_mid_run_rejoins_and_nothing_hangs(tmp_path, monkeypatch, eager):
    from helpers import cluster_hosts_import_this_jaxcomp, events

    cluster_hosts_import_this_jaxcomp(monkeypatch)
    steps, restart_after = 400, 2.0
    argv = ["--quick", "--hosts", "4", "--rate", "100mbit", "--steps", "20", "--max-steps"]
    argv += [str(steps), "--sync-every", "2", "--eval-every", "40", "--kill-at-step", "10"]
    argv += ["--restart-after", str(restart_after), "--failure-timeout", "3", "--pace", "0.05"]
    argv += ["--runs", "kill", "--timeout", "120", "--out", str(tmp_path)]
    argv += ["--eager"] if eager else []
    started = time.monotonic()
    code = cli.main(["--fault-tolerant", *argv, "--keep-logs", str(tmp_path / "logs")])
    assert time.monotonic() - started < 150  # the run's own deadline (120 s) held
    with open(tmp_path / "time_to_quality.json") as f:
        record = json.load(f)
    ((rate, (row,)),) = record["panels"]
    name = "diloco-ft-h2-avg" + ("-eager" if eager else "") + "-kill2-restart2s"
    assert rate == "100mbit" and row["name"] == name
    processes = {(p["rank"], p["incarnation"]): p for p in row["processes"]}
    assert sorted(processes) == [(0, 0), (1, 0), (2, 0), (2, 1), (3, 0)]
    # no process hung; the killed one died of the SIGKILL, every other one finished
    assert not any(p["hung"] for p in processes.values()), processes
    assert code == 0
    assert processes[2, 0]["exit"] == -signal.SIGKILL
    assert all(p["exit"] == 0 for key, p in processes.items() if key != (2, 0)), processes
    # restarted after the pause, it joined the survivors' quorum with their state
    killed, restarted = processes[2, 0]["killed_t"], processes[2, 1]["restarted_t"]
    assert restarted - killed >= restart_after
    joined = processes[2, 1]["joined"]
    assert joined is not None and joined["members"] == 4 and joined["t"] > restarted
    # between the kill and the rejoin the survivors synced among three; the one sync the killed
    # worker may have committed but not yet logged when the SIGKILL landed may still have its part
    logs = tmp_path / "logs" / row["name"]
    syncs = [e for e in events(logs / "worker0.0.jsonl") if e["event"] == "sync"]
    last = max(e["sync"] for e in events(logs / "worker2.0.jsonl") if e["event"] == "sync")
    between = [e for e in syncs if killed < e["t"] < joined["t"] and e["sync"] > last + 1]
    assert between and all(e["trained"] == [0, 1, 3] for e in between), (last, syncs)
    assert syncs[-1]["trained"] == [0, 1, 2, 3]
    # every worker that finished ends at the same step with the same global params
    done = [p["done"] for key, p in processes.items() if key != (2, 0)]
    assert len({(d["step"], d["sync"], d["params"]) for d in done}) == 1, done
    assert done[0]["step"] == steps and done[0]["reason"] == "max_steps"
    # and the curve is written: worker 0's held-out loss every 40 steps, training time rising
    curve = row["curve"]
    assert [p["step"] for p in curve] == list(range(0, steps + 1, 40))
    assert all(math.isfinite(p["loss"]) for p in curve) and curve[-1]["loss"] < curve[0]["loss"]
    assert all(a["seconds"] < b["seconds"] for a, b in zip(curve[1:], curve[2:]))
    assert all(p["bytes"] > 0 and p["wire"] >= p["bytes"] for p in curve[1:])


@pytest.mark.multiprocess
def test_the_service_killed_mid_run_comes_back_and_no_worker_dies(tmp_path, monkeypatch):
    """The coordination service SIGKILLed once worker 0 committed the sync of step 10, and
    started again 2 s later at the same address: every worker reconnects (its own state kept)
    and finishes, with the same global params."""
    from helpers import cluster_hosts_import_this_jaxcomp, events

    cluster_hosts_import_this_jaxcomp(monkeypatch)
    steps = 200
    argv = ["--quick", "--hosts", "4", "--rate", "100mbit", "--steps", "20", "--max-steps"]
    argv += [str(steps), "--sync-every", "2", "--eval-every", "40", "--kill-at-step", "10"]
    argv += ["--kill-service", "--restart-after", "2", "--failure-timeout", "3", "--pace"]
    argv += ["0.05", "--runs", "kill", "--timeout", "120", "--out", str(tmp_path)]
    code = cli.main(["--fault-tolerant", *argv, "--keep-logs", str(tmp_path / "logs")])
    with open(tmp_path / "time_to_quality.json") as f:
        ((_, (row,)),) = json.load(f)["panels"]
    assert row["name"] == "diloco-ft-h2-avg-killservice-restart2s" and code == 0
    assert row["options"]["kill_service"] and "kill_worker" not in row["options"]
    processes = {(p["rank"], p["incarnation"]): p for p in row["processes"]}
    assert sorted(processes) == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert all(p["exit"] == 0 and not p["hung"] for p in processes.values()), processes
    killed, restarted = row["service"]["killed_t"], row["service"]["restarted_t"]
    assert restarted - killed >= 2
    for rank in range(4):
        log = events(tmp_path / "logs" / row["name"] / f"worker{rank}.0.jsonl")
        after = [e for e in log if e["event"] == "sync" and e["t"] > restarted]
        assert after and sum(e["reconnects"] for e in after) == 1, (rank, after[:3])
    done = [p["done"] for p in processes.values()]
    assert len({(d["step"], d["sync"], d["params"]) for d in done}) == 1, done
    assert done[0]["step"] == steps
