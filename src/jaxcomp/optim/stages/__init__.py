"""The stages of a :func:`jaxcomp.compress` update, one file each, in the order a step runs them.

1. :mod:`.guard`: non-finite gradient entries count as 0 and are counted; the ``nonfinite=``
   policy may skip the step (its state kept as it was).
2. :mod:`.warmup`: dense aggregation for the first steps, then the method.
3. :mod:`.mask`: which float leaves are compressed; the others are summed exactly.
4. :mod:`.momentum`: DGC's momentum correction (a velocity per device, cleared where sent).
5. :mod:`.error_feedback`: ``g_e = g + residual`` before, ``residual = g_e - sent`` after.
6. :mod:`.aggregation`: the method's collective over the groups of error-fed vectors.
7. :mod:`.metrics`: compression gain, bytes, density, method, non-finite count.
8. :mod:`.divergence`: the guardrail: a diverging step clears the residual and falls back to
   dense for a window (the warm-up's switch).

:func:`jaxcomp.optim.feedback.feedback_transformation` composes them; gradient accumulation
(:func:`jaxcomp.accumulate`) wraps a whole transformation instead. :mod:`jaxcomp.optim.packing`
joins and splits the vectors every stage reads.
"""

from jaxcomp._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    submodules=(
        "guard",
        "warmup",
        "mask",
        "momentum",
        "error_feedback",
        "aggregation",
        "metrics",
        "divergence",
    ),
)
