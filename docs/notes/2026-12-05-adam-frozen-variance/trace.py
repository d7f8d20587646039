"""The trace behind the note: jaxcomp.adam's update with Dense (the exact mean gradient), emulated
on one device, on the zoo's MLP char-LM at 2x dense Adam's rate.

    cd docs/notes/2026-12-05-adam-frozen-variance
    python trace.py frozen   # the variance before the fix
    python trace.py floored  # with the floor

Every 25 steps (every 5 from 250 to 900) it prints the loss, the gradient norm and, per leaf, the
largest |m_hat| / sqrt(v_hat) of the update, beside the same ratio under plain Adam's variance
(updated every step from the same gradients).
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))
from quality_tasks import mlp_charlm  # noqa: E402

B1, B2, EPS, WARMUP, REFRESH, STEPS = 0.9, 0.999, 1e-8, 100, 50, 1500


def adam_bound(t):
    """S(t): the largest m_hat^2 / v_hat plain Adam reaches at step t (jaxcomp's _ratio_bound)."""
    q = B1 * B1 / B2
    return (1 - B1) ** 2 * (1 - B2**t) * (1 - q**t) / (1 - q) / ((1 - B1**t) ** 2 * (1 - B2))


def main(mode):
    task = mlp_charlm()
    lr = 2 * task.learning_rate

    @jax.jit
    def step(p, m, v, adam_v, batch, t):
        loss, g = jax.value_and_grad(task.loss_fn)(p, batch)
        adam_v = jax.tree.map(lambda s, g: B2 * s + (1 - B2) * g * g, adam_v, g)
        m = jax.tree.map(lambda m, g: B1 * m + (1 - B1) * g, m, g)
        dense = (t < WARMUP) | ((t - WARMUP) % REFRESH == REFRESH - 1)
        decay = jnp.where(t < WARMUP, B2, B2**REFRESH)
        v = jax.tree.map(lambda v, g: jnp.where(dense, decay * v + (1 - decay) * g * g, v), v, g)
        n = (t + 1).astype(jnp.float32)
        stands = jnp.minimum(t + 1, WARMUP) + REFRESH * (jnp.maximum(t + 1 - WARMUP, 0) // REFRESH)
        m_scale, v_corr = 1 / (1 - B1**n), 1 - B2 ** stands.astype(jnp.float32)
        if mode == "floored":
            least = v_corr / adam_bound(n)
            v = jax.tree.map(
                lambda m, v: jnp.where(t < WARMUP, v, jnp.maximum(v, least * (m * m_scale) ** 2)),
                m,
                v,
            )
        ratio = jax.tree.map(lambda m, v: m * m_scale / (jnp.sqrt(v / v_corr) + EPS), m, v)
        adam = jax.tree.map(lambda m, s: m * m_scale / (jnp.sqrt(s / (1 - B2**n)) + EPS), m, adam_v)
        p = jax.tree.map(lambda p, r: p - lr * r, p, ratio)
        worst = {k: (jnp.max(jnp.abs(ratio[k])), jnp.max(jnp.abs(adam[k]))) for k in p}
        norm = jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g)))
        return p, m, v, adam_v, loss, norm, worst

    p = jax.tree.map(jnp.asarray, task.params)
    m = v = adam_v = jax.tree.map(jnp.zeros_like, p)
    for t in range(STEPS):
        p, m, v, adam_v, loss, norm, worst = step(p, m, v, adam_v, task.batch(t), jnp.int32(t))
        if t % 25 == 0 or (250 < t < 900 and t % 5 == 0):
            top = max(worst, key=lambda k: float(worst[k][0]))
            leaves = " ".join(f"{k}:{float(worst[k][0]):.2g}" for k in worst)
            print(
                f"{t} loss {float(loss):.3f} |g| {float(norm):.3g} largest {top} "
                f"{float(worst[top][0]):.3g} (Adam's: {float(worst[top][1]):.3g}) {leaves}",
                flush=True,
            )
        if not np.isfinite(float(loss)):
            break


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "frozen")
