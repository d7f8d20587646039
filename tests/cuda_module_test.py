"""The CUDA module's registration contract, checked without a GPU.

A build without ``_jaxcomp_cuda`` lowers jaxcomp ops for a GPU to their portable XLA implementation
(with a warning naming the fix) by default, and refuses ``implementation="native"`` with
:class:`jaxcomp.ops._ffi.MissingCudaModuleError` instead of failing later inside XLA or running on
the host; a build with it must lower them to its custom calls. Lowering for CUDA needs
no GPU (``jax.export`` cross-lowers), so both cases are checked on the CPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp.ops import _ffi

_OPS = {
    "jaxcomp_topk": lambda x, i=None: jaxcomp.topk(x, 3, implementation=i),
    "jaxcomp_find_threshold": lambda x, i=None: jaxcomp.find_threshold(x, 3, implementation=i),
    "jaxcomp_threshold_topk": lambda x, i=None: jaxcomp.threshold_topk(x, 3, implementation=i),
    "jaxcomp_zfp_encode": lambda x, i=None: jaxcomp.zfp_encode(x, 8, implementation=i),
    "jaxcomp_zfp_decode": lambda x, i=None: jaxcomp.zfp_decode(
        jaxcomp.zfp_encode(x, 8, implementation=i), 10, 8, implementation=i
    ),
    "jaxcomp_sign_pack": lambda x, i=None: jaxcomp.sign_pack(x, 4, implementation=i),
    "jaxcomp_sign_unpack": lambda x, i=None: jaxcomp.sign_unpack(
        *jaxcomp.sign_pack(x, 4, implementation=i), 10, 4, implementation=i
    ),
}


def _export(fn, platform, shape=(2, 10), dtype=jnp.float32):
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in _ffi.TARGETS]
    return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(
        jax.ShapeDtypeStruct(shape, dtype)
    )


def test_cuda_module_registers_every_target():
    if not _ffi.HAS_CUDA:
        assert _ffi._jaxcomp_cuda is None
        return
    assert sorted(_ffi._jaxcomp_cuda.registrations()) == sorted(_ffi.TARGETS)


@pytest.mark.parametrize("target", sorted(_OPS))
def test_gpu_lowering_matches_the_build(target):
    if _ffi.HAS_CUDA:
        exported = _export(_OPS[target], "cuda")
        assert exported.platforms == ("cuda",)
        assert f"@{target}(" in exported.mlir_module()
    else:
        with pytest.raises(_ffi.MissingCudaModuleError, match="JAXCOMP_CUDA=ON"):
            _export(lambda x: _OPS[target](x, "native"), "cuda")
        _ffi._warned_platforms.discard("cuda")
        with pytest.warns(UserWarning, match="JAXCOMP_CUDA=ON"):
            exported = _export(_OPS[target], "cuda")
        assert "custom_call" not in exported.mlir_module()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "target", ["jaxcomp_topk", "jaxcomp_find_threshold", "jaxcomp_threshold_topk"]
)
def test_cuda_top_k_reads_16_bit_input_as_is(target, dtype, monkeypatch):
    # The CUDA top-k kernels read bfloat16/float16 directly (values come back in that type): no
    # convert before or after their custom call on CUDA, while the CPU kernels get the float32
    # upcast. Lowering needs no GPU; a build without the CUDA module lowers as one with it here.
    monkeypatch.setattr(_ffi, "HAS_CUDA", True)
    short = {jnp.bfloat16: "bf16", jnp.float16: "f16"}[dtype]
    values = "f32" if target == "jaxcomp_find_threshold" else short  # the threshold is float32
    for implementation in (None, "native"):
        cuda = _export(lambda x: _OPS[target](x, implementation), "cuda", dtype=dtype).mlir_module()
        (call,) = [line for line in cuda.splitlines() if f"@{target}(" in line]
        assert (
            f": (tensor<2x10x{short}>) -> (tensor<2{'x3' if values == short else ''}x{values}>"
            in call
        )
        assert "stablehlo.convert" not in cuda
        cpu = _export(lambda x: _OPS[target](x, implementation), "cpu", dtype=dtype).mlir_module()
        (call,) = [line for line in cpu.splitlines() if f"@{target}(" in line]
        assert ": (tensor<2x10xf32>) -> (tensor<2" in call
        assert "stablehlo.convert" in cpu


@pytest.mark.parametrize("transform", ["jit", "vmap", "shard_map"])
def test_gpu_guard_is_invisible_on_cpu(transform):
    # On the CPU's devices explicitly: on a GPU machine the default device is a GPU.
    cpus = jax.devices("cpu")
    x = jax.device_put(np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32), cpus[0])
    if transform == "jit":
        y = jax.jit(_ffi.require_cuda_module)(x)
    elif transform == "vmap":
        y = jax.vmap(_ffi.require_cuda_module, in_axes=1, out_axes=1)(x)
    else:
        mesh = jax.sharding.Mesh(np.array(cpus[:2]), ("data",))
        spec = jax.sharding.PartitionSpec("data")
        x = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
        y = jax.jit(
            jax.shard_map(_ffi.require_cuda_module, mesh=mesh, in_specs=spec, out_specs=spec)
        )(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    # The guard itself lowers to nothing on the CPU.
    assert "custom_call" not in _export(_ffi.require_cuda_module, "cpu", x.shape).mlir_module()


def test_gpu_guard_refuses_gpu_lowering():
    with pytest.raises(_ffi.MissingCudaModuleError, match="docs/gpu.md"):
        _export(lambda x: _ffi.require_cuda_module(x) + 1, "cuda")
    with pytest.raises(_ffi.MissingCudaModuleError, match="ROCm"):
        _export(_ffi.require_cuda_module, "rocm")
