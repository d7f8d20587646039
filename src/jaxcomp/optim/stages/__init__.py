"""The stages of a :func:`jaxcomp.compress` update, one file each: each a wrapper around the
next (:mod:`.flight`), in the order a gradient visits them on the way in.

1. :mod:`.metrics`: compression gain, bytes, density, method, non-finite count.
2. :mod:`.nonfinite`: under ``nonfinite="skip"``/``"raise"`` a step with a non-finite entry keeps
   the state of every stage inside (:mod:`.guard` holds the functions: non-finite entries count
   as 0 and are counted).
3. :mod:`.clock`: the step counter and the PRNG key.
4. :mod:`.momentum`: DGC's momentum correction (a velocity per device, cleared where sent).
5. :mod:`.error_feedback`: ``g_e = g + residual`` packed before, ``residual = g_e - sent`` after.
6. :mod:`.guardrail`: the divergence guardrail (:mod:`.divergence` measures and decides): a
   diverging step clears the residual and falls back to dense for a window.
7. :mod:`.aggregate`: every collective of the step: the plain leaves (:mod:`.mask`), the method's
   (:mod:`.aggregation`, after the warm-up's switch: :mod:`.warmup`) and the one psum of scalars.

:func:`jaxcomp.optim.feedback.feedback_transformation` composes them inside the layout, which
lays the gradients out and writes the update back; gradient accumulation
(:func:`jaxcomp.accumulate`) wraps a whole transformation instead. :mod:`jaxcomp.optim.packing`
joins and splits the vectors every stage reads.
"""

from jaxcomp._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    submodules=(
        "flight",
        "metrics",
        "nonfinite",
        "guard",
        "clock",
        "momentum",
        "error_feedback",
        "guardrail",
        "divergence",
        "aggregate",
        "aggregation",
        "mask",
        "warmup",
    ),
)
