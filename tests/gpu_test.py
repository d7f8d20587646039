"""The CUDA kernels against the CPU kernels, bit for bit, on a GPU.

The CPU kernels are checked against the pure-JAX references elsewhere; here every op runs on the
same input on the CPU and on the GPU and the results must be identical: zfp words bit for bit
(and decoded values), top-k index sets (the output order is fixed, so whole arrays), threshold
counts and thresholds. Inputs include the awkward cases: ties, zeros, NaN, ±Inf, denormals,
lengths that are not multiples of a zfp block, a warp or a tile, and more rows than one chunk.

Skipped, with the reason printed (``-rs``), where there is no GPU or no ``_jaxcomp_cuda``
module. Run on a GPU machine with ``pytest -m gpu tests/gpu_test.py`` (see docs/gpu.md).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from train_test import EVERY_METHOD

import jaxcomp
from jaxcomp import collectives
from jaxcomp.ops import _ffi
from jaxcomp.optim.transform import compress
from jaxcomp.training.trainer import data_parallel

pytestmark = pytest.mark.gpu


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:  # no GPU backend in this jaxlib
        return []


if not _gpus():
    pytest.skip(
        "no GPU: jax.devices('gpu') is empty, so the CUDA kernels cannot be compared with the CPU "
        "ones here (run `pytest -m gpu tests/gpu_test.py` on a GPU machine, see docs/gpu.md)",
        allow_module_level=True,
    )
if not _ffi.HAS_CUDA:
    pytest.skip(
        "jaxcomp was built without its CUDA module (_jaxcomp_cuda); rebuild with "
        "`pip install --no-build-isolation --no-deps -Ccmake.define.JAXCOMP_CUDA=ON .`",
        allow_module_level=True,
    )

GPU = _gpus()[0]
CPU = jax.devices("cpu")[0]

# Row lengths around every boundary of the kernels: zfp blocks (4) and warps of blocks (128
# values), top-k tiles (8192 values).
LENGTHS = (1, 3, 4, 5, 127, 129, 1000, 8191, 8193, 3 * 8192 + 5)


def _on(device, x):
    return jax.device_put(x, device)


def _both(fn, *args):
    """(CPU result, GPU result) of fn on the same numpy arguments, as numpy arrays."""
    results = []
    for device in (CPU, GPU):
        out = fn(*(_on(device, a) for a in args))
        results.append(jax.tree.map(np.asarray, out))
    return results


def _assert_same(cpu, gpu):
    for a, b in zip(jax.tree.leaves(cpu), jax.tree.leaves(gpu)):
        assert a.dtype == b.dtype and a.shape == b.shape
        # Bit patterns, so that NaNs and signed zeros compare too.
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def _awkward(shape, seed, kind):
    """float32 test data: 'gradient' (well spread), 'ties' (few distinct magnitudes), 'special'."""
    rng = np.random.default_rng(seed)
    if kind == "gradient":
        x = rng.standard_t(3, size=shape) * 10.0 ** rng.uniform(-6, 0, size=shape)
    elif kind == "ties":
        x = rng.choice([-2.0, -1.0, 0.0, -0.0, 1.0, 2.0, 0.5], size=shape)
    else:
        x = rng.standard_normal(shape)
        flat = x.reshape(-1)
        picks = rng.choice(flat.size, size=min(flat.size, 7), replace=False)
        specials = [np.nan, np.inf, -np.inf, 1e-40, -1e-45, 0.0, 3.4e38]
        flat[picks] = specials[: picks.size]
    return np.asarray(x, np.float32)


def _rows_of_every_kind(n, seed):
    """[3, n]: one row of each kind of _awkward, so one call covers all three."""
    return np.stack(
        [_awkward((n,), seed + i, kind) for i, kind in enumerate(("gradient", "ties", "special"))]
    )


@pytest.mark.parametrize("n", LENGTHS)
def test_topk_matches_cpu(n):
    x = _rows_of_every_kind(n, seed=n)
    for k in sorted({1, max(1, n // 100), max(1, n // 3), n}):
        _assert_same(*_both(lambda v: jaxcomp.topk(v, k), x))


@pytest.mark.parametrize("rounds", [1, 5, 11, 12, 16, 22, 23, 31])
def test_threshold_matches_cpu(rounds):
    n = 3 * 8192 + 5
    x = _rows_of_every_kind(n, seed=rounds)
    for k in (1, 97, n // 2, n):
        _assert_same(*_both(lambda v: jaxcomp.find_threshold(v, k, rounds), x))
        _assert_same(*_both(lambda v: jaxcomp.threshold_topk(v, k, rounds), x))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_topk_dtypes_and_batch_match_cpu(dtype):
    x = _awkward((2, 3, 1000), seed=7, kind="gradient").astype(dtype)
    _assert_same(*_both(lambda v: jaxcomp.topk(v, 10), x))
    _assert_same(*_both(lambda v: jaxcomp.threshold_topk(v, 10), x))
    _assert_same(*_both(jax.vmap(lambda v: jaxcomp.topk(v, 10)), x))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("n", [1000, 8193, 3 * 8192 + 5])
def test_16_bit_input_matches_cpu(dtype, n):
    # The CUDA kernels read bfloat16/float16 directly (the CPU path upcasts to float32 and casts
    # the values back): same indices, thresholds and counts, values bit for bit. Rows of every
    # kind: ties, signed zeros, NaN, +-Inf, values that become denormals or zero in 16 bits.
    with np.errstate(over="ignore"):  # 3.4e38 becomes Inf in float16
        x = _rows_of_every_kind(n, seed=n).astype(dtype)
    for k in (1, 97, n // 3):
        _assert_same(*_both(lambda v: jaxcomp.topk(v, k), x))
        for rounds in (9, 16, 31):
            _assert_same(*_both(lambda v: jaxcomp.threshold_topk(v, k, rounds), x))
            _assert_same(*_both(lambda v: jaxcomp.find_threshold(v, k, rounds), x))
    # And the GPU's 16-bit values are the float32 path's values on the upcast, cast back.
    values, indices = jax.tree.map(np.asarray, jaxcomp.topk(_on(GPU, x), 97))
    up_values, up_indices = jax.tree.map(
        np.asarray, jaxcomp.topk(_on(GPU, x.astype(np.float32)), 97)
    )
    np.testing.assert_array_equal(indices, up_indices)
    np.testing.assert_array_equal(
        values.astype(np.float32).view(np.uint32), up_values.view(np.uint32)
    )


def test_many_short_rows_match_cpu():
    # More rows than one chunk of the GPU radix select's scratch (4096 rows).
    x = _awkward((5000, 7), seed=3, kind="ties")
    _assert_same(*_both(lambda v: jaxcomp.topk(v, 3), x))
    _assert_same(*_both(lambda v: jaxcomp.find_threshold(v, 3, 9), x))


def test_topk_large_row_matches_cpu():
    x = _awkward((1 << 22,), seed=11, kind="gradient")
    _assert_same(*_both(lambda v: jaxcomp.topk(v, 1 << 15), x))
    _assert_same(*_both(lambda v: jaxcomp.threshold_topk(v, 1 << 15), x))


@pytest.mark.parametrize("rate", [1, 2, 3, 4, 5, 7, 8, 12, 16, 21, 31, 32])
def test_zfp_matches_cpu(rate):
    for n in LENGTHS:
        x = _rows_of_every_kind(n, seed=n + rate)
        cpu_words, gpu_words = _both(lambda v: jaxcomp.zfp_encode(v, rate), x)
        _assert_same(cpu_words, gpu_words)
        _assert_same(*_both(lambda w: jaxcomp.zfp_decode(w, n, rate), cpu_words))


def test_zfp_rows_of_zeros_and_nonfinite_match_cpu():
    x = np.zeros((4, 300), np.float32)
    x[1, 17] = np.nan
    x[2, 299] = -np.inf
    x[3] = np.linspace(-1e-38, 1e-38, 300, dtype=np.float32)  # denormals and tiny normals
    for rate in (1, 2, 3, 8, 32):
        cpu_words, gpu_words = _both(lambda v: jaxcomp.zfp_encode(v, rate), x)
        _assert_same(cpu_words, gpu_words)
        _assert_same(*_both(lambda w: jaxcomp.zfp_decode(w, 300, rate), cpu_words))


def test_zfp_large_row_matches_cpu():
    x = _awkward((1 << 22,), seed=5, kind="gradient")
    cpu_words, gpu_words = _both(lambda v: jaxcomp.zfp_encode(v, 8), x)
    _assert_same(cpu_words, gpu_words)
    _assert_same(*_both(lambda w: jaxcomp.zfp_decode(w, x.shape[-1], 8), cpu_words))


def test_gpu_handlers_reject_bad_arguments():
    # Python validates first; the handlers check again (here: a result shape Python cannot get
    # wrong, so call the target directly with an inconsistent one).
    call = jax.ffi.ffi_call(
        "jaxcomp_topk",
        (jax.ShapeDtypeStruct((3,), jnp.float32), jax.ShapeDtypeStruct((3,), jnp.int32)),
        vmap_method="broadcast_all",
    )
    with pytest.raises(Exception, match="k must be in"):
        jax.block_until_ready(call(_on(GPU, np.ones(2, np.float32)), k=np.int64(3)))
    # x of a type the kernels do not read, and values not of x's type.
    call = jax.ffi.ffi_call(
        "jaxcomp_topk",
        (jax.ShapeDtypeStruct((1,), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.int32)),
        vmap_method="broadcast_all",
    )
    with pytest.raises(Exception, match="x must be float32, bfloat16 or float16, got int32"):
        jax.block_until_ready(call(_on(GPU, np.ones(2, np.int32)), k=np.int64(1)))
    with pytest.raises(Exception, match="must be bfloat16, got float32"):
        jax.block_until_ready(call(_on(GPU, np.ones(2, jnp.bfloat16)), k=np.int64(1)))


def test_collectives_on_gpu_arrays_match_cpu():
    x = _awkward((4096,), seed=1, kind="gradient")

    def run(device, fn):
        mesh = jax.sharding.Mesh(np.array([device]), ("data",))
        spec = jax.sharding.PartitionSpec("data")
        mapped = jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=spec,
            out_specs=(jax.sharding.PartitionSpec(), spec),
            check_vma=False,
        )
        return jax.tree.map(np.asarray, jax.jit(mapped)(_on(device, x)))

    calls = {
        "allgather_topk": lambda v: collectives.allgather_topk(v, k=41, axis_name="data"),
        "ar_topk": lambda v: collectives.ar_topk(v, k=41, axis_name="data"),
        "zfp_allreduce": lambda v: collectives.zfp_allreduce(v, rate=8, axis_name="data"),
    }
    for fn in calls.values():
        _assert_same(run(CPU, fn), run(GPU, fn))


def _train_on(device, tx, steps):
    """(params, losses) after ``steps`` of data_parallel on a 1-device mesh of ``device``."""
    rng = np.random.default_rng(0)
    params = {
        "w1": np.asarray(rng.standard_normal((16, 32)) * 0.1, np.float32),
        "b": np.zeros(32, np.float32),
        "w2": np.asarray(rng.standard_normal((32, 4)) * 0.1, np.float32),
    }
    x = rng.standard_normal((24, 16)).astype(np.float32)

    def loss_fn(p, batch):
        return jnp.mean((jnp.tanh(batch["x"] @ p["w1"] + p["b"]) @ p["w2"] - batch["y"]) ** 2)

    mesh = jax.sharding.Mesh(np.array([device]), ("data",))
    dp = data_parallel(loss_fn, tx, mesh)
    state = dp.init(jax.device_put(params, device))
    batch = dp.shard_batch({"x": x, "y": x[:, :4] * 0.5})
    losses = []
    for _ in range(steps):
        state, metrics = dp.step(state, batch)
        losses.append(float(metrics["loss"]))
    return jax.tree.map(np.asarray, state.params), losses


def _assert_trains_like_the_cpu(tx):
    # The kernels are bit for bit the CPU's, the rest is XLA arithmetic, which may round
    # differently (fusions, FMA) by a few ulps a step (bf16's rounding of the gradient turns one
    # into 1e-4 on the third loss). float32 matmuls at full precision: the GPU's default would use
    # TF32.
    with jax.default_matmul_precision("highest"):
        cpu_params, cpu_losses = _train_on(CPU, tx, 20)
        gpu_params, gpu_losses = _train_on(GPU, tx, 20)
    assert np.isfinite(gpu_losses).all() and gpu_losses[-1] < 0.7 * gpu_losses[0], gpu_losses
    np.testing.assert_allclose(gpu_losses[:3], cpu_losses[:3], rtol=1e-3)
    np.testing.assert_allclose(gpu_losses[-1], cpu_losses[-1], rtol=0.05)
    for name in cpu_params:
        scale = np.abs(cpu_params[name]).max()
        assert np.abs(gpu_params[name] - cpu_params[name]).max() <= 0.05 * scale, name


@pytest.mark.parametrize("method, options", EVERY_METHOD, ids=[m for m, _ in EVERY_METHOD])
def test_every_method_trains_on_one_gpu_like_on_the_cpu(method, options):
    # The first thing a GPU user tries: one GPU, any method (train_test.py's list, at settings
    # that train a small MLP in a few steps).
    _assert_trains_like_the_cpu(optax.chain(compress(method, **options), optax.adam(3e-2)))


def test_jaxcomp_adam_with_signs_trains_on_one_gpu_like_on_the_cpu():
    _assert_trains_like_the_cpu(jaxcomp.adam(3e-2, "sign", warmup_steps=5))
