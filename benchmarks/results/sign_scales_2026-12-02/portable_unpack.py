"""The portable (XLA) sign decode of 25,185,290 values, chunk 1024, before and after its scales'
spread became a broadcast and a reshape (jaxcomp.ops.xla.sign.spread), alternating calls in one
job, best of 7, beside the native decode and a plain copy; the decode is read by three consumers
(fed - decoded, 0.1 * decoded, sum of squares), as in a step.

    python benchmarks/results/sign_scales_2026-12-02/portable_unpack.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomp
from jaxcomp.costmodel.probe import best_seconds
from jaxcomp.ops.sign import sign_pack, sign_unpack

N, CHUNK = 25_185_290, 1024


def before(words, scales):
    """The decode as it was: jnp.repeat with total_repeat_length."""
    bits = ((words[:, None] >> jnp.arange(32, dtype=jnp.uint32)) & np.uint32(1)).reshape(-1)[:N]
    plus = jnp.repeat(scales, CHUNK, total_repeat_length=scales.shape[0] * CHUNK)[:N]
    return jnp.where(bits == 1, plus, -plus)


def consumed(decode):
    def step(fed, words, scales):
        decoded = decode(words, scales)
        return fed - decoded, decoded * 0.1, jnp.sum(decoded * decoded)

    return jax.jit(step)


def best_ms(fn, *args, calls=7):
    """The fastest of ``calls`` timed calls after a warm-up (jaxcomp's own timing helper)."""
    return 1e3 * best_seconds(lambda: fn(*args), calls)


def main():
    jaxcomp.tune_host_allocator()
    x = jnp.asarray(np.random.default_rng(0).standard_normal(N, np.float32))
    words, scales = jax.jit(lambda v: sign_pack(v, CHUNK))(x)
    runs = {
        "copy (x * 2)": (jax.jit(lambda v: v * 2), (x,)),
        "xla, before (jnp.repeat)": (consumed(before), (x, words, scales)),
        "xla, after (spread)": (
            consumed(lambda w, s: sign_unpack(w, s, N, CHUNK, implementation="xla")),
            (x, words, scales),
        ),
        "native": (
            consumed(lambda w, s: sign_unpack(w, s, N, CHUNK, implementation="native")),
            (x, words, scales),
        ),
    }
    outs = [np.asarray(runs[k][0](*runs[k][1])[0]) for k in list(runs)[1:]]
    assert all((o.view(np.uint32) == outs[0].view(np.uint32)).all() for o in outs)  # bit for bit
    for round_ in (1, 2):
        for label, (fn, args) in runs.items():
            print(f"round {round_}: {label:26} {best_ms(fn, *args):7.1f} ms", flush=True)


if __name__ == "__main__":
    main()
