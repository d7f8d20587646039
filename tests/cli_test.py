"""The CLI validates every flag before any work (issue 14): a clear error and exit status 2."""

import os

import pytest

from jaxcomp.cli import advise, demo, kernels, netbench

ADVISE = ["--workers", "8", "--bandwidth", "10gbit", "--backward-ms", "120"]


def _fails(main, argv, capsys, match):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert match in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--params", "1e30", *ADVISE], "--params must be in [1, 1e+13]"),
        (["--params", "nan", *ADVISE], "--params must be in"),
        (["--params", "25e6", *ADVISE, "--gamma", "inf"], "--gamma must be >= 1 and finite"),
        (["--params", "25e6", *ADVISE, "--bucket-mb", "inf"], "--bucket-mb must be > 0 and finite"),
        (["--params", "25e6", *ADVISE, "--methods", ","], "--methods names no method"),
        (
            ["--params", "25e6", *ADVISE, "--plot", "/nonexistent-folder/speedup.png"],
            "does not exist",
        ),
        (
            ["--params", "25e6", *ADVISE, "--plot", "speedup.txt"],
            "the name must end in one of .png",
        ),
        (["--params", "1e12", *ADVISE, "--measure-codec"], "--measure-codec times the codec"),
    ],
)
def test_advise_refuses_bad_flags_before_any_work(argv, match, capsys):
    _fails(advise.main, argv, capsys, match)


def test_advise_plot_folder_is_checked_before_work(tmp_path, capsys):
    _fails(
        advise.main, ["--params", "25e6", *ADVISE, "--plot", str(tmp_path)], capsys, "is a folder"
    )
    assert os.listdir(tmp_path) == []


def test_advise_with_one_worker_claims_no_speedup(capsys):
    assert (
        advise.main(
            ["--params", "25e6", "--workers", "1", "--bandwidth", "10gbit", "--backward-ms", "120"]
        )
        == 0
    )
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if " of 1" in line]
    assert len(rows) >= 2
    assert all("1.00x" in row for row in rows), out
    assert "1 worker: nothing crosses the network" in out


def test_one_worker_step_times_are_the_backward_pass():
    from jaxcomp.costmodel import cost

    net = cost.Network.parse("1ms", "1gbit")
    assert (
        advise.sync_sgd_time(4e8, 1, net, 0.1) == 0.1
    )  # no overlap slowdown with nothing to overlap
    assert advise.compressed_time(
        "zfp_ring", 4e8, 1, net, 0.1, encode_decode_seconds=0.02, rate=8, overlap=True
    ) == pytest.approx(0.12)
    assert advise.sync_sgd_time(4e8, 2, net, 0.1) > 0.1


def test_advise_largest_model_is_exact(capsys):
    assert advise.main(["--params", "1e13", *ADVISE]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out and "inf s" not in out


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--batch-size", "0"], "--batch-size must be a positive multiple of 8"),
        (["--batch-size", "-8"], "--batch-size must be a positive multiple of 8"),
        (["--batch-size", "12"], "--batch-size must be a positive multiple of 8"),
        (["--batch-size", "2000"], "--batch-size must be at most the 1438 training images"),
        (["--learning-rate", "nan"], "--learning-rate must be a positive finite number"),
        (["--learning-rate", "0"], "--learning-rate must be a positive finite number"),
        (["--learning-rate=-inf"], "--learning-rate must be a positive finite number"),
        (["--seed", "-1"], "--seed must be in [0, 2**32 - 1]"),
        (["--out", "/proc/x"], "--out '/proc/x': cannot create the folder"),
        # issue 24: a density out of range was a traceback from building the methods
        (["--density", "0"], "--density must be in (0, 1], got 0.0"),
        (["--density", "2"], "--density must be in (0, 1], got 2.0"),
    ],
)
def test_demo_refuses_bad_flags_before_training(argv, match, capsys):
    _fails(demo.main, ["--steps", "2", "--methods", "dense", "--no-progress", *argv], capsys, match)


def test_demo_out_that_is_a_file_fails_at_start(tmp_path, capsys):
    path = tmp_path / "a-file"
    path.write_text("")
    _fails(
        demo.main,
        ["--steps", "2", "--methods", "dense", "--out", str(path)],
        capsys,
        "exists and is not a folder",
    )


def test_kernels_refuses_zero_repeats(capsys):
    """Issue 24: ``--repeats 0`` printed ``inf`` for every kernel."""
    _fails(kernels.main, ["--repeats", "0"], capsys, "--repeats must be at least 1")


@pytest.mark.parametrize("hosts", ["1", "2,1", "0"])
def test_netbench_refuses_a_single_host(hosts, capsys):
    """Issue 24: ``--hosts 1`` printed a row with a 0.00x speed-up (one host sends nothing)."""
    _fails(netbench.main, ["--hosts", hosts], capsys, "--hosts: every count must be at least 2")
