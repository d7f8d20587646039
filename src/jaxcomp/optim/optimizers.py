"""Optimizers that know they are compressed: :func:`adam` and :func:`adamw`, after 1-bit Adam.

``optax.chain(jaxcomp.compress(m), optax.adam(lr))`` compresses the *gradient* and hands what
arrives to an Adam that does not know: Adam's momentum sees each burst that error feedback delivers
once and decays it, and its variance is estimated on those bursts, so most methods lose quality
(BENCHMARKS.md, "What each method costs in quality"). 1-bit Adam (Tang et al., ICML 2021) moves the
compression to where it does no harm:

1. **Warm-up** (the first ``warmup_steps`` steps): plain Adam on the densely averaged gradient;
   its variance ``v`` learns the scale of every coordinate.
2. **Compression stage**: ``v`` is frozen, so the update ``m / (sqrt(v) + eps)`` is *linear* in
   the momentum. Each device updates its own copy of the momentum from its local gradient,
   ``m_i = b1 m + (1 - b1) g_i``, and the devices average ``m_i`` through ``method``, with error
   feedback: what a step does not send is added to the next step's ``m_i``. The averaged ``m``
   is every device's momentum for the next step. Because the update is linear in ``m`` and error
   feedback delivers everything eventually, every coordinate moves as far in total as it would
   under Adam with the same frozen variance, whatever the method drops on a given step.

3. **The variance floor**: a variance frozen (or refreshed) on steps where a coordinate was quiet
   is tiny for it, and when the coordinate wakes ``m / sqrt(v)`` has no bound, so the run can
   explode with any method, ``Dense`` included. Each step after the warm-up raises the stored
   variance to at least ``m_hat^2 / S(t)``, ``S(t)`` the largest ``m_hat^2 / v_hat`` that plain
   Adam can reach at step ``t``: no coordinate steps further than Adam could
   (:func:`_floored`).

What jaxcomp changes against the paper and DeepSpeed's ``OnebitAdam``:

* any jaxcomp method compresses the momentum (the paper: 1-bit signs with a scale), through
  :func:`jaxcomp.compress`, so bytes, metrics, non-finite handling and the guardrails are the
  same as ``compress``'s;
* Adam's bias correction is kept (``optax.adam``'s), so the warm-up is exactly ``optax.adam``
  on the mean gradient (tested); the variance's correction freezes with it.

Use it in place of ``optax.chain(jaxcomp.compress(...), optax.adam(...))`` as the whole
optimizer of :func:`jaxcomp.data_parallel`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomp import methods
from jaxcomp.ops import _checks
from jaxcomp.optim import pinning, sharding, vma
from jaxcomp.optim.compression import compress
from jaxcomp.optim.state import CompressState

#: The default warm-up: dense Adam steps before the variance freezes.
DEFAULT_WARMUP_STEPS = 100

#: The default variance refresh: one dense step in 50 (2% of dense's bytes on top of the method's).
#: On ``benchmarks/quality.py``'s transformer it took back most of what the frozen variance costs
#: in held-out loss (docs/training.md, "Optimizers that know they are compressed").
DEFAULT_REFRESH_EVERY = 50


class CompressedAdamState(NamedTuple):
    """The state of :func:`adam` / :func:`adamw`: Adam's moments and the compression's state."""

    count: jax.Array  # i32[]: optimizer steps taken (the schedule's argument)
    mu: Any  # the averaged momentum, identical on every device (float32)
    nu: Any  # the variance: frozen after the warm-up but for refreshes and its floor (float32)
    compress: CompressState  # the momentum's compression: residual, step, metrics


def adam(
    learning_rate,
    method=None,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    warmup_steps: int = DEFAULT_WARMUP_STEPS,
    refresh_every: int | None = DEFAULT_REFRESH_EVERY,
    warmup_method=None,
    axis_name="data",
    **compress_options,
) -> optax.GradientTransformationExtraArgs:
    """Adam whose momentum crosses the devices compressed, with error feedback (1-bit Adam).

    ``optax.adam`` on the dense mean gradient for ``warmup_steps`` steps; then the variance freezes
    and each device sends its momentum through ``method``. The whole optimizer, e.g. ``tx`` of
    :func:`jaxcomp.data_parallel` (docs/training.md, "Optimizers that know they are compressed").

    Args:
      learning_rate: a float or an optax schedule of the step count.
      method: any method :func:`jaxcomp.compress` takes; default None: :class:`jaxcomp.Sign`.
      b1: the momentum's decay (default 0.9; in (0, 1)).
      b2: the variance's decay during the warm-up (default 0.999).
      eps: added to ``sqrt(v)`` (default 1e-8).
      weight_decay: decoupled weight decay (AdamW's), times the learning rate (default 0).
      warmup_steps: dense Adam steps before the variance freezes (default 100; at least 1).
      refresh_every: a dense step refreshes the variance every this many (default 50; None: never).
      warmup_method: what the warm-up and refreshes send: None (dense) or e.g. ``jaxcomp.Zfp(8)``.
      axis_name: the mesh axis (or axes) the devices average over.
      **compress_options: :func:`jaxcomp.compress`'s other options (not ``momentum_correction``
        or ``warmup_steps``, which this optimizer owns).

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is a :class:`CompressedAdamState`.

    Raises:
      ValueError: a hyper-parameter out of range, or an option this optimizer owns.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, jaxcomp
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
      >>> tx = jaxcomp.adam(0.1, "ar_topk", ratio=0.5, warmup_steps=2)
      >>> dp = jaxcomp.data_parallel(lambda w, b: jnp.mean((b @ w - 1) ** 2), tx, mesh)
      >>> state, batch = dp.init(jnp.zeros(3)), jnp.ones((8 * jax.device_count(), 3))
      >>> for _ in range(20): state, metrics = dp.step(state, batch)
      >>> float(metrics["loss"]) < 0.1
      True

    References:
      Tang et al., "1-bit Adam", ICML 2021 (arXiv 2102.02888), Alg. 1; Loshchilov & Hutter,
      "Decoupled Weight Decay Regularization", ICLR 2019.
    """
    hyper = _check(method, b1, b2, eps, weight_decay, warmup_steps, compress_options)
    hyper["refresh"] = _check_refresh(refresh_every)
    inner, exact = _compressions(method, warmup_method, axis_name, hyper, compress_options)
    schedule = _schedule(learning_rate)

    def init_fn(params):
        _refuse_sharded()
        zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        return CompressedAdamState(jnp.zeros([], jnp.int32), zeros, zeros, inner.init(params))

    update_fn = _update_fn(inner, exact, schedule, weight_decay, hyper)
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _compressions(method, warmup_method, axis_name, hyper, compress_options):
    """``adam``'s two compressions: the momentum's (``method`` after the warm-up) and the exact
    mean of the warm-up's and refreshes' steps."""
    method = methods.Sign() if method is None else method
    inner = compress(
        method,
        axis_name=axis_name,
        warmup_steps=hyper["warmup"],
        warmup_method=warmup_method,
        **compress_options,
    )
    # A refresh starts from a fresh state each time, so a guardrail there could never learn a
    # running statistic: none beside a warm-up method (Dense keeps compress's default).
    exact = compress(
        methods.Dense() if warmup_method is None else warmup_method,
        axis_name=axis_name,
        nonfinite=compress_options.get("nonfinite", "zero"),
        guardrail=warmup_method is None,
    )
    return inner, exact


def _update_fn(inner, exact, schedule, weight_decay, hyper):
    """``adam``'s update: the mean (exact or compressed), the moments, the step."""

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        _refuse_sharded()
        refresh = _refresh_step(state.count, hyper)
        averaged, compressed, stepped = _mean(exact, inner, refresh, updates, state, hyper)
        warm = state.compress.step < hyper["warmup"]
        fallback = _exact_momentum(state.compress, compressed, warm)
        mu, nu = _moments(state, averaged, warm | refresh, refresh, fallback, hyper)
        count = optax.safe_int32_increment(state.count)
        along = _along(mu, fallback, compressed.methods)
        nu = _floored(along, nu, count, warm, hyper)
        out = _direction(along, nu, count, hyper)
        out = _decayed(out, params, weight_decay)
        lr = schedule(state.count)
        out = jax.tree.map(
            lambda u, p: jnp.where(stepped, -lr * u, 0).astype(p.dtype), out, updates
        )
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(stepped, a, b), new, old)  # noqa: E731
        new_state = CompressedAdamState(
            jnp.where(stepped, count, state.count),
            keep(mu, state.mu),
            keep(nu, state.nu),
            compressed,
        )
        return out, new_state

    return update_fn


