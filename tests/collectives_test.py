"""Tests of jaxcomp.collectives: each collective against a numpy simulation of its algorithm."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_equal, count_compilations, need_devices
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import collectives, methods
from jaxcomp.collectives import sizes
from jaxcomp.ops.hadamard import counter_signs, counter_uniform
from jaxcomp.ops.zfp import zfp_num_words

# ----------------------------------------------------------------------------------------------
# The byte model (each method's wire_bytes, in jaxcomp.methods), checked against the textbook cost
# of each algorithm's steps and against the bytes the collectives' jaxprs really move.

_NAMES = {"psum": "dense", "zfp_allreduce": "zfp", "quantized_psum": "quantized"}


def bytes_sent(method, n, n_devices, *, dtype_bytes=4, inner_size=None, **options):
    """The wire bytes of the method behind a collective, by the collective's name."""
    if method in ("psum", "ar_topk", "quantized_psum") and "algorithm" in options:
        options["allreduce"] = options.pop("algorithm")
    if method == "ar_topk":  # the collective's own default leader, the paper's STAR (TopK: SPLIT)
        options.setdefault("leader", "star")
    return methods.parse(_NAMES.get(method, method), **options).wire_bytes(
        n, n_devices, dtype_bytes=dtype_bytes, inner_size=inner_size
    )


@pytest.mark.parametrize("n_devices", [1, 2, 6, 8])
@pytest.mark.parametrize("dtype_bytes", [2, 4])
def test_bytes_sent_matches_the_cost_of_each_step(n_devices, dtype_bytes):
    n, k, N = 1003, 17, n_devices
    ring = lambda m: 2 * (N - 1) / N * m  # noqa: E731
    tree = lambda m: 2 * math.ceil(math.log2(N)) * m  # noqa: E731
    d = dtype_bytes
    assert bytes_sent("psum", n, N, dtype_bytes=d) == ring(n * d)
    assert bytes_sent("psum", n, N, algorithm="tree", dtype_bytes=d) == tree(n * d)
    assert bytes_sent("allgather_topk", n, N, k=k, dtype_bytes=d) == (N - 1) * k * (d + 4)
    assert bytes_sent("ar_topk", n, N, k=k, dtype_bytes=d) == ring(4 * k) + ring(k * d)
    assert bytes_sent("ar_topk", n, N, k=k, algorithm="tree", leader="var", dtype_bytes=d) == (
        tree(4 * k) + tree(k * d) + (N - 1) * 4
    )
    each = math.ceil(k / N)  # SPLIT: each device's indices all-gathered, then N * each values
    assert bytes_sent("ar_topk", n, N, k=k, leader="split", dtype_bytes=d) == (
        (N - 1) * each * 4 + ring(N * each * d)
    )
    chunk_words = zfp_num_words(math.ceil(n / N), 8)
    assert bytes_sent("zfp_allreduce", n, N, rate=8) == 2 * (N - 1) * chunk_words * 4
    p = 2 ** int(math.log2(N))
    rounds = int(math.log2(p)) + (p != N)
    assert bytes_sent("zfp_allreduce", n, N, rate=8, algorithm="recursive_doubling") == (
        rounds * zfp_num_words(n, 8) * 4
    )

    # 1003 values pad to one Hadamard block of 1024. Codes travel packed in uint32 words, in
    # fields wide enough for the sum of N codes: 4 bits + log2(N) headroom.
    def words(length, bits):
        width = (N * (2**bits - 1)).bit_length()
        return math.ceil(length / (32 // width)) * 4

    assert bytes_sent("quantized_psum", n, N, bits=4) == ring(words(1024, 4)) + ring(4)
    assert bytes_sent("quantized_psum", n, N, bits=4, hadamard=False) == ring(
        words(1003, 4)
    ) + ring(4)
    assert bytes_sent("quantized_psum", n, N, bits=8, algorithm="tree") == tree(
        words(1024, 8)
    ) + tree(4)
    if N == 8:  # 4-bit codes from 8 devices: 7-bit fields, 4 to a word, 1 byte a value
        assert bytes_sent("quantized_psum", n, N, bits=4) == ring(1024) + ring(4)
        # 2-bit codes: 5-bit fields, 6 to a word (the sum of 8 codes of 3 needs 5 bits)
        assert bytes_sent("quantized_psum", n, N, bits=2) == ring(math.ceil(1024 / 6) * 4) + ring(4)


@pytest.mark.parametrize("inner_size, n_devices", [(4, 8), (2, 8), (1, 4), (4, 4), (3, 6)])
def test_bytes_sent_hierarchical(inner_size, n_devices):
    n, k = 1003, 50
    inner, outer = inner_size, n_devices // inner_size
    shard, k_shard = math.ceil(n / inner), math.ceil(k / inner)
    expected = (
        (inner - 1) * shard * 4 + (outer - 1) * k_shard * 8 + (inner - 1) * outer * k_shard * 8
    )
    assert bytes_sent("hierarchical_topk", n, n_devices, k=k, inner_size=inner) == expected


def test_bytes_sent_ratio_is_rounded_k():
    for ratio in (0.001, 0.01, 0.5, 1.0):
        k = max(1, round(ratio * 2500))
        assert bytes_sent("allgather_topk", 2500, 8, ratio=ratio) == bytes_sent(
            "allgather_topk", 2500, 8, k=k
        )


def test_bytes_sent_compression_beats_dense_at_scale():
    n = 25_000_000
    dense = bytes_sent("psum", n, 8)
    assert bytes_sent("ar_topk", n, 8, ratio=0.01) < dense / 10
    assert bytes_sent("allgather_topk", n, 8, ratio=0.01) < dense / 2
    assert bytes_sent("zfp_allreduce", n, 8, rate=8) == pytest.approx(dense / 4, rel=1e-5)
    assert bytes_sent("quantized_psum", n, 8, bits=4) < dense / 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(method="nope", n=10, n_devices=2), "method"),
        (dict(method="psum", n=0, n_devices=2), "n must"),
        (dict(method="psum", n=10, n_devices=0), "n_devices"),
        (dict(method="psum", n=10, n_devices=2, algorithm="star"), "allreduce"),
        (dict(method="psum", n=10, n_devices=2, k=3), "remove k="),
        (dict(method="allgather_topk", n=10, n_devices=2), "exactly one of ratio"),
        (dict(method="allgather_topk", n=10, n_devices=2, k=3, ratio=0.1), "exactly one of ratio"),
        (dict(method="allgather_topk", n=10, n_devices=2, k=11), "k=11 exceeds"),
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
        (dict(method="quantized_psum", n=10, n_devices=2, rate=8, bits=4), "remove rate="),
        (dict(method="psum", n=10, n_devices=2, dtype_bytes=0), "dtype_bytes"),
    ],
)
def test_bytes_sent_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        bytes_sent(**kwargs)


