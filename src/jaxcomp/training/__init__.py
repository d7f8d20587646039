"""Layer 6, training: :func:`data_parallel` (the jitted, sharded step; :mod:`.trainer`, built from
:mod:`.state`, :mod:`.layout`, :mod:`.mask`, :mod:`.step`, :mod:`.dispatch`, :mod:`.branches`,
:mod:`.trial` (``compress_auto``'s candidates timed), :mod:`.reprobe`, :mod:`.resize`,
:mod:`.restoring` and :mod:`.model_state` (a model's state beside its params)), DiLoCo's outer
loop (:func:`diloco`: :mod:`.diloco`, :mod:`.diloco_plan`, :mod:`.inner` and :mod:`.outer`) and
the model zoo that the benchmarks train (:mod:`.zoo`).
"""

from jaxcomp._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    submodules=(
        "trainer",
        "diloco",
        "inner",
        "outer",
        "state",
        "layout",
        "mask",
        "step",
        "dispatch",
        "branches",
        "trial",
        "reprobe",
        "resize",
        "restoring",
        "model_state",
        "diloco_plan",
        "zoo",
    ),
    exports={
        "data_parallel": "jaxcomp.training.trainer",
        "DataParallel": "jaxcomp.training.trainer",
        "TrainState": "jaxcomp.training.trainer",
        "diloco": "jaxcomp.training.diloco",
        "DiLoCo": "jaxcomp.training.diloco",
        "DiLoCoState": "jaxcomp.training.diloco",
        "Trial": "jaxcomp.training.trial",
    },
)