def adamw(learning_rate, method=None, *, weight_decay: float = 1e-4, **options):
    """:func:`adam` with decoupled weight decay (AdamW), default 1e-4 as ``optax.adamw``'s.

    Args:
      learning_rate: a float or an optax schedule.
      method: any method :func:`jaxcomp.compress` takes (default None: :class:`jaxcomp.Sign`).
      weight_decay: decoupled weight decay, times the learning rate (default 1e-4).
      **options: :func:`adam`'s other keywords.

    Returns:
      :func:`adam`'s transformation.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.adamw(1e-3, "ar_topk", ratio=0.01)
      >>> tx.init({"w": jnp.zeros(4)}).mu["w"].dtype
      dtype('float32')

    References:
      Tang et al., ICML 2021 (1-bit Adam); Loshchilov & Hutter, ICLR 2019 (AdamW).
    """
    return adam(learning_rate, method, weight_decay=weight_decay, **options)


def _check(method, b1, b2, eps, weight_decay, warmup_steps, compress_options) -> dict:
    """The hyper-parameters, checked, as a dict; raises naming the argument."""
    if isinstance(method, str) and method == "auto":
        raise ValueError(
            "method 'auto' cannot run jaxcomp.adam's dense warm-up (compress_auto picks dense "
            "itself, step by step); pass one method, or use optax.chain(jaxcomp.compress('auto'), "
            "optax.adam(lr))"
        )
    for name in ("momentum_correction", "warmup_steps"):
        if name in compress_options:
            raise ValueError(f"{name}= is the optimizer's own; adam() does not pass it to compress")
    b1 = _checks.static_float(b1, "b1", 0, 1, open_lo=True, open_hi=True)
    b2 = _checks.static_float(b2, "b2", 0, 1, open_lo=True, open_hi=True)
    eps = _checks.static_float(eps, "eps", 0)
    _checks.static_float(weight_decay, "weight_decay", 0)
    warmup = _checks.static_int(warmup_steps, "warmup_steps", 1)
    return {"b1": b1, "b2": b2, "eps": eps, "warmup": warmup}


