"""jaxcomp.ops.flat: the flat gradient vector, and the compiled steps that must never write it in a
fused concatenate (the XLA:CPU loop that took 1.17 s for 25M values)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.ops import flat

# The shapes of the 1024-4096-4096-1024-10 MLP's 8 leaves, scaled down 16x per side: the fusion
# decision depends on the operand count, not on the sizes.
MLP8_SHAPES = [(64, 256), (256,), (256, 256), (256,), (256, 64), (64,), (64, 10), (10,)]

# Every method of the issue, at model granularity (the one that builds the flat vector).
METHODS = [
    ("dense", {}),
    ("allgather_topk", {"ratio": 0.01}),
    ("ar_topk", {"ratio": 0.01}),
    ("randomk", {"ratio": 0.01}),
    ("sign", {}),
    ("bf16", {}),
    ("fp16", {}),
    ("powersgd", {"rank": 2}),
    ("zfp", {"rate": 8}),
    ("quantized", {"bits": 4}),
]


@pytest.mark.parametrize(
    "sizes", [[5], [1, 1], [8, 2], [3, 100, 7], [10] * 12, [1] * 3, [2**20, 4]]
)
def test_split_parts_covers_each_part_once_in_order(sizes):
    pieces = flat.split_parts(sizes)
    assert [p for p, _, _ in pieces] == sorted(p for p, _, _ in pieces)
    for part, size in enumerate(sizes):
        spans = [(a, b) for p, a, b in pieces if p == part]
        assert spans[0][0] == 0 and spans[-1][1] == size
        assert all(b0 == a1 for (_, b0), (a1, _) in zip(spans, spans[1:]))
        assert all(b > a for a, b in spans)
    if len(sizes) > 1:  # enough pieces to keep XLA:CPU from fusing, unless every value is its own
        assert len(pieces) > flat.XLA_CPU_FUSED_CONCAT_OPERANDS or len(pieces) == sum(sizes)
    else:
        assert pieces == [(0, 0, sizes[0])]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32])
@pytest.mark.parametrize("shapes", [[(3,)], [(2, 3), (4,)], MLP8_SHAPES, [(1,), (1,)]])
def test_concat_matches_jnp_concatenate(dtype, shapes):
    rng = np.random.default_rng(0)
    parts = [jnp.asarray(rng.standard_normal(s) * 100, dtype) for s in shapes]
    expected = jnp.concatenate([p.ravel() for p in parts])
    np.testing.assert_array_equal(np.asarray(jax.jit(flat.concat)(parts)), np.asarray(expected))


def _fused_concatenates(hlo: str, at_least: int) -> list[str]:
    """``name: shape`` of each concatenate of at least ``at_least`` values inside a fused
    computation of ``hlo`` (a standalone concatenate is a memcpy and is fine)."""
    found = []
    for body in re.split(r"\n(?=%\S+ \(|ENTRY )", hlo):
        if body.startswith("%fused"):
            for shape in re.findall(r"\[([\d,]+)\]\{[\d,]*\} concatenate\(", body):
                if np.prod([int(d) for d in shape.split(",")]) >= at_least:
                    found.append(f"{body.split(' ', 1)[0]}: [{shape}]")
    return found


def _compiled_update(method, options, shapes):
    tx = optax.chain(jaxcomp.compress(method, **options), optax.sgd(0.1))
    grads = {f"leaf{i}": jnp.ones(s, jnp.float32) for i, s in enumerate(shapes)}
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))

    def update(g, state):
        return tx.update(jax.lax.pcast(g, "data", to="varying"), state)

    step = jax.jit(
        jax.shard_map(update, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()), check_vma=False)
    )
    return step.lower(grads, tx.init(grads)).compile().as_text()


# Leaf-sized and larger: a concatenate that size in a loop fusion is the slow path; PowerSGD's
# concatenated P and Q factors (a few thousand values here) are far below it.
LARGE = 16384


@pytest.mark.parametrize("method,options", METHODS, ids=[m for m, _ in METHODS])
@pytest.mark.parametrize("path", ["native", "xla"])
def test_no_method_writes_a_large_vector_in_a_fused_concatenate(method, options, path, monkeypatch):
    if path == "xla":  # what GPUs and TPUs run
        monkeypatch.setattr(flat, "pack_error_fed", flat.pack_error_fed_xla)
    found = _fused_concatenates(_compiled_update(method, options, MLP8_SHAPES), LARGE)
    assert not found, f"{method}: fused concatenates {found}"


@pytest.mark.parametrize("concat", ["jnp.concatenate", "split without barrier"])
def test_the_check_sees_the_pathology(monkeypatch, concat):
    """The HLO check above is not vacuous (on the XLA path, which GPUs and TPUs run and which the
    CPU ran before the native pack kernel). jnp.concatenate of the 8 leaves (the code before
    jaxcomp.ops.flat) gives the fused concatenate of the whole vector; splitting without the barrier
    lets XLA fold the slices PowerSGD takes of its concatenated totals back into a fused 2-operand
    concatenate per leaf."""
    if concat == "jnp.concatenate":
        patched, method, options = (
            (lambda parts: jnp.concatenate([p.ravel() for p in parts])),
            "ar_topk",
            {"ratio": 0.01},
        )
    else:

        def patched(parts):
            pieces = flat.split_parts([p.size for p in parts])
            return jnp.concatenate([parts[i].ravel()[a:b] for i, a, b in pieces])

        method, options = "powersgd", {"rank": 2}
    monkeypatch.setattr(flat, "concat", patched)
    monkeypatch.setattr(
        flat, "pack_error_fed", flat.pack_error_fed_xla
    )  # the XLA path, which concat serves
    # Without the guardrail's dense branch, whose switch changes what XLA fuses here.
    options = {**options, "guardrail": False}
    assert _fused_concatenates(_compiled_update(method, options, MLP8_SHAPES), LARGE)


PACK_SHAPES = [
    [(5,)],
    [(3,), (70_000,), (5, 7), (1,), (200_000,)],
    MLP8_SHAPES,
    [(1,)] * 20,
    [(0,), (4,)],
]


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shapes", PACK_SHAPES, ids=lambda s: f"{len(s)}leaves")
def test_pack_error_fed_native_matches_xla_bit_for_bit(shapes, with_residual):
    rng = np.random.default_rng(len(shapes))
    grads = [jnp.asarray(rng.standard_normal(s) * 10, jnp.float32) for s in shapes]
    # Non-finite values at the first and last value of a leaf and across the kernel's task edge.
    bad = {0: [0], 1: [0, 65_535, 65_536, 69_999], 4: [131_072, 199_999]}
    for leaf, spots in bad.items():
        if leaf < len(grads) and grads[leaf].size:
            for j, spot in enumerate(s for s in spots if s < grads[leaf].size):
                value = (jnp.nan, jnp.inf, -jnp.inf)[j % 3]
                grads[leaf] = grads[leaf].ravel().at[spot].set(value).reshape(grads[leaf].shape)
    residuals = (
        [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]
        if with_residual
        else None
    )
    packed = jax.jit(flat.pack_error_fed, static_argnums=2)(grads, residuals, 2.0**-80)
    expected = flat.pack_error_fed_xla(grads, residuals, 2.0**-80)
    np.testing.assert_array_equal(np.asarray(packed.vector), np.asarray(expected.vector))
    assert (
        float(packed.nonfinite)
        == float(expected.nonfinite)
        == sum(int((~np.isfinite(np.asarray(g))).sum()) for g in grads)
    )
    assert np.isfinite(np.asarray(packed.vector)).all()
    # The sums: the kernel's (float lanes per 64K values, then double) within 1e-5 of float64's;
    # XLA's float32 reduce is further off (7e-5 seen), so the two agree to 1e-4.
    clean = [np.where(np.isfinite(g), g, 0.0).astype(np.float64) for g in map(np.asarray, grads)]
    exact_gradient = sum(np.sum(c * c) for c in clean)
    vector = np.asarray(packed.vector, np.float64)
    np.testing.assert_allclose(float(packed.gradient), exact_gradient, rtol=1e-5)
    np.testing.assert_allclose(float(packed.fed[0]), np.sum(vector * vector), rtol=1e-5)
    np.testing.assert_allclose(float(expected.gradient), exact_gradient, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(packed.fed), np.asarray(expected.fed), rtol=1e-4)


@pytest.mark.parametrize("n", [1, 5, 65_536 + 3, 300_001])
def test_energies_native_matches_float64_and_xla(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 3, n)).astype(np.float32)
    if n >= 4:  # NaN, ±Inf and a value whose square overflows, across the tasks
        x[[0, n // 3, n // 2, n - 1]] = [np.nan, np.inf, -np.inf, 1e38]
    got = np.asarray(jax.jit(flat.energies, static_argnums=1)(jnp.asarray(x), 2.0**-80))
    finite = x[np.isfinite(x)].astype(np.float64)
    assert np.isfinite(got[0]) == np.isfinite(x).all()  # NaN or Inf with any special
    scaled = finite * 2.0**-80
    # Each (x * 2**-80)**2 is taken in float32, where it underflows for |x| < ~1e5: the XLA
    # reference does the same, so compare the scaled sum with it.
    want = np.asarray(flat.energies_xla(jnp.asarray(x), 2.0**-80))
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4)
    assert got[1] <= np.sum(scaled * scaled) * (1 + 1e-5)
    assert got[2] == n - finite.size == want[2]
    clean = np.where(np.isfinite(x) & (np.abs(x) < 1e30), x, 0.0).astype(np.float32)
    plain = np.asarray(jax.jit(flat.energies)(jnp.asarray(clean)))
    np.testing.assert_allclose(plain[0], np.sum(np.square(clean, dtype=np.float64)), rtol=1e-5)


def test_energies_runs_the_native_kernel_on_cpu_float32_only():
    x = jnp.ones(10)
    assert "jaxcomp_energies" in jax.jit(flat.energies).lower(x).as_text()
    half = x.astype(jnp.bfloat16)
    assert "jaxcomp_energies" not in jax.jit(flat.energies).lower(half).as_text()
    assert flat.energies(half).tolist() == [10.0, 10.0, 0.0]
    with pytest.raises(ValueError, match="energy_scale must be finite and > 0"):
        flat.energies(x, -1.0)


def test_pack_error_fed_energies_of_an_overflowing_sum():
    """g + r that overflows: the vector's energy is infinite, its scaled energy skips the value,
    and the value is counted; the gradient's energy is the finite g's."""
    big = np.float32(3e38)
    grads, residuals = [jnp.array([big, 1.0, jnp.nan])], [jnp.array([big, 2.0, 0.0])]
    for pack in (jax.jit(flat.pack_error_fed, static_argnums=2), flat.pack_error_fed_xla):
        packed = pack(grads, residuals, 0.5)
        assert np.isinf(np.asarray(packed.vector)[0])
        assert float(packed.nonfinite) == 1.0
        assert np.isinf(float(packed.gradient))  # big**2 overflows float32 too
        fed = np.asarray(packed.fed)
        assert np.isinf(fed[0]) and fed[1] == pytest.approx(9.0 * 0.25) and fed[2] == 1.0


def test_pack_error_fed_runs_the_native_kernel_on_cpu_and_xla_for_16_bit():
    grads = [jnp.ones((4, 4)), jnp.ones(3)]
    assert "jaxcomp_pack" in jax.jit(flat.pack_error_fed).lower(grads).as_text()
    half = [g.astype(jnp.bfloat16) for g in grads]
    assert "jaxcomp_pack" not in jax.jit(flat.pack_error_fed).lower(half).as_text()
    vector = flat.pack_error_fed(half).vector
    np.testing.assert_array_equal(np.asarray(vector), np.ones(19, np.float32))


def test_pack_error_fed_refuses_bad_input():
    with pytest.raises(ValueError, match="grads must hold"):
        flat.pack_error_fed([])
    with pytest.raises(ValueError, match="residuals must be shaped like grads"):
        flat.pack_error_fed([jnp.ones(3)], [jnp.ones(4)])
    with pytest.raises(ValueError, match="energy_scale must be finite and > 0"):
        flat.pack_error_fed([jnp.ones(3)], energy_scale=0.0)


@pytest.mark.parametrize("method,options", METHODS[:4], ids=[m for m, _ in METHODS[:4]])
def test_compress_packs_with_the_native_kernel(method, options):
    hlo = _compiled_update(method, options, MLP8_SHAPES)
    assert "jaxcomp_pack" in hlo or method == "dense"  # dense sums leaf by leaf, it packs nothing
