"""ZFP-style codec: the native kernel against the pure-JAX reference (bit for bit) and zfpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zfpy

import jaxcomp
from jaxcomp.ops import reference

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
LENGTHS = (1, 2, 3, 4, 5, 7, 1000, 4099)
RATES = (1, 2, 3, 5, 8, 16, 31, 32)
FLT_MAX = np.finfo(np.float32).max


def bits_of(array):
    """The raw bits of a float array (so -0.0 != 0.0 and NaNs compare by pattern)."""
    array = np.asarray(array)
    return array.view({4: np.uint32, 2: np.uint16}[array.dtype.itemsize])


def gaussian(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def heavy_tailed(rng, shape):
    """Magnitudes spread over ten orders of magnitude, random signs."""
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    return (sign * 10.0 ** rng.uniform(-8, 2, shape)).astype(np.float32)


def with_special_values(rng, n):
    """A row where every kind of special block appears (cut to n values)."""
    specials = np.array(
        [
            0,
            0,
            0,
            0,  # zero block
            -0.0,
            -0.0,
            -0.0,
            -0.0,  # negative zeros
            1e-40,
            -3e-42,
            1e-45,
            0,  # denormals only
            1.0,
            1e-40,
            -2.0,
            0.5,  # normals with a denormal
            FLT_MAX,
            -FLT_MAX,
            1.0,
            0,  # the largest exponent
            1.0,
            np.inf,
            2.0,
            3.0,  # +Inf
            -np.inf,
            0,
            0,
            0,  # -Inf
            np.nan,
            1.0,
            2.0,
            3.0,
        ],  # NaN
        np.float32,
    )
    row = gaussian(rng, n)
    row[: min(n, specials.size)] = specials[:n]
    return row


def assert_kernel_matches_reference(x, rate, dtype):
    n = x.shape[-1]
    x = jnp.asarray(x).astype(dtype)  # FLT_MAX becomes inf in 16-bit types
    words = jaxcomp.zfp_encode(x, rate)
    assert words.dtype == jnp.uint32
    assert words.shape == x.shape[:-1] + (jaxcomp.zfp_num_words(n, rate),)
    np.testing.assert_array_equal(np.asarray(words), np.asarray(reference.zfp_encode(x, rate)))
    decoded = jaxcomp.zfp_decode(words, n, rate, dtype=dtype)
    assert decoded.dtype == dtype and decoded.shape == x.shape
    np.testing.assert_array_equal(
        bits_of(decoded), bits_of(reference.zfp_decode(words, n, rate, dtype=dtype))
    )


@pytest.mark.parametrize("rate", RATES)
def test_kernel_matches_reference(rate):
    # Every (rate, n) pair; the dtype cycles so every (rate, dtype) and (n, dtype) pair occurs too.
    rng = np.random.default_rng(rate)
    for i, n in enumerate(LENGTHS):
        dtype = DTYPES[(i + RATES.index(rate)) % len(DTYPES)]
        x = np.stack([gaussian(rng, n), heavy_tailed(rng, n), with_special_values(rng, n)])
        assert_kernel_matches_reference(x, rate, dtype)


def test_kernel_matches_reference_on_a_long_row():
    x = heavy_tailed(np.random.default_rng(5), (1, 100_003))
    assert_kernel_matches_reference(x, 8, jnp.float32)


@pytest.mark.parametrize("rate", [3, 5, 8, 16, 31, 32])
@pytest.mark.parametrize("n", [7, 4099])
def test_words_and_values_identical_to_zfpy(rate, n):
    rng = np.random.default_rng(n * rate)
    # zfpy scales by a float 2**(30 - emax), which overflows for blocks below 2**-98: keep
    # magnitudes (and the rest of the row) above that.
    x = np.concatenate([heavy_tailed(rng, n // 2), gaussian(rng, n - n // 2)])
    x[:4] = 0.0  # an all-zero block
    words = np.asarray(jaxcomp.zfp_encode(x, rate))
    stream = zfpy.compress_numpy(x, rate=rate, write_header=False)
    np.testing.assert_array_equal(words, np.frombuffer(stream, np.uint32)[: words.size])
    # zfp pads its stream to whole 64-bit words with zeros, like the tail of our last word.
    assert len(stream) == -(-words.size // 2) * 8
    expected = zfpy.decompress_numpy(zfpy.compress_numpy(x, rate=rate))
    np.testing.assert_array_equal(bits_of(jaxcomp.zfp_decode(words, n, rate)), bits_of(expected))


@pytest.mark.parametrize("rate", [8, 16])
@pytest.mark.parametrize("data", [gaussian, heavy_tailed])
def test_error_no_worse_than_zfpy(rate, data):
    x = data(np.random.default_rng(rate), 100_000)
    decoded = np.asarray(jaxcomp.zfp_decode(jaxcomp.zfp_encode(x, rate), x.size, rate))
    ours = np.sqrt(np.mean((decoded.astype(np.float64) - x) ** 2))
    theirs = np.sqrt(
        np.mean(
            (zfpy.decompress_numpy(zfpy.compress_numpy(x, rate=rate)).astype(np.float64) - x) ** 2
        )
    )
    assert ours <= 1.1 * theirs


def decode_one_block(values, rate):
    words = jaxcomp.zfp_encode(np.asarray(values, np.float32), rate)
    return np.asarray(jaxcomp.zfp_decode(words, len(values), rate))


@pytest.mark.parametrize("rate", [3, 8, 32])
def test_special_blocks_decode_as_documented(rate):
    for block in ([0.0] * 4, [-0.0] * 4):
        decoded = decode_one_block(block, rate)
        np.testing.assert_array_equal(bits_of(decoded), 0)  # +0.0, sign dropped
    for bad in (np.inf, -np.inf, np.nan):
        np.testing.assert_array_equal(np.isnan(decode_one_block([1.0, bad, 2.0, 3.0], rate)), True)
        # Only the block holding it: the next block is unaffected.
        assert np.isfinite(
            decode_one_block([1.0, bad, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0], rate)[4:]
        ).all()
    huge = np.array([FLT_MAX, -FLT_MAX / 2, FLT_MAX / 4, 1.0], np.float32)
    tiny = np.array([1e-40, -3e-42, 1e-45, 0.0], np.float32)
    for block in (huge, tiny):
        decoded = decode_one_block(block, rate)
        assert np.isfinite(decoded).all()
        scale = np.abs(block.astype(np.float64)).max()
        assert np.abs(decoded.astype(np.float64) - block).max() <= scale * 2.0 ** (5 - rate)
    if rate == 32:
        # 119 bits for 4 values: the denormals come back exactly.
        np.testing.assert_array_equal(bits_of(decode_one_block(tiny, rate)), bits_of(tiny))


@pytest.mark.parametrize("rate", [1, 2])
def test_low_rates_share_one_row_exponent(rate):
    rows = np.array(
        [
            [1.0, -2.0, 0.5, 3.0, 0.25, -1.0, 2.0, 0.0],
            [0.0] * 8,
            [-0.0] * 8,
            [1.0, 2.0, np.nan, 3.0, 1.0, 1.0, 1.0, 1.0],
            [1.0, 2.0, 3.0, 4.0, 1.0, 1.0, -np.inf, 1.0],
        ],
        np.float32,
    )
    words = np.asarray(jaxcomp.zfp_encode(rows, rate))
    np.testing.assert_array_equal(words[:, 0], [2 + 127, 0, 0, 0x100, 0x100])
    decoded = np.asarray(jaxcomp.zfp_decode(words, 8, rate))
    np.testing.assert_array_equal(bits_of(decoded[1:3]), 0)
    assert np.isnan(decoded[3:]).all()
    assert np.isfinite(decoded[0]).all()
    # A block with a tiny magnitude next to a large one quantizes to zero at 1-2 bits per value.
    x = np.array([1e3, 1e3, 1e3, 1e3, 1e-6, 1e-6, 1e-6, 1e-6], np.float32)
    np.testing.assert_array_equal(decode_one_block(x, rate)[4:], 0.0)


@pytest.mark.parametrize("n", [1, 4, 5, 31, 32, 33, 1000])
@pytest.mark.parametrize("rate", RATES)
def test_num_words(n, rate):
    blocks = -(-n // 4)
    expected = -(-blocks * 4 * rate // 32) + (1 if rate <= 2 else 0)
    assert jaxcomp.zfp_num_words(n, rate) == expected
    assert jax.eval_shape(
        lambda x: jaxcomp.zfp_encode(x, rate), jax.ShapeDtypeStruct((2, n), jnp.float32)
    ).shape == (2, expected)


def test_batched_vmap_and_jit_agree_with_rows():
    rng = np.random.default_rng(7)
    x = jnp.asarray(heavy_tailed(rng, (2, 3, 37)))
    rate = 5
    per_row = np.stack(
        [np.asarray(jaxcomp.zfp_encode(row, rate)) for row in np.asarray(x).reshape(6, 37)]
    )
    batched = jaxcomp.zfp_encode(x, rate)
    np.testing.assert_array_equal(np.asarray(batched).reshape(6, -1), per_row)
    np.testing.assert_array_equal(jax.vmap(lambda r: jaxcomp.zfp_encode(r, rate))(x), batched)
    np.testing.assert_array_equal(jax.jit(jaxcomp.zfp_encode, static_argnums=1)(x, rate), batched)
    decoded = jaxcomp.zfp_decode(batched, 37, rate)
    np.testing.assert_array_equal(
        jax.vmap(jax.vmap(lambda w: jaxcomp.zfp_decode(w, 37, rate)))(batched), decoded
    )
    round_trip = jax.jit(lambda v: jaxcomp.zfp_decode(jaxcomp.zfp_encode(v, rate), 37, rate))(x)
    np.testing.assert_array_equal(round_trip, decoded)
    np.testing.assert_array_equal(decoded[1, 2], jaxcomp.zfp_decode(per_row[5], 37, rate))


@pytest.mark.parametrize(
    "call, error, name",
    [
        (lambda: jaxcomp.zfp_encode(jnp.ones(8), 0), ValueError, "rate"),
        (lambda: jaxcomp.zfp_encode(jnp.ones(8), 33), ValueError, "rate"),
        (lambda: jaxcomp.zfp_encode(jnp.ones(8), 2.5), TypeError, "rate"),
        (lambda: jaxcomp.zfp_encode(jnp.ones(8, jnp.int32), 8), TypeError, "x"),
        (lambda: jaxcomp.zfp_encode(jnp.float32(1.0), 8), ValueError, "x"),
        (lambda: jaxcomp.zfp_decode(jnp.zeros(3, jnp.uint32), 8, 8), ValueError, "words"),
        (lambda: jaxcomp.zfp_decode(jnp.zeros(2, jnp.int32), 8, 8), TypeError, "words"),
        (lambda: jaxcomp.zfp_decode(jnp.zeros(2, jnp.uint32), 8, 0), ValueError, "rate"),
        (lambda: jaxcomp.zfp_decode(jnp.zeros(2, jnp.uint32), 0, 8), ValueError, "n"),
        (
            lambda: jaxcomp.zfp_decode(jnp.zeros(2, jnp.uint32), 8, 8, dtype=jnp.int32),
            TypeError,
            "dtype",
        ),
        (lambda: jaxcomp.zfp_num_words(8, 33), ValueError, "rate"),
    ],
)
def test_bad_input_names_the_argument(call, error, name):
    with pytest.raises(error, match=rf"\b{name}\b"):
        call()


def test_handlers_validate_their_arguments():
    # Bypass the Python checks: the C++ handlers must refuse, not crash.
    decode = jax.ffi.ffi_call(
        "jaxcomp_zfp_decode", jax.ShapeDtypeStruct((8,), jnp.float32), vmap_method="broadcast_all"
    )
    with pytest.raises(Exception, match="words"):
        decode(jnp.zeros(3, jnp.uint32), n=np.int64(8), rate=np.int64(8)).block_until_ready()
    with pytest.raises(Exception, match="rate"):
        decode(jnp.zeros(2, jnp.uint32), n=np.int64(8), rate=np.int64(0)).block_until_ready()
    encode = jax.ffi.ffi_call(
        "jaxcomp_zfp_encode", jax.ShapeDtypeStruct((2,), jnp.uint32), vmap_method="broadcast_all"
    )
    with pytest.raises(Exception, match="rate"):
        encode(jnp.ones(8), rate=np.int64(33)).block_until_ready()
    with pytest.raises(Exception, match="words"):
        encode(
            jnp.ones(8), rate=np.int64(16)
        ).block_until_ready()  # 16 bits x 8 values need 4 words


@pytest.mark.parametrize("rate", [2, 3, 8, 13, 17, 32])
def test_arbitrary_words_decode_like_reference(rate):
    # Every bit pattern is a valid stream: random words reach each plane-decoding path (budget
    # ending mid-plane, reserved headers) in kernel and reference alike.
    n = 203
    words = np.random.default_rng(rate).integers(
        0, 2**32, (2, jaxcomp.zfp_num_words(n, rate)), dtype=np.uint32
    )
    words[1, 0] &= 0xFF  # rates 1-2: a valid row exponent in the header word
    np.testing.assert_array_equal(
        bits_of(jaxcomp.zfp_decode(words, n, rate)), bits_of(reference.zfp_decode(words, n, rate))
    )