def _schedule(learning_rate):
    """The learning rate as a schedule of the step count; a number must be finite."""
    if callable(learning_rate):
        return learning_rate
    try:
        rate = _checks.static_float(learning_rate, "learning_rate")
    except TypeError:
        raise TypeError(
            "learning_rate must be a number or an optax schedule (a function of the step "
            f"count), got {learning_rate!r}"
        ) from None
    return lambda count: rate


def _refuse_sharded():
    """Refuses ZeRO-style sharded updates: every device needs the whole momentum."""
    if sharding.active() is not None:
        raise ValueError(
            "jaxcomp.adam keeps the whole momentum on every device (each device compresses its "
            "own b1 m + (1 - b1) g), so it cannot update 1/N shards: use data_parallel(..., "
            "shard=None), or optax.chain(jaxcomp.compress(...), optax.adam(...)) to shard"
        )


def _check_refresh(refresh_every):
    """``refresh_every``, checked: None or an int >= 1."""
    if refresh_every is None:
        return None
    return _checks.static_int(refresh_every, "refresh_every", 1)


def _refresh_step(count, hyper):
    """Whether optimizer step ``count`` (0-based) is a variance refresh: the last of every
    ``refresh_every`` steps after the warm-up."""
    refresh, warmup = hyper["refresh"], hyper["warmup"]
    if refresh is None:
        return jnp.bool_(False)
    return (count >= warmup) & ((count - warmup) % refresh == refresh - 1)


