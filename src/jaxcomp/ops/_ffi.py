"""Loads jaxcomp's native modules, registers their XLA FFI targets, and picks each op's
implementation.

The CPU module ``_jaxcomp_cpu`` is always built. The CUDA module ``_jaxcomp_cuda`` exists only in
builds made with ``-Ccmake.define.JAXCOMP_CUDA=ON``. Every op takes ``implementation``:
``"native"`` (the FFI kernels; lowered for a GPU in a build without the CUDA module it raises
:class:`MissingCudaModuleError`), ``"xla"`` (:mod:`jaxcomp.ops.xla`, any platform, the same results
bit for bit), or ``None``: native where a native module serves the platform the op is lowered
for, else xla with one warning per platform that says how to get the native kernels.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings

import jax
import jax.extend
from jax.interpreters import batching, mlir

from jaxcomp import _jaxcomp_cpu

#: The names of the FFI targets, one per op: "jaxcomp_" + op name.
TARGETS = (
    "jaxcomp_topk",
    "jaxcomp_find_threshold",
    "jaxcomp_threshold_topk",
    "jaxcomp_zfp_encode",
    "jaxcomp_zfp_decode",
    "jaxcomp_sign_pack",
    "jaxcomp_sign_unpack",
)

for _name, _capsule in _jaxcomp_cpu.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

try:  # only present in CUDA builds
    from jaxcomp import _jaxcomp_cuda  # type: ignore[attr-defined]
except ImportError:
    _jaxcomp_cuda = None
else:
    for _name, _capsule in _jaxcomp_cuda.registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")

HAS_CUDA = _jaxcomp_cuda is not None


class MissingCudaModuleError(RuntimeError):
    """A jaxcomp op was asked to run on a GPU, but this build has no CUDA module."""


_INSTALL_CUDA = (
    "jaxcomp was built without its CUDA module, so its ops cannot run on a GPU. Rebuild it with "
    "`pip install -Ccmake.define.JAXCOMP_CUDA=ON .` (CUDA 13 nvcc and jax[cuda13]; see "
    "docs/gpu.md), or put the inputs on the CPU: jax.device_put(x, jax.devices('cpu')[0])."
)

# An identity on the operands of every jaxcomp op in builds without the CUDA module. Its lowering
# for a GPU raises MissingCudaModuleError, at trace-and-lower time, with the fix in the message;
# on the CPU it lowers to nothing. (Without it, XLA would fail later, with an error that names no
# cause, about an unregistered custom call.)
_require_cuda_module_p = jax.extend.core.Primitive("jaxcomp_require_cuda_module")
_require_cuda_module_p.def_abstract_eval(lambda x: x)
# Eager calls go through jit too, so that they lower for the device that holds the operand.
_require_cuda_module_jit = jax.jit(_require_cuda_module_p.bind)
_require_cuda_module_p.def_impl(lambda x: _require_cuda_module_jit(x))
mlir.register_lowering(_require_cuda_module_p, lambda ctx, x: [x])


def _refuse_gpu(message):
    def lowering(ctx, x):
        raise MissingCudaModuleError(message)

    return lowering


mlir.register_lowering(_require_cuda_module_p, _refuse_gpu(_INSTALL_CUDA), platform="cuda")
mlir.register_lowering(
    _require_cuda_module_p,
    _refuse_gpu("jaxcomp has no ROCm kernels; run its ops on the CPU"),
    platform="rocm",
)
batching.primitive_batchers[_require_cuda_module_p] = lambda args, dims: (
    _require_cuda_module_p.bind(*args),
    dims[0],
)


def require_cuda_module(x):
    """Returns ``x``; lowering it for a GPU raises :class:`MissingCudaModuleError`."""
    return _require_cuda_module_p.bind(x)


def varying_axes(x) -> frozenset:
    """The mesh axes ``x`` is typed as varying over inside ``shard_map`` (empty without
    ``check_vma``)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # the attribute's name before jax 0.10
    return frozenset(aval.mat.varying if vma is None else vma)


def like_varying(out, like):
    """Types an op's result as varying over the axes ``like`` varies over.

    ``ffi_call`` results come out typed invariant (replicated) under ``check_vma=True`` whatever
    their inputs, yet they differ per device; left so, the type checks that guard collectives and
    ``out_specs`` would accept per-device values as replicated. The cast costs nothing at run time.
    """
    # Only shard_map's manual axes: a vmap axis name (the ops batched over a named axis, as
    # jaxcomp.costmodel.probe.codec_seconds does) has nothing to cast.
    manual = frozenset(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
    missing = tuple((varying_axes(like) - varying_axes(out)) & manual)
    return jax.lax.pcast(out, missing, to="varying") if missing else out


def like_varying_operands(outputs, operands):
    """:func:`like_varying` for every output of an op, over the axes any of its operands varies
    over."""
    axes = frozenset().union(*(varying_axes(x) for x in operands))
    manual = frozenset(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))

    def cast(out):
        missing = tuple((axes - varying_axes(out)) & manual)
        return jax.lax.pcast(out, missing, to="varying") if missing else out

    return jax.tree.map(cast, outputs)


