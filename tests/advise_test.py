"""jaxcomp.costmodel.advise: paper 002's T_obs model against hand-computed values and the paper's
own numbers, and the CLI."""

import math
import subprocess
import sys

import pytest
from helpers import subprocess_env

from jaxcomp.cli import advise as advise_cli
from jaxcomp.costmodel import advise, cost

NET = cost.Network(alpha=1e-3, bandwidth=1e9)
BUCKET = 1e6

# ResNet-50 on 64 V100s, paper 002 Table 3: backward ≈ 122 ms; PowerSGD rank 4 compresses 72x
# and takes 45 ms to encode and decode.
RESNET50_BYTES = 4 * 25.6e6
RESNET50_BACKWARD = 0.122


def test_sync_sgd_time_matches_hand_computed_values():
    # 3.5 buckets over 4 workers: three full buckets overlap the backward pass, the half bucket
    # waits for it. T_comm(b) = 2*3 α + 2*3/4 b β = 6 ms + 1.5 ms; T_comm(b/2) = 6 ms + 0.75 ms.
    nbytes = 3.5 * BUCKET
    comm_bucket, comm_last = 7.5e-3, 6.75e-3
    assert advise.sync_sgd_time(
        nbytes, 4, NET, 0.01, bucket_bytes=BUCKET, gamma=1.05
    ) == pytest.approx(max(1.05 * 0.01, 3 * comm_bucket) + comm_last)  # communication-bound
    assert advise.sync_sgd_time(
        nbytes, 4, NET, 0.1, bucket_bytes=BUCKET, gamma=1.05
    ) == pytest.approx(1.05 * 0.1 + comm_last)  # compute-bound: only the last bucket shows
    assert advise.sync_sgd_time(
        nbytes, 4, NET, 0.1, bucket_bytes=BUCKET, overlap=False
    ) == pytest.approx(0.1 + 3 * comm_bucket + comm_last)
    # One bucket or less: nothing to overlap.
    assert advise.sync_sgd_time(
        BUCKET, 4, NET, 0.1, bucket_bytes=BUCKET, gamma=1.1
    ) == pytest.approx(1.1 * 0.1 + comm_bucket)


def test_sync_sgd_time_uses_eqn_1_of_paper_002():
    """Eqn (1): T_comm(b, p, BW) = 2 α (p - 1) + 2 b (p - 1) / (p BW), for the ring."""
    p, b = 64, 25 * 2**20
    eqn_1 = 2 * NET.alpha * (p - 1) + 2 * b * (p - 1) / (p * NET.bandwidth)
    got = advise.sync_sgd_time(b, p, NET, 0.0, bucket_bytes=b, gamma=1.0)
    assert got == pytest.approx(eqn_1, rel=1e-6)  # bytes round up to whole float32 values


def test_compressed_time_matches_hand_computed_values():
    comm = cost.predict("allgather_topk", 3.5 * BUCKET, 4, NET, ratio=0.01)
    assert advise.compressed_time(
        "allgather_topk", 3.5 * BUCKET, 4, NET, 0.1, encode_decode_seconds=0.02, ratio=0.01
    ) == pytest.approx(0.1 + 0.02 + comm)
    # Overlapped: encoding slows the backward pass; the last bucket's message waits for it.
    per_bucket = cost.predict("allgather_topk", BUCKET, 4, NET, ratio=0.01)
    last = cost.predict("allgather_topk", 0.5 * BUCKET, 4, NET, ratio=0.01)
    got = advise.compressed_time(
        "allgather_topk",
        3.5 * BUCKET,
        4,
        NET,
        0.1,
        encode_decode_seconds=0.02,
        ratio=0.01,
        overlap=True,
        bucket_bytes=BUCKET,
        gamma=1.05,
    )
    assert got == pytest.approx(max(1.05 * 0.12, 3 * per_bucket) + last)


