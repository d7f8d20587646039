"""Layer 1, the kernels: XLA FFI bindings of the native kernels, their pure-JAX references
(:mod:`jaxcomp.ops.reference`) and portable XLA versions (:mod:`jaxcomp.ops.xla`).

Imports nothing else of jaxcomp. The public functions are also ``jaxcomp.topk``,
``jaxcomp.zfp_encode``...
"""

import pkgutil

from jaxcomp._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    # every public submodule: topk, zfp, hadamard, sign, flat, reference, xla
    submodules=[m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")],
    exports={},
)
