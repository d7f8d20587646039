"""Layer 5, the optax transformations: :func:`compress` and its update pipeline, the automatic
choice (:mod:`.auto`), the non-finite policy, accumulation and sharded (ZeRO-style) updates.

Imports the layers below; nothing of training, the tools or the command line.
"""

from jaxcomp._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    submodules=("transform", "auto", "nonfinite", "accumulation", "sharding", "timing"),
    exports={"compress": "jaxcomp.optim.transform", "compress_auto": "jaxcomp.optim.auto"},
)
