"""Cast (jaxcomp.methods.cast): the gradient all-reduced in bfloat16 or float16, against a numpy
reference; and the CPU's 16-bit ring (jaxcomp.collectives.narrow_allreduce, bfloat16 and float16)
against a numpy ring, bit for bit."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import count_compilations, need_devices
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import collectives
from jaxcomp.costmodel import cost
from jaxcomp.methods import Cast
from jaxcomp.methods.cast import power_of_two_scale

# compress(mean=False) makes these references exact sums, and compress(seed=) sets the key: both
# deprecated until jaxcomp 0.3, so these tests also keep the old keywords working.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:compress(_auto)?\((mean|seed)=\) is deprecated:DeprecationWarning"
)

N_DEVICES = 8


def _mesh():
    need_devices(N_DEVICES)
    return Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))


def _sgd_run(method, n=257):
    """data_parallel with compress(method, mean=False, error_feedback=True) and sgd(1): params
    move by minus the aggregate. Error feedback is asked for, so that its residual can be read
    (the casts' own default is without)."""
    tx = optax.chain(jaxcomp.compress(method, mean=False, error_feedback=True), optax.sgd(1.0))
    dp = jaxcomp.data_parallel(lambda w, b: jnp.sum(w * jnp.mean(b, axis=0)), tx, _mesh())
    return dp, dp.init(jnp.zeros(n))


def _reference_decode(x, dtype, scale):
    """numpy: what one device sends, decoded (the error-feedback ``sent``)."""
    narrow = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
    return (x.astype(np.float32) * scale).astype(narrow).astype(np.float32) / scale


def _reference_scale(batch):
    room = 65504.0 / (N_DEVICES * np.abs(batch).max())
    return np.float32(2.0 ** np.clip(np.floor(np.log2(room)), -60, 60))


@pytest.mark.parametrize(
    "dtype, magnitude", [("float16", 1.0), ("float16", 3e4), ("float16", 1e-6)]
)
def test_aggregate_matches_numpy_and_error_feedback_keeps_the_rounding(dtype, magnitude):
    """float16, one step: each device's error-feedback residual is exactly x less the ring's sent
    (numpy's ring of float16 roundings), and the sum equals numpy's sum of the decoded values to
    float16's rounding of the partial sums. At 3e4 (8 devices: the unscaled sum would overflow)
    and at 1e-6 (subnormal unscaled) it stays exact to float16's 11 bits thanks to the
    power-of-two scale."""
    n = 257
    method = Cast(dtype)
    dp, state = _sgd_run(method, n)
    batch = (np.random.default_rng(0).standard_normal((N_DEVICES, n)) * magnitude).astype(
        np.float32
    )
    state, metrics = dp.step(state, batch)
    scale = _reference_scale(batch)
    decoded = _reference_decode(batch, dtype, scale)
    residual = np.asarray(jaxcomp.find_compress_state(state.opt_state).residual)
    _, sent, _ = ring_reference(batch * scale, _f16)
    np.testing.assert_array_equal(residual, batch - sent / scale)
    total = -np.asarray(state.params)
    expected = decoded.astype(np.float64).sum(axis=0)
    # The ring rounds each partial sum to the narrow type: each of its N roundings of a chunk is
    # at most eps/2 of a partial sum whose magnitude is at most sum |decoded|.
    bound = N_DEVICES * 2.0**-11 * np.abs(decoded).sum(axis=0)
    assert np.all(np.isfinite(total))
    assert np.all(np.abs(total - expected) <= bound + 1e-30)
    assert float(metrics["bytes_sent"]) == method.wire_bytes(n, N_DEVICES)


@pytest.mark.parametrize(
    "dtype, scale", [("bfloat16", None), ("bfloat16", True), ("float16", None)]
)
def test_step_is_the_ring_bit_for_bit(dtype, scale):
    """bfloat16 and float16 in a data_parallel step on the CPU: the update is the numpy ring's
    total and the error-feedback residual is x - the ring's sent, bit for bit (scaled: of x times
    the shared power of two, divided back; float16 is scaled by default)."""
    n = 257
    method = Cast(dtype, scale=scale)
    dp, state = _sgd_run(method, n)
    batch = (np.random.default_rng(0).standard_normal((N_DEVICES, n)) * 100).astype(np.float32)
    state, metrics = dp.step(state, batch)
    s = _reference_scale(batch) if method.scaled else np.float32(1.0)
    total, sent, _ = ring_reference(batch * s, _bf16 if dtype == "bfloat16" else _f16)
    np.testing.assert_array_equal(-np.asarray(state.params), total / s)
    residual = np.asarray(jaxcomp.find_compress_state(state.opt_state).residual)
    np.testing.assert_array_equal(residual, batch - sent / s)
    assert float(metrics["bytes_sent"]) == method.wire_bytes(n, N_DEVICES)


def test_unscaled_float16_overflows_where_the_scaled_one_does_not():
    """The reason for the scale: 8 devices of 3e4 overflow float16's 65504 unscaled. The overflow
    is caught (issue 24: an overflowed sum counts as non-finite, and ``"zero"`` drops it), so
    unscaled the step is lost; scaled it goes through."""
    batch = np.full((N_DEVICES, 16), 3e4, np.float32)
    totals, nonfinite = {}, {}
    for scale in (False, True):
        dp, state = _sgd_run(Cast("float16", scale=scale), 16)
        state, metrics = dp.step(state, batch)
        totals[scale] = -np.asarray(state.params)
        nonfinite[scale] = float(metrics["nonfinite"])
    # Every entry of the sum overflowed (each counted once), and so did the partial sums the ring's
    # devices rounded.
    assert nonfinite[False] == _overflowed(batch) and (totals[False] == 0).all()
    assert nonfinite[True] == 0
    np.testing.assert_allclose(totals[True], 2.4e5, rtol=2**-10)


def _overflowed(batch):
    """The non-finite count of an unscaled float16 step on ``batch``: the entries of numpy's ring
    total. A cast's sents are not read (``Method.rounds_only``): a device whose partial sum
    overflowed sent inf, and so the total overflowed at that entry too."""
    with np.errstate(over="ignore", invalid="ignore"):
        total, sent, _ = ring_reference(batch, _f16)
    assert np.isinf(total).all()  # the sum itself overflowed everywhere
    assert (~np.isfinite(sent)).any()  # and so did some devices' partial sums
    return int(np.sum(~np.isfinite(total)))


def test_error_feedback_identity_replicas_and_one_compile():
    """Over steps: sum of aggregates = sum of gradients - residuals (to the narrow sum's rounding);
    replicas stay identical; one compilation of the step (data_parallel compiles the cast's
    branch alone, so that its buckets overlap the backward pass, and reads the first state's
    branch with one small compiled function)."""
    n = 300
    dp, state = _sgd_run(Cast("bfloat16"), n)
    rng = np.random.default_rng(1)
    fed = np.zeros(n)
    with count_compilations() as compiles:
        for _ in range(4):
            batch = rng.standard_normal((N_DEVICES, n)).astype(np.float32)
            fed += batch.astype(np.float64).sum(axis=0)
            state, _ = dp.step(state, batch)
    assert compiles[0] == 2
    residual = np.asarray(jaxcomp.find_compress_state(state.opt_state).residual, np.float64)
    np.testing.assert_allclose(
        -np.asarray(state.params), fed - residual.sum(axis=0), rtol=0, atol=0.3
    )
    shards = [np.asarray(s.data) for s in state.params.addressable_shards]
    assert all(np.array_equal(shards[0], s) for s in shards[1:])


def _collectives(hlo):
    """``[(dtype, [dims], op)]`` of the collectives in compiled HLO text."""
    found = re.findall(
        r"= (\w+)\[([\d,]*)\]\S* (all-reduce|reduce-scatter|all-gather|collective-permute)"
        r"(?:-start)?\(",
        hlo,
    )
    return [(dtype, [int(d) for d in dims.split(",") if d], op) for dtype, dims, op in found]


#: Bytes a value of each HLO element type.
HLO_BYTES = {"u16": 2, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "u32": 4, "s32": 4}


def _hlo_bytes(ops, n_devices):
    """Bytes one device sends in the collectives ``ops`` of a compiled program (textbook ring
    costs)."""
    N, total = n_devices, 0.0
    for dtype, dims, op in ops:
        nbytes = int(np.prod(dims)) * HLO_BYTES[dtype]
        total += {
            "all-reduce": 2 * (N - 1) / N * nbytes,
            "all-gather": (N - 1) / N * nbytes,
            "reduce-scatter": (N - 1) * nbytes,
            "collective-permute": nbytes,
        }[op]
    return total


def _compiled_aggregate(method, n, n_devices=N_DEVICES, scatter=False):
    """The compiled HLO text of ``method``'s aggregate (or reduce_scatter) on the CPU."""
    key = jax.random.key(0)

    def aggregate(v):
        if scatter:
            return method.reduce_scatter(v, "data", step=0, key=key, size=v.shape[0])
        return method.aggregate(v, "data", step=0, key=key)[:2]

    mesh = Mesh(np.array(jax.devices()[:n_devices]), ("data",))
    f = jax.jit(
        jax.shard_map(
            aggregate,
            mesh=mesh,
            in_specs=P("data"),
            out_specs=(P("data") if scatter else P(), P("data")),
        )
    )
    return f.lower(jnp.zeros(n * n_devices, jnp.float32)).compile().as_text()


@pytest.mark.parametrize(
    "method",
    [Cast("bfloat16"), Cast("float16"), Cast("bfloat16", scale=True)],
    ids=["bf16", "fp16", "bf16-scaled"],
)
@pytest.mark.parametrize("n", [1003, 1000])
def test_bytes_on_the_wire_are_wire_bytes(method, n):
    """The collectives of the compiled CPU step move what wire_bytes says: both types as uint16
    ring hops and an all-gather of the owned chunks (2 bytes a value, padded to N chunks), and the
    scale's scalar all-reduce."""
    ops = _collectives(_compiled_aggregate(method, n))
    assert _hlo_bytes(ops, N_DEVICES) == pytest.approx(method.wire_bytes(n, N_DEVICES))


@pytest.mark.parametrize(
    "dtype, scale", [("bfloat16", None), ("bfloat16", True), ("float16", None)]
)
@pytest.mark.parametrize("scatter", [False, True], ids=["aggregate", "reduce_scatter"])
def test_compiled_cpu_cast_moves_only_16_bit_words(dtype, scale, scatter):
    """Issue 22, item 5: XLA:CPU's collectives carry a bfloat16 all-reduce as float32, and sum a
    float16 one in software. The CPU program has no all-reduce or reduce-scatter of the vector
    (bf16, f16 or f32): only collective-permutes of u16 chunks and, for the all-reduce, one
    all-gather of them (plus the scale's scalar)."""
    n = 4096
    method = Cast(dtype, scale=scale)
    ops = _collectives(_compiled_aggregate(method, n, scatter=scatter))
    vector_ops = [op for op in ops if np.prod(op[1]) > 1]
    assert vector_ops and all(dtype == "u16" for dtype, _, _ in vector_ops), ops
    assert {op for _, _, op in vector_ops} == (
        {"collective-permute"} if scatter else {"collective-permute", "all-gather"}
    ), ops
    assert sum(op == "collective-permute" for _, _, op in vector_ops) == N_DEVICES - 1
    assert [op for op in ops if op not in vector_ops] == (
        [("f32", [], "all-reduce")] if method.scaled else []
    )
    if scatter:
        assert _hlo_bytes(ops, N_DEVICES) == pytest.approx(
            method.reduce_scatter_bytes(n, N_DEVICES)
        )


@pytest.mark.parametrize("dtype, hlo", [("bfloat16", "bf16"), ("float16", "f16")])
def test_other_platforms_keep_the_psum(dtype, hlo):
    """NCCL and the TPU reduce both 16-bit types natively: lowered for them, the step is one
    all-reduce in the narrow type and no ring (jax.lax.platform_dependent chooses when
    lowering)."""
    mesh = _mesh()
    f = jax.jit(
        jax.shard_map(
            lambda v: Cast(dtype).aggregate(v, "data", step=0, key=None)[:2],
            mesh=mesh,
            in_specs=P("data"),
            out_specs=(P(), P("data")),
        )
    )
    traced = f.trace(jnp.zeros(1003 * N_DEVICES, jnp.float32))
    for platform in ("cuda", "tpu"):
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert "collective_permute" not in text and "all_gather" not in text
        assert re.search(
            r"stablehlo.all_reduce.*\n(.*\n){0,4}.*\(tensor<1003x"
            + hlo
            + r">\) -> tensor<1003x"
            + hlo
            + ">",
            text,
        )
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert "collective_permute" in cpu
    # The CPU's only all-reduce is the scale's scalar (float16 is scaled by default).
    assert re.findall(r"stablehlo.all_reduce.*\n(?:.*\n){0,4}?.*-> tensor<(\w+)>", cpu) == (
        ["f32"] if Cast(dtype).scaled else []
    )


def test_power_of_two_scale():
    assert float(power_of_two_scale(jnp.float32(1.0), 8)) == 4096.0
    assert float(power_of_two_scale(jnp.float32(0.0), 8)) == 1.0
    assert float(power_of_two_scale(jnp.float32(1e30), 8)) == 2.0**-60  # clipped, still finite


def test_wire_bytes_names_and_cost_model():
    bf16, fp16 = Cast("bf16"), Cast(jnp.float16)
    assert bf16 == Cast(jnp.bfloat16) == Cast(ml_dtypes.bfloat16) and fp16 == Cast(np.float16)
    assert (
        bf16.label == "bf16"
        and fp16.label == "fp16"
        and Cast(allreduce="tree").label == "bf16_tree"
    )
    assert bf16.wire_bytes(1000, 8) == jaxcomp.Dense().wire_bytes(1000, 8) / 2
    assert fp16.wire_bytes(1000, 8) == bf16.wire_bytes(1000, 8) + 2 * 7 / 8 * 4
    assert (
        fp16.message_steps(8) == 2 * bf16.message_steps(8) == 28 and bf16.wire_bytes(1000, 1) == 0.0
    )
    # The ring sends 2 (N-1) chunks of ceil(n/N) values (float16 also the scale's scalar).
    assert (
        bf16.wire_bytes(1003, 8) == 2 * 7 * 126 * 2
        and fp16.wire_bytes(1003, 8) == 2 * 7 * 126 * 2 + 7
    )
    assert Cast("bf16", allreduce="tree").wire_bytes(1000, 8) == 2 * 3 * 2000
    assert bf16.reduce_scatter_bytes(1000, 8) == 7 * 125 * 2 and bf16.reduce_scatter_steps(8) == 7
    assert jaxcomp.methods.parse("bf16") == bf16 and jaxcomp.methods.parse("fp16") == fp16
    net = cost.Network.parse("1ms", "1gbit")
    assert cost.predict("bf16", 4e8, 8, net) < cost.predict("dense", 4e8, 8, net)
    assert bf16 in jaxcomp.methods.candidates(variants=True)


def test_cast_is_a_compress_auto_candidate():
    state = jaxcomp.compress_auto([jaxcomp.Dense(), Cast()]).init({"w": jnp.zeros(3)})
    assert [m.describe() for m in state.methods] == ["dense", "bf16"]


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: Cast(jnp.float32), "dtype must be bfloat16 or float16"),
        (lambda: Cast("int8"), "dtype must be"),
        (lambda: Cast("bf16", scale="yes"), "scale must be"),
        (lambda: Cast("bf16", allreduce="star"), "allreduce must be one of"),
        (lambda: jaxcomp.compress("bf16", ratio=0.1), "remove ratio="),
    ],
)
def test_bad_arguments_are_named(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()


# ----------------------------------------------------------------------------------------------
# The CPU's 16-bit ring (jaxcomp.collectives.narrow_allreduce), against numpy.


def _bf16(v):
    return np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _f16(v):
    return np.asarray(v, np.float32).astype(np.float16).astype(np.float32)


#: The numpy rounding of each wire type.
ROUNDINGS = {"bfloat16": _bf16, "float16": _f16}


def ring_reference(X, rounding=_bf16):
    """numpy: the 16-bit ring over the rows of ``X`` ([N, n] float32), in the same order with the
    same roundings (``rounding``: :func:`_bf16` or :func:`_f16`). Device d starts with chunk d - 1;
    at each hop it sends its partial sum rounded, the receiver adds its own chunk in float32;
    device d ends owning chunk d and rounds it once more. Returns ``(total, sent [N, n], owned [N,
    chunk])``: every rounding a device made is taken off its ``sent``."""
    X = np.asarray(X, np.float32)
    N, n = X.shape
    chunk = -(-n // N)
    chunks = np.pad(X, ((0, 0), (0, N * chunk - n))).reshape(N, N, chunk)
    sent = chunks.copy()
    partials = [chunks[d, (d - 1) % N] for d in range(N)]
    for hop in range(N - 1):
        messages = [rounding(p) for p in partials]
        for d in range(N):
            sent[d, (d - 1 - hop) % N] -= partials[d] - messages[d]
        partials = [messages[(d - 1) % N] + chunks[d, (d - 2 - hop) % N] for d in range(N)]
    owned = np.stack([rounding(p) for p in partials])
    for d in range(N):
        sent[d, d] -= partials[d] - owned[d]
    return owned.reshape(-1)[:n], sent.reshape(N, -1)[:, :n], owned


def _run_ring(n_devices, X, scatter=False, algorithm="auto", axes=("data",), dtype="bfloat16"):
    """Every device's (total, sent) of narrow_allreduce in ``dtype`` over the rows of ``X`` on the
    first ``n_devices`` devices (over ``axes``, a mesh of that many devices in all); bfloat16 by
    its own name, bfloat16_allreduce."""
    need_devices(n_devices)
    shape = (n_devices,) if len(axes) == 1 else (2, n_devices // 2)
    mesh = Mesh(np.array(jax.devices()[:n_devices]).reshape(shape), axes)
    axis = axes[0] if len(axes) == 1 else axes

    def f(v):
        if dtype == "bfloat16":
            total, sent = collectives.bfloat16_allreduce(
                v, axis, scatter=scatter, algorithm=algorithm
            )
        else:
            total, sent = collectives.narrow_allreduce(
                v, axis, dtype, scatter=scatter, algorithm=algorithm
            )
        return total[None], sent[None]

    out = jax.jit(
        jax.shard_map(f, mesh=mesh, in_specs=P(axes), out_specs=(P(axes), P(axes)), check_vma=True)
    )(jnp.asarray(X).reshape(-1))
    return tuple(np.asarray(a.astype(jnp.float32)) for a in out)


def _rows(n_devices, n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n_devices, n)) * rng.uniform(0.1, 10.0, (n_devices, 1))).astype(
        np.float32
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "n_devices, n",
    [
        (2, 1),
        (2, 5),
        (2, 1001),
        (3, 1),
        (3, 5),
        (3, 100),
        (3, 30001),
        (8, 1),
        (8, 5),
        (8, 1003),
        (8, 100_003),
    ],
)
def test_ring_matches_numpy_bit_for_bit(n_devices, n, dtype):
    """The ring on 2, 3 and 8 devices, in both types, with fewer values than devices, sizes that are
    not a multiple of N, and a large one: total and sent bit for bit as numpy's ring, the total
    identical on every device, and the devices' sent add up to the total (every rounding is some
    device's, so error feedback keeps all the ring lost)."""
    X = _rows(n_devices, n)
    totals, sent = _run_ring(n_devices, X, dtype=dtype)
    total, expected_sent, _ = ring_reference(X, ROUNDINGS[dtype])
    np.testing.assert_array_equal(totals, np.broadcast_to(total, totals.shape))
    np.testing.assert_array_equal(sent, expected_sent)
    np.testing.assert_allclose(
        sent.astype(np.float64).sum(0), total, rtol=1e-6, atol=1e-6 * np.abs(X).sum(0).max()
    )
    # Each of the N roundings of a chunk is half an ulp of a partial sum at most (float16: plus
    # half its smallest subnormal, 2**-25).
    eps = 2.0**-8 if dtype == "bfloat16" else 2.0**-11
    bound = n_devices * (eps * np.abs(X.astype(np.float64)).sum(0) + 2.0**-25)
    assert np.all(np.abs(total - X.astype(np.float64).sum(0)) <= bound)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("n_devices, row", [(2, 3), (3, 1), (8, 37)])
def test_ring_reduce_scatter_is_the_all_reduce_split(n_devices, row, dtype):
    """scatter=True (sharded training): the ring's reduce-scatter phase; device d's shard is row d
    of the all-reduce bit for bit, rounded as the all-reduce's owner rounds it, with the same
    sent."""
    X = _rows(n_devices, n_devices * row, seed=1)
    shards, sent = _run_ring(n_devices, X, scatter=True, dtype=dtype)
    _, expected_sent, owned = ring_reference(X, ROUNDINGS[dtype])
    np.testing.assert_array_equal(shards, owned)
    np.testing.assert_array_equal(sent, expected_sent)
    with pytest.raises(ValueError, match="not 3 rows of equal length"):
        _run_ring(3, _rows(3, 10), scatter=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_ring_over_two_mesh_axes(dtype):
    """A tuple of axes (a 2 x 4 mesh) rings over the devices in the axes' flattened order."""
    X = _rows(8, 203, seed=2)
    totals, sent = _run_ring(8, X, axes=("node", "gpu"), dtype=dtype)
    total, expected_sent, _ = ring_reference(X, ROUNDINGS[dtype])
    np.testing.assert_array_equal(totals[0], total)
    np.testing.assert_array_equal(sent, expected_sent)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_psum_and_one_device(dtype):
    """algorithm="psum" (what GPU and TPU run) is the cast and one psum, sent the cast; with one
    device nothing is sent and total = sent = x rounded to the narrow type, as Cast always did."""
    X = np.random.default_rng(3).integers(-40, 41, (8, 11)).astype(np.float32)  # every sum exact
    totals, sent = _run_ring(8, X, algorithm="psum", dtype=dtype)
    np.testing.assert_array_equal(totals, np.broadcast_to(X.sum(0), totals.shape))
    np.testing.assert_array_equal(sent, X)
    X = _rows(1, 7)
    for algorithm in collectives.BFLOAT16_ALGORITHMS:
        total, sent = _run_ring(1, X, algorithm=algorithm, dtype=dtype)
        np.testing.assert_array_equal(total, ROUNDINGS[dtype](X))
        np.testing.assert_array_equal(sent, ROUNDINGS[dtype](X))
    with pytest.raises(ValueError, match="algorithm must be one of"):
        _run_ring(2, _rows(2, 4), algorithm="tree", dtype=dtype)


@pytest.mark.parametrize("dtype, match", [("int8", "dtype must be one of"), ("nope", "dtype must")])
def test_narrow_allreduce_names_a_bad_dtype(dtype, match):
    with pytest.raises(ValueError, match=match):
        _run_ring(2, _rows(2, 4), dtype=dtype)


def test_bfloat16_training_trains():
    """compress("bf16") in data_parallel on 8 devices (the CPU ring): a small regression's loss
    falls by more than 10x in 30 adam steps, along dense's curve to 1%, and the replicas stay
    identical."""
    rng = np.random.default_rng(4)
    w_true = rng.standard_normal((16, 4)).astype(np.float32)

    def loss(params, batch):
        return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)

    batches = []
    for _ in range(30):
        x = rng.standard_normal((64, 16)).astype(np.float32)
        batches.append({"x": x, "y": x @ w_true + 0.5})
    final = {}
    for method in ("dense", "bf16"):
        tx = optax.chain(jaxcomp.compress(method), optax.adam(0.05))
        dp = jaxcomp.data_parallel(loss, tx, _mesh())
        state = dp.init({"w": jnp.zeros((16, 4)), "b": jnp.zeros(4)})
        losses = []
        for batch in batches:
            state, metrics = dp.step(state, batch)
            losses.append(float(metrics["loss"]))
        final[method] = losses
        shards = [np.asarray(s.data) for s in state.params["w"].addressable_shards]
        assert all(np.array_equal(shards[0], s) for s in shards[1:])
    assert final["bf16"][-1] < 0.1 * final["bf16"][0]
    np.testing.assert_allclose(final["bf16"], final["dense"], rtol=0.01)


def test_unscaled_float16_sum_that_overflows_is_skipped_under_skip():
    """The guard checks sums against float16's 65504 when the cast is unscaled
    (Method.wire_dtype), not against the gradients' float32: "skip" keeps the params."""
    tx = optax.chain(
        jaxcomp.compress(Cast("float16", scale=False), mean=False, nonfinite="skip"),
        optax.sgd(1.0),
    )
    dp = jaxcomp.data_parallel(lambda w, b: jnp.sum(w * jnp.mean(b, axis=0)), tx, _mesh())
    state, metrics = dp.step(dp.init(jnp.ones(16)), np.full((N_DEVICES, 16), 3e4, np.float32))
    assert float(metrics["nonfinite"]) == _overflowed(np.full((N_DEVICES, 16), 3e4, np.float32))
    np.testing.assert_array_equal(np.asarray(state.params), np.ones(16, np.float32))
    assert Cast("float16", scale=False).wire_dtype == "float16"
    assert Cast("float16").wire_dtype is None and Cast("bfloat16").wire_dtype is None


def _residual_size(tx, n=64):
    """The values of the residual a transformation's state holds, on the test's mesh."""
    dp = jaxcomp.data_parallel(lambda w, b: jnp.sum(w * jnp.mean(b, axis=0)), tx, _mesh())
    return int(
        np.asarray(jaxcomp.find_compress_state(dp.init(jnp.zeros(n)).opt_state).residual).size
    )


def test_the_casts_run_without_error_feedback_by_default():
    """``error_feedback="auto"``: no residual for the casts (``feeds_back_by_default``), one for
    the other methods and for ``compress_auto`` when any candidate wants it; True or False as
    given; anything else is refused by name."""
    sgd = optax.sgd(1.0)
    for method in (Cast("bfloat16"), Cast("float16"), "bf16", "fp16"):
        assert _residual_size(optax.chain(jaxcomp.compress(method), sgd)) == 0
        assert _residual_size(optax.chain(jaxcomp.compress(method, error_feedback=True), sgd)) > 0
    assert _residual_size(optax.chain(jaxcomp.compress(jaxcomp.TopK(0.1)), sgd)) > 0
    only_casts = jaxcomp.compress_auto([jaxcomp.Dense(), Cast("bfloat16")])
    assert _residual_size(optax.chain(only_casts, sgd)) == 0
    with_topk = jaxcomp.compress_auto([jaxcomp.Dense(), Cast("bfloat16"), jaxcomp.TopK(0.1)])
    assert _residual_size(optax.chain(with_topk, sgd)) > 0
    with pytest.raises(TypeError, match="error_feedback must be True, False, 'auto' or a decay"):
        jaxcomp.compress(Cast(), error_feedback="yes")