def ffi_call(target, result_shape_dtypes, *, vmap_method="broadcast_all"):
    """``jax.ffi.ffi_call`` for a jaxcomp target, refusing GPUs in builds without the CUDA module,
    refusing differentiation with an error that names the op, and typing its results inside
    ``shard_map`` as varying over the axes its operands vary over (see :func:`like_varying`)."""
    call = jax.ffi.ffi_call(target, result_shape_dtypes, vmap_method=vmap_method)
    if not HAS_CUDA:
        unguarded = call

        def call(*operands, **attributes):
            return unguarded(*(require_cuda_module(x) for x in operands), **attributes)

    guarded = _not_differentiable(call, target.replace("jaxcomp_", "jaxcomp.", 1))

    def typed(*operands, **attributes):
        return like_varying_operands(guarded(*operands, **attributes), operands)

    return typed


#: The values of every op's ``implementation`` argument (``None``: choose by platform).
IMPLEMENTATIONS = ("native", "xla")


_default_implementation = [None]


@contextlib.contextmanager
def default_implementation(implementation):
    """Ops traced inside the block that are not given ``implementation`` use this one (for
    tests and benchmarks that run code calling the ops, the collectives for example, on the xla
    path). Functions already traced and cached by ``jax.jit`` keep what they were traced with.
    """
    previous = _default_implementation[0]
    _default_implementation[0] = check_implementation(implementation)
    try:
        yield
    finally:
        _default_implementation[0] = previous


def check_implementation(implementation):
    """Returns ``implementation`` if it is ``None``, ``"native"`` or ``"xla"`` (``None`` becomes
    the :func:`default_implementation` in force), else raises ValueError."""
    if implementation is None:
        return _default_implementation[0]
    if isinstance(implementation, str) and implementation in IMPLEMENTATIONS:
        return implementation
    raise ValueError(
        "implementation must be 'native', 'xla' or None (native where a native module serves the "
        f"platform, else xla), got {implementation!r}"
    )


_lowering_platform = contextvars.ContextVar("jaxcomp_lowering_platform", default=None)


@contextlib.contextmanager
def lowering_platform(platform):
    """Tells the ops traced inside the block which platform they will be lowered for, so that
    :func:`platform_dependent` traces only that platform's branch.

    ``jax.lax.platform_dependent`` traces every branch, since JAX learns the platform only when it
    lowers: each op on the CPU traced its portable XLA graph too, which on a model of 1,000 leaves
    was most of the time to trace ``compress``'s update (docs/performance.md). ``data_parallel``
    and ``diloco`` know their mesh's platform and say so here around their traces of ``tx``.
    ``None`` (the default) traces every branch. Functions already traced and cached by
    ``jax.jit`` keep what they were traced with.

    Args:
      platform: ``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``, or ``None``.

    Example:
      >>> import jax.numpy as jnp
      >>> with lowering_platform("cpu"):
      ...     platform_dependent(jnp.ones(2), cpu=lambda x: x + 1, default=lambda x: x - 1)
      Array([2., 2.], dtype=float32)
    """
    if platform is not None and platform not in _PLATFORMS:
        raise ValueError(f"platform must be one of {_PLATFORMS} or None, got {platform!r}")
    token = _lowering_platform.set(platform)
    try:
        yield
    finally:
        _lowering_platform.reset(token)


_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def platform_of(devices):
    """The platform name :func:`lowering_platform` takes for code that runs on ``devices``
    (``"cpu"``, ``"tpu"``, ``"cuda"`` or ``"rocm"``), or ``None`` where it cannot tell (devices of
    several platforms, or a GPU whose runtime says neither CUDA nor ROCm).

    Args:
      devices: ``jax.Device`` s, e.g. ``mesh.devices.flat``.

    Returns:
      A platform name, or ``None``.

    Example:
      >>> import jax
      >>> platform_of(jax.devices())
      'cpu'
    """
    names = set()
    for device in devices:
        name = device.platform
        if name == "gpu":
            version = str(getattr(device.client, "platform_version", "")).lower()
            name = "cuda" if "cuda" in version else "rocm" if "rocm" in version else None
        names.add(name)
    if len(names) != 1:
        return None
    (name,) = names
    return name if name in _PLATFORMS else None


def platform_dependent(*operands, default, **branches):
    """``jax.lax.platform_dependent(*operands, default=default, **branches)``, or, inside
    :func:`lowering_platform`, the one branch of that platform called directly.

    Args:
      *operands: the arrays every branch takes.
      default: the branch of the platforms ``branches`` does not name.
      **branches: a branch per platform name (``cpu=``, ``cuda=``, ...).

    Returns:
      What the branch returns.

    Example:
      >>> import jax.numpy as jnp
      >>> platform_dependent(jnp.ones(2), cpu=lambda x: x + 1, default=lambda x: x - 1)
      Array([2., 2.], dtype=float32)
    """
    platform = _lowering_platform.get() or _platform_of_arrays(operands)
    if platform is not None:
        return branches.get(platform, default)(*operands)
    return jax.lax.platform_dependent(*operands, default=default, **branches)


