import time, jax, jax.numpy as jnp, numpy as np
import jaxcomp
from jaxcomp.ops.zfp import zfp_encode, zfp_decode
jaxcomp.tune_host_allocator()
n = 6296323
x = jnp.asarray(np.random.default_rng(0).standard_normal(n).astype(np.float32))
enc = jax.jit(lambda v: zfp_encode(v, 8))
w = enc(x)
dec = jax.jit(lambda w: zfp_decode(w, n, 8))
w4 = jnp.stack([w]*4)
dec4 = jax.jit(lambda w: zfp_decode(w, n, 8))
copy = jax.jit(lambda v: v * 2)
for name, f, a in [("encode", enc, x), ("decode", dec, w), ("decode4", dec4, w4), ("copy", copy, x)]:
    f(a).block_until_ready()
    best = 1e9; bc = 1e9
    for _ in range(10):
        t0 = time.perf_counter(); c0 = time.process_time(); f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0); bc = min(bc, time.process_time() - c0)
    print(f"{name}: {best*1e3:.1f} ms wall, {bc*1e3:.1f} ms cpu")
