"""Layer 7, many hosts: ``jax.distributed`` start-up with a rendezvous (:mod:`.launch`,
:mod:`.rendezvous`), the emulated cluster (:mod:`.cluster`) and ``jaxcomp netbench``
(:mod:`.netbench`).
"""

from jaxcomp._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    submodules=("launch", "rendezvous", "cluster", "netbench"),
    exports={},
)