def _platform_of_arrays(operands):
    """The platform of concrete arrays (an eager call), or ``None`` (tracers, host values).

    Called eagerly, ``jax.lax.platform_dependent`` picks the branch of the *default* backend, not
    of the arrays' devices: on a GPU machine a CPU array got the CUDA branch and its custom call
    ran on the CPU with the wrong operand types (seen on an H200, jax 0.11.2).
    """
    devices = set()
    for x in operands:
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            return None
        devices |= x.devices()
    return platform_of(devices)


def _portable_message(platform):
    if platform == "cuda":
        how = (
            "this jaxcomp was built without its CUDA module; for the native CUDA kernels rebuild "
            "it with `pip install -Ccmake.define.JAXCOMP_CUDA=ON .` (CUDA 13 nvcc and jax[cuda13]; "
            "see docs/gpu.md)"
        )
    else:
        how = f"jaxcomp has native kernels for CPU and CUDA only, none for {platform!r}"
    return (
        f"jaxcomp ops lowered for {platform!r} run their portable XLA implementation "
        f"(jaxcomp.ops.xla: the same results as the native kernels, slower): {how}. Pass "
        "implementation='xla' to choose it explicitly and silence this warning."
    )


_warned_platforms = set()

# An identity on the operands of the portable branch that the default implementation picks on
# platforms without a native module: lowering it warns once per platform. It is only lowered when
# that branch is (platform_dependent lowers the branch of the platform being compiled for).
_portable_fallback_p = jax.extend.core.Primitive("jaxcomp_portable_fallback")
_portable_fallback_p.def_abstract_eval(lambda x: x)
_portable_fallback_jit = jax.jit(_portable_fallback_p.bind)
_portable_fallback_p.def_impl(lambda x: _portable_fallback_jit(x))
batching.primitive_batchers[_portable_fallback_p] = lambda args, dims: (
    _portable_fallback_p.bind(*args),
    dims[0],
)


def _lower_portable_fallback(ctx, x):
    for platform in ctx.module_context.platforms:
        if platform not in _warned_platforms:
            _warned_platforms.add(platform)
            warnings.warn(_portable_message(platform), stacklevel=2)
    return [x]


mlir.register_lowering(_portable_fallback_p, _lower_portable_fallback)


def dispatch(op, operands, native, portable, implementation, *, native_cuda=None):
    """Runs ``native(*operands)`` or ``portable(*operands)`` (both arrays in, pytree out) as
    ``implementation`` says (see the module docstring); ``op`` names the op in error messages.

    ``native_cuda``, if given, is the native implementation when the op is lowered for CUDA (the
    CUDA top-k kernels read bfloat16/float16 directly, the CPU ones take float32): it must return
    the same types as ``native``. ``native`` serves every other platform.

    The portable path refuses differentiation like the native one, with the same TypeError.
    """
    portable = _not_differentiable(portable, op)
    if implementation == "native":
        if native_cuda is None:
            return native(*operands)
        return platform_dependent(*operands, cuda=native_cuda, default=native)
    if implementation == "xla":
        # Not wrapped in a jit of its own: ``portable`` is a new closure at every call, so such a
        # jit compiled the whole op again at every eager call (a large part of a second for ZFP on a
        # few hundred values). The jaxcomp.ops.xla functions are jitted with their static arguments;
        # called eagerly, only the dtype casts around them run on their own (compiled once per
        # shape).
        return portable(*operands)

    def fallback(*args):
        return portable(*(_portable_fallback_p.bind(a) for a in args))

    natives = {"cpu": native, **({"cuda": native_cuda or native} if HAS_CUDA else {})}
    return platform_dependent(*operands, **natives, default=fallback)


def _not_differentiable(call, op):
    """``call`` with a JVP rule that raises a TypeError naming ``op`` (and the way around it).

    Without it, ``jax.grad`` through a jaxcomp op fails on whichever primitive comes first, with a
    message that names neither the op nor a fix ("Differentiation rule for
    'jaxcomp_require_cuda_module' not implemented"). The rule only runs for inputs that carry a
    tangent, so ops applied to ``jax.lax.stop_gradient`` values or to constants still work under
    ``jax.grad``.
    """

    def run(*operands, **attributes):
        @jax.custom_jvp
        def op_call(*operands):
            return call(*operands, **attributes)

        @op_call.defjvp
        def refuse(primals, tangents):
            raise TypeError(
                f"{op} is not differentiable (its output selects or encodes values; neither its "
                "native kernel nor its XLA implementation defines a derivative). Its input carries "
                "a gradient here: wrap it in jax.lax.stop_gradient(x) if no gradient should flow "
                f"through {op}, or differentiate the pure-JAX "
                f"jaxcomp.ops.reference.{op.split('.', 1)[1]} instead"
            )

        return op_call(*operands)

    return run
