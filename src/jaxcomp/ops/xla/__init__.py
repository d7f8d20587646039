"""The portable implementation of jaxcomp's ops: plain XLA operations, for every platform.

Where no native module serves the platform (TPU, ROCm, a GPU build without the CUDA module), the
ops in :mod:`jaxcomp.ops.topk`, :mod:`jaxcomp.ops.zfp` and :mod:`jaxcomp.ops.sign` run these
instead; ``implementation="xla"`` asks for them anywhere. They compute what the native kernels
compute, bit for bit (the same selections, thresholds, counts, ZFP words, sign words and scales;
tests/xla_test.py and tests/sign_test.py compare them on the CPU), by the kernels' own methods
recast as whole-array operations: a radix search of the magnitude key for the top-k family, a
table-driven bit-plane coder vectorized over all blocks for ZFP, and the sign codec's
halving-tree sums as whole-array additions.

Unlike :mod:`jaxcomp.ops.reference`, written to be read, these are written to be fast; they take
already checked arguments (the public ops check them).
"""

from jaxcomp.ops.xla.sign import sign_pack, sign_unpack
from jaxcomp.ops.xla.topk import find_threshold, threshold_topk, topk
from jaxcomp.ops.xla.zfp import zfp_decode, zfp_encode

__all__ = [
    "find_threshold",
    "sign_pack",
    "sign_unpack",
    "threshold_topk",
    "topk",
    "zfp_decode",
    "zfp_encode",
]
