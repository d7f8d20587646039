"""jaxcomp.distributed.cluster: an emulated 2-host cluster (network namespaces, tbf at 100 Mbit)
trains like one process, the wire carries what bytes_sent says, and nothing is left behind. Needs
root, as CI has."""

import os
import subprocess
import time

import cluster_worker
import numpy as np
import pytest
from helpers import allocator_check_script, need_devices, subprocess_env

from jaxcomp.distributed import cluster
from jaxcomp.distributed.cluster import Cluster, ClusterError

# Ethernet (14) + IPv4 (20) + TCP with timestamps (32): the framing of every packet on the veths.
HEADER_BYTES = 66


def our_namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [
        line.split()[0]
        for line in out.splitlines()
        if line.startswith(cluster.PREFIX + f"{os.getpid()}-")
    ]


def run_workers(tmp_path, *args, timeout=240):
    env = subprocess_env()
    with Cluster(2, rate="100mbit") as c:
        assert len(our_namespaces()) == 3  # the bridge's and one per host
        qdiscs = subprocess.run(
            ["tc", "-n", c.namespace(1), "qdisc", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
        ).stdout
        assert "tbf" in qdiscs and "100Mbit" in qdiscs
        start = time.monotonic()
        codes = c.run(
            [cluster_worker.__file__, str(tmp_path), *args],
            timeout=timeout,
            env={"PYTHONPATH": env["PYTHONPATH"]},
        )
        elapsed = time.monotonic() - start
        pids = [p.popen.pid for p in c.processes]
    return codes, elapsed, pids


@pytest.mark.multiprocess
def test_two_emulated_hosts_train_like_one_process_and_wire_bytes_match(tmp_path):
    need_devices(2)
    cluster.check_support()  # CI runs as root: a missing capability is a failure here, not a skip
    codes, _, _ = run_workers(tmp_path)
    assert codes == [0, 0], f"the workers failed: {codes}"
    assert our_namespaces() == []  # torn down: namespaces take their veths, bridge and qdiscs along
    hosts = [np.load(tmp_path / f"host{i}.npz") for i in range(2)]
    import jax

    want, _ = cluster_worker.run(jax.devices()[:2], lambda batch: batch)
    for name, value in want.items():
        # Two hosts: every sum has two terms, so gloo and XLA's in-process sum agree bit for bit.
        np.testing.assert_array_equal(
            hosts[0][name], hosts[1][name], err_msg=f"hosts differ: {name}"
        )
        np.testing.assert_array_equal(
            hosts[0][name], value, err_msg=f"cluster vs one process: {name}"
        )
    for host in hosts:
        for method in cluster_worker.METHODS:
            tx_bytes, tx_packets, rx_bytes, rx_packets, retransmitted, bytes_sent = host[
                f"wire/{method}"
            ]
            steps = cluster_worker.STEPS - 1
            payload = tx_bytes - HEADER_BYTES * tx_packets
            # A loaded machine can make tbf drop a segment; TCP then sends it again (at most a
            # full segment each), which is framing too: measured per namespace, not guessed.
            resent = retransmitted * 1448
            assert payload >= 0.95 * steps * bytes_sent, (method, payload, steps * bytes_sent)
            assert payload - resent <= 1.05 * steps * bytes_sent, (
                method,
                payload,
                resent,
                steps * bytes_sent,
            )


@pytest.mark.multiprocess
def test_a_dead_host_stops_the_job_and_the_cluster_is_torn_down(tmp_path):
    codes, elapsed, _ = run_workers(tmp_path, "fail", timeout=120)
    assert codes[1] == 3
    assert codes[0] != 0  # stopped, not left waiting in its collective
    assert elapsed < 100
    assert our_namespaces() == []


def test_without_root_a_clear_error_before_anything_is_created(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    before = our_namespaces()
    with pytest.raises(ClusterError, match="root"):
        with Cluster(2, rate="1gbit"):
            pass
    assert our_namespaces() == before


def test_missing_tools_are_named(monkeypatch):
    monkeypatch.setattr(
        cluster.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/" + tool
    )
    with pytest.raises(ClusterError, match="`tc`"):
        cluster.check_support()


def test_delay_needs_netem_and_says_so():
    with pytest.raises(ClusterError, match="netem"):
        with Cluster(2, rate="1gbit", delay="1ms"):
            pass
    assert our_namespaces() == []


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"hosts": 0}, "hosts"),
        ({"hosts": 2, "rate": "fast"}, "rate"),
        ({"hosts": 2, "rate": -5}, "rate"),
        ({"hosts": 2, "subnet": "8.8.8"}, "subnet"),
        ({"hosts": 2, "burst": 10}, "burst"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Cluster(**kwargs)


def test_rates_parse_and_print():
    assert cluster.parse_rate("10gbit") == 1e10 and cluster.parse_rate("250kbit") == 2.5e5
    assert cluster.parse_rate("none") is None and cluster.format_rate(1e8) == "100mbit"


def test_leftovers_of_a_killed_run_are_found_and_removed():
    cluster.check_support()
    # A namespace named after a process that no longer exists, as a killed run leaves it.
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{cluster.PREFIX}{dead.pid}-h0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in cluster.leftovers()
        assert name in cluster.cleanup()
        assert name not in cluster.leftovers()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_sigterm_to_the_cli_tears_everything_down(tmp_path):
    """`kill` of `jaxcomp cluster` (SIGTERM) must not leave namespaces or host processes behind."""
    import signal
    import sys

    env = subprocess_env()
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(600)\n")
    cli = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxcomp",
            "cluster",
            "--hosts",
            "2",
            "--rate",
            "1gbit",
            "--",
            str(script),
        ],
        env=env,
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
    )
    prefix = f"{cluster.PREFIX}{cli.pid}-"

    def namespaces():
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]

    deadline = time.monotonic() + 60
    while len(namespaces()) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # let the host processes start
    assert len(namespaces()) == 3
    cli.send_signal(signal.SIGTERM)
    cli.wait(timeout=60)
    assert namespaces() == []
    leftover = subprocess.run(
        ["pgrep", "-f", str(script)], capture_output=True, text=True
    ).stdout.split()
    assert leftover == []


