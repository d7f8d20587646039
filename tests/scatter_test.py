"""jaxcomp.ops.scatter: the sparse total of top-k and random-k, written into the update's leaves
by the native kernel bit for bit as the XLA reference (a dense vector, sliced and scaled); and a
dense total split into the leaves by the native kernel, bit for bit as XLA's slices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import need_devices
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.ops import _ffi, scatter
from jaxcomp.ops.scatter import (
    SparseTotal,
    scatter_leaves,
    scatter_leaves_xla,
    split_scaled,
    split_scaled_xla,
)

SHAPES = [(3, 5), (0,), (7,), (2, 2, 2), (1000,)]
N = sum(int(np.prod(s)) for s in SHAPES)


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _rows(rng, rows, k, n=N, awkward=True):
    """Rows of distinct indices in [0, n + 5) (some dropped), values with Inf, NaN and -0."""
    indices = np.stack([rng.choice(n + 5, k, replace=False) for _ in range(rows)]).astype(np.int32)
    values = rng.standard_normal((rows, k)).astype(np.float32)
    if awkward:
        values[0, :3] = [np.inf, np.nan, -0.0]
        if rows > 1:  # the same indices again: Inf + -Inf, NaN + x
            indices[1, :3] = indices[0, :3]
            values[1, 0] = -np.inf
    return indices, values


def _both(indices, values, shapes, scale, silenced=None, **options):
    n = sum(int(np.prod(s)) for s in shapes)

    def run(fn):
        return jax.jit(lambda i, v: fn(SparseTotal(i, v, n, **options), shapes, scale, silenced))(
            indices, values
        )

    return run(scatter_leaves), run(scatter_leaves_xla)


@pytest.mark.parametrize(
    "rows, add, drop, scale, silenced",
    [
        (1, True, False, 0.25, None),  # all-gather top-k on one device
        (4, True, True, 1 / 3, None),  # the gathered rows of 4 devices, non-finite sums dropped
        (4, True, False, 1.0, None),  # a sum, not a mean: no finishing pass
        (1, False, True, 0.5, None),  # AR-Topk and random-k: one row set, not added
        (3, True, False, 0.5, True),  # a skipped step: every leaf 0
        (3, True, False, 0.5, False),
    ],
)
def test_kernel_is_the_reference_bit_for_bit(rows, add, drop, scale, silenced):
    rng = np.random.default_rng(rows + 10 * add + 100 * drop)
    indices, values = _rows(rng, rows, 60)
    flag = None if silenced is None else jnp.asarray(silenced)
    got, want = _both(indices, values, SHAPES, scale, flag, add=add, drop=drop)
    assert [g.shape for g in got] == SHAPES
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == jnp.float32
        np.testing.assert_array_equal(_bits(g), _bits(w))
    if silenced:
        assert all(not np.any(np.asarray(g)) for g in got)


def test_large_leaves_split_among_tasks_match_the_reference():
    """25M values in the six-2041 MLP's leaves: the kernel's tasks split them by index."""
    shapes = [(2041, 2041), (2041,)] * 6
    n = sum(int(np.prod(s)) for s in shapes)
    indices, values = _rows(np.random.default_rng(0), 4, n // 100, n)
    got, want = _both(indices, values, shapes, 0.25, drop=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(_bits(g), _bits(w))


def test_the_cpu_runs_the_kernel_and_other_dtypes_the_reference():
    indices, values = _rows(np.random.default_rng(1), 2, 20, awkward=False)

    def hlo(values):
        return (
            jax.jit(lambda i, v: scatter_leaves(SparseTotal(i, v, N), SHAPES, 0.5))
            .lower(indices, values)
            .compile()
            .as_text()
        )

    assert "jaxcomp_scatter_leaves" in hlo(values)
    assert "jaxcomp_scatter_leaves" not in hlo(values.astype(jnp.bfloat16))
    with _ffi.default_implementation("xla"):
        assert "jaxcomp_scatter_leaves" not in hlo(values)
    got = scatter_leaves(SparseTotal(indices, values.astype(jnp.bfloat16), N), SHAPES, 0.5)
    want = scatter_leaves_xla(SparseTotal(indices, values.astype(jnp.bfloat16), N), SHAPES, 0.5)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(_bits(g), _bits(w))


def test_dense_adds_rows_in_order_sets_one_row_and_drops():
    indices = jnp.array([[0, 2], [2, 3]])
    values = jnp.array([[1.0, jnp.inf], [-jnp.inf, 4.0]])
    assert np.isnan(SparseTotal(indices, values, 4).dense()[2])
    assert SparseTotal(indices, values, 4).dropped().dense().tolist() == [1.0, 0.0, 0.0, 4.0]
    one = SparseTotal(jnp.array([3, 9, 1]), jnp.array([-0.0, 5.0, 2.0]), 4, add=False)
    dense = np.asarray(one.dense())  # index 9 is outside: dropped; -0.0 is set as it is
    assert dense.tolist() == [0.0, 2.0, 0.0, 0.0] and np.signbit(dense[3])
    leaves = jax.tree.leaves(one)
    assert len(leaves) == 2  # a pytree of its pairs; n, add, dtype and drop are static


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda t: scatter_leaves(jnp.zeros(4), [(4,)]), TypeError, "SparseTotal"),
        (lambda t: scatter_leaves(t, [(3,)]), ValueError, "shapes must hold the total's 4"),
        (lambda t: scatter_leaves(t, [(4,)], 0.0), ValueError, "scale must be"),
        (lambda t: scatter_leaves(t, [(4,)], jnp.float32(0.5)), ValueError, "scale must be"),
        (
            lambda t: scatter_leaves(SparseTotal(t.indices, t.values, 4, add=False), [(4,)]),
            ValueError,
            "add=False takes one row",
        ),
    ],
)
def test_bad_input_is_a_clear_error(call, error, match):
    total = SparseTotal(jnp.array([[0], [1]]), jnp.array([[1.0], [2.0]]), 4)
    with pytest.raises(error, match=match):
        call(total)


def _loss(w, batch):
    """Each device's gradient is the mean of its rows of the batch: a gradient stream we set."""
    return sum(jnp.sum(w[k] * jnp.mean(batch[k], axis=0)) for k in w)


