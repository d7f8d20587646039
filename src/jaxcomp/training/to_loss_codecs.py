"""The codecs of time to quality's DiLoCo rows: how a row sends its pseudo-gradients (``-int8``,
``-topk``, ``-topk2r02``, or ``@codec=NAME``; :mod:`jaxcomp.training.to_loss` builds the rows).

Every codec but ``none`` keeps an error-feedback residual across syncs (DiLoCo's outer
``jaxcomp.compress`` does, for every method but the casts). The fixed names are :data:`CODECS`;
``topkBrDIGITS`` names any SparseLoCo-style top-k with low-bit values: ``B`` bits a value (1 to
4), the ratio's ``DIGITS`` after the decimal point (``topk2r02``: top-2% in 2 bits,
``topk2r015``: top-1.5%).
"""

from __future__ import annotations

import re

#: The fixed codecs: THC's 8 bits after a random Hadamard rotation; the same 8 bits without the
#: rotation (``int8flat``: no transform before and after, on a grid as wide as the raw values);
#: THC's 4 bits (Streaming DiLoCo's width); top-10% in float32.
_CODECS = {
    "none": lambda methods: None,
    "int8": lambda methods: methods.Quantized(8),
    "int8flat": lambda methods: methods.Quantized(8, hadamard=False),
    "int4": lambda methods: methods.Quantized(4),
    "topk": lambda methods: methods.TopK(0.1),
}
CODECS = tuple(_CODECS)
#: The form of a low-bit top-k codec's name, for messages.
TOPK_FORM = "topkBrDIGITS (B value bits, 1-4; the ratio's digits after the point: topk2r02)"

_LOW_BIT_TOPK = re.compile(r"topk(\d+)r(\d+)")


def low_bit_topk(name):
    """The ``(value_bits, ratio)`` a ``topkBrDIGITS`` codec name spells, or None for a name of
    another form.

    Args:
      name: a codec name.

    Returns:
      ``(bits, ratio)``, or None where ``name`` is not ``topk`` digits ``r`` digits.

    Raises:
      ValueError: for a name of that form whose bits are not 1 to 4 or whose ratio is 0.

    Example:
      >>> low_bit_topk("topk2r02"), low_bit_topk("topk2r015"), low_bit_topk("int8")
      ((2, 0.02), (2, 0.015), None)

    References:
      Sarfi et al., "Communication Efficient LLM Pre-training with SparseLoCo" (arXiv
      2508.15706): top-1 to 3% with 2-bit values.
    """
    match = _LOW_BIT_TOPK.fullmatch(name)
    if match is None:
        return None
    bits, ratio = int(match[1]), float("0." + match[2])
    if not 1 <= bits <= 4:
        raise ValueError(f"codec {name!r}: top-k values travel in 1 to 4 bits, not {bits}")
    if ratio <= 0:
        raise ValueError(f"codec {name!r}: the ratio 0.{match[2]} must be > 0")
    return bits, ratio


def check_codec(name):
    """Raises unless ``name`` is a codec; the message lists the names and the top-k form.

    Args:
      name: a codec name.

    Returns:
      None.

    Raises:
      ValueError: naming ``name``, for a name neither in :data:`CODECS` nor of
        :data:`TOPK_FORM` with bits 1 to 4 and a ratio > 0.

    Example:
      >>> check_codec("topk2r03")

    References:
      Sarfi et al., SparseLoCo (arXiv 2508.15706): the top-k codecs.
    """
    if name in CODECS or low_bit_topk(name) is not None:
        return
    raise ValueError(f"codec {name!r}: choose from {', '.join(CODECS)} or {TOPK_FORM}")


def codec(name):
    """The method a DiLoCo row sends its pseudo-gradients with.

    Args:
      name: one of :data:`CODECS`, or ``topkBrDIGITS`` (:func:`low_bit_topk`).

    Returns:
      A ``jaxcomp`` method, or None for ``"none"`` (dense pseudo-gradients). ``topkBrDIGITS``
      is the all-gather top-k of that ratio with ``B``-bit values on a scale per 64 of them.

    Raises:
      ValueError: for any other name, listing :data:`CODECS` and the top-k form.

    Example:
      >>> codec("int4").bits, codec("none") is None, codec("topk2r02").value_bits
      (4, True, 2)

    References:
      Li et al., "THC" (NSDI 2024): 8 and 4 bits after a Hadamard rotation; Liu et al.,
      "Streaming DiLoCo" (arXiv 2501.18512): outer gradients in 4 bits; Sarfi et al.,
      "Communication Efficient LLM Pre-training with SparseLoCo" (arXiv 2508.15706): top-k
      pseudo-gradients with 2-bit values and error feedback.
    """
    from jaxcomp import methods

    check_codec(name)
    if name in CODECS:
        return _CODECS[name](methods)
    bits, ratio = low_bit_topk(name)
    return methods.TopK(ratio, value_bits=bits)
