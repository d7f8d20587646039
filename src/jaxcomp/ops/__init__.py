"""Layer 1, the kernels: XLA FFI bindings of the native kernels, their pure-JAX references
(:mod:`jaxcomp.ops.reference`) and portable XLA versions (:mod:`jaxcomp.ops.xla`).

Imports nothing else of jaxcomp. The public functions are also ``jaxcomp.topk``, ``jaxcomp.zfp_encode``...
"""

from jaxcomp._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    submodules=("topk", "zfp", "hadamard", "sign", "flat", "reference", "xla"),
    exports={},
)
