"""Top-k with low-bit values (``TopK(..., value_bits=)``): the codec against a numpy reference,
the all-gather and the method against it on 8 devices, error feedback, bytes, and training."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import need_devices
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import collectives, methods
from jaxcomp.collectives import sizes
from jaxcomp.collectives.quantized import unpack_codes
from jaxcomp.collectives.value_codes import decode_values, encode_values
from jaxcomp.methods import TopK

# compress(mean=False) makes these references exact sums, and compress(seed=) sets the key: both
# deprecated until jaxcomp 0.3, so these tests also keep the old keywords working.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:compress(_auto)?\((mean|seed)=\) is deprecated:DeprecationWarning"
)

N_DEVICES = 8


# --- the reference ---------------------------------------------------------------------------


def reference_encode(values, bits, chunk):
    """numpy: per chunk of ``chunk`` values its largest magnitude ``s``, and each value's code,
    the nearest of ``2**bits`` levels spread evenly over ``[-s, s]`` (ties to even), in
    float32 step by step as the codec computes it."""
    v = np.asarray(values, np.float32)
    levels = 2**bits - 1
    codes, scales = np.zeros(v.shape[0], np.uint32), []
    for start in range(0, v.shape[0], chunk):
        part = v[start : start + chunk]
        scale = np.float32(np.max(np.abs(part)))
        unit = scale if scale > 0 else np.float32(1)
        position = (part / unit + np.float32(1)) * np.float32(levels / 2)
        codes[start : start + chunk] = np.clip(np.round(position), 0, levels)
        scales.append(scale)
    return codes, np.array(scales, np.float32)


def reference_pack(codes, bits):
    """numpy: ``32 // bits`` codes a uint32 word, the first in the lowest bits."""
    per_word = 32 // bits
    words = np.zeros(-(-len(codes) // per_word), np.uint64)
    for i, code in enumerate(codes):
        words[i // per_word] |= int(code) << (bits * (i % per_word))
    return words.astype(np.uint32)


def reference_decode(codes, scales, bits, chunk):
    """numpy: code ``c`` of a chunk of scale ``s`` is ``c (2s / (2**bits - 1)) - s``."""
    per_value = np.repeat(scales, chunk)[: len(codes)]
    step = per_value * np.float32(2 / (2**bits - 1))
    return codes.astype(np.float32) * step - per_value


def reference_topk(x, k):
    """numpy: the ``k`` largest magnitudes' indices, ascending (planted values have no ties)."""
    return np.sort(np.argsort(-np.abs(x), kind="stable")[:k])


def reference_allgather(X, k, bits, chunk):
    """numpy: every device's top ``k``, its values coded and decoded; ``(total, sent)``, the
    devices' decoded values added device by device in float32, and each device's dense sent."""
    n = X.shape[1]
    total, sent = np.zeros(n, np.float32), np.zeros_like(X, np.float32)
    for d, x in enumerate(X):
        indices = reference_topk(x, k)
        decoded = reference_decode(*reference_encode(x[indices], bits, chunk), bits, chunk)
        sent[d, indices] = decoded
        total[indices] += decoded
    return total, sent


def planted(rows, n, seed=0):
    """Rows of distinct magnitudes (random signs): top-k has no ties."""
    rng = np.random.default_rng(seed)
    magnitudes = np.stack([rng.permutation(n) + 1.0 for _ in range(rows)]) / n
    return (magnitudes * rng.choice([-1.0, 1.0], size=magnitudes.shape)).astype(np.float32)


# --- the codec -------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("k, chunk", [(1, 64), (3, 1), (64, 64), (65, 64), (200, 7)])
def test_codec_matches_reference(bits, k, chunk):
    values = np.random.default_rng(k + bits).standard_normal(k).astype(np.float32)
    if k > chunk:
        values[:chunk] = 0.0  # a chunk of zeros
    else:
        values[: k // 2] = 0.0
    words, scales = jax.jit(encode_values, static_argnums=(1, 2))(values, bits, chunk)
    codes, want_scales = reference_encode(values, bits, chunk)
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    np.testing.assert_array_equal(np.asarray(unpack_codes(words, bits, k)), codes)
    np.testing.assert_array_equal(np.asarray(words), reference_pack(codes, bits))
    assert words.shape == (math.ceil(k / (32 // bits)),) and scales.shape == (math.ceil(k / chunk),)
    decoded = np.asarray(decode_values(words, scales, bits, chunk, k))
    np.testing.assert_array_equal(decoded, reference_decode(codes, want_scales, bits, chunk))
    # Off by at most half a grid step, s / (2**bits - 1), and an all-zero chunk decodes to 0.
    scale = np.repeat(want_scales, chunk)[:k]
    assert np.all(np.abs(decoded - values) <= scale / (2**bits - 1) + 1e-6 * scale)
    assert np.all(decoded[scale == 0] == 0)


def test_codec_takes_16_bit_values():
    values = jnp.asarray(planted(1, 50)[0], jnp.bfloat16)
    words, scales = encode_values(values, 2, 16)
    codes, want_scales = reference_encode(np.asarray(values, np.float32), 2, 16)
    np.testing.assert_array_equal(np.asarray(unpack_codes(words, 2, 50)), codes)
    np.testing.assert_array_equal(np.asarray(scales), want_scales)


# --- the all-gather and the method -----------------------------------------------------------


def _mesh():
    need_devices(N_DEVICES)
    return Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))


def _sharded(fn):
    """``fn(x) -> (total, sent)`` inside shard_map over 8 devices, on ``[8, n]`` rows."""
    per_device = jax.shard_map(
        lambda x: (lambda total, sent: (total, sent[None]))(*fn(x[0])),
        mesh=_mesh(),
        in_specs=P("data"),
        out_specs=(P(), P("data")),
    )
    return jax.jit(per_device)


@pytest.mark.parametrize("bits, k, chunk", [(1, 13, 5), (2, 13, 5), (3, 40, 64), (4, 1, 64)])
def test_allgather_matches_reference(bits, k, chunk):
    X = planted(N_DEVICES, 200, seed=bits)
    total, sent = _sharded(
        lambda x: collectives.allgather_topk(x, k, "data", value_bits=bits, value_chunk=chunk)
    )(X)
    want_total, want_sent = reference_allgather(X, k, bits, chunk)
    np.testing.assert_array_equal(np.asarray(sent), want_sent)
    np.testing.assert_allclose(np.asarray(total), want_total, rtol=1e-6, atol=1e-7)
    # It does round (one value a chunk is its scale, and travels exactly).
    assert k == 1 or np.any(np.asarray(sent) != np.where(want_sent != 0, X, 0))


def test_method_matches_reference_in_every_form():
    """aggregate (dense, and sparse pairs with a sparse total) and reduce_scatter (each device's
    row of the same total) of TopK(value_bits=2) against the reference."""
    X = planted(N_DEVICES, 200, seed=5)
    method = TopK(k=17, value_bits=2, value_chunk=8)
    want_total, want_sent = reference_allgather(X, 17, 2, 8)
    aggregate = dict(axis_name="data", step=0, key=jax.random.key(0))
    dense = _sharded(lambda x: method.aggregate(x, **aggregate)[:2])(X)

    def sparse(x):
        total, (indices, values), _ = method.aggregate(x, sparse=True, **aggregate)
        return total.dense(), jnp.zeros_like(x).at[indices].set(values, mode="drop")

    def scattered(x):
        row, sent = method.reduce_scatter(x, **aggregate, size=x.shape[0])
        return jax.lax.all_gather(row, "data", tiled=True, to="invarying"), sent

    for total, sent in (dense, _sharded(sparse)(X), _sharded(scattered)(X)):
        np.testing.assert_array_equal(np.asarray(sent), want_sent)
        np.testing.assert_allclose(np.asarray(total), want_total, rtol=1e-6, atol=1e-7)


def test_options_are_checked_naming_them():
    with pytest.raises(ValueError, match=r"value_bits must be in \[1, 4\], got 5"):
        TopK(0.02, value_bits=5)
    with pytest.raises(ValueError, match=r"value_bits must be in \[1, 4\], got 0"):
        TopK(0.02, value_bits=0)
    with pytest.raises(TypeError, match="value_bits must be an integer"):
        TopK(0.02, value_bits=True)
    for collective in ("ar", "hierarchical"):
        with pytest.raises(ValueError, match=f"value_bits= applies to collective='allgather' "
                           f"only, not '{collective}'"):  # fmt: skip
            TopK(0.02, collective=collective, value_bits=2)
    with pytest.raises(ValueError, match="value_chunk= applies with value_bits= only"):
        TopK(0.02, value_chunk=32)
    with pytest.raises(ValueError, match=r"value_chunk must be in \[1, .*got 0"):
        TopK(0.02, value_bits=2, value_chunk=0)
    with pytest.raises(ValueError, match="value_bits must be"):
        collectives.allgather_topk(jnp.ones(4), 1, "data", value_bits=8)


def test_local_work_is_the_codec_and_the_error_feedback():
    x = planted(1, 500, seed=3)[0]
    method = TopK(0.02, value_bits=2)
    residual = jax.jit(method.local_work(500, 8))(x)
    _, want_sent = reference_allgather(x[None], method.kept(500), 2, sizes.DEFAULT_VALUE_CHUNK)
    np.testing.assert_allclose(np.asarray(residual), x - want_sent[0], rtol=1e-6, atol=1e-7)


def test_parse_and_names():
    method = methods.parse("allgather_topk", ratio=0.02, value_bits=2)
    assert method == TopK(0.02, value_bits=2) != TopK(0.02)
    assert (
        method.label == "allgather_topk_2bit" and method.describe() == "allgather_topk_2bit(0.02)"
    )
    with pytest.raises(ValueError, match="method 'ar_topk': value_bits= applies to"):
        methods.parse("ar_topk", ratio=0.02, value_bits=2)
    # Without value_bits nothing changes: the same label, bytes and object.
    assert TopK(0.01) == TopK(0.01, value_bits=None) and TopK(0.01).label == "allgather_topk"
    assert TopK(0.01).wire_bytes(1000, 8) == 560.0


@pytest.mark.parametrize("bits, chunk", [(1, 64), (2, 64), (3, 10), (4, 1)])
@pytest.mark.parametrize("n_devices", [1, 2, 8])
def test_wire_bytes_count_indices_codes_and_scales(bits, chunk, n_devices):
    n, k = 5000, 100
    method = TopK(k=k, value_bits=bits, value_chunk=chunk)
    words = k + math.ceil(k / (32 // bits)) + math.ceil(k / chunk)
    assert method.wire_bytes(n, n_devices) == (n_devices - 1) * 4 * words
    assert method.wire_bytes(n, n_devices, dtype_bytes=2) == method.wire_bytes(n, n_devices)
    assert method.reduce_scatter_bytes(n, n_devices) == method.wire_bytes(n, n_devices)
    assert method.message_steps(n_devices) == TopK(k=k).message_steps(n_devices)
    if bits == 2 and chunk == 64:  # 32 + 2 + 0.5 bits a pair: about half of float32's 64
        assert method.wire_bytes(n, 8) / TopK(k=k).wire_bytes(n, 8) == pytest.approx(
            0.545, abs=0.005
        )


# --- in training -----------------------------------------------------------------------------


def _mlp():
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.standard_normal((16, 32)) * 0.3, jnp.float32),
        "b": jnp.zeros(32),
        "w2": jnp.asarray(rng.standard_normal((32, 4)) * 0.3, jnp.float32),
    }
    x = rng.standard_normal((48, 16)).astype(np.float32)  # rows for 1, 3 or 8 devices

    def loss_fn(p, batch):
        return jnp.mean((jnp.tanh(batch["x"] @ p["w1"] + p["b"]) @ p["w2"] - batch["y"]) ** 2)

    return params, loss_fn, {"x": x, "y": x[:, :4] * 0.5}


def test_error_feedback_keeps_the_rounding():
    """Four steps of compress(TopK(value_bits=2)) on 8 devices, planted gradients: the sum over
    the devices of what each took off its residual (g + residual before - residual after) is the
    sum the collective added, every step; so over the steps sent + residual == the gradients.
    The residual at the sent indices is the rounding, not 0."""
    n, steps = 300, 4
    tx = jaxcomp.compress(TopK(0.02, value_bits=2), axis_name="data", mean=False)
    state = tx.init(jax.ShapeDtypeStruct((n,), jnp.float32))

    def local(g, residual, step):
        out, new = tx.update(g[0], state._replace(residual=residual[0], step=step))
        return out, new.residual[None], new.step

    run = jax.jit(
        jax.shard_map(
            local,
            mesh=_mesh(),
            in_specs=(P("data"), P("data"), P()),
            out_specs=(P(), P("data"), P()),
        )
    )
    residual, step = jnp.zeros((N_DEVICES, n), jnp.float32), state.step
    sent_total, grads_total = np.zeros(n), np.zeros((N_DEVICES, n))
    for t in range(steps):
        g = planted(N_DEVICES, n, seed=10 + t)
        fed = g + np.asarray(residual)
        out, residual, step = run(jnp.asarray(g), residual, step)
        took = fed - np.asarray(residual)
        np.testing.assert_allclose(took.sum(0), np.asarray(out), rtol=1e-5, atol=1e-6)
        # At the sent indices the residual is fed - decoded: the reference's rounding error.
        _, want_sent = reference_allgather(fed, 6, 2, sizes.DEFAULT_VALUE_CHUNK)
        np.testing.assert_allclose(took, want_sent, rtol=1e-6, atol=1e-6)
        assert np.any(np.asarray(residual)[want_sent != 0] != 0)
        sent_total += np.asarray(out)
        grads_total += g
    np.testing.assert_allclose(
        sent_total + np.asarray(residual).sum(0), grads_total.sum(0), rtol=1e-5, atol=1e-5
    )


def test_bytes_sent_is_what_the_all_gather_carries():
    """The bytes_sent metric is wire_bytes, and wire_bytes is (N - 1) times the one uint32
    message the compiled step all-gathers."""
    params, loss_fn, batch = _mlp()
    n = sum(p.size for p in jax.tree.leaves(params))
    method = TopK(0.02, value_bits=2)
    tx = optax.chain(jaxcomp.compress(method, guardrail=False), optax.adam(3e-2))
    dp = jaxcomp.data_parallel(loss_fn, tx, _mesh())
    state, batch = dp.init(params), dp.shard_batch(batch)
    _, metrics = dp.step(state, batch)
    assert float(metrics["bytes_sent"]) == method.wire_bytes(n, N_DEVICES)
    hlo = dp.step.lower(state, batch).compile().as_text()
    gathered = re.findall(r"=\s*(\w+)\[(\d+),(\d+)\][^=]*\sall-gather(?:-start)?\(", hlo)
    words = sizes.coded_pairs_words(method.kept(n), 2, sizes.DEFAULT_VALUE_CHUNK)
    assert ("u32", str(N_DEVICES), str(words)) in gathered, gathered
    assert method.wire_bytes(n, N_DEVICES) == (N_DEVICES - 1) * words * 4
    assert not [g for g in gathered if g[0].startswith(("f", "bf"))], gathered  # no float values


@pytest.mark.parametrize("n_devices", [1, 3, 8])
def test_trains_data_parallel(n_devices):
    """compress(TopK(0.02, value_bits=2)) trains a small MLP on 1 device (the codec still runs,
    with nothing to gather), on 3 and on 8."""
    need_devices(n_devices)
    params, loss_fn, batch = _mlp()
    tx = optax.chain(jaxcomp.compress(TopK(0.02, value_bits=2)), optax.adam(3e-2))
    mesh = Mesh(np.array(jax.devices()[:n_devices]), ("data",))
    dp = jaxcomp.data_parallel(loss_fn, tx, mesh)
    state, batch = dp.init(params), dp.shard_batch(batch)
    losses = []
    for _ in range(30):
        state, metrics = dp.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0], losses


def test_trains_as_diloco_outer_compressor_on_8_workers():
    """SparseLoCo's setting: DiLoCo's pseudo-gradients as top-k with 2-bit values."""
    params, loss_fn, batch = _mlp()
    mesh = Mesh(np.array(jax.devices()[:N_DEVICES]), ("workers",))
    run = jaxcomp.diloco(
        loss_fn, optax.adam(1e-2), mesh=mesh, sync_every=4, compress=TopK(0.02, value_bits=2)
    )
    state, losses = run.init(params), []
    for _ in range(24):
        state, metrics = run.step(state, batch)
        losses.append(float(np.mean(metrics["loss"])))
        assert float(metrics["bytes_sent"]) in (0.0, TopK(0.02, value_bits=2).wire_bytes(
            sum(p.size for p in jax.tree.leaves(params)), N_DEVICES))  # fmt: skip
    assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0], losses
