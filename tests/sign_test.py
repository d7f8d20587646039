"""The sign codec (jaxcomp.ops.sign: native kernels and XLA path) and the Sign method
(jaxcomp.methods.sign), against a numpy reference of docs/kernels.md, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from collectives_test import _collective_bytes
from helpers import count_compilations, need_devices
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.methods import Sign
from jaxcomp.ops.sign import sign_pack, sign_unpack, sign_unpack_sum

# compress(mean=False) makes these references exact sums, and compress(seed=) sets the key: both
# deprecated until jaxcomp 0.3, so these tests also keep the old keywords working.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:compress(_auto)?\((mean|seed)=\) is deprecated:DeprecationWarning"
)

N_DEVICES = 8
SMALLEST_NORMAL = np.float32(2.0**-126)


# --- numpy reference
# -------------------------------------------------------------------------------


def ref_pack(x, chunk):
    """docs/kernels.md step by step: IEEE's x >= 0 (numpy flushes no denormal), the halving tree."""
    x = np.asarray(x, np.float32)
    n = x.shape[-1]
    bits = np.zeros(x.shape[:-1] + (-(-n // 32) * 32,), np.uint64)
    bits[..., :n] = x >= 0
    words = (
        (bits.reshape(x.shape[:-1] + (-1, 32)) << np.arange(32, dtype=np.uint64))
        .sum(-1)
        .astype(np.uint32)
    )
    p = 1 << (chunk - 1).bit_length()
    scales = np.zeros(x.shape[:-1] + (-(-n // chunk),), np.float32)
    for index in np.ndindex(scales.shape):
        *row, q = index
        values = np.abs(x[tuple(row)][q * chunk : (q + 1) * chunk])
        tree = np.zeros(p, np.float32)
        tree[: values.size] = np.where(values < SMALLEST_NORMAL, np.float32(0), values)
        h = p // 2
        while h >= 1:
            tree = tree[:h] + tree[h : 2 * h]
            h //= 2
        with np.errstate(over="ignore", invalid="ignore"):
            mean = tree[0] * (np.float32(1) / np.float32(values.size))
        scales[index] = (
            np.float32(np.nan) if np.isnan(mean) else (0 if abs(mean) < SMALLEST_NORMAL else mean)
        )
    return words, scales


def ref_unpack(words, scales, n, chunk):
    bits = (np.asarray(words)[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    bits = bits.reshape(words.shape[:-1] + (-1,))[..., :n]
    plus = np.repeat(np.asarray(scales), chunk, axis=-1)[..., :n]
    return np.where(bits == 1, plus, -plus)


def test_the_pure_jax_reference_is_the_numpy_one():
    x = rows(203, 1)
    for chunk in (29, 256):
        words, scales = jax.jit(lambda v: jaxcomp.ops.reference.sign_pack(v, chunk))(x)
        want_words, want_scales = ref_pack(x, chunk)
        np.testing.assert_array_equal(np.asarray(words), want_words)
        np.testing.assert_array_equal(as_bits(scales), as_bits(want_scales))
        np.testing.assert_array_equal(
            as_bits(jaxcomp.ops.reference.sign_unpack(words, scales, 203, chunk)),
            as_bits(ref_unpack(want_words, want_scales, 203, chunk)),
        )


def as_bits(a):
    a = np.asarray(a)
    return a.view({4: np.uint32, 2: np.uint16}[a.dtype.itemsize])


def rows(n, seed):
    """[3, n] float32: gradients over 6 decades, ties with signed zeros, specials (NaN, ±Inf,
    denormals of both signs)."""
    rng = np.random.default_rng(seed)
    gradient = rng.standard_t(3, n) * 10.0 ** rng.uniform(-6, 0, n)
    ties = rng.choice([-2.0, -1.0, 0.0, -0.0, 1.0, 0.5], n)
    special = rng.standard_normal(n)
    picks = rng.choice(n, min(n, 6), replace=False)
    special[picks] = [np.nan, np.inf, -np.inf, 1e-40, -1e-40, -0.0][: picks.size]
    return np.stack([gradient, ties, special]).astype(np.float32)


# --- the kernels
# -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, chunk", [(1, 1), (33, 5), (100, 32), (1000, 1000), (1003, 7), (5000, 1024), (300, 4096)]
)
@pytest.mark.parametrize("implementation", ["native", "xla"])
def test_pack_and_unpack_match_the_reference_bit_for_bit(n, chunk, implementation):
    x = rows(n, n + chunk)
    words, scales = jax.jit(lambda v: sign_pack(v, chunk, implementation=implementation))(x)
    want_words, want_scales = ref_pack(x, chunk)
    np.testing.assert_array_equal(np.asarray(words), want_words)
    np.testing.assert_array_equal(as_bits(scales), as_bits(want_scales))
    decoded = jax.jit(lambda w, s: sign_unpack(w, s, n, chunk, implementation=implementation))(
        words, scales
    )
    np.testing.assert_array_equal(
        as_bits(decoded), as_bits(ref_unpack(want_words, want_scales, n, chunk))
    )


def test_steps_along_is_the_decoded_signs_of_the_flattened_values():
    """What jaxcomp.adam's dense fallback steps along: a device's decoded signs, row-major."""
    x = np.random.default_rng(3).normal(size=(7, 11)).astype(np.float32)
    got = np.asarray(jax.jit(Sign(chunk=10).steps_along)(jnp.asarray(x)))
    words, scales = ref_pack(x.reshape(-1), 10)
    want = ref_unpack(words, scales, x.size, 10).reshape(x.shape)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got.shape == x.shape and got.dtype == np.float32


@pytest.mark.parametrize("n, chunk, n_rows", [(1, 1, 1), (1003, 7, 3), (70_000, 1024, 8)])
@pytest.mark.parametrize("implementation", ["native", "xla"])
def test_unpack_sum_adds_the_rows_in_order_bit_for_bit(n, chunk, n_rows, implementation):
    x = np.concatenate([rows(n, seed) for seed in range(3)])[:n_rows]
    x[0, : min(n, 5)] = 0.0  # a zero scale decodes to -0.0 in some rows: 0 + -0 is +0
    words, scales = ref_pack(x, chunk)
    if n_rows > 1:
        scales[1, 0] = 0.0
    total = jax.jit(lambda w, s: sign_unpack_sum(w, s, n, chunk, implementation=implementation))(
        words, scales
    )
    want = np.zeros(n, np.float32)  # the loop it stands for, row after row in float32
    for decoded in ref_unpack(words, scales, n, chunk):
        want = want + decoded
    # Bit for bit (signed zeros included), except NaN's sign and payload: IEEE 754 leaves them
    # open when both operands of an add are NaN, and the compiler may swap them.
    total = np.asarray(total)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(total), nan)
    np.testing.assert_array_equal(as_bits(total[~nan]), as_bits(want[~nan]))


@pytest.mark.parametrize(
    "words, scales, match",
    [
        ((1,), (1,), "2-D"),
        ((0, 1), (0, 2), "2-D"),
        ((2, 1), (2, 3), "scales"),
        ((2, 2), (2, 2), "words"),
    ],
)
def test_unpack_sum_refuses_bad_shapes(words, scales, match):
    with pytest.raises(ValueError, match=match):
        sign_unpack_sum(jnp.zeros(words, jnp.uint32), jnp.ones(scales), 20, 16)


def test_native_and_xla_agree_on_16_bit_input_and_under_jit():
    x = jnp.asarray(rows(777, 3), jnp.bfloat16)
    native = jax.jit(lambda v: sign_pack(v, 100, implementation="native"))(x)
    portable = jax.jit(lambda v: sign_pack(v, 100, implementation="xla"))(x)
    for a, b in zip(native, portable):
        np.testing.assert_array_equal(as_bits(a), as_bits(b))
    want_words, want_scales = ref_pack(np.asarray(x.astype(jnp.float32)), 100)
    np.testing.assert_array_equal(np.asarray(native[0]), want_words)
    np.testing.assert_array_equal(as_bits(native[1]), as_bits(want_scales))
    decoded = sign_unpack(*native, 777, 100, dtype=jnp.float16)
    assert decoded.dtype == jnp.float16


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: sign_pack(jnp.ones(10), 0), ValueError, "chunk"),
        (lambda: sign_pack(jnp.ones(10), 2.5), TypeError, "chunk"),
        (lambda: sign_pack(jnp.ones(10, jnp.int32), 4), TypeError, "x must be"),
        (lambda: sign_pack(jnp.ones(10), 4, implementation="cuda"), ValueError, "implementation"),
        (
            lambda: sign_unpack(jnp.zeros(3, jnp.uint32), jnp.ones(3), 40, 16),
            ValueError,
            "words must have",
        ),
        (
            lambda: sign_unpack(jnp.zeros(1, jnp.uint32), jnp.ones(3), 20, 16),
            ValueError,
            "scales must have",
        ),
        (
            lambda: sign_unpack(jnp.zeros(1, jnp.int32), jnp.ones(2), 20, 16),
            TypeError,
            "words must be uint32",
        ),
        (
            lambda: sign_unpack(jnp.zeros(1, jnp.uint32), jnp.ones(2), 0, 16),
            ValueError,
            "n must be",
        ),
        (lambda: Sign(0), ValueError, "chunk must be"),
        (lambda: Sign(aggregation="mean"), ValueError, "aggregation must be one of"),
        (lambda: Sign(allreduce="tree"), ValueError, "aggregation='allreduce' only"),
        (lambda: jaxcomp.compress("sign", chunk=-1), ValueError, "chunk"),
    ],
)
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --- the method
# -----------------------------------------------------------------------------------------


def _mesh():
    need_devices(N_DEVICES)
    return Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))


def _aggregate(method, x):
    """(total of every device, sent of every device) of ``method.aggregate`` on rows of ``x``."""

    def run(v):
        total, sent, _ = method.aggregate(v[0], "data", step=jnp.int32(0), key=jax.random.key(0))
        return total[None], sent[None]

    return jax.jit(
        jax.shard_map(run, mesh=_mesh(), in_specs=P("data"), out_specs=(P("data"), P("data")))
    )(x)


def ref_ring(x, chunk):
    """The ring of signs (jaxcomp.collectives.sign_ring), device by device in numpy: ``(total,
    sent)``. Device d starts with chunk d - 1 and sends to d + 1; it owns chunk d at the end."""
    n_devices, n = x.shape
    c = -(-n // n_devices)
    rows = np.zeros((n_devices, n_devices * c), np.float32)
    rows[:, :n] = x
    rows = rows.reshape(n_devices, n_devices, c)  # [device, chunk, value]

    def code(values):
        words, scales = ref_pack(values, chunk)
        return ref_unpack(words, scales, c, chunk)

    lost = np.zeros_like(rows)
    held = [(d - 1) % n_devices for d in range(n_devices)]  # the chunk each device codes next
    partial = np.stack([rows[d, held[d]] for d in range(n_devices)])
    for _ in range(n_devices):
        decoded = np.stack([code(p) for p in partial])
        for d in range(n_devices):
            lost[d, held[d]] = partial[d] - decoded[d]
        if held == list(range(n_devices)):  # each device coded the chunk it owns
            break
        decoded = np.roll(decoded, 1, axis=0)  # device d receives device d - 1's message
        held = [(h - 1) % n_devices for h in held]
        partial = np.stack([decoded[d] + rows[d, held[d]] for d in range(n_devices)])
    total = decoded.reshape(-1)[:n]
    sent = (rows - lost).reshape(n_devices, -1)[:, :n]
    return total, sent


@pytest.mark.parametrize("aggregation", ["allgather", "majority", "allreduce", "ring"])
def test_aggregate_matches_numpy_and_is_identical_on_every_device(aggregation):
    n, chunk = 1003, 64
    method = Sign(chunk, aggregation=aggregation)
    x = np.random.default_rng(5).standard_normal((N_DEVICES, n)).astype(np.float32)
    total, sent = (np.asarray(a) for a in _aggregate(method, x))
    assert (as_bits(total) == as_bits(total[0])).all()  # replicas bit-identical
    words, scales = ref_pack(x, chunk)
    decoded = ref_unpack(words, scales, n, chunk)
    if aggregation == "allgather":  # devices added in order, in float32
        want = np.zeros(n, np.float32)
        for row in decoded:
            want = want + row
        np.testing.assert_array_equal(total[0], want)
        np.testing.assert_array_equal(sent, decoded)
    elif aggregation == "majority":
        votes = np.sign(
            np.where(ref_unpack(words, np.ones_like(scales), n, chunk) > 0, 1, -1).sum(0)
        )
        summed = np.zeros(scales.shape[1], np.float32)
        for row in scales:
            summed = summed + row
        want = votes.astype(np.float32) * np.repeat(summed, chunk)[:n]
        np.testing.assert_array_equal(total[0], want)
        np.testing.assert_array_equal(sent, np.broadcast_to(want / N_DEVICES, sent.shape))
    elif aggregation == "ring":  # the partial sums coded hop by hop, bit for bit
        want_total, want_sent = ref_ring(x, chunk)
        np.testing.assert_array_equal(total[0], want_total)
        np.testing.assert_allclose(sent, want_sent, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(sent.sum(0), total[0], rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_array_equal(sent, decoded)
        np.testing.assert_allclose(total[0], decoded.sum(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("aggregation", ["allgather", "allreduce", "ring"])
def test_wire_bytes_are_the_bytes_the_collectives_move(aggregation):
    n = 1003
    method = Sign(100, aggregation=aggregation)
    for dtype in (jnp.float32, jnp.bfloat16):
        traced = jax.jit(
            jax.shard_map(
                lambda v: method.aggregate(v, "data", step=0, key=jax.random.key(0))[:2],
                mesh=_mesh(),
                in_specs=P("data"),
                out_specs=(P(), P("data")),
            )
        ).trace(jnp.zeros(n * N_DEVICES, dtype))
        uniform, p2p = _collective_bytes(traced.jaxpr.jaxpr, {"data": N_DEVICES})
        assert bool(p2p) == (aggregation == "ring")  # the ring's hops are point to point
        assert len(set(p2p.values())) <= 1  # every device sends as much
        assert uniform + max(p2p.values(), default=0) == pytest.approx(
            method.wire_bytes(n, N_DEVICES, dtype_bytes=jnp.dtype(dtype).itemsize)
        )
    # The packed all-gather's bytes against the dense all-reduce: N - 1 copies of ~n/8 bytes against
    # ~2n d, so it wins below ~16 d devices.
    assert Sign().wire_bytes(1 << 20, 8) < jaxcomp.Dense().wire_bytes(1 << 20, 8) / 7.5
    assert Sign().wire_bytes(1 << 20, 256) > Sign(aggregation="allreduce").wire_bytes(1 << 20, 256)
    assert Sign().message_steps(8) == 3 and Sign(aggregation="allreduce").message_steps(8) == 14
    # The ring's bytes do not grow with the devices: 2 (N-1)/N of one device's signs.
    ring = Sign(aggregation="ring")
    assert ring.wire_bytes(1 << 20, 8) == pytest.approx(Sign().wire_bytes(1 << 20, 8) / 4, 0.01)
    assert ring.wire_bytes(1 << 20, 64) < 2 * Sign().wire_bytes(1 << 20, 2)
    assert ring.message_steps(8) == 14


@pytest.mark.parametrize("aggregation", ["allgather", "majority", "allreduce", "ring"])
def test_error_feedback_is_exact_over_steps_with_one_compilation(aggregation):
    """sum of aggregates = sum of gradients - residuals; bytes_sent = wire_bytes; no
    recompilation."""
    n, steps = 600, 3
    method = Sign(128, aggregation=aggregation)
    tx = optax.chain(jaxcomp.compress(method, mean=False), optax.sgd(1.0))
    dp = jaxcomp.data_parallel(lambda w, b: jnp.sum(w * jnp.mean(b, axis=0)), tx, _mesh())
    state = dp.init(jnp.zeros(n))
    rng = np.random.default_rng(1)
    fed = np.zeros(n)
    with count_compilations() as compiles:
        for step in range(steps):
            batch = rng.standard_normal((N_DEVICES, n)).astype(np.float32)
            fed += batch.astype(np.float64).sum(axis=0)
            state, metrics = dp.step(state, batch)
            if step == 0:
                first = compiles[0]
            assert float(metrics["bytes_sent"]) == method.wire_bytes(n, N_DEVICES)
            residual = np.asarray(jaxcomp.find_compress_state(state.opt_state).residual, np.float64)
            np.testing.assert_allclose(
                -np.asarray(state.params), fed - residual.sum(axis=0), rtol=1e-5, atol=1e-4
            )
    assert compiles[0] == first


def test_compress_auto_takes_the_packed_signs_on_a_slow_network():
    """Sign is among compress_auto's candidates: on a slow link its 1/8 bytes win; the total is
    replicated, as the branches need."""
    n = 1000
    candidates = jaxcomp.methods.candidates(sign=64)
    assert [m.describe() for m in candidates] == ["dense", "sign", "sign_allreduce", "sign_ring"]
    tx = jaxcomp.compress_auto(
        candidates, network=jaxcomp.costmodel.cost.Network.parse("1ms", "1gbit")
    )

    def run(g):
        updates, state = tx.update(g[0], tx.init(g[0]))
        return updates, state.metrics.bytes_sent, state.metrics.method

    g = jax.random.normal(jax.random.key(2), (N_DEVICES, n))
    updates, bytes_sent, method = jax.jit(
        jax.shard_map(run, mesh=_mesh(), in_specs=P("data"), out_specs=(P(), P(), P()))
    )(g)
    assert int(method) == 1 and float(bytes_sent) == Sign(64).wire_bytes(n, N_DEVICES)
    words, scales = ref_pack(np.asarray(g), 64)
    np.testing.assert_allclose(
        updates, ref_unpack(words, scales, n, 64).mean(0), rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("special", [False, True])
def test_scaled_signs_read_the_decoded_vectors_energies_off_the_scales(dtype, special):
    """ScaledSigns.energies is flat.energies of the decoded vector (a shorter last chunk; with
    ``special`` a zero, a NaN, an infinite scale and one whose square overflows)."""
    from jaxcomp.costmodel.ratio_choice import ENERGY_SCALE
    from jaxcomp.ops import flat
    from jaxcomp.ops.sign import ScaledSigns

    n, chunk = 1003, 64
    rng = np.random.default_rng(7)
    words = jnp.asarray(rng.integers(0, 2**32, -(-n // 32), dtype=np.uint32))
    scales = rng.uniform(0.1, 2.0, -(-n // chunk)) * 10.0 ** rng.integers(-8, 8, 16)
    if special:
        scales[[0, 3, 5, 15]] = [0.0, np.nan, np.inf, 3e38]
    scales = jnp.asarray(scales, jnp.float32)
    vector = sign_unpack(words, scales, n, chunk, dtype=dtype)
    for energy_scale in (1.0, ENERGY_SCALE):
        got = ScaledSigns(vector, scales, chunk).energies(energy_scale)
        want = flat.energies_xla(vector, energy_scale)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
    assert float(ScaledSigns(vector, scales, chunk).energies()[2]) == (2 * chunk if special else 0)


@pytest.mark.parametrize("n_devices", [1, 2, 3, 8])
@pytest.mark.parametrize("aggregation", ["allgather", "allreduce"])
def test_a_pinned_step_takes_the_sent_energies_from_the_scales(n_devices, aggregation):
    """data_parallel pins the sign branch (beside the guardrail's dense fallback), and that step
    reads no gradient-sized vector for the energies of what it sent: it computes the switched
    step's updates and residual bit for bit, and its gain to float rounding."""
    from jaxcomp.optim import pinning

    need_devices(n_devices)
    mesh = Mesh(np.array(jax.devices()[:n_devices]), ("data",))
    n = 5000
    tx = jaxcomp.compress(Sign(256, aggregation=aggregation))
    grads = {"w": jnp.asarray(np.random.default_rng(n_devices).normal(size=n), jnp.float32)}
    state = tx.init(grads)
    state = state._replace(residual={"w": 0.3 * grads["w"][::-1]})
    assert pinning.can_pin(state) and int(pinning.next_branch(state)) == 0

    def update(branch):
        def run(g, s):
            with pinning.pinned(branch):
                return tx.update(jax.lax.pcast(g, "data", to="varying"), s)

        spec = (P(), P())
        return jax.jit(
            jax.shard_map(run, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
        )

    pinned, switched = update(0), update(None)
    assert "jaxcomp_energies" not in pinned.lower(grads, state).compile().as_text()
    (a_updates, a_state), (b_updates, b_state) = pinned(grads, state), switched(grads, state)
    np.testing.assert_array_equal(as_bits(a_updates["w"]), as_bits(b_updates["w"]))
    np.testing.assert_array_equal(as_bits(a_state.residual["w"]), as_bits(b_state.residual["w"]))
    np.testing.assert_allclose(float(a_state.metrics.gain), float(b_state.metrics.gain), rtol=1e-5)
    assert 0 < float(a_state.metrics.gain) < 1
