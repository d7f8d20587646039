"""Tests of jaxcomp.collectives: each collective against a numpy simulation of its algorithm."""

import math

import pytest

from jaxcomp import collectives
from jaxcomp.zfp import zfp_num_words


# ----------------------------------------------------------------------------------------------
# bytes_sent: the byte model, checked against the textbook cost of each algorithm's steps.

@pytest.mark.parametrize("n_devices", [1, 2, 6, 8])
@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_bytes_sent_matches_the_cost_of_each_step(n_devices, dtype_bytes):
    n, k, N = 1003, 17, n_devices
    ring = lambda m: 2 * (N - 1) / N * m  # noqa: E731
    tree = lambda m: 2 * math.ceil(math.log2(N)) * m  # noqa: E731
    d = dtype_bytes
    assert collectives.bytes_sent("psum", n, N, dtype_bytes=d) == ring(n * d)
    assert collectives.bytes_sent("psum", n, N, algorithm="tree", dtype_bytes=d) == tree(n * d)
    assert collectives.bytes_sent("allgather_topk", n, N, k=k, dtype_bytes=d) == (N - 1) * k * (d + 4)
    assert collectives.bytes_sent("ar_topk", n, N, k=k, dtype_bytes=d) == ring(4 * k) + ring(k * d)
    assert collectives.bytes_sent("ar_topk", n, N, k=k, algorithm="tree", leader="var", dtype_bytes=d) == (
        tree(4 * k) + tree(k * d) + (N - 1) * 4)
    chunk_words = zfp_num_words(math.ceil(n / N), 8)
    assert collectives.bytes_sent("zfp_allreduce", n, N, rate=8) == 2 * (N - 1) * chunk_words * 4
    p = 2 ** int(math.log2(N))
    rounds = int(math.log2(p)) + (p != N)
    assert collectives.bytes_sent("zfp_allreduce", n, N, rate=8, algorithm="recursive_doubling") == (
        rounds * zfp_num_words(n, 8) * 4)
    # 1003 values pad to one Hadamard block of 1024; 4 bits from up to 8 devices fit int8.
    assert collectives.bytes_sent("quantized_psum", n, N, bits=4) == ring(1024) + ring(4)
    assert collectives.bytes_sent("quantized_psum", n, N, bits=4, hadamard=False) == ring(1003) + ring(4)
    assert collectives.bytes_sent("quantized_psum", n, N, bits=8, algorithm="tree") == tree(1024 * 2) + tree(4)


@pytest.mark.parametrize("inner_size, n_devices", [(4, 8), (2, 8), (1, 4), (4, 4), (3, 6)])
def test_bytes_sent_hierarchical(inner_size, n_devices):
    n, k = 1003, 50
    inner, outer = inner_size, n_devices // inner_size
    shard, k_shard = math.ceil(n / inner), math.ceil(k / inner)
    expected = (inner - 1) * shard * 4 + (outer - 1) * k_shard * 8 + (inner - 1) * outer * k_shard * 8
    assert collectives.bytes_sent("hierarchical_topk", n, n_devices, k=k, inner_size=inner) == expected


def test_bytes_sent_ratio_is_rounded_k():
    for ratio in (0.001, 0.01, 0.5, 1.0):
        k = max(1, round(ratio * 2500))
        assert (collectives.bytes_sent("allgather_topk", 2500, 8, ratio=ratio)
                == collectives.bytes_sent("allgather_topk", 2500, 8, k=k))


def test_bytes_sent_compression_beats_dense_at_scale():
    n = 25_000_000
    dense = collectives.bytes_sent("psum", n, 8)
    assert collectives.bytes_sent("ar_topk", n, 8, ratio=0.01) < dense / 10
    assert collectives.bytes_sent("allgather_topk", n, 8, ratio=0.01) < dense / 2
    assert collectives.bytes_sent("zfp_allreduce", n, 8, rate=8) == pytest.approx(dense / 4, rel=1e-5)
    assert collectives.bytes_sent("quantized_psum", n, 8, bits=4) < dense / 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="nope", n=10, n_devices=2), "method"),
    (dict(method="psum", n=0, n_devices=2), "n must"),
    (dict(method="psum", n=10, n_devices=0), "n_devices"),
    (dict(method="psum", n=10, n_devices=2, algorithm="star"), "algorithm"),
    (dict(method="psum", n=10, n_devices=2, k=3), "k/ratio does not apply"),
    (dict(method="allgather_topk", n=10, n_devices=2), "exactly one of k and ratio"),
    (dict(method="allgather_topk", n=10, n_devices=2, k=3, ratio=0.1), "exactly one of k and ratio"),
    (dict(method="allgather_topk", n=10, n_devices=2, k=11), "k must"),
    (dict(method="allgather_topk", n=10, n_devices=2, k=0), "k must"),
    (dict(method="allgather_topk", n=10, n_devices=2, ratio=1.5), "ratio"),
    (dict(method="ar_topk", n=10, n_devices=2, k=3, leader="max"), "leader"),
    (dict(method="hierarchical_topk", n=10, n_devices=8, k=3), "inner_size"),
    (dict(method="hierarchical_topk", n=10, n_devices=8, k=3, inner_size=3), "inner_size"),
    (dict(method="zfp_allreduce", n=10, n_devices=2), "rate"),
    (dict(method="zfp_allreduce", n=10, n_devices=2, rate=33), "rate"),
    (dict(method="zfp_allreduce", n=10, n_devices=2, rate=8, algorithm="tree"), "algorithm"),
    (dict(method="quantized_psum", n=10, n_devices=2, bits=0), "bits"),
    (dict(method="quantized_psum", n=10, n_devices=2, bits=17), "bits"),
    (dict(method="quantized_psum", n=10, n_devices=2, rate=8, bits=4), "rate does not apply"),
    (dict(method="psum", n=10, n_devices=2, dtype_bytes=0), "dtype_bytes"),
])
def test_bytes_sent_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        collectives.bytes_sent(**kwargs)
