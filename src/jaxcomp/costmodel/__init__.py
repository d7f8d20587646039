"""Layer 4, the cost model: predicted seconds per method on a network (:mod:`.cost`, from the
α-β terms of one collective, :mod:`.terms`, and the units of :mod:`.units`), the formulas of
``jaxcomp advise`` (:mod:`.advise`), measuring the network and the codecs (:mod:`.probe`), and
the adaptive compression ratio of paper 000 §3-E (:mod:`.ratio_choice`, once
``jaxcomp.adaptive``) with its compression gain (:mod:`.gain`).

Imports ops, collectives and methods; nothing that builds a transformation.
"""

from jaxcomp._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    submodules=("cost", "terms", "units", "advise", "probe", "ratio_choice", "gain"),
    exports={"Network": "jaxcomp.costmodel.cost"},
)
