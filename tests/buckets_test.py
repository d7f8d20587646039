"""compress(bucket_mb=): buckets sent in the order the backward pass finishes them, each after
the one before, so that XLA neither merges them nor waits for the whole backward pass."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import EntryGraph, all_reduced_arrays

import jaxcomp
from jaxcomp.collectives import small
from jaxcomp.optim import readiness
from jaxcomp.optim.config import FeedbackConfig
from jaxcomp.optim.stages import mask

SIZES = (64, 256, 256, 64, 10)  # a 4-layer MLP: its first layer's gradient is finished last


def _params():
    rng = np.random.default_rng(0)
    return {
        f"l{i}": jnp.asarray(rng.standard_normal((a, b), dtype=np.float32) / np.sqrt(a))
        for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:]))
    }


def _loss(params, x):
    for i in range(len(SIZES) - 1):
        x = jnp.tanh(x @ params[f"l{i}"])
    return jnp.mean(x**2)


def _train(tx, n_devices, steps=3):
    mesh = jax.make_mesh((n_devices,), ("data",), devices=jax.devices()[:n_devices])
    dp = jaxcomp.data_parallel(_loss, tx, mesh)
    state = dp.init(_params())
    rng = np.random.default_rng(1)
    for _ in range(steps):
        batch = dp.shard_batch(rng.standard_normal((4 * n_devices, SIZES[0]), dtype=np.float32))
        state, _ = dp.step(state, batch)
    return dp, state, batch


def test_bucketed_cuts_the_last_leaves_first():
    leaves = [jnp.zeros(4), jnp.zeros(4), jnp.zeros(16), jnp.zeros(2)]
    assert mask.bucketed(leaves, [0, 1, 2, 3], 32) == [[3], [2], [0, 1]]
    assert mask.bucketed(leaves, [0, 1, 2, 3], 1e9) == [[0, 1, 2, 3]]
    assert mask.bucketed(leaves, [0, 1, 2, 3], 1) == [[3], [2], [1], [0]]  # one leaf at least


@pytest.mark.parametrize(
    "granularity, sends_everything, groups",
    [
        ("model", False, [([2], "bucket 0 (leaf 2)"), ([0, 1], "bucket 1 (leaves 0-1)")]),
        ("leaf", False, [([2], "leaf 2"), ([0], "leaf 0"), ([1], "leaf 1")]),
        # A method that sends everything sums the small leaves of a bucket as one vector.
        ("model", True, [([2], "leaf 2"), ([0, 1], "bucket 1 (leaves 0-1)")]),
        ("leaf", True, [([2], "leaf 2"), ([0], "leaf 0"), ([1], "leaf 1")]),
    ],
)
def test_layout_groups_by_bucket(granularity, sends_everything, groups):
    config = FeedbackConfig.check("data", True, granularity, True, 0, "zero", bucket_mb=1e-4)
    tree = [jnp.zeros(8), jnp.zeros(8), jnp.zeros(32)]  # 1e-4 MiB = 104 bytes
    lay = mask.layout(config, tree, sends_everything)
    assert lay.groups == groups
    assert lay.buckets == ([0, 1] if len(groups) == 2 else [0, 1, 1])


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "25", True])
def test_bucket_mb_is_checked_before_anything_runs(bad):
    with pytest.raises(ValueError, match="bucket_mb must be a size in MiB > 0"):
        jaxcomp.compress("dense", bucket_mb=bad)
    with pytest.raises(ValueError, match="bucket_mb"):
        jaxcomp.compress("auto", ratio=0.01, bucket_mb=bad)


@pytest.mark.parametrize("n_devices", [1, 2, 3, 8])
def test_dense_is_bit_identical_with_buckets(n_devices):
    plain = _train(optax.chain(jaxcomp.compress("dense"), optax.adam(1e-2)), n_devices)[1]
    tx = optax.chain(jaxcomp.compress("dense", bucket_mb=0.1), optax.adam(1e-2))
    bucketed = _train(tx, n_devices)[1]
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(bucketed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "n_devices",
    [pytest.param(n, marks=pytest.mark.slow) for n in (1, 2)]
    + [3, pytest.param(8, marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("method, eps", [("fp16", 2.0**-11), ("bf16", 2.0**-8)])
def test_casts_in_buckets_agree_to_their_rounding(n_devices, method, eps):
    """The casts round each value alone, but on the CPU they sum by a ring whose chunks (so each
    value's order of additions and roundings) follow the message's length, and float16's shared
    scale is a bucket's own: in buckets the update is the same to the narrow type's rounding
    (each of a value's N roundings is half an ulp of a partial sum, error feedback carrying what
    is lost), plain SGD so that the update is the sum itself."""
    init = jax.tree.leaves(_params())
    runs = [
        _train(optax.chain(jaxcomp.compress(method, bucket_mb=mb), optax.sgd(1e-2)), n_devices)[1]
        for mb in (None, 0.1)
    ]
    for p0, a, b in zip(init, *(jax.tree.leaves(r.params) for r in runs)):
        plain, bucketed = np.asarray(a) - np.asarray(p0), np.asarray(b) - np.asarray(p0)
        np.testing.assert_allclose(
            bucketed, plain, rtol=0, atol=4 * n_devices * eps * np.abs(plain).max()
        )


@pytest.mark.parametrize("n_devices", [1, 2, 3, 8])
def test_topk_buckets_of_one_leaf_match_leaf_granularity(n_devices):
    # 0.01 MiB holds no two leaves of this MLP: each bucket is one leaf, compressed on its own.
    by_leaf = jaxcomp.compress("ar_topk", ratio=0.05, granularity="leaf")
    by_bucket = jaxcomp.compress("ar_topk", ratio=0.05, bucket_mb=0.01)
    a = _train(optax.chain(by_leaf, optax.sgd(0.1)), n_devices)[1]
    b = _train(optax.chain(by_bucket, optax.sgd(0.1)), n_devices)[1]
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _collective_dependencies(hlo: str):
    """Per gradient-sized collective of the compiled entry computation: how many of the step's
    dots it waits for (transitively), and how many dots there are."""
    graph = EntryGraph(hlo)
    dots = graph.dots()
    collectives = [n for n in graph.order if graph.kinds[n] == "all-reduce"]
    return [len(dots & graph.ancestors(c)) for c in collectives], len(dots)


@pytest.mark.parametrize("method", ["dense", "ar_topk"])
def test_the_first_bucket_does_not_wait_for_the_whole_backward_pass(method):
    """The HLO: without buckets every gradient collective waits for every dot of the step (XLA
    merged them); with buckets the first waits for fewer, so it can run beside the rest."""
    options = {"ratio": 0.05} if method == "ar_topk" else {}
    hlo = {}
    for bucket_mb in (None, 0.2):
        tx = optax.chain(jaxcomp.compress(method, bucket_mb=bucket_mb, **options), optax.sgd(0.1))
        dp, state, batch = _train(tx, 2, steps=1)
        hlo[bucket_mb] = dp.step.lower(state, batch).compile().as_text()
    waits, dots = _collective_dependencies(hlo[None])
    assert dots >= 7 and min(waits) == dots
    waits, dots = _collective_dependencies(hlo[0.2])
    assert min(waits) < dots, waits
    # The chain writes into each bucket's own buffer: XLA adds no copy for it.
    assert hlo[0.2].count(" copy(") <= hlo[None].count(" copy(")


def test_backward_order_puts_a_late_used_leaf_last():
    # "a_embed" sorts first but its gradient is finished last: the input is embedded first.
    def loss(p, x):
        h = jnp.tanh(x @ p["a_embed"])
        return jnp.sum(jnp.tanh(h @ p["b_hidden"]) @ p["c_head"])

    params = {"a_embed": jnp.ones((3, 4)), "b_hidden": jnp.ones((4, 4)), "c_head": jnp.ones(4)}
    assert readiness.backward_order(jax.grad(loss), params, jnp.ones((2, 3))) == (2, 1, 0)


def test_bucket_ranks_follow_the_order():
    # Buckets (by tree order) [leaf 2], [leaves 0-1]; leaf 2 finished last: [0, 1] goes first.
    assert readiness.bucket_ranks([0, 1], [[2], [0, 1]], (0, 1, 2)) == [1, 0]
    assert readiness.bucket_ranks([0, 1], [[2], [0, 1]], None) == [0, 1]
    assert readiness.bucket_ranks([0, 0, 1], [[2], [1], [0]], (0, 1, 2)) == [1, 1, 0]


def test_data_parallel_sends_by_the_backward_order():
    """The embedding sorts last in the tree (the default order would send it first) and is
    finished last: data_parallel sends the head's bucket first, the embedding's last."""

    def loss(p, x):
        h = jnp.tanh(x @ p["z_embed"])
        h = jnp.tanh(h @ p["b_hidden"])
        return jnp.mean(jnp.tanh(h @ p["a_head"]) ** 2)

    rng = np.random.default_rng(0)
    params = {
        "z_embed": jnp.asarray(rng.standard_normal((32, 256), dtype=np.float32)),
        "b_hidden": jnp.asarray(rng.standard_normal((256, 256), dtype=np.float32)),
        "a_head": jnp.asarray(rng.standard_normal((256, 64), dtype=np.float32)),
    }
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    tx = optax.chain(jaxcomp.compress("dense", bucket_mb=0.1), optax.sgd(0.1))
    dp = jaxcomp.data_parallel(loss, tx, mesh)
    state = dp.init(params)
    batch = dp.shard_batch(rng.standard_normal((8, 32), dtype=np.float32))
    waits, dots = _collective_dependencies(dp.step.lower(state, batch).compile().as_text())
    # The head's bucket waits for the forward pass and the head's backward dots only (by the
    # tree's order the embedding's bucket went first: [6, 7, 8] of 8).
    assert waits == sorted(waits) and waits[0] <= dots // 2 and waits[-1] == dots, waits


def test_an_empty_leaf_in_a_bucket_is_passed_over():
    # 1e-4 MiB = 104 bytes: buckets [b, c] (b has no values) and [a]; the second waits for
    # the first's totals, the empty one among them.
    params = {"a": jnp.ones((4, 8)), "b": jnp.zeros((0, 3)), "c": jnp.ones((8, 2))}

    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["a"]) @ p["c"]) + jnp.sum(p["b"])

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    for method in ("dense", "ar_topk"):
        options = {"ratio": 0.5} if method == "ar_topk" else {}
        tx = optax.chain(jaxcomp.compress(method, bucket_mb=1e-4, **options), optax.sgd(0.1))
        dp = jaxcomp.data_parallel(loss, tx, mesh)
        state, _ = dp.step(dp.init(params), dp.shard_batch(np.ones((4, 4), np.float32)))
        assert np.isfinite(np.asarray(state.params["a"])).all()


@pytest.mark.parametrize("bucket_mb", [None, 0.2])
def test_the_dense_step_copies_no_gradient(bucket_mb):
    """The non-finite guard's second sum sits in a loop that runs once or never: a ``lax.cond``
    there copied every total its finite branch passed through, a whole gradient per step."""
    tx = optax.chain(jaxcomp.compress("dense", bucket_mb=bucket_mb), optax.adam(0.1))
    dp, state, batch = _train(tx, 2, steps=1)
    hlo = dp.step.lower(state, batch).compile().as_text()
    copied = re.findall(r"= f32\[(\d+)(?:,(\d+))?\]\S* copy\(", hlo)
    assert copied == [] and hlo.count(" while(") == 1, copied


def test_summed_together_keeps_large_leaves_alone_and_dtypes_apart():
    leaves = [jnp.zeros(3), jnp.zeros(70000), jnp.zeros(5, jnp.bfloat16), jnp.zeros(2)]
    leaves.append(jnp.zeros(small.JOINED_VALUES))
    assert mask.summed_together(leaves, [0, 1, 2, 3, 4]) == [[0, 3, 4], [1], [2]]
    assert mask.summed_together(leaves, []) == []


def _many_leaves(n=48):
    rng = np.random.default_rng(0)
    return {
        f"w{i:02d}": jnp.asarray(rng.standard_normal((8, 8), dtype=np.float32) / 3)
        for i in range(n)
    }


def _many_leaves_loss(params, x):
    for key in sorted(params):
        x = jnp.tanh(x @ params[key])
    return jnp.mean(x**2)


@pytest.mark.parametrize("granularity", ["model", "leaf"])
def test_dense_sums_many_small_leaves_as_one_vector(granularity):
    """XLA merges per-leaf all-reduces into one instruction, but XLA:CPU runs that as one
    collective per leaf (over gloo a round trip each): dense joins the small leaves first, unless
    ``granularity="leaf"`` asks for one collective per leaf."""
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    tx = optax.chain(jaxcomp.compress("dense", granularity=granularity), optax.sgd(0.1))
    dp = jaxcomp.data_parallel(_many_leaves_loss, tx, mesh)
    state = dp.init(_many_leaves())
    batch = dp.shard_batch(np.ones((4, 8), np.float32))
    arrays = all_reduced_arrays(dp.step.lower(state, batch).compile().as_text())
    assert (arrays <= 4) if granularity == "model" else (arrays >= 48), arrays


@pytest.mark.parametrize("n_devices", [1, 2, 3, 8])
def test_dense_of_small_leaves_joined_matches_per_leaf(n_devices):
    """The same sums; XLA fuses the work around a joined vector otherwise, so the last bit of an
    update may round another way. After three Adam steps on 3 devices (numpy 2.4, optax 0.2.8)
    one parameter of 0.000277 differed by 1.04e-7, 3.8e-4 relative. Adam moves each parameter by
    up to the learning rate a step, so ``atol`` is 1e-4 of the learning rate."""
    mesh = jax.make_mesh((n_devices,), ("data",), devices=jax.devices()[:n_devices])
    rng = np.random.default_rng(2)
    batches = [rng.standard_normal((2 * n_devices, 8), dtype=np.float32) for _ in range(3)]
    params = []
    for granularity in ("model", "leaf"):
        tx = optax.chain(jaxcomp.compress("dense", granularity=granularity), optax.adam(1e-2))
        dp = jaxcomp.data_parallel(_many_leaves_loss, tx, mesh)
        state = dp.init(_many_leaves())
        for batch in batches:
            state, _ = dp.step(state, dp.shard_batch(batch))
        params.append(jax.tree.leaves(state.params))
    for a, b in zip(*params):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4 * 1e-2)