def test_settled_counters_wait_for_the_queued_sends(monkeypatch):
    """A collective can end on a host whose last sends still wait in the link's tbf queue (the
    netbench cell test once saw 5% fewer bytes on the wire than bytes_sent): with ``settle`` the
    read waits until the bytes sent stop moving, while the bytes received may still move."""
    reads = iter([(100, 0), (150, 10), (180, 20), (180, 30), (999, 40)])
    monkeypatch.setattr(cluster, "_interface_counters", lambda interface: next(reads))
    monkeypatch.setattr(cluster, "_SETTLE_POLL", 0.001)
    assert cluster.read_interface_counters("eth0", settle=5.0) == (180, 30)
    assert next(reads) == (999, 40)  # it stopped reading once two reads agreed
    # Without settle: one read. With a settle shorter than the sends: the last read.
    reads = iter([(1, 1), (2, 2)])
    assert cluster.read_interface_counters("eth0") == (1, 1)
    moving = iter((i, 0) for i in range(10_000))
    monkeypatch.setattr(cluster, "_interface_counters", lambda interface: next(moving))
    tx, _ = cluster.read_interface_counters("eth0", settle=0.05)
    assert 1 <= tx < 10_000


@pytest.mark.multiprocess
def test_the_cli_starts_every_host_with_the_allocator_asked_for(tmp_path, capsys):
    from jaxcomp.cli import cluster as cli

    script = allocator_check_script(tmp_path)  # exits 0 if started with its argument's
    run = ["--hosts", "2", "--rate", "none", "--timeout", "120"]
    assert cli.main([*run, "--allocator", "tuned", "--", script, "tuned"]) == 0
    assert cli.main([*run, "--", script, "glibc"]) == 0  # glibc's, the default
    capsys.readouterr()
    # Started untuned, every host fails its check; the first to exit stops the other, so the
    # job's code is 3 or the stopped host's -15, and each host's own exit 3 is in the report.
    assert cli.main([*run, "--", script, "tuned"]) != 0
    assert "exit 3" in capsys.readouterr().err
    assert our_namespaces() == []
    with pytest.raises(SystemExit):
        cli.main([*run, "--allocator", "jemalloc", "--", script])
    assert "invalid choice: 'jemalloc'" in capsys.readouterr().err
