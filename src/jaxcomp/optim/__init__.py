"""Layer 5, the optax transformations: :func:`compress` and its update pipeline, the automatic
choice (:mod:`.auto`), the non-finite policy, accumulation and sharded (ZeRO-style) updates.

Bottom up: :mod:`.sharding` and :mod:`.packing` (the vectors), :mod:`.stages` (one module per
stage of an update), :mod:`.state` (:class:`CompressState`), :mod:`.config`, :mod:`.nonfinite`,
:mod:`.feedback` (the pipeline), :mod:`.auto_state` and :mod:`.auto`, :mod:`.compression`
(:func:`compress`), and :mod:`.transform`, which re-exports the names of 0.1. Imports the layers
below; nothing of training, the tools or the command line.
"""

from jaxcomp._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    submodules=(
        "transform",
        "auto",
        "auto_state",
        "nonfinite",
        "accumulation",
        "sharding",
        "timing",
        "compression",
        "config",
        "feedback",
        "packing",
        "stages",
        "state",
        "optimizers",
        "vma",
        "host",
    ),
    exports={
        "compress": "jaxcomp.optim.compression",
        "compress_auto": "jaxcomp.optim.auto",
        "adam": "jaxcomp.optim.optimizers",
        "adamw": "jaxcomp.optim.optimizers",
    },
)