@pytest.mark.parametrize("method", ["allgather_topk", "ar_topk", "randomk"])
def test_compress_writes_the_sparse_total_into_the_leaves_as_the_xla_path_does(method):
    """Two devices, two leaves, a non-finite gradient entry: the update through the kernel is the
    update of the all-XLA path, bit for bit, step after step (the residual included)."""
    need_devices(2)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    params = {"a": jnp.zeros((40, 30)), "b": jnp.zeros(77)}
    rng = np.random.default_rng(2)
    batches = [
        {k: rng.standard_normal((2,) + v.shape).astype(np.float32) for k, v in params.items()}
        for _ in range(3)
    ]
    batches[1]["a"][0, 3, 4] = np.nan

    def run():
        # sgd(1.0): XLA folds the mean's 1/2 and a learning rate into one factor when both are
        # its own multiplies (x * (1/2 * lr), one rounding fewer), exact only for lr = +-1.
        tx = optax.chain(jaxcomp.compress(method, ratio=0.05), optax.sgd(1.0))
        dp = jaxcomp.data_parallel(_loss, tx, mesh)
        state = dp.init(params)
        hlo = dp.step.lower(state, batches[0]).compile().as_text()
        for batch in batches:
            state, _ = dp.step(state, batch)
        return dp.params(state), hlo

    got, hlo = run()
    with _ffi.default_implementation("xla"):
        want, hlo_xla = run()
    assert "jaxcomp_scatter_leaves" in hlo and "jaxcomp_scatter_leaves" not in hlo_xla
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(_bits(g), _bits(w))
    assert np.any(np.asarray(got["a"]))


def test_in_shard_map_the_kernel_runs_per_device():
    need_devices(2)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    indices, values = _rows(np.random.default_rng(3), 2, 30, awkward=False)

    def per_device(i, v):
        out = scatter_leaves(SparseTotal(i[0], v[0], N), SHAPES, 0.5)
        return [o[None] for o in out]

    f = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"))
    )
    got = f(indices[:, None], values[:, None])
    for d in range(2):
        want = scatter_leaves_xla(SparseTotal(indices[d], values[d], N), SHAPES, 0.5)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(_bits(g[d]), _bits(w))


# Runs of small leaves (the kernel's) between large ones (XLA's slices), empty leaves too.
SPLIT_SHAPES = [(3, 5), (0,), (7,), (2, 2, 2)] * 3 + [(70_000,)] + [(9,), (1, 4)] * 5 + [(66_000,)]


def _dense(rng, n):
    """n + 3 values (the last 3 past the leaves: padding), with NaN, +-Inf and -0."""
    dense = rng.standard_normal(n + 3).astype(np.float32)
    dense[[0, 5, 17, 30]] = [np.nan, np.inf, -np.inf, -0.0]
    return dense


def _split_both(shapes, scale, silenced=None, seed=4, drop=False):
    dense = _dense(np.random.default_rng(seed), sum(int(np.prod(s)) for s in shapes))
    got = jax.jit(lambda d: split_scaled(d, shapes, scale, silenced, drop))
    want = jax.jit(lambda d: split_scaled_xla(d, shapes, scale, silenced, drop))
    return got(dense), want(dense), got.lower(dense).compile().as_text()


