"""Every op called directly inside ``shard_map(check_vma=True)`` types its results as varying over
the axes its input varies over: per-device results must never pass for replicated ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import need_devices
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.ops import _ffi

N = 64
OPS = {
    "topk": lambda x: jaxcomp.topk(x, 5),
    "find_threshold": lambda x: jaxcomp.find_threshold(x, 5),
    "threshold_topk": lambda x: jaxcomp.threshold_topk(x, 5),
    "zfp_encode": lambda x: jaxcomp.zfp_encode(x, 8),
    "zfp_decode": lambda x: jaxcomp.zfp_decode(
        jax.lax.stop_gradient(jaxcomp.zfp_encode(x, 8)), N, 8
    ),
    "hadamard_transform": jaxcomp.hadamard_transform,
}


@pytest.mark.parametrize("implementation", [None, "xla"])
@pytest.mark.parametrize("name", OPS)
def test_results_vary_over_the_input_axes(name, implementation):
    need_devices(8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    seen = {}

    def per_device(x):
        out = OPS[name](x[0])
        seen["vma"] = [_ffi.varying_axes(leaf) for leaf in jax.tree.leaves(out)]
        return jax.tree.map(lambda leaf: leaf[None], out)

    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, N)), jnp.float32)
    with _ffi.default_implementation(implementation):
        mapped = jax.jit(
            jax.shard_map(
                per_device, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=True
            )
        )
        per_device_results = mapped(x)
    assert seen["vma"] and all("data" in vma for vma in seen["vma"]), seen["vma"]
    # And the per-device results are each device's own: row d equals the op on x[d] alone.
    for d in (0, 5):
        for got, want in zip(jax.tree.leaves(per_device_results), jax.tree.leaves(OPS[name](x[d]))):
            np.testing.assert_array_equal(np.asarray(got[d]), np.asarray(want))


def test_replicated_input_gives_replicated_results():
    # No varying axis in, none out: the cast adds nothing that was not there.
    need_devices(8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    seen = {}

    def replicated(x):
        values, indices = jaxcomp.topk(x, 3)
        seen["vma"] = (_ffi.varying_axes(values), _ffi.varying_axes(indices))
        return values

    jax.jit(jax.shard_map(replicated, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=True))(
        jnp.arange(10.0)
    )
    assert seen["vma"] == (frozenset(), frozenset())
