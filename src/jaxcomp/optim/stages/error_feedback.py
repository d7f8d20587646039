"""Stage 5, error feedback: what a device did not send is added to its next gradient.

``g_e = g + residual`` before aggregation, ``residual = g_e - sent`` after; the residual is the
state of this stage, one float32 array per compressed leaf, different on every device.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxcomp.costmodel import ratio_choice
from jaxcomp.ops import flat, pieces
from jaxcomp.ops.pieces import Pieces


def add_residual(g, residual):
    """The error-fed gradient of a leaf: ``g + residual``.

    Args:
      g: the leaf's finite gradient (or DGC velocity), float32.
      residual: the state's residual of the leaf.

    Returns:
      ``g + residual``.

    Example:
      >>> import jax.numpy as jnp
      >>> add_residual(jnp.array([1.0]), jnp.array([0.5])).tolist()
      [1.5]

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1; Seide et al., "1-Bit SGD", Interspeech 2014.
    """
    return g + residual


def fused(grads, residuals):
    """A group's error-fed vector in one pass: each gradient's non-finite entries as 0, its
    residual added, the leaves joined, and the energies the metrics and the guardrail read
    (:func:`jaxcomp.ops.flat.pack_error_fed`).

    Args:
      grads: the group's gradient leaves.
      residuals: their residuals, or None without error feedback.

    Returns:
      A :class:`jaxcomp.ops.flat.Packed`: the vector, the non-finite count, the gradient's energy
      and the vector's (scaled by :data:`~jaxcomp.costmodel.ratio_choice.ENERGY_SCALE`).

    Example:
      >>> import jax.numpy as jnp
      >>> packed = fused([jnp.array([1.0, jnp.nan])], [jnp.array([0.5, 0.5])])
      >>> packed.vector.tolist(), float(packed.nonfinite)
      ([1.5, 0.5], 1.0)

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 and §3-C3 (fused compression).
    """
    return flat.pack_error_fed(grads, residuals, ratio_choice.ENERGY_SCALE)


def remaining(fed, sent, sparse: bool):
    """What the device did not send: ``fed - sent``, the next residual.

    Args:
      fed: a group's error-fed vector (float32).
      sent: this device's contribution: dense, :class:`jaxcomp.ops.pieces.Pieces` of it (the
        residual then comes back as the same parts, never joined),
        :class:`jaxcomp.ops.sign.ScaledSigns`, or ``(indices, values)``.
      sparse: ``sent`` is ``(indices, values)``.

    Returns:
      The group's new residual vector.

    Example:
      >>> import jax.numpy as jnp
      >>> fed = jnp.array([1.0, 2.0, 3.0])
      >>> remaining(fed, (jnp.array([1]), jnp.array([2.0])), True).tolist()
      [1.0, 0.0, 3.0]

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1.
    """
    if sparse:
        indices, values = sent
        # fed[i] + (-v) is fed[i] - v exactly: the same residual as fed - dense(sent).
        return fed.at[indices].add(-values.astype(jnp.float32), mode="drop", unique_indices=True)
    if isinstance(sent, Pieces):
        fed = Pieces.split(fed, sent.sizes)
        return Pieces([f - s.astype(jnp.float32) for f, s in zip(fed.parts, sent.parts)])
    return fed - pieces.joined(sent).astype(jnp.float32)
