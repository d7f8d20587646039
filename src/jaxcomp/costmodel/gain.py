"""The compression gain ``‖g_c‖² / ‖g_e‖²``: how much of the error-fed gradient's energy the
compressed one keeps, summed so that no finite gradient overflows float32.

The adaptive compression ratio (:mod:`jaxcomp.costmodel.ratio_choice`) weighs it against the
compression and communication times; :func:`jaxcomp.compress_auto` computes it in every step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def compression_gain(compressed, error_fed):
    """Compression gain ``‖g_c‖² / ‖g_e‖²``: the share of the error-fed gradient's energy kept.

    Args:
      compressed: the gradient as sent (dense, zeros where dropped), any float array or pytree.
      error_fed: the gradient plus the error-feedback residual, same structure.

    Returns:
      A float32 scalar in ``[0, 1]`` for a top-k compressor (1 when ``error_fed`` is all zero).

    Example:
      >>> import jax.numpy as jnp
      >>> round(float(compression_gain(jnp.array([3.0, 0.0]), jnp.array([3.0, 4.0]))), 6)
      0.36

    References:
      Tyagi & Swany, arXiv 2312.02493, §2-C3 (gain from GraVAC).
    """

    def energies(tree):
        values = [jnp.asarray(x, jnp.float32) for x in jax.tree.leaves(tree)]
        plain = sum(jnp.sum(jnp.square(x)) for x in values)
        scaled = sum(scaled_energy(x) for x in values)
        fits = plain <= PLAIN_ENERGY_LIMIT
        return jnp.where(fits, plain, 0.0), jnp.where(fits, 0.0, scaled)

    (kept, kept_scaled), (total, total_scaled) = energies(compressed), energies(error_fed)
    return gain_from_energies(kept, total, kept_scaled, total_scaled)


#: Values are multiplied by this before squaring when their plain float32 energy (sum of squares)
#: would not fit: every finite float32 (below ``2**128``) then squares to below ``2**96``, and what
#: the scaling loses (squares below ``2**-126``, values below ``2**17``) is below ``2**-66`` of the
#: energy of a vector that needed it.
ENERGY_SCALE = 2.0**-80

#: The largest energy one device adds to a plain float32 sum over the devices (``2**27`` devices
#: of it still fit); a larger one, or a non-finite one, is taken scaled (:func:`scaled_energy`).
PLAIN_ENERGY_LIMIT = 2.0**100


def scaled_energy(values):
    """``sum((x * ENERGY_SCALE)**2)`` over the finite entries of ``values``: an energy that does not
    overflow float32 for any finite gradient (``1e20`` squares to ``1e40``, past float32's
    ``3.4e38``), in units of ``ENERGY_SCALE**-2``.

    Args:
      values: a float array.

    Returns:
      A float32 scalar.

    Example:
      >>> import jax.numpy as jnp
      >>> e = scaled_energy(jnp.array([1e20, 1e20, jnp.inf]))
      >>> round(float(e) / ENERGY_SCALE**2 / 1e40, 4)
      2.0

    References:
      Blue, "A Portable Fortran Program to Find the Euclidean Norm of a Vector", ACM TOMS 1978
      (scaled sums of squares).
    """
    x = jnp.asarray(values, jnp.float32)
    return jnp.sum(jnp.where(jnp.isfinite(x), jnp.square(x * ENERGY_SCALE), 0.0))


def gain_from_energies(kept, total, kept_scaled=0.0, total_scaled=0.0):
    """``kept / total`` as a compression gain: 1 when ``total`` is 0 (nothing to send), and NaN or
    Inf, not a plausible number, when a sum overflowed or held a NaN.

    Energies too large for a plain float32 sum come as ``kept_scaled`` and ``total_scaled``
    (:func:`scaled_energy`, e.g. the devices whose gradients reach ``1e20``); when any is there,
    the plain ones are scaled down to their units and added, so the gain stays finite.

    Args:
      kept: ``‖g_c‖²``, a float scalar (traced or not).
      total: ``‖g_e‖²``.
      kept_scaled: the part of ``‖g_c‖²`` summed scaled (:data:`ENERGY_SCALE`), default 0.
      total_scaled: the part of ``‖g_e‖²`` summed scaled.

    Returns:
      A float32 scalar.

    Example:
      >>> round(float(gain_from_energies(9.0, 25.0)), 6), float(gain_from_energies(0.0, 0.0))
      (0.36, 1.0)
      >>> round(float(gain_from_energies(0.0, 0.0, 1.0, 4.0)), 6)
      0.25

    References:
      Tyagi & Swany, arXiv 2312.02493, §2-C3.
    """
    kept, total = jnp.asarray(kept, jnp.float32), jnp.asarray(total, jnp.float32)
    kept_scaled = jnp.asarray(kept_scaled, jnp.float32)
    total_scaled = jnp.asarray(total_scaled, jnp.float32)
    scaled = (kept_scaled > 0) | (total_scaled > 0)
    # In the scaled units, a plain energy is ENERGY_SCALE**2 smaller: two steps, each representable.
    kept = jnp.where(scaled, kept * ENERGY_SCALE * ENERGY_SCALE + kept_scaled, kept)
    total = jnp.where(scaled, total * ENERGY_SCALE * ENERGY_SCALE + total_scaled, total)
    return jnp.where(total == 0, 1.0, kept / jnp.where(total == 0, 1.0, total)).astype(jnp.float32)
