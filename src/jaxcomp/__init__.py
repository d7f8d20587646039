"""jaxcomp: gradient compression for data-parallel JAX.

Native kernels (XLA FFI custom calls) compress gradients before they cross the network:

* :func:`topk` — exact top-k by magnitude;
* :func:`find_threshold` / :func:`threshold_topk` — MSTopK-style threshold search;
* :func:`zfp_encode` / :func:`zfp_decode` — a ZFP-style fixed-rate float codec;
* :func:`hadamard_transform` — THC's rotation;
* :func:`sign_pack` / :func:`sign_unpack` — 1-bit signs with a scale per chunk.

A compression method is one object (:mod:`jaxcomp.methods`: :class:`Dense`, :class:`TopK`,
:class:`Zfp`, :class:`Quantized`); :func:`compress` aggregates gradients with one, inside an
``optax.chain``, and :func:`compress_auto` chooses among several as the network changes.

Everything is imported on first use (PEP 562): ``import jaxcomp`` loads neither JAX, optax nor
the native module until a name that needs them is touched, so ``import jaxcomp.costmodel.cost``
and the command line's ``--help`` stay fast.
"""

from __future__ import annotations

import importlib

from jaxcomp import _deprecated
from jaxcomp._lazy import attach

__version__ = "0.2.0"

# Public name -> the module that defines it.
_EXPORTS = {
    # ops
    "DEFAULT_ROUNDS": "jaxcomp.ops.topk",
    "find_threshold": "jaxcomp.ops.topk",
    "threshold_topk": "jaxcomp.ops.topk",
    "topk": "jaxcomp.ops.topk",
    "zfp_decode": "jaxcomp.ops.zfp",
    "zfp_encode": "jaxcomp.ops.zfp",
    "zfp_num_words": "jaxcomp.ops.zfp",
    "hadamard_transform": "jaxcomp.ops.hadamard",
    "sign_pack": "jaxcomp.ops.sign",
    "sign_unpack": "jaxcomp.ops.sign",
    # methods
    "Method": "jaxcomp.methods",
    "Dense": "jaxcomp.methods",
    "TopK": "jaxcomp.methods",
    "Zfp": "jaxcomp.methods",
    "Quantized": "jaxcomp.methods",
    "RandomK": "jaxcomp.methods",
    "Cast": "jaxcomp.methods",
    "PowerSGD": "jaxcomp.methods",
    "Sign": "jaxcomp.methods",
    # the transformations
    "compress": "jaxcomp.optim.compression",
    "CompressMetrics": "jaxcomp.optim.state",
    "CompressState": "jaxcomp.optim.state",
    "find_compress_state": "jaxcomp.optim.state",
    "compress_auto": "jaxcomp.optim.auto",
    "adam": "jaxcomp.optim.optimizers",
    "adamw": "jaxcomp.optim.optimizers",
    "muon": "jaxcomp.optim.muon",
    "CompressedAdamState": "jaxcomp.optim.optimizers",
    "AutoState": "jaxcomp.optim.auto_state",
    "RatioSearch": "jaxcomp.optim.auto",
    "auto_branches": "jaxcomp.optim.auto_state",
    "set_network": "jaxcomp.optim.auto_state",
    "NONFINITE_POLICIES": "jaxcomp.optim.nonfinite",
    "NonfinitePolicy": "jaxcomp.optim.nonfinite",
    "skip_nonfinite": "jaxcomp.optim.nonfinite",
    "skipped_update": "jaxcomp.optim.nonfinite",
    "Guardrail": "jaxcomp.optim.stages.divergence",
    # training and measuring
    "accumulate": "jaxcomp.optim.accumulation",
    "DataParallel": "jaxcomp.training.trainer",
    "TrainState": "jaxcomp.training.trainer",
    "data_parallel": "jaxcomp.training.trainer",
    "DiLoCo": "jaxcomp.training.diloco",
    "DiLoCoState": "jaxcomp.training.diloco",
    "diloco": "jaxcomp.training.diloco",
    "sharded_updates": "jaxcomp.optim.sharding",
    "tune_host_allocator": "jaxcomp.ops.allocator",
    "release_host_memory": "jaxcomp.ops.allocator",
    "probe_network": "jaxcomp.costmodel.probe",
    "Network": "jaxcomp.costmodel.cost",
}

# The layers, bottom up; each imports only those before it (tests/layers_test.py).
LAYERS = ("ops", "collectives", "methods", "costmodel", "optim", "training", "distributed", "cli")

_getattr, __dir__, __all__ = attach(__name__, submodules=LAYERS, exports=_EXPORTS)
_deprecated.install()


def __getattr__(name):
    if f"jaxcomp.{name}" in _deprecated.MOVED:  # jaxcomp.cost & co.: warns, then the new module
        return importlib.import_module(f"jaxcomp.{name}")
    return _getattr(name)