# ----------------------------------------------------------------------------------------------
# Running a collective on a mesh, and numpy simulations of each algorithm.

AXIS = "data"


def mesh_1d(n_devices):
    need_devices(n_devices)
    return Mesh(np.array(jax.devices()[:n_devices]), (AXIS,))


def mesh_2d(outer, inner):
    need_devices(outer * inner)
    return Mesh(np.array(jax.devices()[: outer * inner]).reshape(outer, inner), ("node", "gpu"))


def sharded(mesh, fn, n_args=0, axes=AXIS):
    """jit(shard_map(fn)) over rows of a [devices, n] array; returns every device's (total,
    sent)."""
    spec = P(axes)
    mapped = jax.shard_map(
        fn, mesh=mesh, in_specs=(spec,) + (P(),) * n_args, out_specs=(spec, spec), check_vma=True
    )
    compiled = jax.jit(mapped)

    def call(X, *args):
        total, sent = compiled(jnp.asarray(X).reshape(-1), *args)
        shape = X.shape
        return tuple(np.asarray(a.astype(jnp.float32)).reshape(shape) for a in (total, sent))

    return call


def gradients(n_devices, n, dtype, seed=0):
    """One row per device. Half-precision rows hold small integers, so every sum of them is exact in
    any order and the simulation can be compared bit for bit whatever order XLA adds in."""
    rng = np.random.default_rng(seed)
    if jnp.dtype(dtype) == jnp.float32:
        rows = rng.standard_normal((n_devices, n)) * rng.uniform(0.5, 2.0, (n_devices, 1))
    else:
        rows = rng.integers(-12, 13, (n_devices, n))
    return np.asarray(rows, np.float32).astype(jnp.dtype(dtype))


def assert_replicas_identical(total):
    bits = np.ascontiguousarray(total).view(np.uint32)
    np.testing.assert_array_equal(bits, np.broadcast_to(bits[0], bits.shape))


def assert_bits_equal(actual, expected, dtype):
    """Bit-for-bit equality after rounding the float32 simulation to the collective's dtype."""
    expected = np.asarray(np.asarray(expected, np.float32).astype(jnp.dtype(dtype)), np.float32)
    np.testing.assert_array_equal(np.asarray(actual, np.float32), expected)


def np_topk(row, k):
    """Indices of the k largest magnitudes, ties to the lower index, in ascending order."""
    return np.sort(np.argsort(-np.abs(row), kind="stable")[:k])


def selection(selector):
    if selector == "exact":
        return np_topk
    return lambda row, k: np.asarray(jaxcomp.threshold_topk(jnp.asarray(row), k)[1])


def wire_sum(rows):
    """Sum over devices in device order, float32 (XLA's CPU all-reduce order)."""
    total = np.zeros(rows.shape[1:], np.float32)
    for row in rows:
        total = total + row
    return total


def sim_allgather_topk(X, k, select):
    Xf = X.astype(np.float32)
    total, sent = np.zeros(Xf.shape[1], np.float32), np.zeros_like(Xf)
    for d, row in enumerate(Xf):
        idx = select(row, k)
        total[idx] += row[idx]
        sent[d, idx] = row[idx]
    return total, sent


