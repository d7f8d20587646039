"""MSTopK threshold search (find_threshold, threshold_topk): native kernels against the
pure-JAX reference, numpy counts and the documented bracket guarantee."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_equal
from topk_test import DTYPES, SHAPE_K, assert_same

import jaxcomp
from jaxcomp.ops import reference

# 1 and 8 rounds settle only exponent bits, 16 is the default (one histogram pass), 23 and 31
# need the kernel's second pass; 31 is exact top-k.
ROUNDS = (1, 8, 16, 23, 31)


def gradient_like(shape, dtype, seed=0):
    """Normal values over several binades, rounded to ``dtype`` (ties are common in 16 bits)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-6, 3, shape))
    return jnp.asarray(x, dtype)


def keys_of(x):
    """Magnitude keys (int64 for easy arithmetic) of x's float32 upcast, rows flattened."""
    x32 = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
    return (x32.view(np.uint32) & 0x7FFFFFFF).astype(np.int64)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape,k", SHAPE_K)
def test_find_threshold_matches_reference_and_numpy(dtype, shape, k):
    x = gradient_like(shape, dtype)
    x32 = np.asarray(x, np.float32)
    for rounds in ROUNDS:
        threshold, count = jaxcomp.find_threshold(x, k, rounds=rounds)
        assert threshold.shape == count.shape == shape[:-1]
        assert threshold.dtype == jnp.float32 and count.dtype == jnp.int32
        np.testing.assert_array_equal(
            count, np.sum(np.abs(x32) >= np.asarray(threshold)[..., None], axis=-1)
        )
        assert np.all(np.asarray(count) >= k)
        # The reference sees the exact float32 upcast, so it compiles once per shape for all dtypes.
        assert_same((threshold, count), reference.find_threshold(x32, k, rounds=rounds))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape,k", SHAPE_K)
def test_threshold_topk_matches_reference_and_keeps_the_bracket(dtype, shape, k):
    x = gradient_like(shape, dtype, seed=1)
    x32 = np.asarray(x, np.float32)
    keys = keys_of(x)
    for rounds in ROUNDS:
        values, indices = jaxcomp.threshold_topk(x, k, rounds=rounds)
        assert values.shape == indices.shape == shape[:-1] + (k,)
        assert values.dtype == x.dtype and indices.dtype == jnp.int32
        assert_same(
            (np.asarray(values, np.float32), indices),
            reference.threshold_topk(x32, k, rounds=rounds),
        )
        # The guarantee: selected keys >= lo, unselected keys < hi = lo + 2^(31 - rounds).
        threshold, _ = jaxcomp.find_threshold(x, k, rounds=rounds)
        lo = keys_of(threshold[..., None])[:, 0]
        hi = lo + 2 ** (31 - rounds)
        flat_indices = np.asarray(indices).reshape(-1, k)
        for row_keys, row_indices, row_lo, row_hi in zip(keys, flat_indices, lo, hi):
            assert np.all(np.diff(row_indices) > 0)  # distinct, ascending
            selected = np.zeros(row_keys.shape, bool)
            selected[row_indices] = True
            assert np.all(row_keys[selected] >= row_lo)
            assert np.all(row_keys[~selected] < row_hi)


@pytest.mark.parametrize("shape,k", [((4096,), 37), ((100003,), 1000), ((3, 2, 1001), 37)])
def test_31_rounds_equal_exact_topk(shape, k):
    x = gradient_like(shape, jnp.bfloat16, seed=2)  # bfloat16: many ties at the k-th magnitude
    assert_trees_equal(jaxcomp.threshold_topk(x, k, rounds=31), jaxcomp.topk(x, k))
    threshold, count = jaxcomp.find_threshold(x, k, rounds=31)
    kth_largest = -np.sort(-np.abs(np.asarray(x, np.float32)), axis=-1)[..., k - 1]
    np.testing.assert_array_equal(threshold, kth_largest)


