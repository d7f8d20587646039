"""Layer 2, the collectives: every cross-device exchange of jaxcomp, in ``shard_map``.

Every collective here is called inside :func:`jax.shard_map` on a named mesh axis, takes this
device's local 1-D vector ``x`` and has :func:`jax.lax.psum` (sum) semantics. Each returns
``(total, sent)``:

* ``total``: the aggregate, bit-identical on every device of the axis;
* ``sent``: this device's own contribution as the aggregate saw it, a dense vector of ``x``'s
  shape and dtype, so that error feedback is exactly ``x - sent`` (each function says what that
  means for its compression).

Shapes and every Python argument are static; what changes from step to step (the STAR leader's
``step``, the quantizer's ``key``) is a traced argument, so one compilation serves every step.

Dense sums and top-k values cross the wire in ``x``'s dtype (ZFP words, integer codes and
bfloat16 bits in their own); everything summed locally (scatter-adds, decoded chunks) is
accumulated in float32 and returned in ``x``'s dtype. The bytes each puts on the wire are
counted by the method that uses it (:meth:`jaxcomp.methods.Method.wire_bytes`), from the same
sizes (:mod:`jaxcomp.collectives.sizes`).

Typing under ``check_vma=True``: every ``total`` is invariant (replicated) over the axis, except
``zfp_allreduce(..., algorithm="recursive_doubling")``, whose result comes out of point-to-point
``ppermute`` exchanges and is typed varying although it is bit-identical on every device. Every
``sent`` is varying.

One module per concept; this package re-exports their public functions (loaded on first use, so
``from jaxcomp.collectives import sizes`` loads no JAX) and holds the option tables they share
with :mod:`jaxcomp.methods`:

* :mod:`~jaxcomp.collectives.dense`: :func:`psum`, :func:`psum_scatter`, :func:`pmax` (the
  one exchange that is not a ``(total, sent)`` sum) and :func:`narrow_allreduce` (bfloat16 or
  float16, :func:`bfloat16_allreduce`);
* :mod:`~jaxcomp.collectives.topk`: :func:`allgather_topk`, :func:`ar_topk`,
  :func:`hierarchical_topk`;
* :mod:`~jaxcomp.collectives.value_codes`: the all-gathered top-k's values as low-bit codes
  (``allgather_topk(..., value_bits=)``);
* :mod:`~jaxcomp.collectives.zfp`: :func:`zfp_allreduce`, :func:`zfp_reduce_scatter`;
* :mod:`~jaxcomp.collectives.ring`: the ring all-reduce with a codec, shared by ZFP, bfloat16
  and signs;
* :mod:`~jaxcomp.collectives.quantized`: :func:`quantized_psum` (THC) and its codec;
* :mod:`~jaxcomp.collectives.sign`: :func:`sign_allgather` (scaled signs, majority vote) and
  :func:`sign_ring` (the ring whose messages are signs) with :func:`sign_reduce_scatter`;
* :mod:`~jaxcomp.collectives.sizes`: the message sizes the collectives and the byte model share;
* :mod:`~jaxcomp.collectives.small`: what is not a gradient: metrics, flags and the gather of
  sharded params;
* :mod:`~jaxcomp.collectives.baseline`: XLA's own all-reduce, as a program without jaxcomp runs
  it (what the benchmarks compare against).
"""

from __future__ import annotations

from jaxcomp._lazy import attach

#: Top-k selectors: exact :func:`jaxcomp.topk` or MSTopK :func:`jaxcomp.threshold_topk`.
SELECTORS = ("exact", "threshold")

#: AR-Topk leader rules: round-robin by step (STAR), largest local top-k norm (VAR), or every
#: device picking ``k / N`` of the indices (SPLIT).
LEADERS = ("star", "var", "split")

#: Point-to-point algorithms of :func:`zfp_allreduce`.
ZFP_ALGORITHMS = ("ring", "recursive_doubling")

#: Algorithms of :func:`narrow_allreduce` (and :func:`bfloat16_allreduce`): by platform, or one of
#: the two everywhere.
BFLOAT16_ALGORITHMS = ("auto", "ring", "psum")

_EXPORTS = {
    "psum": "jaxcomp.collectives.dense",
    "psum_scatter": "jaxcomp.collectives.dense",
    "pmax": "jaxcomp.collectives.dense",
    "bfloat16_allreduce": "jaxcomp.collectives.dense",
    "narrow_allreduce": "jaxcomp.collectives.dense",
    "allgather_topk": "jaxcomp.collectives.topk",
    "ar_topk": "jaxcomp.collectives.topk",
    "hierarchical_topk": "jaxcomp.collectives.topk",
    "zfp_allreduce": "jaxcomp.collectives.zfp",
    "zfp_reduce_scatter": "jaxcomp.collectives.zfp",
    "quantized_psum": "jaxcomp.collectives.quantized",
    "sign_allgather": "jaxcomp.collectives.sign",
    "sign_ring": "jaxcomp.collectives.sign",
    "sign_reduce_scatter": "jaxcomp.collectives.sign",
}

__getattr__, __dir__, _names = attach(
    __name__,
    submodules=(
        "dense",
        "topk",
        "value_codes",
        "zfp",
        "ring",
        "quantized",
        "sign",
        "sizes",
        "small",
        "baseline",
    ),
    exports=_EXPORTS,
)
__all__ = ["BFLOAT16_ALGORITHMS", "LEADERS", "SELECTORS", "ZFP_ALGORITHMS", *_names]
