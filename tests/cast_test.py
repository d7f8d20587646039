"""Cast (jaxcomp.methods.cast): the gradient all-reduced in bfloat16 or float16, against a numpy reference."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import count_compilations, need_devices
from jax.sharding import Mesh

import jaxcomp
from jaxcomp import cost
from jaxcomp.methods import Cast
from jaxcomp.methods.cast import power_of_two_scale

N_DEVICES = 8


def _mesh():
    need_devices(N_DEVICES)
    return Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))


def _sgd_run(method, n=257):
    """data_parallel with compress(method, mean=False) and sgd(1): params move by minus the aggregate."""
    tx = optax.chain(jaxcomp.compress(method, mean=False), optax.sgd(1.0))
    dp = jaxcomp.data_parallel(lambda w, b: jnp.sum(w * jnp.mean(b, axis=0)), tx, _mesh())
    return dp, dp.init(jnp.zeros(n))


def _reference_decode(x, dtype, scale):
    """numpy: what one device sends, decoded (the error-feedback ``sent``)."""
    narrow = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    return (x.astype(np.float32) * scale).astype(narrow).astype(np.float32) / scale


def _reference_scale(batch):
    room = 65504.0 / (N_DEVICES * np.abs(batch).max())
    return np.float32(2.0 ** np.clip(np.floor(np.log2(room)), -60, 60))


@pytest.mark.parametrize("dtype, magnitude", [("bfloat16", 1.0), ("float16", 1.0), ("float16", 3e4),
                                              ("float16", 1e-6)])
def test_aggregate_matches_numpy_and_error_feedback_keeps_the_rounding(dtype, magnitude):
    """One step: each device's error-feedback residual is exactly x - decode(encode(x)) (numpy), and
    the sum equals numpy's sum of the decoded values to the narrow type's rounding of the sum. float16
    at 3e4 (8 devices: the unscaled sum would overflow) and at 1e-6 (subnormal unscaled) stays exact
    to float16's 11 bits thanks to the power-of-two scale."""
    n = 257
    method = Cast(dtype)
    dp, state = _sgd_run(method, n)
    batch = (np.random.default_rng(0).standard_normal((N_DEVICES, n)) * magnitude).astype(np.float32)
    state, metrics = dp.step(state, batch)
    scale = _reference_scale(batch) if dtype == "float16" else np.float32(1.0)
    decoded = _reference_decode(batch, dtype, scale)
    residual = np.asarray(jaxcomp.find_compress_state(state.opt_state).residual)
    np.testing.assert_array_equal(residual, batch - decoded)
    total = -np.asarray(state.params)
    expected = decoded.astype(np.float64).sum(axis=0)
    eps = 2.0**-8 if dtype == "bfloat16" else 2.0**-11
    # The all-reduce adds in the narrow type: each of the N-1 adds rounds by at most eps/2 of a
    # partial sum whose magnitude is at most sum |decoded|.
    bound = N_DEVICES * eps * np.abs(decoded).sum(axis=0)
    assert np.all(np.isfinite(total))
    assert np.all(np.abs(total - expected) <= bound + 1e-30)
    assert float(metrics["bytes_sent"]) == method.wire_bytes(n, N_DEVICES)


def test_unscaled_float16_overflows_where_the_scaled_one_does_not():
    """The reason for the scale: 8 devices of 3e4 overflow float16's 65504 unscaled."""
    batch = np.full((N_DEVICES, 16), 3e4, np.float32)
    totals = {}
    for scale in (False, True):
        dp, state = _sgd_run(Cast("float16", scale=scale), 16)
        state, _ = dp.step(state, batch)
        totals[scale] = -np.asarray(state.params)
    assert np.isinf(totals[False]).all()
    np.testing.assert_allclose(totals[True], 2.4e5, rtol=2**-10)


