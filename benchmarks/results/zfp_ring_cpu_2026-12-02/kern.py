"""ZFP rate 8 on one ring chunk of mlp4096 over 4 devices, and the all-gather's 4 chunks."""

import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomp
from jaxcomp.ops.zfp import zfp_decode, zfp_encode

jaxcomp.tune_host_allocator()
N = 6_296_323
x = jnp.asarray(np.random.default_rng(0).standard_normal(N).astype(np.float32))
encode = jax.jit(lambda v: zfp_encode(v, 8))
words = encode(x)
decode = jax.jit(lambda w: zfp_decode(w, N, 8))
copy = jax.jit(lambda v: v * 2)
cases = [
    ("encode", encode, x),
    ("decode", decode, words),
    ("decode4", decode, jnp.stack([words] * 4)),
    ("copy", copy, x),
]
for name, f, arg in cases:
    f(arg).block_until_ready()
    best, best_cpu = float("inf"), float("inf")
    for _ in range(10):
        start, start_cpu = time.perf_counter(), time.process_time()
        f(arg).block_until_ready()
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - start_cpu)
    print(f"{name}: {best * 1e3:.1f} ms wall, {best_cpu * 1e3:.1f} ms cpu")