def test_powersgd_on_resnet50_stops_paying_near_9_gbit():
    """Paper 002 App. D (Fig. 19): for ResNet-50 on 64 GPUs, PowerSGD rank 4 is slower than
    synchronous SGD once the bandwidth exceeds about 9 Gbit/s."""

    def dense(bandwidth):
        return advise.sync_sgd_time(
            RESNET50_BYTES, 64, cost.Network(0.0, bandwidth), RESNET50_BACKWARD
        )

    def powersgd(bandwidth):
        # Two all-reduces (the P and Q factors), together 1/72 of the gradient.
        net = cost.Network(0.0, bandwidth)
        return (
            RESNET50_BACKWARD
            + 0.045
            + 2 * cost.predict("dense_ring", RESNET50_BYTES / 72 / 2, 64, net)
        )

    edge_gbit = advise.break_even_bandwidth(powersgd, dense) * 8 / 1e9
    assert 8.5 < edge_gbit < 10.5


def test_resnet50_needs_less_than_4x_at_10_gbit():
    """Paper 002 App. D (Fig. 18): at 10 Gbit/s common models need less than 4x compression."""
    needed = advise.required_compression(
        RESNET50_BYTES, 64, cost.Network.parse("0", "10gbit"), RESNET50_BACKWARD
    )
    assert 1.0 < needed < 4.0


@pytest.mark.parametrize("bandwidth", ["1gbit", "3gbit", "10gbit"])
@pytest.mark.parametrize("target", [0.8, 0.9])
def test_required_compression_is_the_smallest_ratio_that_reaches_the_target(bandwidth, target):
    net = cost.Network.parse("10us", bandwidth)
    needed = advise.required_compression(
        RESNET50_BYTES, 64, net, RESNET50_BACKWARD, target_efficiency=target
    )

    def efficiency(ratio):
        return RESNET50_BACKWARD / advise.sync_sgd_time(
            RESNET50_BYTES / ratio, 64, net, RESNET50_BACKWARD
        )

    assert efficiency(needed) >= target
    assert efficiency(needed / 1.001) < target
    # No smaller ratio on a fine grid reaches it either.
    assert not any(
        efficiency(needed * 0.999**i) >= target for i in range(1, 400) if needed * 0.999**i >= 1
    )


def test_required_compression_none_needed_and_unreachable():
    fast = cost.Network.parse("1us", "400gbit")
    assert advise.required_compression(RESNET50_BYTES, 8, fast, RESNET50_BACKWARD) == 1.0
    # A 10 ms latency makes a 64-worker ring slower than the backward pass, however small the
    # message.
    slow = cost.Network.parse("10ms", "10gbit")
    assert advise.required_compression(RESNET50_BYTES, 64, slow, RESNET50_BACKWARD) is None


def test_break_even_bandwidth():
    # 0.1 + 1e6/bw < 1e8/bw exactly when bw < 9.9e8.
    edge = advise.break_even_bandwidth(lambda bw: 0.1 + 1e6 / bw, lambda bw: 1e8 / bw)
    assert edge == pytest.approx(9.9e8, rel=1e-6)
    assert advise.break_even_bandwidth(lambda bw: 1.0, lambda bw: 0.5) is None
    assert math.isinf(advise.break_even_bandwidth(lambda bw: 0.5, lambda bw: 1.0))


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda: advise.sync_sgd_time(1e6, 4, NET, -1.0), ValueError, "backward_seconds"),
        (lambda: advise.sync_sgd_time(1e6, 4, NET, 0.1, gamma=0.9), ValueError, "gamma"),
        (
            lambda: advise.sync_sgd_time(1e6, 4, NET, 0.1, bucket_bytes=0),
            ValueError,
            "bucket_bytes",
        ),
        (
            lambda: advise.sync_sgd_time(1e6, 4, NET, 0.1, method="allgather_topk"),
            ValueError,
            "method",
        ),
        (lambda: advise.compressed_time("zfp_ring", 1e6, 4, NET, 0.1), ValueError, "rate"),
        (
            lambda: advise.compressed_time(
                "zfp_ring", 1e6, 4, NET, 0.1, rate=8, encode_decode_seconds="1"
            ),
            TypeError,
            "encode_decode_seconds",
        ),
        (
            lambda: advise.required_compression(1e6, 4, NET, 0.1, target_efficiency=1.0),
            ValueError,
            "target_efficiency",
        ),
        (lambda: advise.required_compression(1e6, 4, NET, 0.0), ValueError, "backward_seconds"),
    ],
)
def test_bad_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --- the command line ---------------------------------------------------------------------------

