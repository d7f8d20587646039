"""ZFP's fixed-rate stream length in plain Python: the uint32 words a row of ``n`` values codes to.

The one definition of that number, below both the codec (:func:`jaxcomp.zfp_num_words`, which
validates its arguments and calls :func:`row_words`) and the argument checks of the decoders
(:mod:`jaxcomp.ops._checks`), so neither imports the other; the byte model
(:class:`jaxcomp.methods.Zfp`) counts with it too. Importing it loads no JAX. The bit format is in
``docs/kernels.md``.
"""

from __future__ import annotations


def row_words(n: int, rate: int) -> int:
    """uint32 words of a row of ``n`` values at ``rate`` bits each, for arguments already checked.

    Args:
      n: values in the row, ``>= 1``.
      rate: bits per value, in ``[1, 32]``.

    Returns:
      ``ceil(ceil(n / 4) * 4 * rate / 32)``: whole blocks of 4 values, ``4 * rate`` bits each; plus
      one header word (the row's common exponent) when ``rate <= 2``.

    Example:
      >>> row_words(1000, 8), row_words(5, 2)
      (250, 2)

    References:
      Lindstrom, "Fixed-Rate Compressed Floating-Point Arrays", IEEE TVCG 2014 (zfp).
    """
    blocks = -(-n // 4)
    return -(-(blocks * 4 * rate) // 32) + (1 if rate <= 2 else 0)
