"""compress(warmup_method=) and jaxcomp.adam(warmup_method=): the warm-up (and jaxcomp.adam's
variance refreshes) sent by a method that sends every value instead of densely."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import need_devices
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.methods import Cast, Dense, Sign, TopK, Zfp

LR = 0.05


def _updates(tx, grads):
    """``tx``'s updates for ``grads[t]: [devices, n]``, step by step (replicated)."""
    n_dev, n = grads.shape[1], grads.shape[2]
    mesh = Mesh(np.array(jax.devices()[:n_dev]), ("data",))

    def steps(g):
        def step(state, g_t):
            u, state = tx.update(g_t[0], state, jnp.zeros(n))
            return state, u

        # A scan compiles the later steps once, where a Python loop compiled each of them (the
        # first step runs before it: it makes the state's leaves vary over the devices).
        state, first = step(tx.init(jnp.zeros(n)), g[0])
        return jnp.concatenate([first[None], jax.lax.scan(step, state, g[1:])[1]])

    f = jax.shard_map(steps, mesh=mesh, in_specs=P(None, "data"), out_specs=P())
    return np.asarray(jax.jit(f)(grads))


def _grads(steps, devices, n, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=(steps, devices, n)).astype(np.float32))


@pytest.mark.parametrize("warm", [Zfp(8), Cast("float16")], ids=["zfp8", "fp16"])
def test_adams_warmup_is_optax_adam_after_the_warmup_method(warm):
    """jaxcomp.adam's warm-up with ``warmup_method=X`` is ``optax.adam`` on what ``compress(X)``
    (with error feedback) delivers, step for step; after it the momentum goes as signs."""
    need_devices(8)
    grads = _grads(6, 8, 256)
    ours = _updates(jaxcomp.adam(LR, Sign(), warmup_steps=4, warmup_method=warm), grads)
    # jaxcomp.adam keeps its method's residual (Sign's) through the warm-up too.
    theirs = _updates(
        optax.chain(jaxcomp.compress(warm, error_feedback=True), optax.adam(LR)), grads
    )
    np.testing.assert_allclose(ours[:4], theirs[:4], rtol=1e-5, atol=1e-7)
    dense = _updates(jaxcomp.adam(LR, Sign(), warmup_steps=4), grads)
    assert not np.allclose(ours[:4], dense[:4], rtol=0, atol=1e-7)  # not the dense warm-up


@pytest.mark.parametrize("host_branches", [False, True])
def test_warmup_and_refresh_steps_send_the_warmup_methods_bytes(host_branches):
    """The warm-up and the variance refreshes report ZFP's bytes, the other steps top-k's; with
    the branch picked on the host the warm-up lasts one step longer (jaxcomp.training.branches)."""
    need_devices(8)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    loss = lambda w, batch: jnp.sum((batch @ w) ** 2)  # noqa: E731
    tx = jaxcomp.adam(
        0.01, "ar_topk", ratio=0.1, warmup_steps=2, refresh_every=2, warmup_method=Zfp(8)
    )
    dp = jaxcomp.data_parallel(loss, tx, mesh, host_branches=host_branches)
    state, sent = dp.init(jnp.ones(4096)), []
    for _ in range(6):
        state, metrics = dp.step(state, jnp.ones((8, 4096)))
        sent.append(float(metrics["bytes_sent"]))
    zfp = Zfp(8).wire_bytes(4096, 8)
    dense = Dense().wire_bytes(4096, 8)
    compressed = sent[4]
    assert sent[0] == pytest.approx(zfp) and zfp < dense / 3 and compressed < zfp
    late = zfp if host_branches else compressed
    assert sent == [sent[0], sent[0], late, sent[0], compressed, sent[0]]


@pytest.mark.parametrize("host_branches", [False, True])
def test_compress_warms_up_with_the_method_then_runs_top_k(host_branches):
    """compress(TopK, warmup_steps=3, warmup_method=bf16): the `method` metric reads the bf16
    cast, then top-k; training converges as with the dense warm-up."""
    need_devices(8)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 32)).astype(np.float32)
    y = x @ rng.normal(size=32).astype(np.float32)
    loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)  # noqa: E731

    def train(**options):
        tx = optax.chain(jaxcomp.compress(TopK(0.25), warmup_steps=3, **options), optax.sgd(0.05))
        dp = jaxcomp.data_parallel(loss, tx, mesh, host_branches=host_branches)
        state, ran = dp.init(jnp.zeros(32)), []
        for _ in range(60):
            state, metrics = dp.step(state, {"x": x, "y": y})
            ran.append(int(metrics["method"]))
        return float(metrics["loss"]), ran, jaxcomp.find_compress_state(state.opt_state)

    cast_loss, ran, cs = train(warmup_method=Cast("bfloat16"))
    dense_loss, _, dense_cs = train()
    assert [m.describe() for m in cs.methods][:2] == ["bf16", "allgather_topk(0.25)"]
    assert [m.describe() for m in dense_cs.methods][:2] == ["dense", "allgather_topk(0.25)"]
    first_topk = 4 if host_branches else 3
    assert ran[:first_topk] == [0] * first_topk and set(ran[first_topk:]) == {1}
    # The loss starts near 32 (mean(y ** 2)); both runs end near 0.03 after 60 steps.
    assert cast_loss < 0.1 and cast_loss == pytest.approx(dense_loss, rel=0.1)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda: jaxcomp.compress(TopK(0.1), warmup_steps=5, warmup_method=TopK(0.5)),
            "warmup_method must send every value",
        ),
        (
            lambda: jaxcomp.compress(
                TopK(0.1), warmup_steps=5, warmup_method=Zfp(8, algorithm="recursive_doubling")
            ),
            "warmup_method must send every value",
        ),
        (
            lambda: jaxcomp.compress(TopK(0.1), warmup_method=Zfp(8)),
            "warmup_method=zfp\\(8\\) needs warmup_steps > 0",
        ),
        (
            lambda: jaxcomp.compress("auto", warmup_method=Zfp(8)),
            "warmup_method= applies to a single method",
        ),
        (
            lambda: jaxcomp.adam(1e-3, Sign(), warmup_method=jaxcomp.PowerSGD(2)),
            "warmup_method must send every value",
        ),
    ],
)
def test_bad_warmup_methods_are_refused_naming_the_argument(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_a_method_that_sends_everything_has_no_warmup_to_send():
    """Dense has no warm-up, so its warm-up method is moot (not an error): one branch."""
    state = jaxcomp.compress(Dense(), warmup_steps=5, warmup_method=Zfp(8)).init(jnp.zeros(4))
    assert [m.describe() for m in state.methods] == ["dense"]