ISSUE_EXAMPLE = [
    "--params",
    "25.6e6",
    "--workers",
    "64",
    "--bandwidth",
    "10gbit",
    "--latency",
    "0.5ms",
    "--backward-ms",
    "120",
]


def test_main_prints_every_method_and_the_summaries(capsys):
    assert advise_cli.main(ISSUE_EXAMPLE) == 0
    out = capsys.readouterr().out
    for method in (
        "dense",
        "allgather_topk",
        "ar_topk",
        "ar_topk_tree",
        "randomk",
        "zfp",
        "zfp_recursive_doubling",
        "quantized",
        "sign",
        "sign_allreduce",
        "sign_ring",
    ):
        assert method in out
    assert "hierarchical_topk" not in out  # needs --inner-size
    assert "Compression needed for 90% of linear scaling" in out
    assert "Compression pays below" in out
    dense_line = next(line for line in out.splitlines() if line.split()[:2] == ["dense", "-"])
    expected = advise.sync_sgd_time(4 * 25.6e6, 64, cost.Network.parse("0.5ms", "10gbit"), 0.12)
    assert cost.format_duration(expected) in dense_line and "1.00x" in dense_line


def test_main_with_encode_decode_times_and_overlap_options(capsys):
    argv = ISSUE_EXAMPLE + [
        "--methods",
        "allgather_topk,ar_topk_tree",
        "--inner-size",
        "8",
        "--encode-decode-ms",
        "allgather_topk=100,ar_topk_tree=40",
        "--batch-overlap",
    ]
    assert advise_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "zfp" not in out and "upper bounds" not in out
    line = next(line for line in out.splitlines() if line.startswith("allgather_topk"))
    expected = advise.compressed_time(
        "allgather_topk",
        4 * 25.6e6,
        64,
        cost.Network.parse("0.5ms", "10gbit"),
        0.12,
        encode_decode_seconds=0.1,
        ratio=0.01,
        overlap=True,
    )
    assert cost.format_duration(expected) in line
    assert advise_cli.main(ISSUE_EXAMPLE + ["--no-overlap", "--encode-decode-ms", "5"]) == 0
    assert "after the backward pass" in capsys.readouterr().out


def test_main_measures_the_codecs_on_this_machine(capsys):
    argv = [
        "--params",
        "1e5",
        "--workers",
        "8",
        "--bandwidth",
        "1gbit",
        "--backward-ms",
        "10",
        "--measure-codec",
    ]
    assert advise_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "measured on this machine" in out and "upper bounds" not in out
    line = next(line for line in out.splitlines() if line.split()[:1] == ["zfp"])
    assert line.split()[5] != "0"  # the enc+dec column


def test_main_plots_speedup_against_bandwidth(tmp_path, capsys):
    path = tmp_path / "speedup.png"
    assert advise_cli.main(ISSUE_EXAMPLE + ["--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(path) in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra",
    [
        ["--bandwidth", "fast"],
        ["--latency", "-1ms"],
        ["--workers", "0"],
        ["--backward-ms", "0"],
        ["--ratio", "2"],
        ["--inner-size", "5"],
        ["--methods", "dense_ring"],
        ["--methods", "sign_sgd"],
        ["--encode-decode-ms", "lots"],
        ["--encode-decode-ms", "zfp_ring=1,bogus=2"],
        ["--gamma", "0.5"],
        ["--target-efficiency", "1.5"],
    ],
)
def test_main_rejects_bad_arguments(extra, capsys):
    with pytest.raises(SystemExit) as exit_info:
        advise_cli.main(ISSUE_EXAMPLE + extra)
    assert exit_info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_runs_as_a_module(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "jaxcomp.cli.advise", *ISSUE_EXAMPLE],
        env=subprocess_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("jaxcomp advise: 25.6M parameters")
