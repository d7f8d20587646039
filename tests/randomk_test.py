"""RandomK (jaxcomp.methods.randomk): a method from issue 15 landed as one file, against a numpy
reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import count_compilations, need_devices
from jax.sharding import Mesh

import jaxcomp
from jaxcomp.costmodel import cost
from jaxcomp.methods import RandomK
from jaxcomp.methods.randomk import shared_indices

# compress(mean=False) makes these references exact sums, and compress(seed=) sets the key: both
# deprecated until jaxcomp 0.3, so these tests also keep the old keywords working.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:compress(_auto)?\((mean|seed)=\) is deprecated:DeprecationWarning"
)

N_DEVICES = 8


def _mesh():
    need_devices(N_DEVICES)
    return Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))


@pytest.mark.parametrize("n, k", [(100, 10), (1003, 17), (7, 7), (5, 1), (2**20, 1000)])
def test_shared_indices_are_distinct_in_range_and_deterministic(n, k):
    key = jax.random.key(n + k)
    idx = np.asarray(shared_indices(key, n, k))
    assert idx.dtype == np.int32 and idx.shape == (k,)
    assert len(set(idx.tolist())) == k and idx.min() >= 0 and idx.max() < n
    np.testing.assert_array_equal(idx, np.asarray(shared_indices(key, n, k)))


def test_shared_indices_pick_every_index_alike():
    """Each index is drawn with probability k / n (n not a multiple of k: the rotation evens it
    out)."""
    n, k, draws = 50, 7, 4000
    counts = np.zeros(n)
    sample = jax.jit(jax.vmap(lambda key: shared_indices(key, n, k)))(
        jax.random.split(jax.random.key(0), draws)
    )
    np.add.at(counts, np.asarray(sample).ravel(), 1)
    expected = draws * k / n
    assert np.abs(counts - expected).max() < 5 * np.sqrt(expected)


def test_aggregate_matches_numpy_and_error_feedback_is_exact():
    """Every device sends its values at the shared indices; the sum equals numpy's; sum of
    aggregates = sum of gradients - residuals over several steps; replicas agree; one
    compilation."""
    n, steps = 1000, 3
    method = RandomK(0.05)
    tx = optax.chain(jaxcomp.compress(method, mean=False), optax.sgd(1.0))
    dp = jaxcomp.data_parallel(lambda w, b: jnp.sum(w * jnp.mean(b, axis=0)), tx, _mesh())
    state = dp.init(jnp.zeros(n))
    rng = np.random.default_rng(0)
    fed = np.zeros(n)
    with count_compilations() as compiles:
        for step in range(steps):
            batch = rng.standard_normal((N_DEVICES, n)).astype(np.float32)
            residual_before = np.asarray(
                jaxcomp.find_compress_state(state.opt_state).residual, np.float64
            )
            params_before = np.asarray(state.params, np.float64)
            state, metrics = dp.step(state, batch)
            fed += batch.sum(axis=0)
            # numpy reference of this step: the indices from the step's key, the sum of the
            # error-fed values at them.
            key = jax.random.fold_in(
                jax.random.fold_in(jaxcomp.find_compress_state(state.opt_state).key, step), 0
            )
            idx = np.asarray(shared_indices(key, n, 50))
            error_fed = batch + residual_before
            expected = np.zeros(n)
            expected[idx] = error_fed[:, idx].sum(axis=0)
            np.testing.assert_allclose(
                params_before - np.asarray(state.params), expected, rtol=1e-5, atol=1e-5
            )
            assert float(metrics["bytes_sent"]) == method.wire_bytes(n, N_DEVICES)
            assert float(metrics["density"]) == pytest.approx(0.05)
        first = compiles[0]
        state, _ = dp.step(state, rng.standard_normal((N_DEVICES, n)).astype(np.float32))
    assert compiles[0] == first
    residual = np.asarray(jaxcomp.find_compress_state(state.opt_state).residual, np.float64)
    assert residual.shape == (N_DEVICES, n)


def test_error_feedback_identity_over_steps():
    n = 600
    tx = optax.chain(jaxcomp.compress(RandomK(k=30), mean=False), optax.sgd(1.0))
    dp = jaxcomp.data_parallel(lambda w, b: jnp.sum(w * jnp.mean(b, axis=0)), tx, _mesh())
    state = dp.init(jnp.zeros(n))
    rng = np.random.default_rng(1)
    fed = np.zeros(n)
    for _ in range(4):
        batch = rng.standard_normal((N_DEVICES, n)).astype(np.float32)
        fed += batch.astype(np.float64).sum(axis=0)
        state, _ = dp.step(state, batch)
        residual = np.asarray(jaxcomp.find_compress_state(state.opt_state).residual, np.float64)
        np.testing.assert_allclose(
            -np.asarray(state.params), fed - residual.sum(axis=0), rtol=1e-5, atol=1e-4
        )


def test_wire_bytes_are_one_allreduce_of_k_values_and_cost_model_agrees():
    m = RandomK(0.01)
    assert m.wire_bytes(10_000, 8) == 2 * 7 / 8 * 100 * 4
    assert m.wire_bytes(10_000, 8, dtype_bytes=2) == 2 * 7 / 8 * 100 * 2
    assert m.wire_bytes(10_000, 1) == 0.0 and m.message_steps(8) == 14
    assert RandomK(0.01, allreduce="tree").message_steps(8) == 6
    # It sends values only, so it beats AR-Topk (values and indices) on the same network.
    net = cost.Network.parse("1ms", "1gbit")
    assert cost.predict(m, 4e8, 8, net) < cost.predict(
        jaxcomp.TopK(0.01, collective="ar"), 4e8, 8, net
    )
    assert cost.predict("randomk", 4e8, 8, net, ratio=0.01) == cost.predict(m, 4e8, 8, net)


def test_randomk_runs_in_compress_auto_and_ratio_search():
    state = jaxcomp.compress_auto(
        [jaxcomp.Dense(), RandomK(0.5)], ratio_search=jaxcomp.RatioSearch((0.01, 0.1))
    ).init({"w": jnp.zeros(3)})
    assert [m.describe() for m in state.methods] == [
        "dense",
        "randomk(0.1)",
        "randomk(0.0333)",
        "randomk(0.01)",
    ]


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: RandomK(), "exactly one of ratio"),
        (lambda: RandomK(0.1, k=3), "exactly one of ratio"),
        (lambda: RandomK(0.0), "ratio must be in"),
        (lambda: RandomK(k=0), "k must be"),
        (lambda: RandomK(0.1, allreduce="star"), "allreduce must be one of"),
        (lambda: RandomK(k=11).wire_bytes(10, 2), "k=11 exceeds"),
    ],
)
def test_bad_arguments_are_named(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()