def sim_ar_topk(X, k, leader, step, select):
    Xf = X.astype(np.float32)
    if leader == "split":  # every device's top ceil(k / N), each index once
        each = min(-(-k // len(Xf)), Xf.shape[1])
        idx = np.unique(np.concatenate([select(row, each) for row in Xf]))
    elif leader == "star":
        idx = select(Xf[step % len(Xf)], k)
    else:
        norms = [np.sum(np.square(row[select(row, k)])) for row in Xf]
        idx = select(Xf[int(np.argmax(norms))], k)
    total, sent = np.zeros(Xf.shape[1], np.float32), np.zeros_like(Xf)
    total[idx] = wire_sum(Xf[:, idx])
    sent[:, idx] = Xf[:, idx]
    return total, sent


def sim_hierarchical(X, k, outer, inner, select):
    """X rows in mesh order: device (node o, gpu i) is row o * inner + i."""
    Xf = X.astype(np.float32)
    n = Xf.shape[1]
    shard, k_shard = -(-n // inner), -(-k // inner)
    total, sent = np.zeros(inner * shard, np.float32), np.zeros_like(Xf)
    for node in range(outer):
        rows = np.pad(Xf[node * inner : (node + 1) * inner], ((0, 0), (0, inner * shard - n)))
        node_sum = wire_sum(rows)
        chosen = np.concatenate(
            [
                select(node_sum[j * shard : (j + 1) * shard], k_shard) + j * shard
                for j in range(inner)
            ]
        )
        total[chosen] += node_sum[chosen]
        real = chosen[chosen < n]
        sent[node * inner : (node + 1) * inner, real] = Xf[node * inner : (node + 1) * inner, real]
    return total[:n], sent


def codec(rate):
    def encode(v):
        return np.asarray(jaxcomp.zfp_encode(jnp.asarray(v, jnp.float32), rate))

    def decode(words, n):
        return np.asarray(jaxcomp.zfp_decode(jnp.asarray(words), n, rate))

    return encode, decode


def sim_zfp_ring(X, rate):
    """Also returns a bound on |total - exact sum|: the codec errors met along the way, summed."""
    encode, decode = codec(rate)
    Xf = X.astype(np.float32)
    N, n = Xf.shape
    chunk = -(-n // N)
    chunks = np.pad(Xf, ((0, 0), (0, N * chunk - n))).reshape(N, N, chunk)
    partials = [chunks[d, d] for d in range(N)]
    bound = np.zeros(chunk, np.float32)
    sent = chunks.copy()  # less each error device d makes on chunk c
    for hop in range(N - 1):
        words = [encode(p) for p in partials]
        bound += np.max([np.abs(decode(w, chunk) - p) for w, p in zip(words, partials)], axis=0)
        for d in range(N):
            sent[d, (d - hop) % N] -= partials[d] - decode(words[d], chunk)
        partials = [
            decode(words[(d - 1) % N], chunk) + chunks[d, (d - hop - 1) % N] for d in range(N)
        ]
    owned = [encode(p) for p in partials]  # device d owns chunk (d + 1) % N
    total = np.concatenate([decode(owned[(j - 1) % N], chunk) for j in range(N)])[:n]
    bound += np.max([np.abs(decode(w, chunk) - p) for w, p in zip(owned, partials)], axis=0)
    for d in range(N):
        sent[d, (d + 1) % N] -= partials[d] - decode(owned[d], chunk)
    return total, sent.reshape(N, -1)[:, :n], np.tile(bound, N)[:n]


def sim_zfp_recursive_doubling(X, rate):
    encode, decode = codec(rate)
    Xf = X.astype(np.float32)
    N, n = Xf.shape
    p = 1 << (N.bit_length() - 1)
    extra = N - p
    device = [2 * r + 1 if r < extra else r + extra for r in range(p)]
    partial = {d: Xf[d] for d in range(N)}
    error = {d: np.zeros(n, np.float32) for d in range(N)}  # a bound on |partial - exact partial|
    for i in range(extra):
        words = encode(Xf[2 * i])
        partial[2 * i + 1] = Xf[2 * i + 1] + decode(words, n)
        error[2 * i + 1] = np.abs(decode(words, n) - Xf[2 * i])
    distance = 1
    while distance < p:
        words = {d: encode(partial[d]) for d in device}
        lost = {d: error[d] + np.abs(decode(words[d], n) - partial[d]) for d in device}
        partner = {device[r]: device[r ^ distance] for r in range(p)}
        partial = {d: decode(words[d], n) + decode(words[partner[d]], n) for d in device}
        error = {d: lost[d] + lost[partner[d]] for d in device}
        distance *= 2
    total, error = partial[device[0]], error[device[0]]
    if extra:
        words = encode(total)
        error = error + np.abs(decode(words, n) - total)
        total = decode(words, n)
    sent = np.stack([decode(encode(row), n) for row in Xf])
    return total, sent, error


# ----------------------------------------------------------------------------------------------
# Each collective against its simulation: every device gets the same bits.


@pytest.mark.parametrize(
    "dtype, n_devices, n",
    [(jnp.float32, 8, 1003), (jnp.bfloat16, 8, 1003), (jnp.float16, 6, 5), (jnp.float32, 1, 7)],
)
def test_psum(dtype, n_devices, n):
    X = gradients(n_devices, n, dtype)
    total, sent = sharded(mesh_1d(n_devices), lambda x: collectives.psum(x, AXIS))(X)
    assert_replicas_identical(total)
    assert_bits_equal(total[0], wire_sum(X.astype(np.float32)), dtype)
    assert_bits_equal(sent, X.astype(np.float32), dtype)


@pytest.mark.parametrize(
    "dtype, n_devices, n, k, selector",
    [
        (jnp.float32, 8, 1003, 37, "exact"),
        (jnp.float32, 8, 1003, 37, "threshold"),
        (jnp.bfloat16, 6, 50, 50, "exact"),  # k = n
        (jnp.float16, 8, 3, 1, "threshold"),
        (jnp.bfloat16, 1, 9, 4, "exact"),  # an axis of one device
    ],
)
def test_allgather_topk(dtype, n_devices, n, k, selector):
    X = gradients(n_devices, n, dtype)
    total, sent = sharded(
        mesh_1d(n_devices), lambda x: collectives.allgather_topk(x, k, AXIS, selector)
    )(X)
    expected_total, expected_sent = sim_allgather_topk(X, k, selection(selector))
    assert_replicas_identical(total)
    assert_bits_equal(total[0], expected_total, dtype)
    assert_bits_equal(sent, expected_sent, dtype)


@pytest.mark.parametrize(
    "dtype, n_devices, n, k, leader",
    [
        (jnp.float32, 8, 1003, 37, "star"),
        (jnp.float32, 8, 1003, 37, "var"),
        (jnp.bfloat16, 6, 50, 50, "star"),
        (jnp.float16, 6, 7, 3, "var"),
        (jnp.float32, 1, 9, 4, "star"),
        (jnp.bfloat16, 1, 9, 4, "var"),
        (jnp.float32, 8, 1003, 37, "split"),
        (jnp.bfloat16, 6, 50, 50, "split"),
        (jnp.float16, 3, 7, 3, "split"),
        (jnp.float32, 1, 9, 4, "split"),
    ],
)
def test_ar_topk(dtype, n_devices, n, k, leader):
    X = gradients(n_devices, n, dtype)
    call = sharded(
        mesh_1d(n_devices), lambda x, s: collectives.ar_topk(x, k, AXIS, leader, step=s), 1
    )
    for step in (0, 3, n_devices + 1):
        total, sent = call(X, jnp.int32(step))
        expected_total, expected_sent = sim_ar_topk(X, k, leader, step, np_topk)
        assert_replicas_identical(total)
        assert_bits_equal(total[0], expected_total, dtype)
        assert_bits_equal(sent, expected_sent, dtype)


@pytest.mark.parametrize("broadcast", ["psum", "all_gather"])
def test_ar_topk_threshold_selector_and_both_broadcasts(broadcast):
    X = gradients(8, 500, jnp.float32)
    call = sharded(
        mesh_1d(8),
        lambda x, s: collectives.ar_topk(
            x, 20, AXIS, "var", step=s, selector="threshold", _broadcast=broadcast
        ),
        1,
    )
    total, sent = call(X, jnp.int32(0))
    expected_total, expected_sent = sim_ar_topk(X, 20, "var", 0, selection("threshold"))
    assert_replicas_identical(total)
    assert_bits_equal(total[0], expected_total, jnp.float32)
    assert_bits_equal(sent, expected_sent, jnp.float32)


@pytest.mark.parametrize(
    "dtype, outer, inner, n, k",
    [
        (jnp.float32, 2, 4, 1003, 40),  # shards of 251, k_shard 10
        (jnp.bfloat16, 2, 4, 1003, 40),
        (jnp.float32, 2, 4, 10, 10),  # k larger than a shard (3): every real entry is kept
        (jnp.float16, 4, 2, 7, 3),
        (jnp.float32, 1, 4, 9, 5),  # one node
        (jnp.bfloat16, 4, 1, 9, 5),  # one device per node
    ],
)
def test_hierarchical_topk(dtype, outer, inner, n, k):
    X = gradients(outer * inner, n, dtype)
    call = sharded(
        mesh_2d(outer, inner),
        lambda x: collectives.hierarchical_topk(x, k, "gpu", "node"),
        axes=("node", "gpu"),
    )
    total, sent = call(X)
    expected_total, expected_sent = sim_hierarchical(X, k, outer, inner, np_topk)
    assert_replicas_identical(total)
    assert_bits_equal(total[0], expected_total, dtype)
    assert_bits_equal(sent, expected_sent, dtype)
    # Error feedback stays exact: the devices' sent sum to the total.
    np.testing.assert_allclose(wire_sum(sent), total[0], rtol=1e-6, atol=1e-6)


def test_hierarchical_topk_threshold_selector():
    X = gradients(8, 300, jnp.float32)
    call = sharded(
        mesh_2d(2, 4),
        lambda x: collectives.hierarchical_topk(x, 30, "gpu", "node", "threshold"),
        axes=("node", "gpu"),
    )
    total, sent = call(X)
    expected_total, expected_sent = sim_hierarchical(X, 30, 2, 4, selection("threshold"))
    assert_bits_equal(total[0], expected_total, jnp.float32)
    assert_bits_equal(sent, expected_sent, jnp.float32)


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
@pytest.mark.parametrize(
    "dtype, n_devices, n, rate",
    [
        (jnp.float32, 8, 1003, 12),
        (jnp.float32, 6, 101, 8),  # not a power of two: recursive doubling folds two devices
        (jnp.bfloat16, 6, 5, 2),  # fewer values than devices; rate 2 has a header word
        (jnp.float16, 3, 64, 32),
        (jnp.float32, 2, 6, 1),
    ],
)
def test_zfp_allreduce(dtype, algorithm, n_devices, n, rate):
    X = gradients(n_devices, n, dtype)
    call = sharded(
        mesh_1d(n_devices), lambda x: collectives.zfp_allreduce(x, rate, AXIS, algorithm)
    )
    total, sent = call(X)
    simulate = sim_zfp_ring if algorithm == "ring" else sim_zfp_recursive_doubling
    expected_total, expected_sent, bound = simulate(X, rate)
    assert_replicas_identical(total)
    assert_bits_equal(total[0], expected_total, dtype)
    assert_bits_equal(sent, expected_sent, dtype)
    if algorithm == "ring" and dtype == jnp.float32:
        # Every error the ring made is some device's: the sents add up to the total.
        np.testing.assert_allclose(
            sent.astype(np.float64).sum(0), total[0], rtol=1e-5, atol=1e-5 * np.abs(X).sum(0).max()
        )
    # Within the codec's error of the exact sum (plus float32 and output rounding).
    exact = X.astype(np.float64).sum(0)
    slack = 1e-5 * np.abs(X.astype(np.float64)).sum(0) + np.abs(exact) * float(jnp.finfo(dtype).eps)
    assert np.all(np.abs(total[0] - exact) <= bound * 1.001 + slack)


def test_zfp_allreduce_one_device_sends_nothing():
    X = gradients(1, 10, jnp.float32)
    for algorithm in collectives.ZFP_ALGORITHMS:
        total, sent = sharded(
            mesh_1d(1), lambda x: collectives.zfp_allreduce(x, 4, AXIS, algorithm)
        )(X)
        np.testing.assert_array_equal(total, X)
        np.testing.assert_array_equal(sent, X)


# ----------------------------------------------------------------------------------------------
# quantized_psum: unbiased, on the agreed grid, and the devices' sent add up to the total.


def quantized_means(mesh, X, bits, keys, hadamard):
    """Mean and all totals of quantized_psum over many keys, in one compiled call."""

    def many(x, keys):
        totals = jax.lax.map(
            lambda key: collectives.quantized_psum(x, bits, AXIS, key, hadamard)[0], keys
        )
        return totals, totals

    f = jax.jit(jax.shard_map(many, mesh=mesh, in_specs=(P(AXIS), P()), out_specs=(P(), P(AXIS))))
    totals, per_device = f(jnp.asarray(X).reshape(-1), keys)
    return np.asarray(totals, np.float32), np.asarray(per_device, np.float32)


@pytest.mark.parametrize(
    "hadamard, n_devices, n, bits", [(True, 8, 100, 4), (False, 6, 37, 2), (True, 6, 5, 1)]
)
def test_quantized_psum_is_unbiased(hadamard, n_devices, n, bits):
    X = gradients(n_devices, n, jnp.float32, seed=n)
    draws = 400
    keys = jax.random.split(jax.random.key(7), draws)
    totals, per_device = quantized_means(mesh_1d(n_devices), X, bits, keys, hadamard)
    exact = X.astype(np.float64).sum(0)
    # Each code's error is below one grid step 2R/(2**bits - 1), zero-mean and independent across
    # devices; an orthonormal transform keeps the variance. R is at most the largest norm (or
    # entry).
    bound = np.max(np.linalg.norm(X, axis=1)) if hadamard else np.abs(X).max()
    step = 2 * bound / (2**bits - 1)
    sigma = np.sqrt(n_devices) * step / 2
    np.testing.assert_array_less(np.abs(totals.mean(0) - exact), 5 * sigma / np.sqrt(draws) + 1e-5)
    assert np.abs(totals - exact).max() > 0  # it does quantize
    assert_replicas_identical(per_device.reshape(n_devices, draws * n))  # stacked device by device


def sim_quantized(X, bits, key, hadamard):
    """numpy THC with the same random draws; float32 like the collective."""
    N, n = X.shape
    Xf = X.astype(np.float32)
    sign_key, noise_key = jax.random.split(key)
    length, block = n, n
    if hadamard:
        block = min(1 << (n - 1).bit_length(), sizes.MAX_HADAMARD_BLOCK)
        length = -(-n // block) * block
    H = np.ones((1, 1), np.float32)
    while H.shape[0] < block:
        H = np.block([[H, H], [H, -H]])
    H = H / np.float32(np.sqrt(block))
    signs = np.asarray(counter_signs(sign_key, (length // block, block)))

    def forward(v):
        return (
            ((np.pad(v, (0, length - n)).reshape(-1, block) * signs) @ H).reshape(-1)
            if hadamard
            else v
        )

    def inverse(v):
        return ((v.reshape(-1, block) @ H) * signs).reshape(-1)[:n] if hadamard else v

    rotated = np.stack([forward(row) for row in Xf])
    bound = np.abs(rotated).max()
    levels = 2**bits - 1
    noise = np.stack(
        [np.asarray(counter_uniform(jax.random.fold_in(noise_key, d), (length,))) for d in range(N)]
    )
    codes = np.clip(np.floor((rotated / bound + 1) * (levels / 2) + noise), 0, levels)
    step = bound * 2 / levels
    total = inverse(codes.sum(0) * step - N * bound)
    sent = np.stack([inverse(c * step - bound) for c in codes])
    return total, sent, step


@pytest.mark.parametrize(
    "dtype, hadamard, n_devices, n, bits",
    [
        (jnp.float32, True, 8, 1003, 8),
        (jnp.float32, False, 8, 1003, 8),
        (jnp.bfloat16, True, 6, 20, 3),
        (jnp.float16, False, 6, 20, 3),
        (jnp.float32, True, 8, 4, 16),
        # int4 and int2 (Quantized(bits=4), Quantized(bits=2)): the codes exactly, not only their
        # mean (test_quantized_psum_is_unbiased).
        (jnp.float32, True, 8, 1003, 4),
        (jnp.float32, False, 8, 1003, 2),
        (jnp.bfloat16, False, 3, 37, 2),
    ],
)
def test_quantized_psum_matches_simulation(dtype, hadamard, n_devices, n, bits):
    X = gradients(n_devices, n, dtype)
    key = jax.random.key(3)
    call = sharded(
        mesh_1d(n_devices),
        lambda x, key: collectives.quantized_psum(x, bits, AXIS, key, hadamard),
        1,
    )
    total, sent = call(X, key)
    expected_total, expected_sent, step = sim_quantized(X, bits, key, hadamard)
    assert_replicas_identical(total)
    # Values differ by float32 rounding -- dequantizing cancels about N R, and the transforms add in
    # another order -- and by the final rounding to dtype. Rarely a code sits within rounding of a
    # level and goes the other way: one grid step on one entry, or spread over a Hadamard block.
    eps = float(jnp.finfo(dtype).eps)
    slack = (
        1e-2 * step + 16 * float(jnp.finfo(jnp.float32).eps) * n_devices * step * (2**bits - 1) / 2
    )
    block = min(1 << (n - 1).bit_length(), sizes.MAX_HADAMARD_BLOCK)
    flip = 2 * step / np.sqrt(block) if hadamard else step
    for actual, expected in ((total[0], expected_total), (sent, expected_sent)):
        off = np.abs(actual - expected) - eps * np.abs(expected) - slack
        assert np.all(off <= flip * 1.001)
        if not hadamard:
            assert np.mean(off > 0) <= 1e-3
    # The devices' sent add up to the total: error feedback is exact.
    assert np.all(
        np.abs(wire_sum(sent) - total[0]) <= eps * (np.abs(sent).sum(0) + np.abs(total[0])) + slack
    )


def test_quantized_psum_zero_input_and_one_device():
    zeros = np.zeros((8, 9), np.float32)
    key = jax.random.key(0)
    total, sent = sharded(mesh_1d(8), lambda x, k: collectives.quantized_psum(x, 4, AXIS, k), 1)(
        zeros, key
    )
    np.testing.assert_array_equal(total, zeros)
    X = gradients(1, 9, jnp.float32)
    total, sent = sharded(mesh_1d(1), lambda x, k: collectives.quantized_psum(x, 4, AXIS, k), 1)(
        X, key
    )
    np.testing.assert_array_equal(total, X)
    np.testing.assert_array_equal(sent, X)


@pytest.mark.parametrize("method", ["allgather_topk", "ar_topk", "zfp_allreduce", "quantized_psum"])
def test_same_result_without_vma_checks(method):
    """shard_map(check_vma=False) (no varying/invariant typing) computes the same bits."""
    fn = {
        "allgather_topk": lambda x, s, key: collectives.allgather_topk(x, 5, AXIS),
        "ar_topk": lambda x, s, key: collectives.ar_topk(x, 5, AXIS, "var"),
        "zfp_allreduce": lambda x, s, key: collectives.zfp_allreduce(
            x, 8, AXIS, "recursive_doubling"
        ),
        "quantized_psum": lambda x, s, key: collectives.quantized_psum(x, 4, AXIS, key),
    }[method]
    mesh = mesh_1d(6)
    x = jnp.asarray(gradients(6, 40, jnp.float32)).reshape(-1)
    results = [
        jax.jit(
            jax.shard_map(
                fn,
                mesh=mesh,
                in_specs=(P(AXIS), P(), P()),
                out_specs=(P(AXIS), P(AXIS)),
                check_vma=check,
            )
        )(x, jnp.int32(2), jax.random.key(5))
        for check in (True, False)
    ]
    assert_trees_equal(*results)


# ----------------------------------------------------------------------------------------------
# One compilation for every step and key.


def test_new_step_or_key_does_not_recompile():
    X = jnp.asarray(gradients(8, 64, jnp.float32)).reshape(-1)
    mesh = mesh_1d(8)

    def step_fn(x, step, key):
        a, _ = collectives.ar_topk(x, 5, AXIS, "star", step=step)
        b, _ = collectives.quantized_psum(x, 4, AXIS, key)
        return a + b

    f = jax.jit(jax.shard_map(step_fn, mesh=mesh, in_specs=(P(AXIS), P(), P()), out_specs=P()))
    first = f(X, jnp.int32(0), jax.random.key(0))
    with count_compilations() as compiled:
        second = f(X, jnp.int32(1), jax.random.key(1))
        second.block_until_ready()
    assert compiled[0] == 0
    assert not np.array_equal(np.asarray(first), np.asarray(second))


# ----------------------------------------------------------------------------------------------
# bytes_sent agrees with what the implementation puts on the wire, read off its jaxpr.


def _sub_jaxprs(params):
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            item = getattr(item, "jaxpr", item)  # ClosedJaxpr -> Jaxpr
            if hasattr(item, "eqns"):
                yield item


def _collective_bytes(jaxpr, axis_sizes):
    """Per-device bytes of every collective in a jaxpr (nested ones included), by the textbook
    cost of each: (bytes every device sends, {device: bytes it sends point-to-point})."""
    uniform, p2p = 0.0, {}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        axes = eqn.params.get("axes", eqn.params.get("axis_name"))
        axes = axes if isinstance(axes, (tuple, list)) else (axes,)
        size = int(np.prod([axis_sizes[a] for a in axes if a in axis_sizes]))
        message = sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars)
        if name.startswith(("psum", "pmax")) and name not in ("psum_scatter",):
            uniform += 2 * (size - 1) / size * message
        elif name.startswith("all_gather"):
            uniform += (size - 1) * message
        elif name in ("reduce_scatter", "psum_scatter"):
            uniform += (size - 1) / size * message
        elif name == "ppermute":
            for source, _ in eqn.params["perm"]:
                p2p[source] = p2p.get(source, 0) + message
        for sub in _sub_jaxprs(eqn.params):
            more_uniform, more_p2p = _collective_bytes(sub, axis_sizes)
            uniform += more_uniform
            for device, sent in more_p2p.items():
                p2p[device] = p2p.get(device, 0) + sent
    return uniform, p2p


CASES = [
    ("psum", lambda x: collectives.psum(x, AXIS), {}),
    ("allgather_topk", lambda x: collectives.allgather_topk(x, 7, AXIS), dict(k=7)),
    ("ar_topk", lambda x: collectives.ar_topk(x, 7, AXIS, "star"), dict(k=7)),
    ("ar_topk", lambda x: collectives.ar_topk(x, 7, AXIS, "var"), dict(k=7, leader="var")),
    ("ar_topk", lambda x: collectives.ar_topk(x, 7, AXIS, "split"), dict(k=7, leader="split")),
    ("zfp_allreduce", lambda x: collectives.zfp_allreduce(x, 8, AXIS), dict(rate=8)),
    (
        "zfp_allreduce",
        lambda x: collectives.zfp_allreduce(x, 8, AXIS, "recursive_doubling"),
        dict(rate=8, algorithm="recursive_doubling"),
    ),
    (
        "quantized_psum",
        lambda x: collectives.quantized_psum(x, 4, AXIS, jax.random.key(0)),
        dict(bits=4),
    ),
    (
        "quantized_psum",
        lambda x: collectives.quantized_psum(x, 12, AXIS, jax.random.key(0), False),
        dict(bits=12, hadamard=False),
    ),
]


@pytest.mark.parametrize("n_devices", [8, 6])
@pytest.mark.parametrize(
    "method, fn, params", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_bytes_sent_agrees_with_the_implementation(n_devices, method, fn, params):
    n, dtype = 1003, jnp.bfloat16
    mesh = mesh_1d(n_devices)
    traced = jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=P(AXIS), out_specs=(P(AXIS), P(AXIS)))
    ).trace(jnp.zeros(n * n_devices, dtype))
    uniform, p2p = _collective_bytes(traced.jaxpr.jaxpr, {AXIS: n_devices})
    measured = uniform + max(p2p.values(), default=0)
    assert measured == pytest.approx(bytes_sent(method, n, n_devices, dtype_bytes=2, **params))


def test_bytes_sent_agrees_with_hierarchical_implementation():
    n, k = 1003, 40
    mesh = mesh_2d(2, 4)
    fn = lambda x: collectives.hierarchical_topk(x, k, "gpu", "node")  # noqa: E731
    traced = jax.jit(
        jax.shard_map(
            fn, mesh=mesh, in_specs=P(("node", "gpu")), out_specs=(P(("node", "gpu")),) * 2
        )
    ).trace(jnp.zeros(n * 8))
    uniform, p2p = _collective_bytes(traced.jaxpr.jaxpr, {"node": 2, "gpu": 4})
    assert not p2p
    assert uniform == pytest.approx(bytes_sent("hierarchical_topk", n, 8, k=k, inner_size=4))


# ----------------------------------------------------------------------------------------------
# Bad input: errors that name the argument, raised while tracing.


def trace(fn, mesh=None, n=10, dtype=jnp.float32):
    mesh = mesh or mesh_1d(2)
    jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))).trace(
        jnp.zeros(n * mesh.size, dtype)
    )


KEY = jax.random.key(0)


@pytest.mark.parametrize(
    "fn, error, message",
    [
        (lambda x: collectives.psum(x, "model"), ValueError, "axis_name='model'"),
        (lambda x: collectives.allgather_topk(x, 3, "model"), ValueError, "axis_name='model'"),
        (lambda x: collectives.ar_topk(x, 3, "model"), ValueError, "axis_name='model'"),
        (lambda x: collectives.zfp_allreduce(x, 8, "model"), ValueError, "axis_name='model'"),
        (lambda x: collectives.quantized_psum(x, 4, "model", KEY), ValueError, "axis_name='model'"),
        (
            lambda x: collectives.hierarchical_topk(x, 3, "gpu", AXIS),
            ValueError,
            "inner_axis='gpu'",
        ),
        (
            lambda x: collectives.hierarchical_topk(x, 3, AXIS, "node"),
            ValueError,
            "outer_axis='node'",
        ),
        (
            lambda x: collectives.hierarchical_topk(x, 3, AXIS, AXIS),
            ValueError,
            "must be different",
        ),
        (lambda x: collectives.allgather_topk(x, 0, AXIS), ValueError, "k must be"),
        (lambda x: collectives.allgather_topk(x, 11, AXIS), ValueError, "k must be"),
        (lambda x: collectives.ar_topk(x, -1, AXIS), ValueError, "k must be"),
        (lambda x: collectives.ar_topk(x, 11, AXIS), ValueError, "k must be"),
        (lambda x: collectives.hierarchical_topk(x, 0, AXIS, AXIS), ValueError, "k must be"),
        (lambda x: collectives.allgather_topk(x, 2.5, AXIS), TypeError, "k must be"),
        (lambda x: collectives.allgather_topk(x, 3, AXIS, "sort"), ValueError, "selector"),
        (lambda x: collectives.ar_topk(x, 3, AXIS, leader="max"), ValueError, "leader"),
        (lambda x: collectives.ar_topk(x, 3, AXIS, step=1.5), TypeError, "step"),
        (lambda x: collectives.zfp_allreduce(x, 0, AXIS), ValueError, "rate"),
        (lambda x: collectives.zfp_allreduce(x, 33, AXIS), ValueError, "rate"),
        (lambda x: collectives.zfp_allreduce(x, 8, AXIS, "tree"), ValueError, "algorithm"),
        (lambda x: collectives.quantized_psum(x, 0, AXIS, KEY), ValueError, "bits"),
        (lambda x: collectives.quantized_psum(x, 17, AXIS, KEY), ValueError, "bits"),
        (lambda x: collectives.quantized_psum(x, 4, AXIS, 3), TypeError, "key"),
        (
            lambda x: collectives.quantized_psum(x, 4, AXIS, KEY, hadamard="yes"),
            TypeError,
            "hadamard",
        ),
        (
            lambda x: collectives.quantized_psum(
                x, 4, AXIS, jax.random.fold_in(KEY, jax.lax.axis_index(AXIS))
            ),
            ValueError,
            "same on every device",
        ),
        (lambda x: collectives.psum(x.reshape(2, 5), AXIS), ValueError, "1-D"),
        (lambda x: collectives.psum(x.astype(jnp.int32), AXIS), TypeError, "x must be"),
    ],
)
def test_bad_input(fn, error, message):
    with pytest.raises(error, match=message):
        trace(fn)


@pytest.mark.parametrize(
    "method", ["allgather_topk", "ar_topk", "ar_topk split", "hierarchical_topk"]
)
def test_sparse_sent_is_the_dense_sent_as_pairs(method):
    """sparse_sent=True gives the (indices, values) whose scatter is the dense sent, bit for bit,
    and the same total: what lets compress take the sent values off its residual in place."""
    rng = np.random.default_rng(3)
    n, k = 1001, 37
    if method == "hierarchical_topk":
        mesh, axes = mesh_2d(2, 4), ("node", "gpu")

        def run(x, sparse):
            return collectives.hierarchical_topk(x, k, "gpu", "node", sparse_sent=sparse)
    else:
        mesh, axes = mesh_1d(8), AXIS

        def run(x, sparse):
            name, *leader = method.split()
            options = {"step": 3, "leader": (leader or ["star"])[0]} if name == "ar_topk" else {}
            return getattr(collectives, name)(x, k, AXIS, sparse_sent=sparse, **options)

    def both(x):
        total, sent = run(x, False)
        total_s, (indices, values) = run(x, True)
        scattered = (
            jnp.zeros(n + 64, x.dtype).at[indices].set(values)[:n]
        )  # room for padding indices
        return total_s - total, scattered - sent

    f = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P(axes), out_specs=(P(axes), P(axes))))
    x = rng.standard_normal(8 * n).astype(np.float32)
    d_total, d_sent = f(x)
    assert not np.any(np.asarray(d_total)) and not np.any(np.asarray(d_sent))


@pytest.mark.parametrize("n_devices", [1, 2, 3, 8])
def test_gather_leaf_shards_joins_the_small_ones(n_devices):
    """One all-gather for the small leaves of each dtype, a large leaf alone; the same result as
    gathering each leaf."""
    from jaxcomp.collectives import small

    need_devices(n_devices)
    mesh = Mesh(np.array(jax.devices()[:n_devices]), ("data",))
    rng = np.random.default_rng(0)
    shapes = [
        (n_devices * 3,),
        (n_devices, 5),
        (n_devices * (small.JOINED_VALUES + 1),),
        (n_devices,),
    ]
    leaves = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]
    leaves.append(jnp.arange(n_devices * 2, dtype=jnp.bfloat16))

    def both(*shards):
        return small.gather_leaf_shards(list(shards), "data"), [
            small.gather_shards(s, "data") for s in shards
        ]

    spec = (P("data"),) * len(leaves)
    f = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=spec, out_specs=P()))
    joined, apart = f(*leaves)
    for a, b in zip(joined, apart):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    hlo = (
        jax.jit(
            jax.shard_map(
                lambda *s: small.gather_leaf_shards(list(s), "data"),
                mesh=mesh,
                in_specs=spec,
                out_specs=P(),
            )
        )
        .lower(*leaves)
        .compile()
        .as_text()
    )
    if n_devices > 1:  # the three small f32 leaves, the large one, the bfloat16 one
        assert len(re.findall(r" all-gather(?:-start)?\(", hlo)) == 3, hlo


