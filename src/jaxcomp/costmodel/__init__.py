"""Layer 4, the cost model: predicted seconds per method on a network (:mod:`.cost`), the
formulas of ``jaxcomp advise`` (:mod:`.advise`), measuring the network and the codecs
(:mod:`.probe`), and the adaptive compression ratio of paper 000 §3-E (:mod:`.ratio_choice`,
once ``jaxcomp.adaptive``).

Imports ops, collectives and methods; nothing that builds a transformation.
"""

from jaxcomp._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    submodules=("cost", "advise", "probe", "ratio_choice"),
    exports={"Network": "jaxcomp.costmodel.cost"},
)