@pytest.mark.parametrize("magnitude", [0.5, 0.0])  # 0.0: +0 and -0 share key 0
@pytest.mark.parametrize("shape", [(100003,), (3, 2, 1001)])
def test_bracket_ties_go_to_the_lower_index(shape, magnitude):
    x = jnp.asarray(np.random.default_rng(3).choice([-magnitude, magnitude], shape), jnp.float32)
    _, indices = jaxcomp.threshold_topk(x, 50, rounds=12)
    np.testing.assert_array_equal(indices, np.broadcast_to(np.arange(50), shape[:-1] + (50,)))
    threshold, count = jaxcomp.find_threshold(x, 50, rounds=12)
    np.testing.assert_array_equal(threshold, np.full(shape[:-1], magnitude, np.float32))
    np.testing.assert_array_equal(count, np.full(shape[:-1], shape[-1]))


def test_nan_ranks_largest():
    x = np.random.default_rng(4).standard_normal(70000).astype(np.float32)
    x[[9, 60000]] = np.nan
    x[20] = np.inf
    # From 10 rounds on, NaN (key 0x7FC00000) and Inf (0x7F800000) fall in different brackets.
    for rounds in (10, 16, 31):
        _, indices = jaxcomp.threshold_topk(x, 2, rounds=rounds)
        np.testing.assert_array_equal(indices, [9, 60000])
        _, indices = jaxcomp.threshold_topk(x, 3, rounds=rounds)
        np.testing.assert_array_equal(indices, [9, 20, 60000])
    threshold, count = jaxcomp.find_threshold(x, 2, rounds=31)
    assert np.isnan(threshold) and int(count) == 2


def test_jit_and_vmap():
    x = gradient_like((4, 1001), jnp.float32, seed=5)
    for op in (jaxcomp.find_threshold, jaxcomp.threshold_topk):
        batched = op(x, 10, rounds=12)
        assert_trees_equal(jax.jit(op, static_argnums=(1, 2))(x, 10, 12), batched)
        assert_trees_equal(jax.vmap(lambda row: op(row, 10, rounds=12))(x), batched)


@pytest.mark.parametrize("op", [jaxcomp.find_threshold, jaxcomp.threshold_topk])
@pytest.mark.parametrize(
    "x,k,rounds,error,match",
    [
        (jnp.ones(5), 2, 0, ValueError, r"rounds must be in \[1, 31\], got 0"),
        (jnp.ones(5), 2, 32, ValueError, r"rounds must be in \[1, 31\], got 32"),
        (jnp.ones(5), 2, 4.0, TypeError, "rounds must be a static Python integer"),
        (jnp.ones(5), 0, 16, ValueError, "k must be >= 1"),
        (jnp.ones(5), 6, 16, ValueError, "k must be at most"),
        (jnp.ones(5, jnp.int8), 2, 16, TypeError, "x must be float32"),
        (jnp.ones(5, jnp.complex64), 2, 16, TypeError, "x must be float32"),
    ],
)
def test_bad_arguments_raise_naming_them(op, x, k, rounds, error, match):
    with pytest.raises(error, match=match):
        op(x, k, rounds=rounds)


def test_traced_rounds_is_rejected():
    with pytest.raises(TypeError, match="rounds must be a static Python integer"):
        jax.jit(jaxcomp.threshold_topk, static_argnums=1)(jnp.ones(5), 2, 16)


@pytest.mark.parametrize("target", ["jaxcomp_find_threshold", "jaxcomp_threshold_topk"])
@pytest.mark.parametrize(
    "k,rounds,match",
    [(2, 0, "rounds must be in"), (2, 32, "rounds must be in"), (9, 16, "k must be in")],
)
def test_handler_validates_on_its_own(target, k, rounds, match):
    result_shape = (k,) if target == "jaxcomp_threshold_topk" else ()
    call = jax.ffi.ffi_call(
        target,
        (
            jax.ShapeDtypeStruct(result_shape, jnp.float32),
            jax.ShapeDtypeStruct(result_shape, jnp.int32),
        ),
        vmap_method="broadcast_all",
    )
    with pytest.raises(jax.errors.JaxRuntimeError, match=match):
        jax.block_until_ready(
            call(jnp.ones(5, jnp.float32), k=np.int64(k), rounds=np.int64(rounds))
        )
