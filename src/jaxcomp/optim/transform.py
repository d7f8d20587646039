"""The optax transformation :func:`compress` and the names of its pipeline, under their 0.1 home.

``compress`` lives in :mod:`jaxcomp.optim.compression`; its state in :mod:`jaxcomp.optim.state`;
the error-feedback pipeline in :mod:`jaxcomp.optim.feedback`, one stage per module of
:mod:`jaxcomp.optim.stages`. This module re-exports them (``jaxcomp.transform`` is its
deprecated alias), so ``from jaxcomp.optim.transform import compress`` keeps working.
"""

from __future__ import annotations

from jaxcomp.optim.compression import compress
from jaxcomp.optim.config import GRANULARITIES, FeedbackConfig
from jaxcomp.optim.feedback import feedback_transformation
from jaxcomp.optim.stages.aggregation import (
    Aggregation,
    Groups,
    aggregate_groups,
    init_method_state,
    run_branch,
    static_cost,
)
from jaxcomp.optim.state import (
    Branches,
    CompressMetrics,
    CompressState,
    compress_states,
    find_compress_state,
)

__all__ = [
    "GRANULARITIES",
    "Aggregation",
    "Branches",
    "CompressMetrics",
    "CompressState",
    "FeedbackConfig",
    "Groups",
    "aggregate_groups",
    "compress",
    "compress_states",
    "feedback_transformation",
    "find_compress_state",
    "init_method_state",
    "run_branch",
    "static_cost",
]
