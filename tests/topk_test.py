"""Exact top-k: the native kernel against the pure-JAX reference (and numpy for the reference)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_equal, count_compilations, need_devices

import jaxcomp
from jaxcomp.ops import reference

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]

# Awkward row lengths (1, 3, 5), a power of two, a row long enough for the kernel to split it
# across threads (n > 2 * 32768) and batched rows that the kernel spreads over threads instead.
SHAPE_KS = [
    ((1,), (1,)),
    ((3,), (1, 3)),
    ((5,), (1, 2, 5)),
    ((4096,), (1, 37, 4096)),
    ((100003,), (1, 37, 100003)),
    ((3, 2, 1001), (1, 37, 1001)),
]
SHAPE_K = [(shape, k) for shape, ks in SHAPE_KS for k in ks]


def planted(shape, k, dtype, seed=0):
    """Values of magnitude <= 1 with, per row, ``k`` planted entries of distinct magnitudes in
    [2, 2 + k/4): the unique top-k set. Returns ``(x, expected sorted indices [rows, k])``."""
    rng = np.random.default_rng(seed)
    n = shape[-1]
    rows = rng.uniform(-1.0, 1.0, (int(np.prod(shape[:-1])), n))
    expected = []
    for row in rows:
        top = rng.choice(n, k, replace=False)
        if k < n:  # with k = n every entry is selected, whatever its magnitude
            # Quarter steps up to 2 + 37/4 are exact in bfloat16 and float16: magnitudes stay
            # distinct.
            row[top] = rng.choice([-1.0, 1.0], k) * (2.0 + 0.25 * rng.permutation(k))
        expected.append(np.sort(top))
    return jnp.asarray(rows.reshape(shape), dtype), np.stack(expected)


def numpy_topk_indices(x, k):
    """Sorted indices of the k largest |x| per row (float32), ties to the lower index, NaN
    largest."""
    keys = np.asarray(x, np.float32).reshape(-1, x.shape[-1]).view(np.uint32) & 0x7FFFFFFF
    order = np.argsort(0x7FFFFFFF - keys.astype(np.int64), axis=-1, kind="stable")
    return np.sort(order[:, :k], axis=-1)


def assert_same(actual, desired):
    """Equal pytrees of arrays with equal dtypes; NaNs compare equal (as float32)."""
    for a, d in zip(jax.tree.leaves(actual), jax.tree.leaves(desired), strict=True):
        a, d = np.asarray(a), np.asarray(d)
        assert a.dtype == d.dtype and a.shape == d.shape
        if jnp.issubdtype(a.dtype, jnp.floating):
            a, d = a.astype(np.float32), d.astype(np.float32)
        np.testing.assert_array_equal(a, d)


def assert_selection(x, values, indices, expected):
    """Indices equal ``expected`` ([rows, k]) and values are x at those indices, bit for bit."""
    n, k = x.shape[-1], expected.shape[-1]
    assert values.shape == indices.shape == x.shape[:-1] + (k,)
    assert values.dtype == x.dtype and indices.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(indices).reshape(-1, k), expected)
    gathered = np.take_along_axis(np.asarray(x).reshape(-1, n), expected, axis=-1)
    bits = f"u{gathered.itemsize}"  # compares -0.0 with 0.0 as different, as it should
    np.testing.assert_array_equal(np.asarray(values).reshape(-1, k).view(bits), gathered.view(bits))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape,k", SHAPE_K)
def test_topk_matches_reference(dtype, shape, k):
    x, expected = planted(shape, k, dtype)
    values, indices = jaxcomp.topk(x, k)
    assert_selection(x, values, indices, expected)
    # The reference sees the exact float32 upcast, so it compiles once per shape for all dtypes.
    assert_same(
        reference.topk(np.asarray(x, np.float32), k), (np.asarray(values, np.float32), indices)
    )


@pytest.mark.parametrize("shape", [(5,), (4096,), (3, 2, 1001)])
def test_reference_topk_matches_numpy(shape):
    x = jnp.asarray(np.random.default_rng(1).standard_normal(shape), jnp.bfloat16)  # many ties
    k = min(37, shape[-1])
    values, indices = reference.topk(x, k)
    assert_selection(x, values, indices, numpy_topk_indices(x, k))


@pytest.mark.parametrize("shape", [(100003,), (3, 2, 1001), (70,)])
def test_equal_magnitudes_go_to_the_lower_index(shape):
    rng = np.random.default_rng(2)
    n = shape[-1]
    x = rng.choice([-1.0, 1.0], shape).astype(np.float32)
    # A few larger entries spread over the row, then ties at the k-th magnitude: the selection
    # is the larger ones plus the lowest-index ones among the rest, in every thread's part.
    larger = np.arange(5, n, n // 5)[:5]
    x[..., larger] = 3.0
    k = 20
    expected = np.sort(
        np.concatenate([larger, np.setdiff1d(np.arange(n), larger)[: k - len(larger)]])
    )
    expected = np.broadcast_to(expected, (int(np.prod(shape[:-1])), k))
    x = jnp.asarray(x)
    assert_selection(x, *jaxcomp.topk(x, k), expected)
    assert_trees_equal(jaxcomp.topk(x, k), reference.topk(x, k))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_nan_ranks_largest(dtype):
    x = np.random.default_rng(3).standard_normal((2, 40000)).astype(np.float32)
    x[0, [7, 30001]] = np.nan
    x[0, 3], x[0, 11] = np.inf, -np.inf
    x[1, 39999] = -np.nan
    x = jnp.asarray(x, dtype)
    for k, first_row in [(1, [7]), (2, [7, 30001]), (4, [3, 7, 11, 30001])]:
        values, indices = jaxcomp.topk(x, k)
        np.testing.assert_array_equal(indices[0], first_row)
        assert int(indices[1, -1]) == 39999 and np.isnan(float(values[1, -1]))
        assert_same(
            (np.asarray(values, np.float32), indices), reference.topk(np.asarray(x, np.float32), k)
        )


def test_jit_vmap_and_static_shapes():
    x = jnp.asarray(np.random.default_rng(4).standard_normal((4, 1001)), jnp.float32)
    batched = jaxcomp.topk(x, 10)
    assert_trees_equal(jax.jit(jaxcomp.topk, static_argnums=1)(x, 10), batched)
    assert_trees_equal(jax.vmap(lambda row: jaxcomp.topk(row, 10))(x), batched)
    # A vmapped axis that is not the leading one: the rows are still x's columns.
    assert_trees_equal(jax.vmap(lambda row: jaxcomp.topk(row, 10), in_axes=1)(x.T), batched)
    shapes = jax.eval_shape(
        functools.partial(jaxcomp.topk, k=10), jax.ShapeDtypeStruct((2, 3, 50), jnp.bfloat16)
    )
    assert [(s.shape, s.dtype) for s in shapes] == [
        ((2, 3, 10), jnp.bfloat16),
        ((2, 3, 10), jnp.int32),
    ]


def test_second_call_does_not_recompile():
    f = jax.jit(lambda x: jaxcomp.topk(x, 5))
    x, other_x = jnp.arange(100.0), -jnp.arange(100.0)
    with count_compilations() as first:
        jax.block_until_ready(f(x))
    with count_compilations() as second:
        jax.block_until_ready(f(other_x))
    assert first[0] >= 1 and second[0] == 0


@pytest.mark.parametrize(
    "x,k,error,match",
    [
        (jnp.ones(5), 0, ValueError, "k must be >= 1"),
        (jnp.ones(5), -2, ValueError, "k must be >= 1"),
        (jnp.ones(5), 6, ValueError, r"k must be at most .* \(5\), got 6"),
        (jnp.ones(5), 2.0, TypeError, "k must be a static Python integer"),
        (jnp.ones(5), True, TypeError, "k must be an integer"),
        (jnp.ones(5, jnp.int32), 2, TypeError, "x must be float32, bfloat16 or float16"),
        (jnp.ones(5, jnp.complex64), 2, TypeError, "x must be float32, bfloat16 or float16"),
        (jnp.float32(1.0), 1, ValueError, "x must have at least one dimension"),
    ],
)
def test_bad_arguments_raise_naming_them(x, k, error, match):
    with pytest.raises(error, match=match):
        jaxcomp.topk(x, k)


def test_traced_k_is_rejected():
    with pytest.raises(TypeError, match="k must be a static Python integer"):
        jax.jit(jaxcomp.topk)(jnp.ones(5), 2)


def _direct_topk_call(x, k, values_len, indices_len):
    """The FFI target called without the Python wrapper's checks."""
    call = jax.ffi.ffi_call(
        "jaxcomp_topk",
        (
            jax.ShapeDtypeStruct((values_len,), jnp.float32),
            jax.ShapeDtypeStruct((indices_len,), jnp.int32),
        ),
        vmap_method="broadcast_all",
    )
    return jax.block_until_ready(call(x, k=np.int64(k)))