def _mean(exact, inner, refresh, grads, state: CompressedAdamState, hyper):
    """The averaged gradient or momentum of this step: the compressed one, or on a variance
    refresh the exact mean (one ``lax.cond``; none without ``refresh_every``)."""
    compressed = lambda: _compressed_mean(inner, grads, state, hyper)  # noqa: E731
    if hyper["refresh"] is None:
        return compressed()
    return vma.cond_typed_alike(
        refresh, lambda: _exact_mean(exact, grads, state.compress), compressed
    )


def _compressed_mean(inner, grads, state: CompressedAdamState, hyper):
    """``(averaged, compress state, stepped)``: the gradient during the warm-up, afterwards the
    momentum ``b1 m + (1 - b1) g``, averaged through the method with error feedback."""
    b1, warm = hyper["b1"], state.compress.step < hyper["warmup"]
    local = jax.tree.map(lambda m, g: jnp.where(warm, g, b1 * m + (1 - b1) * g), state.mu, grads)
    averaged, compressed = inner.update(local, state.compress)
    averaged = jax.tree.map(lambda a: a.astype(jnp.float32), averaged)
    return averaged, compressed, compressed.step != state.compress.step


def _exact_mean(exact, grads, compressed: CompressState):
    """``(averaged, compress state, stepped)`` of a variance refresh: the dense mean gradient;
    the method's state (residual, step) stays, its metrics report the dense step (with the
    method's guardrail count: the refresh's fresh state has none)."""
    averaged, dense_state = exact.update(grads, exact.init(grads))
    averaged = jax.tree.map(lambda a: a.astype(jnp.float32), averaged)
    metrics = dense_state.metrics._replace(fallbacks=compressed.metrics.fallbacks)
    asked = None if compressed.asked is None else pinning.next_branch(compressed)
    return averaged, compressed._replace(metrics=metrics, asked=asked), dense_state.step > 0


def _exact_momentum(before: CompressState, after: CompressState, warm):
    """Whether this step, after the warm-up, averaged the momentum exactly: the guardrail's
    dense fallback ran (the Dense branch beside a lossy method), and not on the step that
    triggered it (which sends nothing)."""
    dense = [i for i, m in enumerate(after.methods) if isinstance(m, methods.Dense)]
    if not dense or len(after.methods) == 1 or after.divergence is None:
        return jnp.bool_(False)
    triggered = after.divergence.fallbacks != before.divergence.fallbacks
    ran = (after.metrics.method == dense[0]) & (after.step != before.step)
    return ran & ~warm & ~triggered


def _along(mu, fallback, branches):
    """The momentum the step goes along. On the guardrail's dense steps each coordinate of the
    exact mean momentum steps no further than either rule would take it: exact Adam's, or the
    method's (:meth:`~jaxcomp.methods.Method.steps_along`, scaled signs for 1-bit Adam), so
    ``sign(m) min(|m|, |shaped(m)|)``. The stored momentum stays exact.

    Either rule alone can throw a run off: exact Adam's where only the method's cap on large
    coordinates kept the run stable at its learning rate; the method's where it lifts quiet
    coordinates to their chunk's scale over a variance that never saw them."""
    lossy = [m for m in branches if not isinstance(m, methods.Dense)]
    method = lossy[0] if len(lossy) == 1 else methods.Dense()
    if type(method).steps_along is methods.Method.steps_along:
        return mu

    def least(m):
        return jnp.sign(m) * jnp.minimum(jnp.abs(m), jnp.abs(method.steps_along(m)))

    return jax.lax.cond(fallback, lambda t: jax.tree.map(least, t), lambda t: t, mu)


def _moments(state: CompressedAdamState, averaged, dense, refresh, exact, hyper):
    """The new momentum and variance: Adam's on a dense step (with a refresh's variance weight),
    the averaged momentum otherwise. Where the momentum was averaged ``exact`` ly (the
    guardrail's dense fallback), the variance takes Adam's step too, from the mean gradient that
    momentum implies, ``(m_new - b1 m) / (1 - b1)``: the fallback re-learns the variance of the
    coordinates that woke."""
    b1, b2 = hyper["b1"], hyper["b2"]
    b2_refresh = b2 ** (hyper["refresh"] or 1)  # Python floats: 1 - b2 as optax computes it
    mu = jax.tree.map(
        lambda m, a: jnp.where(dense, b1 * m + (1 - b1) * a, a).astype(jnp.float32),
        state.mu,
        averaged,
    )

    def variance(v, a, m):
        adam = b2 * v + (1 - b2) * jnp.square(a)
        refreshed = b2_refresh * v + (1 - b2_refresh) * jnp.square(a)
        implied = b2 * v + (1 - b2) * jnp.square((a - b1 * m) / (1 - b1))
        frozen = jnp.where(exact, implied, v)
        return jnp.where(dense, jnp.where(refresh, refreshed, adam), frozen).astype(jnp.float32)

    nu = jax.tree.map(variance, state.nu, averaged, state.mu)
    return mu, nu