@pytest.mark.parametrize("drop", [False, True], ids=["kept", "dropped"])
@pytest.mark.parametrize(
    "scale, silenced", [(1.0, None), (0.25, None), (1 / 3, False), (0.5, True)]
)
def test_split_kernel_is_the_reference_bit_for_bit(scale, silenced, drop):
    got, want, hlo = _split_both(
        SPLIT_SHAPES, scale, None if silenced is None else jnp.asarray(silenced), drop=drop
    )
    assert hlo.count('custom_call_target="jaxcomp_split_leaves"') == 2  # the two runs
    assert [g.shape for g in got] == SPLIT_SHAPES
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == jnp.float32
        np.testing.assert_array_equal(_bits(g), _bits(w))
    if silenced:
        assert all(not np.any(_bits(g)) for g in got)  # +0.0 everywhere
    flat = np.concatenate([np.asarray(g).ravel() for g in got])
    # _dense plants NaN and +-Inf in the first leaves.
    assert np.all(np.isfinite(flat)) == (drop or bool(silenced))
    if drop and not silenced:  # the planted -0.0 stays -0.0; NaN and +-Inf become +0.0
        assert _bits(flat[[0, 5, 17, 30]]).tolist() == [0, 0, 0, 0x80000000]


def test_split_runs_and_tasks():
    """Short runs and large leaves stay XLA's; 2.6M values of small leaves split among tasks."""
    runs = scatter._split_runs
    assert runs([10] * 7) == [(0, 7, False)] and runs([10] * 8) == [(0, 8, True)]
    assert runs([10**6, 10, 10**6]) == [(0, 3, False)]
    assert runs([0] * 3 + [10] * 5 + [10**5]) == [(0, 8, True), (8, 9, False)]
    got, want, hlo = _split_both([(scatter.SPLIT_SMALL_VALUES,)] * 40, 0.125)
    assert hlo.count('custom_call_target="jaxcomp_split_leaves"') == 1
    for g, w in zip(got, want):
        np.testing.assert_array_equal(_bits(g), _bits(w))


def test_split_runs_the_kernel_on_float32_and_the_reference_otherwise():
    dense = _dense(np.random.default_rng(6), sum(int(np.prod(s)) for s in SPLIT_SHAPES))

    def hlo(x):
        return jax.jit(lambda d: split_scaled(d, SPLIT_SHAPES, 0.5)).lower(x).compile().as_text()

    assert "jaxcomp_split_leaves" in hlo(dense)
    assert "jaxcomp_split_leaves" not in hlo(dense.astype(jnp.bfloat16))
    with _ffi.default_implementation("xla"):
        assert "jaxcomp_split_leaves" not in hlo(dense)
    half = jnp.asarray(dense, jnp.bfloat16)
    got, want = split_scaled(half, SPLIT_SHAPES, 0.5), split_scaled_xla(half, SPLIT_SHAPES, 0.5)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(_bits(g), _bits(w))


@pytest.mark.parametrize(
    "dense, shapes, scale, match",
    [
        (jnp.zeros(3), [(2, 2)], 1.0, "at least the shapes' 4 values, got shape \\(3,\\)"),
        (jnp.zeros((2, 2)), [(4,)], 1.0, "dense must be 1-D"),
        (jnp.zeros(4), [(4,)], -1.0, "scale must be"),
        (jnp.zeros(4), [(4,)], jnp.float32(0.5), "scale must be"),
    ],
)
def test_split_bad_input_is_a_clear_error(dense, shapes, scale, match):
    with pytest.raises(ValueError, match=match):
        split_scaled(dense, shapes, scale)


def test_a_step_of_many_leaves_compiles_no_slice_per_leaf():
    """XLA fuses a leaf's slice of the flat total into its consumers with the offset as a constant,
    so each leaf's loops compile on their own (a model of 1,000 leaves spent 20-60 s on them).
    With the kernel, the leaves come out whole and leaves of one shape share their loops."""
    need_devices(2)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    params = {f"w{i}": jnp.zeros(24) for i in range(40)}
    tx = optax.chain(jaxcomp.compress("bf16", error_feedback=True), optax.adam(1e-3))
    dp = jaxcomp.data_parallel(_loss, tx, mesh)
    batch = {k: np.ones((2, 3, 24), np.float32) for k in params}
    hlo = dp.step.lower(dp.init(params), batch).compile().as_text()
    assert hlo.count("jaxcomp_split_leaves") >= 2  # the update and the residual
    leaf_slices = [line for line in hlo.splitlines() if "f32[24]{0} slice(" in line]
    assert not leaf_slices, leaf_slices[:3]
    with _ffi.default_implementation("xla"):  # what the test would see without the kernel
        xla = jaxcomp.data_parallel(_loss, tx, mesh)
        hlo = xla.step.lower(xla.init(params), batch).compile().as_text()
    assert hlo.count("f32[24]{0} slice(") >= len(params)
