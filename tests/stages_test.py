"""The stages of a compress update (jaxcomp.optim.stages, jaxcomp.optim.packing), each on its own
against a numpy reference; tests/transform_test.py checks them composed."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import need_devices
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxcomp.costmodel import ratio_choice
from jaxcomp.methods import Dense, PowerSGD, RandomK, TopK, Zfp
from jaxcomp.ops import flat
from jaxcomp.optim import packing, sharding
from jaxcomp.optim.config import FeedbackConfig
from jaxcomp.optim.stages import aggregation, error_feedback, guard, mask, metrics, momentum, warmup
from jaxcomp.optim.state import NONFINITE_POLICIES

N_DEVICES = 8
SHAPES = [(1,), (3,), (4, 5), (257,)]  # 1, odd, 2-D, larger than a block and not a multiple of 8
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _mesh():
    need_devices(N_DEVICES)
    return Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))


def _on_devices(fn, *per_device, out_specs=P()):
    """Runs ``fn`` inside shard_map over 8 devices; each argument holds one row per device."""
    stacked = [jnp.asarray(x).reshape((-1,) + np.shape(x)[2:]) for x in per_device]
    return jax.shard_map(
        fn, mesh=_mesh(), in_specs=tuple(P("data") for _ in stacked), out_specs=out_specs
    )(*stacked)


def _with_nonfinite(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(shape).astype(np.float32)
    flat = g.reshape(-1)
    flat[:: max(1, flat.size // 3)] = np.nan
    if flat.size > 1:
        flat[1] = np.inf
    return jnp.asarray(g, dtype)


# --- guard --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_guard_finite_against_numpy(shape, dtype):
    g = _with_nonfinite(shape, dtype)
    values, count = guard.finite(g)
    expected = np.asarray(g, np.float32)
    bad = ~np.isfinite(expected)
    assert values.dtype == jnp.float32 and values.shape == shape
    np.testing.assert_array_equal(np.asarray(values), np.where(bad, 0.0, expected))
    assert float(count) == bad.sum()


def _resum(sharded):
    """Sums a vector over "data": whole, or scattered (each device its shard of the sum)."""
    if sharded:
        return lambda u: jax.lax.psum_scatter(u, "data", scatter_dimension=0, tiled=True)
    return lambda u: jax.lax.psum(u, "data")


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("plant", [False, True])
def test_guard_guarded_totals_against_numpy(plant, sharded):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((N_DEVICES, 1, 16)).astype(np.float32)
    if plant:
        x[3, 0, 5] = np.nan
        x[6, 0, 0] = -np.inf

    def step(v):
        v = v[0]
        resum = _resum(sharded)
        flat_sum = lambda: (v, resum, lambda total: [total])  # noqa: E731
        totals, count = guard.guarded_totals([resum(v)], flat_sum, "data", sharded)
        return totals[0], count

    out_specs = (P("data") if sharded else P(), P())
    total, count = _on_devices(step, x, out_specs=out_specs)
    finite = np.where(np.isfinite(x), x, 0.0)
    np.testing.assert_allclose(np.asarray(total), finite.sum(axis=0)[0], rtol=1e-5, atol=1e-6)
    assert float(count) == (2 if plant else 0)


@pytest.mark.parametrize("sharded", [False, True])
def test_guard_guarded_totals_counts_a_sum_that_overflowed_once(sharded):
    x = np.ones((N_DEVICES, 1, 16), np.float32)
    x[:, 0, 2] = 3e38  # finite on every device, the sum is not
    x[5, 0, 7] = np.nan

    def step(v):
        v = v[0]
        resum = _resum(sharded)
        flat_sum = lambda: (v, resum, lambda total: [total])  # noqa: E731
        totals, count = guard.guarded_totals([resum(v)], flat_sum, "data", sharded)
        return totals[0], count

    total, count = _on_devices(step, x, out_specs=(P("data") if sharded else P(), P()))
    want = np.full(16, 8.0, np.float32)
    want[2], want[7] = 0.0, 7.0
    np.testing.assert_array_equal(np.asarray(total), want)
    assert float(count) == 2  # the NaN, and the overflowed entry once (not once per device)


def test_guard_skip_flag_and_hold():
    assert guard.skip_flag("zero", jnp.float32(3)) is None
    for policy in ("skip", "raise"):
        assert bool(guard.skip_flag(policy, jnp.float32(1)))
        assert not bool(guard.skip_flag(policy, jnp.float32(0)))
    old = {"a": jnp.arange(3), "b": None}
    new = {"a": jnp.arange(3) + 10, "b": None}
    assert guard.hold(None, old, new) is new
    np.testing.assert_array_equal(guard.hold(jnp.bool_(True), old, new)["a"], [0, 1, 2])
    np.testing.assert_array_equal(guard.hold(jnp.bool_(False), old, new)["a"], [10, 11, 12])
    assert NONFINITE_POLICIES[0] == "zero"


# --- warm-up ------------------------------------------------------------------------------------


def test_warmup_length_and_branches():
    assert warmup.warmup_length(TopK(0.1), 0) == 0
    assert warmup.warmup_length(TopK(0.1), 7) == 7
    assert warmup.warmup_length(Dense(), 7) == 0  # dense already
    with pytest.raises(ValueError, match="warmup_steps"):
        warmup.warmup_length(TopK(0.1), -1)
    assert warmup.branches(TopK(0.1), 0) == (TopK(0.1),)
    assert warmup.branches(TopK(0.1), 3) == (warmup.DENSE, TopK(0.1))
    warmup.check_switchable(TopK(0.1), 3)
    warmup.check_switchable(Zfp(8, algorithm="recursive_doubling"), 0)
    with pytest.raises(ValueError, match="warmup_steps needs a method whose total"):
        warmup.check_switchable(Zfp(8, algorithm="recursive_doubling"), 3)


@pytest.mark.parametrize("step", [0, 2, 3, 10])
def test_warmup_choose_follows_the_step(step):
    groups = aggregation.Groups([None, None], ["leaf 0", "leaf 1"], [1000, 30], 8, None, 4)
    runs = warmup.branches(TopK(0.1), 3)
    branch, sent, kept = warmup.choose(runs, groups, jnp.int32(step), 3)
    expected = runs[int(step >= 3)]
    want_sent, want_kept, _ = aggregation.static_cost(expected, groups)
    assert int(branch) == int(step >= 3)
    assert float(sent) == np.float32(want_sent) and float(kept) == want_kept
    # Without a warm-up: the one method, static.
    assert warmup.choose((TopK(0.1),), groups, jnp.int32(step), 0) == (
        0,
        *aggregation.static_cost(TopK(0.1), groups)[:2],
    )


# --- mask ---------------------------------------------------------------------------------------


def _tree():
    return {
        "bias": jnp.zeros(3),
        "count": jnp.zeros((), jnp.int32),
        "kernel": jnp.zeros((4, 5)),
        "scale": jnp.zeros(9),
    }


@pytest.mark.parametrize("min_size", [0, 4, 10, 100])
@pytest.mark.parametrize("by", ["none", "tree", "callable"])
def test_mask_compressed_leaves_against_reference(by, min_size):
    tree = _tree()
    chosen = {"bias": True, "count": False, "kernel": True, "scale": False}
    given = {"none": None, "tree": chosen, "callable": lambda params: chosen}[by]
    got = mask.compressed_leaves(given, min_size, tree)
    leaves = jax.tree.leaves(tree)
    flags = [True] * 4 if by == "none" else jax.tree.leaves(chosen)
    assert got == [f and leaf.size >= min_size for f, leaf in zip(flags, leaves)]


def test_mask_refuses_a_mask_that_does_not_fit():
    with pytest.raises(ValueError, match="mask must have the structure"):
        mask.compressed_leaves({"bias": True}, 0, _tree())
    with pytest.raises(ValueError, match="mask must hold Python bools"):
        mask.compressed_leaves(jax.tree.map(lambda _: 1, _tree()), 0, _tree())


@pytest.mark.parametrize("granularity", ["model", "leaf"])
def test_mask_layout(granularity):
    c = FeedbackConfig.check("data", True, granularity, True, 0, "zero", min_size=4)
    lay = mask.layout(c, _tree(), sends_everything=False)
    # Leaves in key order: bias (3), count (int), kernel (20), scale (9).
    assert lay.floats == [0, 2, 3] and lay.plain == [0]
    if granularity == "model":
        assert lay.groups == [([2, 3], "the model")]
    else:
        assert lay.groups == [([2], "leaf 2"), ([3], "leaf 3")]
    assert lay.compressed == {2, 3}
    dense = mask.layout(c, _tree(), sends_everything=True)
    if granularity == "model":  # the small leaves of one dtype are summed as one vector
        assert dense.groups == [([0, 2, 3], "leaves [0, 2, 3]")] and not dense.plain
    else:
        assert dense.groups == [([0], "leaf 0"), ([2], "leaf 2"), ([3], "leaf 3")]
    residual = [optax.MaskedNode(), None, jnp.zeros(20), jnp.zeros(9)]
    mask.check_same_choice(lay, residual)
    mask.check_same_choice(lay, None)
    with pytest.raises(ValueError, match="mask and min_size choose other leaves"):
        mask.check_same_choice(lay, [jnp.zeros(3), None, jnp.zeros(20), jnp.zeros(9)])


@pytest.mark.parametrize("sharded", [False, True])
def test_mask_sum_plain_against_numpy(sharded):
    rng = np.random.default_rng(2)
    a = rng.standard_normal((N_DEVICES, 1, 5)).astype(np.float32)
    b = rng.standard_normal((N_DEVICES, 1, 11)).astype(np.float32)
    shards = N_DEVICES if sharded else None

    def step(x, y):
        total, sent, kept = mask.sum_plain([x[0], y[0]], "data", N_DEVICES, 4, jnp.float32, shards)
        assert kept == 16
        want = Dense().reduce_scatter_bytes if sharded else Dense().wire_bytes
        assert sent == want(16, N_DEVICES, dtype_bytes=4)
        return total

    total = np.asarray(_on_devices(step, a, b, out_specs=P("data") if sharded else P()))
    sums = [a.sum(axis=0)[0], b.sum(axis=0)[0]]
    if sharded:
        rebuilt = sharding.from_shard_major(jnp.asarray(total), [5, 11], N_DEVICES)
        for piece, want in zip(rebuilt, sums):
            np.testing.assert_allclose(np.asarray(piece), want, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_allclose(total, np.concatenate(sums), rtol=1e-5, atol=1e-6)


# --- momentum -----------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [0.0, 0.5, 0.9])
def test_momentum_accumulate_against_numpy(m):
    rng = np.random.default_rng(3)
    u, g = rng.standard_normal((2, 17)).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(momentum.accumulate(m, jnp.asarray(u), jnp.asarray(g))), m * u + g, rtol=1e-6
    )


def test_momentum_clear_sent_dense_and_sparse_agree():
    u = jnp.arange(1.0, 9.0)
    indices = jnp.array([1, 4, 6])
    values = u[indices]
    dense_sent = jnp.zeros(8).at[indices].set(values)
    expected = np.where(np.isin(np.arange(8), [1, 4, 6]), 0.0, np.arange(1.0, 9.0))
    np.testing.assert_array_equal(momentum.clear_sent(u, dense_sent, False), expected)
    np.testing.assert_array_equal(momentum.clear_sent(u, (indices, values), True), expected)


def test_momentum_check():
    momentum.check(TopK(0.1), 0.9)
    momentum.check(RandomK(0.1), 0.9)
    momentum.check(Dense(), None)
    with pytest.raises(ValueError, match="momentum_correction applies to the sparsifying"):
        momentum.check(Dense(), 0.9)


# --- error feedback -----------------------------------------------------------------------------


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_error_feedback_fused_against_numpy(dtype, with_residual):
    grads = [_with_nonfinite(s, dtype, seed=i) for i, s in enumerate(SHAPES)]
    rng = np.random.default_rng(4)
    residuals = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in SHAPES]
    packed = error_feedback.fused(grads, residuals if with_residual else None)
    fed, count = packed.vector, packed.nonfinite
    parts, bad, energy = [], 0, 0.0
    for g, r in zip(grads, residuals):
        g = np.asarray(g, np.float32)
        bad += (~np.isfinite(g)).sum()
        g = np.where(np.isfinite(g), g, 0.0)
        energy += float(np.sum(np.square(g, dtype=np.float64)))
        parts.append((g + np.asarray(r) if with_residual else g).reshape(-1))
    want = np.concatenate(parts)
    np.testing.assert_allclose(np.asarray(fed), want, rtol=1e-6)
    assert float(count) == bad
    # The energies the metrics and the guardrail read, from the same pass.
    np.testing.assert_allclose(float(packed.gradient), energy, rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(packed.fed),
        np.asarray(flat.energies(jnp.asarray(want), ratio_choice.ENERGY_SCALE)),
        rtol=1e-5,
    )
    assert float(packed.fed[0]) == pytest.approx(np.sum(np.square(want, dtype=np.float64)), 1e-5)
    # The unfused stages give the same vector.
    unfused = [
        error_feedback.add_residual(guard.finite(g)[0], r) if with_residual else guard.finite(g)[0]
        for g, r in zip(grads, residuals)
    ]
    np.testing.assert_array_equal(np.asarray(packing.pack(unfused, None, None)), np.asarray(fed))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_error_feedback_remaining_dense_and_sparse_agree(dtype):
    rng = np.random.default_rng(5)
    fed = jnp.asarray(rng.standard_normal(33), jnp.float32)
    indices = jnp.array([0, 7, 32])
    values = fed[indices].astype(dtype)
    dense = jnp.zeros(33, dtype).at[indices].set(values)
    want = np.asarray(fed) - np.asarray(dense, np.float32)
    np.testing.assert_array_equal(error_feedback.remaining(fed, dense, False), want)
    np.testing.assert_array_equal(error_feedback.remaining(fed, (indices, values), True), want)


# --- aggregation --------------------------------------------------------------------------------


def test_aggregation_run_branch_static_and_traced_agree():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((N_DEVICES, 1, 64)).astype(np.float32)
    runs = (Dense(), TopK(0.25, collective="ar"))

    def step(v, branch):
        groups = aggregation.Groups([v[0]], ["the model"], [64], N_DEVICES, None, 4)
        key = jax.random.key(0)
        static = aggregation.run_branch(runs, 1, groups, "data", 0, key, False, (None, None))
        traced = aggregation.run_branch(
            runs, branch[0, 0], groups, "data", 0, key, False, (None, None)
        )
        direct = aggregation.aggregate_groups(runs[1], groups, "data", 0, jax.random.key(0))
        dense = aggregation.run_branch(
            runs, branch[0, 0] - 1, groups, "data", 0, key, False, (None, None)
        )
        return static[0][0], traced[0][0], direct[0][0], dense[0][0]

    branch = np.ones((N_DEVICES, 1, 1), np.int32)
    static, traced, direct, dense = _on_devices(step, x, branch)
    np.testing.assert_array_equal(static, traced)
    np.testing.assert_array_equal(static, direct)
    np.testing.assert_allclose(dense, x.sum(axis=0)[0], rtol=1e-5, atol=1e-5)
    # AR top-k keeps at most k = 16 of the 64 values.
    assert 0 < np.count_nonzero(np.asarray(static)) <= 16


def test_aggregation_static_cost_sums_the_groups():
    groups = aggregation.Groups([None, None], ["leaf 0", "leaf 1"], [100, 28], 8, None, 4)
    sent, kept, steps = aggregation.static_cost(Dense(), groups)
    assert kept == 128
    assert sent == Dense().wire_bytes(100, 8, dtype_bytes=4) + Dense().wire_bytes(
        28, 8, dtype_bytes=4
    )
    assert steps == 2 * Dense().message_steps(8)


def test_aggregation_init_method_state():
    state = aggregation.init_method_state((Dense(), PowerSGD(2)), [((32, 16), (16,)), ((64, 32),)])
    assert state[0] is None
    assert [[q.shape for q in group] for group in state[1]] == [[(16, 2)], [(32, 2)]]


# --- metrics ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sparse", [False, True])
def test_metrics_gain_against_numpy(sparse):
    rng = np.random.default_rng(7)
    fed = rng.standard_normal((N_DEVICES, 1, 10)).astype(np.float32)
    keep = np.zeros(10, bool)
    keep[[1, 5]] = True
    counts = np.arange(N_DEVICES, dtype=np.float32).reshape(N_DEVICES, 1, 1)

    def step(f, count):
        f = f[0]
        if sparse:
            sent = (jnp.array([1, 5]), f[jnp.array([1, 5])])
        else:
            sent = jnp.where(jnp.asarray(keep), f, 0.0)
        result = aggregation.Aggregation([f], [sent], 0.0, 2, 0, sparse, False)
        return metrics.gain_and_nonfinite(result, [f], count[0, 0], "data")

    gain, count = _on_devices(step, fed, counts)
    want = (fed[..., keep] ** 2).sum() / (fed**2).sum()
    np.testing.assert_allclose(float(gain), want, rtol=1e-5)
    assert float(count) == counts.sum()


def test_metrics_gain_is_one_when_everything_is_sent():
    counts = np.ones((N_DEVICES, 1, 1), np.float32)

    def step(count):
        result = aggregation.Aggregation([], [], 0.0, 0, 0, False, True)
        return metrics.gain_and_nonfinite(result, [], count[0, 0], "data")

    gain, count = _on_devices(step, counts)
    assert float(gain) == 1.0 and float(count) == N_DEVICES


def test_metrics_step_metrics():
    m = metrics.step_metrics(jnp.float32(0.5), 100.0, 25, 1, jnp.float32(2), 50)
    assert m.density.dtype == jnp.float32 and float(m.density) == 0.5
    assert m.method.dtype == jnp.int32 and int(m.method) == 1
    assert float(m.bytes_sent) == 100.0 and float(m.gain) == 0.5 and float(m.nonfinite) == 2


# --- packing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shards", [None, 3, 8])
def test_packing_round_trip(shards):
    leaves = [jnp.arange(float(np.prod(s))).reshape(s) + 100 * i for i, s in enumerate(SHAPES)]
    row = packing.row((Dense(),), leaves, shards)
    vector = packing.pack(leaves, shards, row)
    if shards is None:
        assert row is None and vector.shape == (sum(leaf.size for leaf in leaves),)
    else:
        assert vector.shape == (shards * row,)
    for i, piece in packing.pieces(leaves, range(len(leaves)), vector, shards):
        np.testing.assert_array_equal(np.asarray(piece)[: leaves[i].size], leaves[i].reshape(-1))


def test_packing_write_and_keep():
    leaves = [jnp.zeros(2, jnp.bfloat16), jnp.zeros((1, 3))]
    total = jnp.arange(5.0)
    out = [None, None]
    packing.write(out, leaves, [0, 1], total, 0.5, None)
    assert out[0].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out[0], np.float32), [0.0, 0.5])
    np.testing.assert_array_equal(out[1], [[1.0, 1.5, 2.0]])
    packing.write(out, leaves, [0, 1], total, 0.5, jnp.bool_(True))
    assert not np.asarray(out[1]).any()
    old = [jnp.full(2, 7.0), jnp.full((1, 3), 7.0)]
    new = [None, None]
    packing.keep(new, old, leaves, [0, 1], total, jnp.bool_(True))
    np.testing.assert_array_equal(new[1], old[1])
    packing.keep(new, old, leaves, [0, 1], total, None)
    np.testing.assert_array_equal(new[1], [[2.0, 3.0, 4.0]])