def test_error_feedback_identity_replicas_and_one_compile():
    """Over steps: sum of aggregates = sum of gradients - residuals (to the narrow sum's rounding);
    replicas stay identical; one compilation."""
    n = 300
    dp, state = _sgd_run(Cast("bfloat16"), n)
    rng = np.random.default_rng(1)
    fed = np.zeros(n)
    with count_compilations() as compiles:
        for _ in range(4):
            batch = rng.standard_normal((N_DEVICES, n)).astype(np.float32)
            fed += batch.astype(np.float64).sum(axis=0)
            state, _ = dp.step(state, batch)
    assert compiles[0] == 1
    residual = np.asarray(jaxcomp.find_compress_state(state.opt_state).residual, np.float64)
    np.testing.assert_allclose(-np.asarray(state.params), fed - residual.sum(axis=0), rtol=0, atol=0.3)
    shards = [np.asarray(s.data) for s in state.params.addressable_shards]
    assert all(np.array_equal(shards[0], s) for s in shards[1:])


@pytest.mark.parametrize("method", [Cast("bfloat16"), Cast("float16")], ids=["bf16", "fp16"])
def test_bytes_on_the_wire_are_wire_bytes(method):
    """The collectives in the traced step move what wire_bytes says (16-bit values, and float16's
    scalar scale)."""
    from collectives_test import _collective_bytes
    from jax.sharding import PartitionSpec as P

    n = 1003
    traced = jax.jit(jax.shard_map(lambda v: method.aggregate(v, "data", step=0, key=jax.random.key(0)),
                                   mesh=_mesh(), in_specs=P("data"), out_specs=(P(), P("data")))).trace(
        jnp.zeros(n * N_DEVICES, jnp.float32))
    uniform, p2p = _collective_bytes(traced.jaxpr.jaxpr, {"data": N_DEVICES})
    assert not p2p and uniform == pytest.approx(method.wire_bytes(n, N_DEVICES))


def test_power_of_two_scale():
    assert float(power_of_two_scale(jnp.float32(1.0), 8)) == 4096.0
    assert float(power_of_two_scale(jnp.float32(0.0), 8)) == 1.0
    assert float(power_of_two_scale(jnp.float32(1e30), 8)) == 2.0**-60  # clipped, still finite


def test_wire_bytes_names_and_cost_model():
    bf16, fp16 = Cast("bf16"), Cast(jnp.float16)
    assert bf16 == Cast(jnp.bfloat16) == Cast(ml_dtypes.bfloat16) and fp16 == Cast(np.float16)
    assert bf16.label == "bf16" and fp16.label == "fp16" and Cast(allreduce="tree").label == "bf16_tree"
    assert bf16.wire_bytes(1000, 8) == jaxcomp.Dense().wire_bytes(1000, 8) / 2
    assert fp16.wire_bytes(1000, 8) == bf16.wire_bytes(1000, 8) + 2 * 7 / 8 * 4
    assert fp16.message_steps(8) == 2 * bf16.message_steps(8) == 28 and bf16.wire_bytes(1000, 1) == 0.0
    assert jaxcomp.methods.parse("bf16") == bf16 and jaxcomp.methods.parse("fp16") == fp16
    net = cost.Network.parse("1ms", "1gbit")
    assert cost.predict("bf16", 4e8, 8, net) < cost.predict("dense", 4e8, 8, net)
    assert bf16 in jaxcomp.methods.candidates(variants=True)


def test_cast_is_a_compress_auto_candidate():
    state = jaxcomp.compress_auto([jaxcomp.Dense(), Cast()]).init({"w": jnp.zeros(3)})
    assert [m.describe() for m in state.methods] == ["dense", "bf16"]


@pytest.mark.parametrize("build, match", [
    (lambda: Cast(jnp.float32), "dtype must be bfloat16 or float16"),
    (lambda: Cast("int8"), "dtype must be"),
    (lambda: Cast("bf16", scale="yes"), "scale must be"),
    (lambda: Cast("bf16", allreduce="star"), "allreduce must be one of"),
    (lambda: jaxcomp.compress("bf16", ratio=0.1), "remove ratio="),
])
def test_bad_arguments_are_named(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()