@pytest.mark.parametrize("n_devices", [1, 2, 3, 8])
def test_joined_mean_averages_each_array_in_one_all_reduce_per_dtype(n_devices):
    """The mean of each array over the devices (a numpy reference), the small float32 ones in
    one all-reduce, a large one alone, a bfloat16 one apart; an integer array is refused."""
    from helpers import all_reduced_arrays

    from jaxcomp.collectives import small

    need_devices(n_devices)
    mesh = Mesh(np.array(jax.devices()[:n_devices]), ("data",))
    rng = np.random.default_rng(0)
    shapes = [(n_devices, 3), (n_devices, 2, 2), (n_devices, small.JOINED_VALUES + 1), (n_devices,)]
    rows = [rng.integers(-8, 8, size=s).astype(np.float32) for s in shapes]
    rows.append(rng.integers(-8, 8, size=(n_devices, 4)).astype(jnp.bfloat16))
    spec = (P("data"),) * len(rows)

    def mean(*local):
        return small.joined_mean([x[0] for x in local], "data")

    f = jax.jit(jax.shard_map(mean, mesh=mesh, in_specs=spec, out_specs=P()))
    for got, x in zip(f(*rows), rows):
        assert got.dtype == x.dtype and got.shape == x.shape[1:]
        rtol = 1e-2 if x.dtype == jnp.bfloat16 else 1e-6
        want = x.astype(np.float32).mean(axis=0)
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=rtol)
    hlo = f.lower(*rows).compile().as_text()
    if n_devices > 1:  # the three small f32 arrays joined, the large one, the bfloat16 one
        assert all_reduced_arrays(hlo) == 3, hlo
    ints = jax.shard_map(
        lambda x: small.joined_mean([x], "data")[0], mesh=mesh, in_specs=P("data"), out_specs=P()
    )
    with pytest.raises(TypeError, match="arrays\\[0\\] has dtype int32"):
        ints(jnp.zeros(n_devices, jnp.int32))


