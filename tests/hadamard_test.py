"""jaxcomp.ops.hadamard: the native Walsh-Hadamard kernel against its XLA path and the matrix, and
the counter-hash random streams of the quantizer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp.ops.hadamard import counter_signs, counter_uniform, hadamard_reference


def sylvester(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@pytest.mark.parametrize(
    "shape",
    [(1,), (2,), (8,), (3, 16), (2, 5, 64), (1024,)]
    + [pytest.param(s, marks=pytest.mark.slow) for s in ((4, 2**14), (2**15,))],
)
def test_native_equals_xla_path_bit_for_bit_and_the_matrix(shape):
    x = jax.random.normal(jax.random.key(shape[-1]), shape)
    got = jaxcomp.hadamard_transform(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(hadamard_reference(x)))
    if shape[-1] <= 1024:  # the matrix itself; larger rows are checked through H H = n I
        want = np.asarray(x, np.float64) @ sylvester(shape[-1]).T
    else:
        want = np.asarray(x, np.float64)
        got = jaxcomp.hadamard_transform(got) / shape[-1]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.sqrt(shape[-1]))


def test_is_its_own_inverse_up_to_n_and_works_under_jit_and_vmap():
    x = jax.random.normal(jax.random.key(0), (6, 256))
    twice = jax.jit(jaxcomp.hadamard_transform)(jaxcomp.hadamard_transform(x)) / 256
    np.testing.assert_allclose(np.asarray(twice), np.asarray(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(jaxcomp.hadamard_transform)(x)),
        np.asarray(jaxcomp.hadamard_transform(x)),
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_narrow_floats_are_transformed_in_float32(dtype):
    x = jnp.arange(16, dtype=dtype)
    got = jaxcomp.hadamard_transform(x)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(hadamard_reference(x.astype(jnp.float32)))
    )


@pytest.mark.parametrize(
    "x, error, match",
    [
        (jnp.ones(3), ValueError, "power-of-two"),
        (jnp.ones((4, 12)), ValueError, "power-of-two"),
        (jnp.ones(()), ValueError, "at least one dimension"),
        (jnp.ones(4, jnp.int32), TypeError, "x"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(x, error, match):
    with pytest.raises(error, match=match):
        jaxcomp.hadamard_transform(x)


def test_handler_validates_on_its_own():
    call = jax.ffi.ffi_call(
        "jaxcomp_hadamard", jax.ShapeDtypeStruct((6,), jnp.float32), vmap_method="broadcast_all"
    )
    with pytest.raises(Exception, match="power of two"):
        jax.block_until_ready(call(jnp.ones(6, jnp.float32)))
    call = jax.ffi.ffi_call(
        "jaxcomp_hadamard", jax.ShapeDtypeStruct((4,), jnp.float32), vmap_method="broadcast_all"
    )
    with pytest.raises(Exception, match="out must have x's leading dimensions followed by n = 8"):
        jax.block_until_ready(call(jnp.ones(8, jnp.float32)))


def test_counter_streams_are_uniform_independent_and_keyed():
    key = jax.random.key(7)
    u = np.asarray(counter_uniform(key, (200_000,)), np.float64)
    assert 0.0 <= u.min() and u.max() < 1.0
    # Mean, variance and neighbour correlation of a uniform stream, within 5 standard errors.
    assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / u.size)
    assert abs(u.var() - 1 / 12) < 0.002
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 5 / np.sqrt(u.size)
    counts, _ = np.histogram(u, bins=16, range=(0, 1))
    assert counts.min() > 0.9 * u.size / 16
    # The same key gives the same draws; another key, other draws; raw u32[2] keys work too.
    np.testing.assert_array_equal(u, np.asarray(counter_uniform(key, (200_000,))))
    assert not np.array_equal(u[:100], np.asarray(counter_uniform(jax.random.key(8), (100,))))
    np.testing.assert_array_equal(
        np.asarray(counter_uniform(jax.random.PRNGKey(7), (5,))),
        np.asarray(counter_uniform(jax.random.wrap_key_data(jax.random.PRNGKey(7)), (5,))),
    )
    s = np.asarray(counter_signs(key, (400, 500)))
    assert set(np.unique(s)) == {-1.0, 1.0} and abs(s.mean()) < 5 / np.sqrt(s.size)
    assert s.shape == (400, 500)
