"""Pure-JAX references for every jaxcomp kernel, written for clarity rather than speed.

They implement ``docs/kernels.md`` step by step; the tests compare the native kernels with them
(index sets, counts, codec words bit for bit, decoded values).
"""

from jaxcomp.ops.reference.sign import sign_pack, sign_unpack
from jaxcomp.ops.reference.topk import find_threshold, threshold_topk, topk
from jaxcomp.ops.reference.zfp import zfp_decode, zfp_encode

__all__ = [
    "find_threshold",
    "sign_pack",
    "sign_unpack",
    "threshold_topk",
    "topk",
    "zfp_decode",
    "zfp_encode",
]
