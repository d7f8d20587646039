"""Loads jaxcomp's native modules and registers their XLA FFI targets.

The CPU module ``_jaxcomp_cpu`` is always built. The CUDA module ``_jaxcomp_cuda`` exists only in
builds made with ``-Ccmake.define.JAXCOMP_CUDA=ON``; without it, a jaxcomp op lowered for a GPU
raises :class:`MissingCudaModuleError` instead of silently running somewhere else.
"""

from __future__ import annotations

import jax

from jaxcomp import _jaxcomp_cpu

#: The names of the FFI targets, one per op: "jaxcomp_" + op name.
TARGETS = (
    "jaxcomp_topk",
    "jaxcomp_find_threshold",
    "jaxcomp_threshold_topk",
    "jaxcomp_zfp_encode",
    "jaxcomp_zfp_decode",
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