def _variance_steps(count, hyper):
    """The steps the variance stands for after ``count`` optimizer steps: the warm-up's, and
    ``refresh_every`` for each refresh since."""
    warmup, refresh = hyper["warmup"], hyper["refresh"]
    done = jnp.minimum(count, warmup)
    if refresh is not None:
        done = done + refresh * (jnp.maximum(count - warmup, 0) // refresh)
    return done


def _ratio_bound(count, hyper):
    """``S(t)``: the square of the largest ``|m_hat| / sqrt(v_hat)`` that ``optax.adam`` can reach
    at step ``t = count`` from zero moments, whatever its gradients.

    By Cauchy-Schwarz over Adam's weights of the past gradients, ``m_hat^2 <= S(t) v_hat`` with
    ``S(t) = (1-b1)^2 (1-b2^t) sum_{k<t} (b1^2/b2)^k / ((1-b1^t)^2 (1-b2))``: about 5 at step
    100 and 53 (a ratio of 7.3) late in a run at the default ``b1 = 0.9``, ``b2 = 0.999``."""
    b1, b2 = hyper["b1"], hyper["b2"]
    t = count.astype(jnp.float32)
    q = b1 * b1 / b2
    geometric = t if q == 1 else (1 - q**t) / (1 - q)
    return (1 - b1) ** 2 * (1 - b2**t) * geometric / ((1 - b1**t) ** 2 * (1 - b2))


def _floored(mu, nu, count, warm, hyper):
    """The variance, raised after the warm-up wherever the momentum would step further than
    Adam ever could: ``v_hat >= m_hat^2 / S(t)`` (:func:`_ratio_bound`).

    A frozen (or refreshed) variance is tiny for coordinates that were quiet at the steps it saw
    (a dead unit that wakes, a rare token's row), so ``m / sqrt(v)`` could reach 1e5 there and
    the run explode. Adam raises ``v`` with the gradient that raises ``m``; the floor does the
    same from the averaged momentum, which every device holds, and it is stored, so the raised
    variance stays until refreshes decay it. A coordinate inside Adam's bound is unchanged."""
    b1 = hyper["b1"]
    m_scale = 1 / (1 - b1 ** count.astype(jnp.float32))
    v_corrected = 1 - hyper["b2"] ** _variance_steps(count, hyper).astype(jnp.float32)
    least = v_corrected / _ratio_bound(count, hyper)
    return jax.tree.map(
        lambda m, v: jnp.where(warm, v, jnp.maximum(v, least * jnp.square(m * m_scale))), mu, nu
    )


def _direction(mu, nu, count, hyper):
    """Adam's bias-corrected direction ``m_hat / (sqrt(v_hat) + eps)``; the variance's
    correction counts only the steps it stands for."""
    b1, b2 = hyper["b1"], hyper["b2"]
    variance_steps = _variance_steps(count, hyper).astype(jnp.float32)
    m_scale = 1 / (1 - b1 ** count.astype(jnp.float32))
    v_scale = 1 / (1 - b2**variance_steps)
    return jax.tree.map(lambda m, v: m * m_scale / (jnp.sqrt(v * v_scale) + hyper["eps"]), mu, nu)


def _decayed(direction, params, weight_decay):
    """AdamW's decoupled weight decay added to the direction (needs ``params``)."""
    if not weight_decay:
        return direction
    if params is None:
        raise ValueError("weight_decay needs the params: call update(grads, state, params)")
    return jax.tree.map(lambda d, p: d + weight_decay * p, direction, params)
