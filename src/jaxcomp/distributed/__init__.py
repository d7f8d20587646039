"""Layer 7, many hosts: ``jax.distributed`` start-up with a rendezvous (:mod:`.launch`,
:mod:`.rendezvous`, its server :mod:`.rendezvous_server`, what a peer's failure does:
:mod:`._failure`), a quorum per sync for workers that may die (:mod:`.quorum`) and DiLoCo on
it (:mod:`.diloco_ft`, its codecs :mod:`.ft_codecs`), the emulated cluster (:mod:`.cluster`,
its link rates :mod:`.rates`) and the network benchmark (:mod:`.netbench`, its worker
:mod:`.netbench_worker` and what the worker trains, :mod:`.netbench_workload`).
"""

from jaxcomp._lazy import attach

__getattr__, __dir__, __all__ = attach(
    __name__,
    submodules=(
        "launch",
        "rendezvous",
        "rendezvous_server",
        "quorum",
        "diloco_ft",
        "ft_codecs",
        "cluster",
        "rates",
        "netbench",
        "netbench_worker",
        "netbench_workload",
    ),
    exports={},
)
