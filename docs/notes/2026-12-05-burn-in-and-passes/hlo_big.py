import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
if os.environ.get("OLD"):
    sys.meta_path = [
        f
        for f in sys.meta_path
        if "editable" not in repr(f).lower() and "scikit" not in repr(f).lower()
    ]
if os.environ.get("OLD"):
    sys.path.insert(0, os.environ["OLD"])
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcomp

print("jaxcomp from", jaxcomp.__file__, file=sys.stderr)
mesh = Mesh(np.array(jax.devices()), ("data",))
shapes = {"wte": (512, 768), "w1": (768, 3072), "w2": (3072, 768), "ln": (768,), "b": (3072,)}
params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
methods = {
    "dense": {},
    "ar_topk": {"ratio": 0.01},
    "allgather_topk": {"ratio": 0.01},
    "zfp": {"rate": 8},
    "quantized": {"bits": 4},
    "bf16": {},
    "powersgd": {"rank": 4},
    "sign": {},
    "randomk": {"ratio": 0.01},
}
out = {}
for name, opts in methods.items():
    tx = jaxcomp.compress(name, **opts)
    state = tx.init(params)

    def upd(g, s):
        u, s2 = tx.update(g, s)
        return u, s2

    gspec = jax.tree.map(lambda _: P("data"), params)
    f = jax.jit(
        jax.shard_map(
            lambda g, s: upd(jax.tree.map(lambda x: x[0], g), s),
            mesh=mesh,
            in_specs=(gspec, P()),
            out_specs=(P(), P()),
            check_vma=False,
        )
    )
    g = jax.tree.map(lambda p: jnp.zeros((8,) + p.shape, p.dtype), params)
    try:
        text = f.lower(g, state).compile().as_text()
    except Exception as e:
        out[name] = f"error {type(e).__name__}: {str(e)[:100]}"
        continue
    big = 0
    fusions = 0
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?\S+ = (\w+)\[([\d,]*)\]", line)
        if m and m.group(2):
            n = int(np.prod([int(x) for x in m.group(2).split(",") if x]))
            if n >= 10000:
                big += 1
        if " fusion(" in line or "kind=kLoop" in line:
            fusions += 1
    out[name] = {"big_ops": big, "lines": len(text.splitlines())}
print(json.dumps(out))
