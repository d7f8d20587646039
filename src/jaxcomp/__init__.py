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
the native module until a name that needs them is touched, so ``import jaxcomp.cost`` and the
command line's ``--help`` stay fast.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    # ops
    "DEFAULT_ROUNDS": "jaxcomp.selection",
    "find_threshold": "jaxcomp.selection",
    "threshold_topk": "jaxcomp.selection",
    "topk": "jaxcomp.selection",
    "zfp_decode": "jaxcomp.zfp",
    "zfp_encode": "jaxcomp.zfp",
    "zfp_num_words": "jaxcomp.zfp",
    "hadamard_transform": "jaxcomp.hadamard",
    "sign_pack": "jaxcomp.sign",
    "sign_unpack": "jaxcomp.sign",
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
    "compress": "jaxcomp.transform",
    "CompressMetrics": "jaxcomp.transform",
    "CompressState": "jaxcomp.transform",
    "find_compress_state": "jaxcomp.transform",
    "compress_auto": "jaxcomp.auto",
    "AutoState": "jaxcomp.auto",
    "RatioSearch": "jaxcomp.auto",
    "auto_branches": "jaxcomp.auto",
    "set_network": "jaxcomp.auto",
    "NONFINITE_POLICIES": "jaxcomp.nonfinite",
    "NonfinitePolicy": "jaxcomp.nonfinite",
    "skip_nonfinite": "jaxcomp.nonfinite",
    "skipped_update": "jaxcomp.nonfinite",
    # training and measuring
    "accumulate": "jaxcomp.accumulation",
    "DataParallel": "jaxcomp.train",
    "TrainState": "jaxcomp.train",
    "data_parallel": "jaxcomp.train",
    "sharded_updates": "jaxcomp.sharding",
    "probe_network": "jaxcomp.probe",
}

_SUBMODULES = (
    "adaptive",
    "auto",
    "collectives",
    "cost",
    "layout",
    "methods",
    "nonfinite",
    "probe",
    "reference",
    "sharding",
    "thc",
    "train",
    "transform",
    "xla",
)

__all__ = sorted(_EXPORTS) + list(_SUBMODULES)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"jaxcomp.{name}")
    else:
        raise AttributeError(f"module 'jaxcomp' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
