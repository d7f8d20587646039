"""Muon for jaxcomp: optax's ``optax.contrib.muon`` with its arguments checked and one learning
rate for all of the params, as :func:`jaxcomp.diloco`'s inner optimizer (MuLoCo).

Muon orthogonalizes the Nesterov momentum of each weight matrix by a few Newton-Schulz
iterations (local matmuls: no collective) and updates the other leaves with AdamW. Which leaves
are matrices is optax's rule: every 2-D leaf, unless ``dimension_numbers`` says otherwise (a
leaf of 3 or more dimensions, a convolution's kernel, a stack of scanned layers or attention's
``[in, heads, head_dim]`` kernel, goes to AdamW unless it names its axes there).
docs/training.md (DiLoCo, "Muon as the inner optimizer") says when to use it and how.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from optax import contrib

from jaxcomp.ops import _checks

__all__ = ["muon", "refuse_sharded", "uses_muon"]


def muon(
    learning_rate,
    *,
    weight_decay: float = 0.0,
    beta: float = 0.95,
    ns_steps: int = 5,
    consistent_rms: float | None = 0.2,
    adam_learning_rate=None,
    dimension_numbers=None,
) -> optax.GradientTransformation:
    """Muon (momentum orthogonalized by Newton-Schulz) on the matrices, AdamW on the rest.

    ``optax.contrib.muon`` with AdamW's scale: each matrix's update is scaled to the RMS that an
    AdamW update has (``consistent_rms``), so the one ``learning_rate`` serves the matrices and
    the AdamW leaves alike and a rate tuned for AdamW is a good start.

    Args:
      learning_rate: the peak rate (a positive float) or an optax schedule.
      weight_decay: decoupled weight decay (times the rate), on every leaf as AdamW's.
      beta: the momentum's decay, in ``[0, 1)``.
      ns_steps: the Newton-Schulz iterations, at least 1.
      consistent_rms: a matrix's update RMS, or None for optax's width scaling
        ``sqrt(max(1, fan_out / fan_in))`` (then the rate is Muon's own, ``0.02`` or so).
      adam_learning_rate: the AdamW leaves' rate (default ``learning_rate``).
      dimension_numbers: optax's ``muon_weight_dimension_numbers``: a pytree (or a function of
        the params returning one) of ``optax.contrib.MuonDimensionNumbers`` for the matrices
        and None for the AdamW leaves (default: every 2-D leaf is a matrix).

    Returns:
      An ``optax.GradientTransformation`` whose state holds an ``optax.contrib.MuonState``.

    Raises:
      ValueError: a number out of range. TypeError: an argument of the wrong kind.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.muon(1e-3)
      >>> params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
      >>> updates, _ = tx.update(params, tx.init(params), params)
      >>> jaxcomp.optim.muon.uses_muon(tx), updates["w"].shape
      (True, (4, 3))

    References:
      Jordan et al., "Muon" (kellerjordan.github.io/posts/muon, 2024); Liu et al., "Muon is
      Scalable for LLM Training" (arXiv 2502.16982: the consistent RMS); Thérien et al.,
      "MuLoCo: Muon is a practical inner optimizer for DiLoCo" (arXiv 2505.23725).
    """
    learning_rate = _rate(learning_rate, "learning_rate")
    if adam_learning_rate is not None:
        adam_learning_rate = _rate(adam_learning_rate, "adam_learning_rate")
    weight_decay = _checks.static_float(weight_decay, "weight_decay", 0)
    beta = _checks.static_float(beta, "beta", 0, 1, open_hi=True)
    ns_steps = _checks.static_int(ns_steps, "ns_steps", 1)
    if consistent_rms is not None:
        consistent_rms = _checks.static_float(consistent_rms, "consistent_rms", 0, open_lo=True)
    return contrib.muon(
        learning_rate,
        ns_steps=ns_steps,
        beta=beta,
        weight_decay=weight_decay,
        adam_weight_decay=weight_decay,
        adam_learning_rate=adam_learning_rate,
        muon_weight_dimension_numbers=dimension_numbers,
        consistent_rms=consistent_rms,
    )


def _rate(value, name: str):
    """A learning rate: an optax schedule (any callable) or a positive finite float."""
    if callable(value):
        return value
    return _checks.static_float(value, name, 0, open_lo=True)


def uses_muon(tx: optax.GradientTransformation) -> bool:
    """Whether ``tx`` orthogonalizes a weight matrix: its state for a matrix holds an
    ``optax.contrib.MuonState`` (:func:`muon`, ``optax.contrib.muon`` or a chain around one).

    Args:
      tx: an optax transformation.

    Returns:
      True if its ``init`` of an ``8 x 8`` matrix makes a ``MuonState``; False otherwise, or if
      it cannot initialize a bare matrix.

    Example:
      >>> import optax
      >>> uses_muon(optax.contrib.muon(0.02)), uses_muon(optax.adamw(1e-3))
      (True, False)

    References:
      Jordan et al., "Muon" (kellerjordan.github.io/posts/muon, 2024).
    """
    try:
        state = jax.eval_shape(tx.init, {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)})
    except Exception:  # a tx built for other params (a mask, labels): the probe tells nothing,
        return False  # and a run it cannot read must not be refused for it
    found = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, contrib.MuonState))
    return any(isinstance(x, contrib.MuonState) for x in found)


def refuse_sharded(tx: optax.GradientTransformation, shard, name: str = "tx") -> None:
    """Refuses a Muon optimizer given ZeRO's flat shards (``shard=``), where it would find no
    matrix and silently update every leaf with AdamW.

    Args:
      tx: the optimizer that would get the shards.
      shard: the run's ``shard=`` (None: whole leaves, nothing to refuse).
      name: the argument ``tx`` was given as, for the message.

    Returns:
      None; raises ``ValueError`` naming ``shard`` and ``name``.

    Example:
      >>> refuse_sharded(optax.contrib.muon(0.02), "optimizer")
      Traceback (most recent call last):
      ValueError: shard='optimizer' hands tx each device's flat 1/n shard ...

    References:
      Rajbhandari et al., "ZeRO", SC 2020 (the flat shards); Jordan et al., "Muon" (2024).
    """
    if shard is not None and uses_muon(tx):
        raise ValueError(
            f"shard={shard!r} hands {name} each device's flat 1/n shard of every leaf, so a "
            f"Muon {name} would find no matrix to orthogonalize and update every leaf with "
            "AdamW: pass shard=None with Muon (each device keeps whole leaves)"
        )
