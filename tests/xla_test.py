"""The portable XLA implementation (jaxcomp.ops.xla, implementation="xla") against the native
kernels, bit for bit: every op over the awkward inputs of the kernel tests, the collectives run on
it, argument checks, differentiation, and the default's choice (with its warning) per platform."""

import importlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import count_compilations, need_devices
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import collectives
from jaxcomp.ops import _ffi

xla_topk = importlib.import_module("jaxcomp.ops.xla.topk")  # the module, not its topk function

LENGTHS = (1, 3, 4, 5, 127, 1000, 8193)
RATES = (1, 2, 3, 5, 8, 16, 31, 32)
ROUNDS = (1, 5, 16, 23, 31)  # find_threshold's rounds


def bits(tree):
    """Leaves as raw bits (NaN payloads and signed zeros compare too)."""
    out = []
    for leaf in jax.tree.leaves(tree):
        leaf = np.asarray(leaf)
        out.append(
            leaf.view({8: np.uint64, 4: np.uint32, 2: np.uint16, 1: np.uint8}[leaf.dtype.itemsize])
        )
    return out


def assert_same(native, portable):
    a, b = bits(native), bits(portable)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def rows(n, seed):
    """[3, n] float32: gradients (magnitudes over 6 decades), ties with signed zeros, specials."""
    rng = np.random.default_rng(seed)
    gradient = rng.standard_t(3, n) * 10.0 ** rng.uniform(-6, 0, n)
    ties = rng.choice([-2.0, -1.0, 0.0, -0.0, 1.0, 2.0, 0.5], n)
    special = rng.standard_normal(n)
    picks = rng.choice(n, min(n, 7), replace=False)
    special[picks] = [np.nan, np.inf, -np.inf, 1e-40, -1e-45, 0.0, 3.4e38][: picks.size]
    return np.stack([gradient, ties, special]).astype(np.float32)


def both(op, *args, **kwargs):
    return op(*args, **kwargs, implementation="native"), op(*args, **kwargs, implementation="xla")