# ----------------------------------------------------------------------------------------------
# One device: no collective carries the vector (XLA:CPU copies a vector through an all-reduce
# over one device rather than removing it).

_VECTOR_COLLECTIVE = re.compile(
    r"= (\(?[^=]*?\)?) (all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)"
    r"(?:-start)?\("
)


def _vector_collectives(hlo, n):
    """The collectives of a compiled program whose operands hold ``n`` values or more."""
    return [
        line.strip()[:160]
        for line in hlo.splitlines()
        if (m := _VECTOR_COLLECTIVE.search(line))
        and any(
            math.prod(int(d) for d in dims.split(",")) >= n
            for dims in re.findall(r"\[([\d,]+)\]", m.group(1))
        )
    ]


@pytest.mark.parametrize(
    "name",
    ["dense", "allgather_topk", "ar_topk", "randomk", "sign", "bf16", "fp16", "zfp"]
    + ["quantized", "powersgd"],
)
def test_one_device_moves_the_vector_through_no_collective(name):
    """``compress`` of every method on a 1-device mesh: the same update as before (the method's
    own rounding or selection, nothing summed), typed replicated, with no all-reduce over the one
    device in the compiled step (it cost 2-3 copies' time a step)."""
    need_devices(1)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    options = {"ratio": 0.05, "rate": 8, "bits": 8, "rank": 2}
    tx = jaxcomp.compress(methods.parse(name, strict=False, **options), error_feedback=False)
    g = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((64, 48)), jnp.float32)}
    state = tx.init(g)

    def update(g):
        return tx.update(jax.tree.map(lambda v: jax.lax.pcast(v, "data", to="varying"), g), state)[
            0
        ]

    f = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=P(), out_specs=P()))
    assert _vector_collectives(f.lower(g).compile().as_text(), 64) == []
    got = np.asarray(f(g)["w"])
    sent = got != 0
    assert sent.any()
    if name in ("dense", "allgather_topk", "ar_topk", "randomk"):  # exact values where sent
        np.testing.assert_array_equal(got[sent], np.asarray(g["w"])[sent])
    if name in ("dense", "bf16", "fp16", "zfp", "quantized"):  # every value, up to its rounding
        np.testing.assert_allclose(got, np.asarray(g["w"]), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("axes", [("data",), ("node", "data")])
def test_one_device_total_retypes_without_a_collective(axes):
    from jaxcomp.collectives._common import one_device_total, psum_or_retype

    need_devices(2)
    one = Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(axes)), axes)
    x = jnp.arange(6.0)
    for fn in (one_device_total, psum_or_retype):
        f = jax.jit(
            jax.shard_map(lambda v: fn(v * 2, axes), mesh=one, in_specs=P(axes), out_specs=P())
        )
        np.testing.assert_array_equal(np.asarray(f(x)), np.arange(6.0) * 2)
        assert _vector_collectives(f.lower(x).compile().as_text(), 6) == []
    # Under vmap too (a batch of vectors per device), as the psum it replaces.
    f = jax.jit(
        jax.shard_map(
            jax.vmap(lambda v: psum_or_retype(v, axes)), mesh=one, in_specs=P(axes), out_specs=P()
        )
    )
    batch = jnp.arange(12.0).reshape(2, 6)
    np.testing.assert_array_equal(np.asarray(f(batch)), np.asarray(batch))
    two = Mesh(np.array(jax.devices()[:2]).reshape((1,) * (len(axes) - 1) + (2,)), axes)
    f = jax.jit(
        jax.shard_map(lambda v: psum_or_retype(v, axes), mesh=two, in_specs=P(axes), out_specs=P())
    )
    np.testing.assert_array_equal(np.asarray(f(x)), np.arange(3.0) + np.arange(3.0, 6.0))
    with pytest.raises(ValueError, match="one device"):
        jax.jit(
            jax.shard_map(
                lambda v: one_device_total(v, axes), mesh=two, in_specs=P(axes), out_specs=P()
            )
        )(x)
