"""One flat vector of many arrays, built so that no XLA fusion can write it slowly.

Every method that compresses the model as a whole (``granularity="model"``) works on one 1-D
vector made of all the gradient leaves. ``jnp.concatenate`` builds it, and on XLA:CPU the
concatenation's speed depends on how many arrays it joins:

* with **at most 8 operands**, XLA:CPU's instruction fusion (``CpuInstructionFusion::ShouldFuse``,
  ``kMaxConcatenateArguments = 8``; "for vectors it's always beneficial to fuse concatenations")
  fuses the concatenate with its producers (the error-feedback add, the non-finite select, a
  cast to bfloat16) and with its consumers into one loop fusion. The loop emitter then maps each
  output index to its operand through a tree of branches of depth ``log2(#operands)`` per
  element, which LLVM cannot vectorize: each value then costs far more than a copy of it would
  (docs/performance.md, "The fused-concatenate trap", has the profile);
* with **more than 8 operands**, the fusion pass refuses ("Concatenate fusion is inefficient"):
  the producers run as their own vectorized loops and the concatenate as a memcpy per operand.

So the step of a 1024-4096-4096-1024-10 MLP (8 leaves) was many times slower than that of six
2041x2041 layers (12 leaves) of the same size. :func:`concat` always takes the second path: it
splits the largest parts until there are more than 8, which costs nothing (each piece is written by
its producer's own loop) and does not depend on which shapes a model has, and puts the result behind
an optimization barrier, so that no consumer's slice can be folded back into a smaller concatenate
(PowerSGD slices each leaf's total back out of the concatenated totals, and XLA would otherwise
rebuild each leaf from its two halves in a fused 2-operand concatenate).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

#: XLA:CPU fuses a concatenate of at most this many operands into its producers and consumers.
XLA_CPU_FUSED_CONCAT_OPERANDS = 8


def split_parts(
    sizes: list[int], min_parts: int = XLA_CPU_FUSED_CONCAT_OPERANDS + 1
) -> list[tuple[int, int, int]]:
    """How :func:`concat` cuts parts of ``sizes`` values: ``(part, start, stop)`` pieces in order.

    The largest piece is halved until there are ``min_parts`` pieces (or every piece holds one
    value); a single part is never cut (it needs no concatenation at all).

    Args:
      sizes: values per part.
      min_parts: the number of pieces to reach.

    Returns:
      The pieces, in the parts' order, covering each part exactly once.

    Example:
      >>> split_parts([8, 2], min_parts=4)
      [(0, 0, 2), (0, 2, 4), (0, 4, 8), (1, 0, 2)]

    References:
      XLA ``xla/service/cpu/cpu_instruction_fusion.cc`` (the 8-operand limit).
    """
    pieces = [(i, 0, n) for i, n in enumerate(sizes)]
    if len(sizes) <= 1:
        return pieces
    while len(pieces) < min_parts:
        j = max(range(len(pieces)), key=lambda p: pieces[p][2] - pieces[p][1])
        part, start, stop = pieces[j]
        if stop - start < 2:
            break
        middle = start + (stop - start) // 2
        pieces[j : j + 1] = [(part, start, middle), (part, middle, stop)]
    return pieces


def concat(parts):
    """One 1-D vector of ``parts`` (raveled, in order), never written by a slow fused loop.

    Args:
      parts: arrays of one dtype, any shapes.

    Returns:
      Their values as one 1-D array (``parts[0].ravel()`` itself for a single part).

    Example:
      >>> import jax.numpy as jnp
      >>> concat([jnp.ones((2, 2)), jnp.zeros(3)]).tolist()
      [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]

    References:
      XLA ``xla/service/cpu/cpu_instruction_fusion.cc`` (why more than 8 operands); the module
      docstring and docs/performance.md (the measurements).
    """
    flat = [p.ravel() for p in parts]
    if len(flat) == 1:
        return flat[0]
    pieces = split_parts([f.shape[0] for f in flat])
    # The barrier keeps XLA's simplifier from folding a consumer's slice of one leaf back through
    # the concatenate (slice(concat(halves)) -> concat(halves of that leaf)), which would make a
    # 2-operand concatenate that fuses again.
    return jax.lax.optimization_barrier(
        jnp.concatenate([flat[i][start:stop] for i, start, stop in pieces])
    )


def dropped(x):
    """``x`` with its non-finite entries as 0 (same dtype).

    Args:
      x: an array.

    Returns:
      ``where(isfinite(x), x, 0)``.

    Example:
      >>> import jax.numpy as jnp
      >>> dropped(jnp.array([1.0, jnp.inf, jnp.nan])).tolist()
      [1.0, 0.0, 0.0]

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018, §3.2 (non-finite values).
    """
    return jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x))


def cleared(flag, x):
    """``x``, or zeros of its shape and dtype where ``flag`` (a scalar or ``x``'s shape) is set: a
    select that XLA fuses into whatever writes ``x``.

    Args:
      flag: a boolean scalar, or a boolean array of ``x``'s shape.
      x: an array.

    Returns:
      ``where(flag, 0, x)``.

    Example:
      >>> import jax.numpy as jnp
      >>> cleared(jnp.bool_(True), jnp.array([1.0, 2.0])).tolist()
      [0.0, 0.0]

    References:
      docs/training.md, "Guardrails: guardrail=" (a triggered step's residual is cleared).
    """
    return jnp.where(flag, jnp.zeros_like(x), x)


def finite_values(g):
    """``g`` in float32 with its non-finite values (NaN, ±Inf) as 0.

    Args:
      g: a float array.

    Returns:
      A float32 array of ``g``'s shape.

    Example:
      >>> import jax.numpy as jnp
      >>> finite_values(jnp.array([1.0, jnp.inf])).tolist()
      [1.0, 0.0]

    References:
      docs/training.md, "Non-finite gradients" (never sent, never kept in the residual).
    """
    return dropped(g.astype(jnp.float32))


def count_nonfinite(g):
    """The non-finite values of ``g``, as a float32 scalar (exact below 2**24).

    A float count reduces inside the select's own loop; an int32 one made XLA:CPU write an s32
    copy of the whole array first (one more pass over it).

    Args:
      g: a float array.

    Returns:
      A float32 scalar.

    Example:
      >>> import jax.numpy as jnp
      >>> float(count_nonfinite(jnp.array([1.0, jnp.nan, -jnp.inf])))
      2.0

    References:
      docs/training.md, "Non-finite gradients" (the ``nonfinite`` metric).
    """
    return jnp.sum(jnp.where(jnp.isfinite(g), 0.0, 1.0), dtype=jnp.float32)


class Packed(NamedTuple):
    """What :func:`pack_error_fed` returns: the vector and what the same pass learned."""

    vector: jax.Array  # float32 [sum of sizes]: the error-fed vector
    nonfinite: jax.Array  # f32[]: non-finite gradient values (exact below 2**24)
    gradient: jax.Array  # f32[]: sum of g**2 over the finite gradient values
    fed: jax.Array  # f32[3]: :func:`energies` of the vector


def _check_energy_scale(energy_scale):
    if not (np.isfinite(energy_scale) and energy_scale > 0):
        raise ValueError(f"energy_scale must be finite and > 0, got {energy_scale!r}")


def energies_xla(x, energy_scale=1.0):
    """:func:`energies` in XLA ops (a variadic reduce): what every platform but the CPU runs, and
    the reference the CPU kernel is tested against (to float rounding).

    Args:
      x: a float array.
      energy_scale: the factor of the second sum.

    Returns:
      A float32 ``[3]``.

    Example:
      >>> import jax.numpy as jnp
      >>> energies_xla(jnp.array([3.0, 4.0, jnp.inf]), 0.5).tolist()
      [inf, 6.25, 1.0]

    References:
      Tyagi & Swany, arXiv 2312.02493, §2-C3 (compression gain).
    """
    x = x.astype(jnp.float32)
    finite = jnp.isfinite(x)
    operands = (
        jnp.square(x),
        jnp.where(finite, jnp.square(x * energy_scale), 0.0),
        jnp.where(finite, 0.0, 1.0),
    )
    zero = jnp.zeros((), jnp.float32)
    sums = jax.lax.reduce(
        operands,
        (zero, zero, zero),
        lambda a, b: (a[0] + b[0], a[1] + b[1], a[2] + b[2]),
        tuple(range(x.ndim)),
    )
    return jnp.stack(sums)


def energies(x, energy_scale=1.0):
    """``[sum x**2, sum over finite x of (x * energy_scale)**2, non-finite x]`` in float32, in
    one read: the part of the compression gain each device's sent (and error-fed) vector adds.

    On the CPU a float32 ``x`` is summed by one native pass (``kernels/pack.h``'s
    ``vector_energies``: vector registers, XLA's intra-op threads, 64K-value pieces added in
    order); XLA's variadic reduce takes several copies' time there. Elsewhere, and
    for 16-bit ``x``, :func:`energies_xla` runs.

    Args:
      x: a float array.
      energy_scale: the factor of the second sum (a sum of squares that does not overflow).

    Returns:
      A float32 ``[3]``.

    Example:
      >>> import jax.numpy as jnp
      >>> energies(jnp.array([3.0, 4.0, jnp.inf]), 0.5).tolist()
      [inf, 6.25, 1.0]

    References:
      Tyagi & Swany, arXiv 2312.02493, §2-C3 (compression gain).
    """
    from jaxcomp.ops import _ffi

    _check_energy_scale(energy_scale)
    if x.dtype != jnp.float32 or x.size == 0:
        return energies_xla(x, energy_scale)
    call = _ffi.ffi_call(
        "jaxcomp_energies", jax.ShapeDtypeStruct((3,), jnp.float32), vmap_method="sequential"
    )

    def native(v):
        return call(v, energy_scale=np.float32(energy_scale))

    return _ffi.platform_dependent(x, cpu=native, default=lambda v: energies_xla(v, energy_scale))


def finite_energy(g):
    """``sum g**2`` over the finite values of ``g``, in float32.

    Args:
      g: a float array.

    Returns:
      A float32 scalar.

    Example:
      >>> import jax.numpy as jnp
      >>> float(finite_energy(jnp.array([3.0, jnp.nan, 4.0])))
      25.0

    References:
      Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019 (the gradient norm).
    """
    x = g.astype(jnp.float32)
    return jnp.sum(jnp.where(jnp.isfinite(x), jnp.square(x), 0.0))


def pack_error_fed_xla(grads, residuals=None, energy_scale=1.0) -> Packed:
    """:func:`pack_error_fed` in XLA ops: what every platform but the CPU runs, and the reference
    the CPU kernel is tested against (the vector and the count bit for bit, the sums to float
    rounding).

    Args:
      grads: float arrays, any shapes.
      residuals: None, or float32 arrays shaped like ``grads``.
      energy_scale: as for :func:`pack_error_fed`.

    Returns:
      A :class:`Packed`, as :func:`pack_error_fed` returns it.

    Example:
      >>> import jax.numpy as jnp
      >>> packed = pack_error_fed_xla([jnp.array([2.0, -jnp.inf])])
      >>> packed.vector.tolist(), float(packed.nonfinite), float(packed.gradient)
      ([2.0, 0.0], 1.0, 4.0)

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (error feedback, g_e = g + residual).
    """
    fed = [
        finite_values(g) if residuals is None else finite_values(g) + r
        for g, r in zip(grads, residuals or grads)
    ]
    vector = concat(fed)
    return Packed(
        vector,
        sum(count_nonfinite(g) for g in grads),
        sum(finite_energy(g) for g in grads),
        energies_xla(vector, energy_scale),
    )


def pack_error_fed(grads, residuals=None, energy_scale=1.0) -> Packed:
    """The flat error-fed vector of gradient leaves, and what one pass over them learns: how many
    values were not finite, the gradient's energy and the vector's.

    ``vector = concat(where(isfinite(g_i), g_i, 0) + r_i)``: each leaf's non-finite values count as
    0 (never sent, never kept in the residual), its residual is added, and the leaves are joined
    into one float32 vector. On the CPU this is one native pass (``kernels/pack.h``: read each
    gradient and residual once, write the vector once, and sum the energies in registers on the
    way); done by XLA it is a loop per leaf into a temporary, then the concatenation
    (:func:`concat`), two to three passes over fresh memory, and the energies one and a half more.
    Elsewhere (GPU, TPU) XLA's own fusion does it well and runs.

    Args:
      grads: float32 arrays, any shapes.
      residuals: None, or float32 arrays shaped like ``grads``.
      energy_scale: the factor of the vector's scaled energy (``Packed.fed[1]``).

    Returns:
      A :class:`Packed`: the float32 ``[sum of sizes]`` vector, the non-finite count, ``sum g**2``
      over the finite gradient values and :func:`energies` of the vector. The sums are taken in
      64K-value pieces, so they match the XLA reference to float rounding, not bit for bit.

    Example:
      >>> import jax.numpy as jnp
      >>> packed = pack_error_fed([jnp.array([1.0, jnp.nan]), jnp.ones((2, 2))],
      ...                         [jnp.array([0.5, 0.5]), jnp.zeros((2, 2))])
      >>> packed.vector.tolist(), float(packed.nonfinite), float(packed.gradient)
      ([1.5, 0.5, 1.0, 1.0, 1.0, 1.0], 1.0, 5.0)

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (error feedback, g_e = g + residual); Lin et al.,
      DGC, ICLR 2018 (the fused gradient vector).
    """
    from jaxcomp.ops import _ffi

    grads, residuals = list(grads), None if residuals is None else list(residuals)
    if not grads:
        raise ValueError("grads must hold at least one array")
    if residuals is not None and [r.shape for r in residuals] != [g.shape for g in grads]:
        raise ValueError(
            f"residuals must be shaped like grads: {[r.shape for r in residuals]} vs "
            f"{[g.shape for g in grads]}"
        )
    _check_energy_scale(energy_scale)
    n = sum(g.size for g in grads)
    if n == 0 or any(g.dtype != jnp.float32 for g in grads + (residuals or [])):
        return pack_error_fed_xla(grads, residuals, energy_scale)  # the kernel reads float32
    call = _ffi.ffi_call(
        "jaxcomp_pack",
        (jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((5,), jnp.float32)),
        vmap_method="sequential",
    )
    has_residual = np.int64(residuals is not None)

    def native(*operands):
        scale = np.float32(energy_scale)
        vector, stats = call(*operands, residual=has_residual, energy_scale=scale)
        return Packed(vector, stats[0], stats[1], stats[2:])

    def portable(*operands):
        return pack_error_fed_xla(
            operands[: len(grads)],
            operands[len(grads) :] if residuals is not None else None,
            energy_scale,
        )

    return Packed(
        *_ffi.platform_dependent(*grads, *(residuals or []), cpu=native, default=portable)
    )