@pytest.mark.parametrize(
    "n", [n if n < 8193 else pytest.param(n, marks=pytest.mark.slow) for n in LENGTHS]
)
def test_topk_family_identical(n):
    x = rows(n, n)
    middle = max(1, n // 3)
    for j, k in enumerate(sorted({1, middle, n})):
        assert_same(*both(jaxcomp.topk, x, k))
        # Each rounds value is a compile of both paths (the cost of this test): two per k, cycling
        # with the length and the k, so every value meets every kind of k (1, a third, all).
        # 16 ends the coarse digit, 5 is inside it.
        start = LENGTHS.index(n) + j
        for rounds in (ROUNDS[start % 5], ROUNDS[(start + 2) % 5]):
            assert_same(*both(jaxcomp.find_threshold, x, k, rounds))
            assert_same(*both(jaxcomp.threshold_topk, x, k, rounds))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_narrow_dtypes_batches_vmap_and_jit(dtype):
    x = jnp.asarray(rows(1000, 7).reshape(3, 1, 1000), dtype)
    assert_same(*both(jaxcomp.topk, x, 10))
    assert_same(*both(jaxcomp.threshold_topk, x, 10))
    for implementation in ("native", "xla"):
        vmapped = jax.vmap(lambda v, i=implementation: jaxcomp.topk(v, 10, implementation=i))(x)
        assert_same(jaxcomp.topk(x, 10), vmapped)
        jitted = jax.jit(lambda v, i=implementation: jaxcomp.zfp_encode(v, 5, implementation=i))(x)
        assert_same(jaxcomp.zfp_encode(x, 5), jitted)


def test_many_short_rows_and_a_long_row():
    x = np.random.default_rng(3).choice([-2.0, -1.0, 0.0, 1.0, 0.5], (5000, 7)).astype(np.float32)
    assert_same(*both(jaxcomp.topk, x, 3))
    assert_same(*both(jaxcomp.find_threshold, x, 3, 9))
    # Past SORT_BELOW (2**14): the histograms' path, every radix digit of the keys in play.
    long_row = rows(xla_topk.SORT_BELOW + 1, 4)[0]
    assert_same(*both(jaxcomp.topk, long_row, 6_600))
    assert_same(*both(jaxcomp.threshold_topk, long_row, 1_300))
    assert_same(*both(jaxcomp.find_threshold, long_row, 1_300, 23))


def test_an_eager_call_on_the_xla_path_compiles_once():
    """Called eagerly (a notebook), the portable op compiled itself again at every call (a jit
    of a new closure each time: 0.4-0.7 s a call for ZFP on 3 x 127 values)."""
    x = jnp.asarray(rows(127, 130))
    ops = [
        lambda: jaxcomp.zfp_encode(x, 3, implementation="xla"),
        lambda: jaxcomp.topk(x, 5, implementation="xla"),
        lambda: jaxcomp.sign_pack(x, implementation="xla"),
    ]
    for op in ops:
        jax.block_until_ready(op())
        with count_compilations() as compiles:
            jax.block_until_ready(op())
        assert compiles[0] == 0


@pytest.mark.parametrize("n, rows_", [(7, 50), (1000, 3), (65_537, 1)])
def test_short_rows_sort_where_long_rows_use_histograms_and_find_the_same_bracket(n, rows_):
    """Rows shorter than SORT_BELOW find their k-th key by a sort (5,000 rows of 7 took 4.5 s a
    call with the histograms' 2**16 bins a row); both ways give the same bracket for every
    rounds."""
    x = np.concatenate([rows(n, n + s) for s in range(-(-rows_ // 3))])[:rows_]
    keys = xla_topk._keys(jnp.asarray(x))
    for k in sorted({1, max(1, n // 3), n}):
        for rounds in ROUNDS:
            by_sort = xla_topk._bracket(keys, k, rounds, by="sort")
            by_histogram = xla_topk._bracket(keys, k, rounds, by="histogram")
            assert_same(by_sort, by_histogram)


@pytest.mark.parametrize(
    "rate", [r if r in (1, 8, 16, 32) else pytest.param(r, marks=pytest.mark.slow) for r in RATES]
)
def test_zfp_words_and_values_identical(rate):
    # Two lengths per rate, cycling, so every length meets two or three rates (compiles are the
    # cost).
    start = RATES.index(rate)
    for n in (LENGTHS[start % 7], LENGTHS[(start + 3) % 7]):
        x = rows(n, n + rate)
        native_words, portable_words = both(jaxcomp.zfp_encode, x, rate)
        assert_same(native_words, portable_words)
        assert_same(*both(jaxcomp.zfp_decode, native_words, n, rate))
    # Any words decode, the same way: random bit patterns reach every plane-decoding path.
    n = 203
    words = np.random.default_rng(rate).integers(
        0, 2**32, (2, jaxcomp.zfp_num_words(n, rate)), dtype=np.uint32
    )
    words[1, 0] &= 0xFF  # rates 1-2: a valid row exponent in the header word
    assert_same(*both(jaxcomp.zfp_decode, words, n, rate))


def test_zfp_special_rows_and_dtypes():
    x = np.zeros((4, 300), np.float32)
    x[1, 17] = np.nan
    x[2, 299] = -np.inf
    x[3] = np.linspace(-1e-38, 1e-38, 300, dtype=np.float32)
    for rate in (1, 2, 3, 8, 32):
        words, portable_words = both(jaxcomp.zfp_encode, x, rate)
        assert_same(words, portable_words)
        assert_same(
            *both(jaxcomp.zfp_decode, words, 300, rate, jnp.bfloat16 if rate == 8 else jnp.float32)
        )


def test_hadamard_identical_and_differentiable():
    x = jax.random.normal(jax.random.key(0), (3, 256))
    assert_same(*both(jaxcomp.hadamard_transform, x))
    weights = jnp.arange(256.0)
    for implementation in ("native", "xla"):
        grad = jax.grad(
            lambda v, i=implementation: jnp.sum(
                jaxcomp.hadamard_transform(v, implementation=i) * weights
            )
        )
        # The transform is symmetric: the gradient of <H x, w> is H w.
        np.testing.assert_array_equal(
            np.asarray(grad(x[0])), np.asarray(jaxcomp.hadamard_transform(weights))
        )


OPS = {
    "topk": lambda x, i: jaxcomp.topk(x, 3, implementation=i)[0],
    "find_threshold": lambda x, i: jaxcomp.find_threshold(x, 3, implementation=i)[0],
    "threshold_topk": lambda x, i: jaxcomp.threshold_topk(x, 3, implementation=i)[0],
    "zfp_encode": lambda x, i: jaxcomp.zfp_encode(x, 8, implementation=i).astype(jnp.float32),
}
# zfp_decode takes uint32 words, which carry no gradient.


@pytest.mark.parametrize("implementation", ["native", "xla", None])
@pytest.mark.parametrize("name", OPS)
def test_differentiation_is_a_clear_type_error(name, implementation):
    x = jnp.ones(16)
    with pytest.raises(
        TypeError, match=rf"jaxcomp\.{name} is not differentiable.*stop_gradient"
    ) as info:
        jax.grad(lambda v: jnp.sum(OPS[name](v, implementation)))(x)
    assert "CUDA" not in str(info.value)
    # Constants and stopped gradients go through.
    jax.grad(lambda v: jnp.sum(OPS[name](jax.lax.stop_gradient(v), implementation)) + jnp.sum(v))(x)


@pytest.mark.parametrize("bad", ["XLA", "cuda", 1, ""])
def test_bad_implementation_names_the_argument(bad):
    for call in (
        lambda: jaxcomp.topk(jnp.ones(4), 2, implementation=bad),
        lambda: jaxcomp.zfp_encode(jnp.ones(4), 8, implementation=bad),
        lambda: jaxcomp.zfp_decode(jnp.zeros(1, jnp.uint32), 4, 8, implementation=bad),
        lambda: jaxcomp.find_threshold(jnp.ones(4), 2, implementation=bad),
        lambda: jaxcomp.hadamard_transform(jnp.ones(4), implementation=bad),
    ):
        with pytest.raises(ValueError, match="implementation must be 'native', 'xla' or None"):
            call()


def _exported_text(fn, platform, x):
    """The StableHLO of ``fn`` lowered for ``platform`` (which need not be present)."""
    return jax.jit(fn).trace(x).lower(lowering_platforms=(platform,)).as_text()


def test_default_picks_native_on_cpu_and_xla_with_one_warning_elsewhere():
    x = jnp.ones((2, 64), jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the CPU uses the native kernel: no warning
        assert "jaxcomp_topk" in _exported_text(lambda v: jaxcomp.topk(v, 3), "cpu", x)
    _ffi._warned_platforms.discard("tpu")
    with pytest.warns(
        UserWarning, match="lowered for 'tpu' run their portable XLA implementation"
    ) as record:
        text = _exported_text(lambda v: jaxcomp.topk(v, 3), "tpu", x)
        _exported_text(lambda v: jaxcomp.zfp_encode(v, 8), "tpu", x)
    assert len([w for w in record if "portable" in str(w.message)]) == 1  # once per platform
    assert "jaxcomp_topk" not in text
    if (
        not _ffi.HAS_CUDA
    ):  # a GPU build without the CUDA module: xla, with the way to native kernels
        _ffi._warned_platforms.discard("cuda")
        with pytest.warns(UserWarning, match="JAXCOMP_CUDA=ON"):
            text = _exported_text(
                lambda v: jaxcomp.zfp_decode(jaxcomp.zfp_encode(v, 8), 64, 8), "cuda", x
            )
        assert "jaxcomp_zfp" not in text
        with pytest.raises(_ffi.MissingCudaModuleError):  # unless native is asked for
            _exported_text(lambda v: jaxcomp.topk(v, 3, implementation="native"), "cuda", x)


def _has_platform_index(fn, *args):
    return "platform_index" in str(jax.make_jaxpr(fn)(*args))


def test_a_known_platform_traces_its_branch_only():
    """Inside lowering_platform, an op traces the one branch of that platform (no portable graph
    for platforms the code will never be lowered for); outside, every branch."""
    x = jnp.ones((2, 64), jnp.float32)
    assert _has_platform_index(lambda v: jaxcomp.topk(v, 3), x)
    with _ffi.lowering_platform("cpu"):
        assert not _has_platform_index(lambda v: jaxcomp.topk(v, 3), x)
        text = jax.jit(lambda v: jaxcomp.topk(v, 3)).trace(x).lower().as_text()
    assert "jaxcomp_topk" in text
    with _ffi.lowering_platform("tpu"), pytest.warns(UserWarning, match="portable XLA"):
        _ffi._warned_platforms.discard("tpu")
        text = (
            jax.jit(lambda v: jaxcomp.topk(v, 3))
            .trace(x)
            .lower(lowering_platforms=("tpu",))
            .as_text()
        )
    assert "jaxcomp_topk" not in text
    np.testing.assert_array_equal(  # the same values either way
        jaxcomp.topk(x * jnp.arange(64.0), 3)[0],
        _in_lowering_platform("cpu", lambda: jaxcomp.topk(x * jnp.arange(64.0), 3))[0],
    )
    with pytest.raises(ValueError, match="platform must be one of"):
        with _ffi.lowering_platform("gpu"):
            pass


def _in_lowering_platform(platform, fn):
    with _ffi.lowering_platform(platform):
        return fn()


def test_an_eager_call_takes_the_branch_of_its_arrays_platform(monkeypatch):
    """Called eagerly, jax.lax.platform_dependent takes the *default* backend's branch whatever the
    arrays' devices: on an H200 (jax 0.11.2) a CPU array got the CUDA branch, whose bfloat16 custom
    call then ran on the CPU and failed. An eager call now takes its arrays' platform."""
    x = jax.device_put(jnp.ones(3), jax.devices("cpu")[0])

    def refuse(*args, **kwargs):
        raise AssertionError("an eager call went through jax.lax.platform_dependent")

    monkeypatch.setattr(jax.lax, "platform_dependent", refuse)
    branches = {"cpu": lambda v: v + 1, "cuda": lambda v: v * 0, "default": lambda v: v - 1}
    np.testing.assert_array_equal(_ffi.platform_dependent(x, **branches), [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(
        jaxcomp.topk(jnp.asarray([1.0, -3.0, 2.0], jnp.bfloat16), 2)[1], [1, 2]
    )
    # Traced (a tracer has no devices) and host values: the platform is left to XLA's lowering.
    assert _ffi._platform_of_arrays((np.ones(3),)) is None
    seen = []
    jax.make_jaxpr(lambda v: seen.append(_ffi._platform_of_arrays((v,))) or v)(x)
    assert seen == [None]
    monkeypatch.undo()
    assert _has_platform_index(lambda v: _ffi.platform_dependent(v, **branches), x)


def test_platform_of_devices():
    assert _ffi.platform_of(jax.devices()) == "cpu"
    assert _ffi.platform_of([]) is None


def test_data_parallel_traces_the_meshs_platform_only():
    """data_parallel and diloco know their mesh's platform: their steps trace no portable branch
    (on a model of 1,000 leaves that was 70% of compress's trace; docs/performance.md)."""
    import optax

    need_devices(2)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    params = {"w": jnp.ones((64, 8)), "b": jnp.zeros(8)}

    def loss(p, batch):
        return jnp.mean((batch @ p["w"] + p["b"]) ** 2)

    for method, options in (("ar_topk", {"ratio": 0.1}), ("zfp", {"rate": 8}), ("sign", {})):
        tx = optax.chain(jaxcomp.compress(method, **options), optax.sgd(0.1))
        dp = jaxcomp.data_parallel(loss, tx, mesh)
        state = dp.init(params)
        batch = dp.shard_batch(jnp.ones((4, 64)))
        jaxpr = str(dp.step.trace(state, batch).jaxpr)
        assert "platform_index" not in jaxpr, method
        assert "jaxcomp_" in jaxpr, method  # the native kernels are there
    workers = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("workers",))
    run = jaxcomp.diloco(
        loss, optax.sgd(0.1), optax.sgd(1.0), mesh=workers, sync_every=1, compress=jaxcomp.Zfp(8)
    )
    state = run.init(params)
    jaxpr = str(run.step.trace(state, run.shard_batch(jnp.ones((4, 64)))).jaxpr)
    assert "platform_index" not in jaxpr and "jaxcomp_zfp" in jaxpr


COLLECTIVES = {
    "allgather_topk": lambda v: collectives.allgather_topk(v, k=41, axis_name="data"),
    "allgather_threshold": lambda v: collectives.allgather_topk(
        v, k=41, axis_name="data", selector="threshold"
    ),
    "ar_topk": lambda v: collectives.ar_topk(v, k=41, axis_name="data"),
    "zfp_allreduce": lambda v: collectives.zfp_allreduce(v, rate=8, axis_name="data"),
    "zfp_allreduce_low_rate": lambda v: collectives.zfp_allreduce(
        v, rate=2, axis_name="data", algorithm="recursive_doubling"
    ),
    "quantized_psum": lambda v: collectives.quantized_psum(
        v, bits=4, axis_name="data", key=jax.random.key(1)
    ),
}


@pytest.mark.parametrize("name", COLLECTIVES)
def test_collectives_on_the_xla_path(name):
    need_devices(8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    x = jnp.asarray(rows(4096 * 8, 1)[0].reshape(8, 4096))
    x = jnp.where(jnp.isfinite(x), x, 0.0)

    def run(implementation):
        with _ffi.default_implementation(implementation):
            fn = jax.shard_map(
                lambda v: COLLECTIVES[name](v[0]),
                mesh=mesh,
                in_specs=P("data"),
                out_specs=(P(), P("data")),
                check_vma=False,
            )
            return jax.jit(fn)(x)

    assert_same(run("native"), run("xla"))


def test_empty_batches():
    x = jnp.ones((2, 0, 5))
    assert_same(*both(jaxcomp.topk, x, 2))
    assert_same(*both(jaxcomp.find_threshold, x, 2))
    assert_same(*both(jaxcomp.zfp_encode, x, 2))
    assert_same(*both(jaxcomp.zfp_decode, jnp.zeros((0, 3), jnp.uint32), 20, 2))
