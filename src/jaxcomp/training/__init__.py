"""Layer 6, training: :func:`data_parallel` (the jitted, sharded step) and the model zoo that the
benchmarks train (:mod:`.zoo`).
"""

from jaxcomp._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    submodules=("trainer", "zoo"),
    exports={
        "data_parallel": "jaxcomp.training.trainer",
        "DataParallel": "jaxcomp.training.trainer",
        "TrainState": "jaxcomp.training.trainer",
    },
)