# k = 0 gets one-element results: XLA drops a call whose results are all empty, so the handler
# would never run.
@pytest.mark.parametrize(
    "k,values_len,indices_len,match",
    [
        (6, 6, 6, r"k must be in \[1, 5\], got 6"),
        (0, 1, 1, r"k must be in \[1, 5\], got 0"),
        (2, 3, 2, "values must have x's leading dimensions followed by k = 2"),
        (2, 2, 1, "indices must have"),
    ],
)
def test_handler_validates_on_its_own(k, values_len, indices_len, match):
    with pytest.raises(jax.errors.JaxRuntimeError, match=match):
        _direct_topk_call(jnp.ones(5, jnp.float32), k, values_len, indices_len)


def test_uneven_rows_and_long_batched_rows():
    # Alone, a long row is split across threads: one whose largest values all sit at its start
    # overfills the first thread's candidate buffer, and the kernel falls back to full passes.
    rng = np.random.default_rng(6)
    row = rng.standard_normal(300000).astype(np.float32)
    row[:20000] *= 1000.0
    k = 15000
    for ordered in (row, row[::-1]):
        assert_selection(
            jnp.asarray(ordered), *jaxcomp.topk(ordered, k), numpy_topk_indices(ordered, k)
        )
        assert_same(jaxcomp.threshold_topk(ordered, k), reference.threshold_topk(ordered, k))
    # More long rows than threads: each thread takes whole rows.
    x = rng.standard_normal((10, 70000)).astype(np.float32)
    x[3, -5000:] *= 100.0
    assert_selection(jnp.asarray(x), *jaxcomp.topk(x, 700), numpy_topk_indices(x, 700))
    assert_same(
        jaxcomp.threshold_topk(x, 700, rounds=20), reference.threshold_topk(x, 700, rounds=20)
    )


