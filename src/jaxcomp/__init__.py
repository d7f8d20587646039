"""jaxcomp: gradient compression for data-parallel JAX.

Native kernels (XLA FFI custom calls) compress gradients before they cross the network:

* :func:`topk` — exact top-k by magnitude;
* :func:`find_threshold` / :func:`threshold_topk` — MSTopK-style threshold search;
* :func:`zfp_encode` / :func:`zfp_decode` — a ZFP-style fixed-rate float codec.

:mod:`jaxcomp.reference` holds a pure-JAX version of each op, written for clarity; the tests
compare kernels against it. ``docs/kernels.md`` states the exact semantics.
"""

from jaxcomp import adaptive, collectives, cost, reference
from jaxcomp.hadamard import hadamard_transform
from jaxcomp.probe import probe
from jaxcomp.topk import DEFAULT_ROUNDS, find_threshold, threshold_topk, topk
from jaxcomp.train import DataParallel, TrainState, data_parallel
from jaxcomp.transform import (METHODS, NONFINITE_POLICIES, AutoState, CompressMetrics, CompressState,
                               NonfinitePolicy, auto_branches, compress, find_compress_state, set_network,
                               skip_nonfinite, skipped_update)
from jaxcomp.zfp import zfp_decode, zfp_encode, zfp_num_words

__version__ = "0.1.0"

__all__ = [
    "AutoState",
    "METHODS",
    "NONFINITE_POLICIES",
    "NonfinitePolicy",
    "auto_branches",
    "set_network",
    "skip_nonfinite",
    "skipped_update",
    "CompressMetrics",
    "CompressState",
    "DEFAULT_ROUNDS",
    "DataParallel",
    "TrainState",
    "adaptive",
    "collectives",
    "compress",
    "cost",
    "data_parallel",
    "find_compress_state",
    "probe",
    "find_threshold",
    "hadamard_transform",
    "reference",
    "threshold_topk",
    "topk",
    "zfp_decode",
    "zfp_encode",
    "zfp_num_words",
]