def kernel_sample_positions(n):
    """Where the CPU kernel samples a long row for its candidate floor (``kernels/topk.h``,
    ``PlanCandidates``)."""
    samples = min(1 << 14, max(256, n // 256))
    window = n // samples
    s = np.arange(samples, dtype=np.uint64)
    with np.errstate(over="ignore"):
        scrambled = (s + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    return s.astype(np.int64) * window + ((scrambled >> np.uint64(32)) % np.uint64(window)).astype(
        np.int64
    )


def test_a_sample_that_misleads_falls_back_to_the_histogram_pass():
    # The sampled entries hold the row's 40 largest values, so the floor sits among them and
    # fewer than k entries reach it: the kernel must not select from those candidates alone.
    rng = np.random.default_rng(7)
    n, k = 300000, 3000
    row = rng.uniform(-1.0, 1.0, n).astype(np.float32)
    row[kernel_sample_positions(n)[:40]] = 100.0 + np.arange(40)
    assert_selection(jnp.asarray(row), *jaxcomp.topk(row, k), numpy_topk_indices(row, k))
    assert_same(jaxcomp.threshold_topk(row, k), reference.threshold_topk(row, k))
    assert_same(
        jaxcomp.threshold_topk(row, k, rounds=20), reference.threshold_topk(row, k, rounds=20)
    )


def test_concurrent_calls_inside_shard_map():
    # Eight handlers run at once and share XLA's thread pool; each splits its long row into parts.
    need_devices(8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    x = jnp.asarray(np.random.default_rng(7).standard_normal((8, 100003)), jnp.float32)
    per_shard = jax.jit(
        jax.shard_map(
            lambda rows: jaxcomp.topk(rows, 500),
            mesh=mesh,
            in_specs=jax.sharding.PartitionSpec("data"),
            out_specs=jax.sharding.PartitionSpec("data"),
        )
    )
    values, indices = per_shard(x)
    assert_selection(x, values, indices, numpy_topk_indices(x, 500))


MERGE_CASES = {
    "one run": np.array([[2, 5, 9]]),
    "ascending runs with repeats": np.array([[0, 3, 4, 8], [1, 3, 5, 8], [3, 4, 6, 7]]),
    "every run the same": np.array([[1, 2], [1, 2], [1, 2]]),
    "a run not ascending": np.array([[0, 3], [5, 1]]),
    "an odd number of runs": np.array([[0, 9], [2, 9], [4, 9], [6, 9], [8, 9]]),
}


@pytest.mark.parametrize("runs", MERGE_CASES.values(), ids=MERGE_CASES.keys())
def test_merged_indices_match_the_sort(runs):
    from jaxcomp.ops.topk import merged_indices, merged_indices_xla

    runs = jnp.asarray(runs, jnp.int32)
    expected = np.sort(np.asarray(runs).ravel())
    expected[1:][expected[1:] == expected[:-1]] = 99
    np.testing.assert_array_equal(merged_indices_xla(runs, 99), expected)
    np.testing.assert_array_equal(jax.jit(lambda r: merged_indices(r, 99))(runs), expected)


def test_merged_indices_of_long_gathered_selections():
    # What SPLIT gathers: each of 8 devices' ascending top-k indices of one vector of 1M.
    from jaxcomp.ops.topk import merged_indices, merged_indices_xla

    rng = np.random.default_rng(3)
    runs = np.stack([np.sort(rng.choice(1 << 20, 30001, replace=False)) for _ in range(8)])
    runs = jnp.asarray(runs, jnp.int32)
    hlo = jax.jit(lambda r: merged_indices(r, 1 << 20)).lower(runs).as_text()
    assert "jaxcomp_merge_indices" in hlo
    np.testing.assert_array_equal(merged_indices(runs, 1 << 20), merged_indices_xla(runs, 1 << 20))


@pytest.mark.parametrize(
    "runs,pad,match",
    [
        (np.zeros(3, np.int32), 0, "2-D int32"),
        (np.zeros((2, 2), np.float32), 0, "2-D int32"),
        (np.zeros((0, 2), np.int32), 0, "non-empty"),
        (np.zeros((2, 2), np.int32), 2**31, "pad"),
        (np.zeros((2, 2), np.int32), 1.5, "pad"),
    ],
)
def test_merged_indices_bad_arguments_raise_naming_them(runs, pad, match):
    from jaxcomp.ops.topk import merged_indices

    with pytest.raises(ValueError, match=match):
        merged_indices(jnp.asarray(runs), pad)
