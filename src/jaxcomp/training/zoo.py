"""The model zoo every speed benchmark runs on: real flax modules, their losses and their batches.

    model = zoo.build("resnet50")
    loss, grads = jax.value_and_grad(model.loss_fn)(model.params, model.make_batch(rng, 4))

A speed claim measured on one model says little about another: XLA:CPU's fusion decisions depend
on the layer shapes and on the number of leaves. A 1-D concatenate of at most 8 operands, for
example (the flat gradient of a model of at most 8 leaves), is fused into its producers and
emitted as a per-element branch tree, tens of times slower than a copy, while a model of a
thousand small leaves spends its time in per-leaf overheads. So every speed benchmark
(``benchmarks/`` and ``jaxcomp netbench --model``) runs the same zoo:

==============  ===========  ======  ===============================================================
name            params       leaves  what it is
==============  ===========  ======  ===============================================================
``mlp4096``      25,185,290       8  Dense 1024-4096-4096-1024-10, tanh between, cross-entropy
``mlp2041``      25,006,332      12  six square 2041-wide Dense layers (netbench's ``--params 25e6``
                                     MLP)
``gpt2``        124,439,808     148  GPT-2 small: 50257x768 tied embedding, 12 blocks, next-token
                                     loss
``resnet50``     25,557,032     161  ResNet-50 v1.5: HWIO conv kernels, BatchNorm, 1000 classes
``many_small``    1,102,666   1,030  256 residual blocks of LayerNorm + Dense 64x64
==============  ===========  ======  ===============================================================

The parameters are real; the batches are random and small so that a CPU step stays short:
GPT-2 reads ``seq_len`` tokens (default 64, not 1024) and ResNet-50 ``image_size`` square RGB
images (default 64x64, not 224x224). Parameter shapes do not depend on either.

flax is imported by :func:`build`, not by this module (``import jaxcomp.training.zoo`` loads no
JAX).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

#: The zoo's model names, from the two MLPs to the models of many (or many kinds of) leaves.
NAMES = ("mlp4096", "mlp2041", "gpt2", "resnet50", "many_small")

_VOCAB, _POSITIONS, _WIDTH, _BLOCKS, _HEADS = 50257, 1024, 768, 12, 12  # GPT-2 small
_SMALL_BLOCKS, _SMALL_WIDTH = 256, 64  # many_small


@dataclasses.dataclass(frozen=True)
class Model:
    """One zoo model, ready to train: its parameters, its loss and a source of batches.

    Attributes:
      name: the zoo name (one of :data:`NAMES`).
      description: one line saying what the model is and what a batch holds.
      params: the trained parameters (flax's ``"params"`` collection, key 0);
        ``jax.ShapeDtypeStruct`` leaves when built with ``abstract=True``.
      loss_fn: ``loss_fn(params, batch) -> scalar``: the module's forward pass and its loss.
      make_batch: ``make_batch(rng, batch_size) -> dict`` of numpy arrays, one host's batch
        (``rng`` a ``numpy.random.Generator``).
      n_params: parameters (all float32).
      n_leaves: leaves of ``params``.
      state: the collections that are not trained (ResNet-50's ``batch_stats``), empty otherwise;
        ``loss_fn`` closes over them.
    """

    name: str
    description: str
    params: Any
    loss_fn: Callable[[Any, dict], Any]
    make_batch: Callable[[Any, int], dict]
    n_params: int
    n_leaves: int
    state: dict = dataclasses.field(default_factory=dict)


def build(model: str, *, seq_len: int = 64, image_size: int = 64, abstract: bool = False) -> Model:
    """Builds a zoo model: flax's ``init`` with ``jax.random.key(0)``, its loss and its batches.

    Args:
      model: one of :data:`NAMES`.
      seq_len: tokens per sequence of ``gpt2``'s batches (1 to 1024; GPT-2 trains on 1024, 64
        keeps a CPU step short). Other models ignore it.
      image_size: height and width of ``resnet50``'s images (at least 32, the network's total
        stride; ImageNet's is 224, 64 keeps a CPU step short). Other models ignore it.
      abstract: give ``params`` as ``jax.ShapeDtypeStruct`` leaves (``jax.eval_shape`` of the
        init: no memory, no compute), for counts and for ``jax.eval_shape(loss_fn, ...)``.

    Returns:
      A :class:`Model`.

    Raises:
      ValueError: ``model`` is not a zoo name, or ``seq_len`` / ``image_size`` is out of range.

    Example:
      >>> m = build("gpt2", abstract=True)
      >>> m.n_params, m.n_leaves, m.params["wte"]["embedding"].shape
      (124439808, 148, (50257, 768))

    References:
      Radford et al., "Language Models are Unsupervised Multitask Learners", 2019 (GPT-2);
      He et al., "Deep Residual Learning for Image Recognition", CVPR 2016 (ResNet-50).
    """
    if model not in NAMES:
        raise ValueError(f"model must be one of {', '.join(NAMES)}; got {model!r}")
    if not 1 <= seq_len <= _POSITIONS:
        raise ValueError(
            f"seq_len must be between 1 and {_POSITIONS} (GPT-2's positions), got {seq_len}"
        )
    if image_size < 32:
        raise ValueError(
            f"image_size must be at least 32 (ResNet-50's total stride), got {image_size}"
        )
    try:
        import flax  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "jaxcomp.training.zoo builds flax models: pip install flax (or jaxcomp[demo])"
        ) from e
    import jax
    import numpy as np

    recipe = _RECIPES[model](seq_len=seq_len, image_size=image_size)
    example = recipe.make_batch(np.random.default_rng(0), 1)
    # Not jitted: compiling the initializers of many_small's thousand leaves takes several times
    # longer than running them one by one.
    init = lambda: recipe.init(jax.random.key(0), example)  # noqa: E731
    variables = jax.eval_shape(init) if abstract else init()
    params = variables["params"]
    state = {k: v for k, v in variables.items() if k != "params"}
    if (
        abstract
    ):  # loss_fn closes over the state: give it arrays (zeros: train mode never reads them)
        state = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), state)

    def loss_fn(p, batch):
        return recipe.loss({"params": p, **state}, batch)

    leaves = jax.tree.leaves(params)
    return Model(
        name=model,
        description=recipe.description,
        params=params,
        loss_fn=loss_fn,
        make_batch=_checked(recipe.make_batch),
        n_params=sum(int(np.prod(x.shape)) for x in leaves),
        n_leaves=len(leaves),
        state=state,
    )


@dataclasses.dataclass(frozen=True)
class _Recipe:
    description: str
    init: Callable  # (key, example batch) -> flax variables
    loss: Callable  # (variables, batch) -> scalar
    make_batch: Callable  # (rng, batch_size) -> dict of numpy arrays


def _checked(make_batch):
    def checked(rng, batch_size):
        if int(batch_size) != batch_size or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        return make_batch(rng, int(batch_size))

    return checked


def _cross_entropy(logits, labels):
    """Mean softmax cross-entropy of integer ``labels`` (float32 whatever the logits' dtype)."""
    import jax
    import jax.numpy as jnp

    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[..., None], axis=-1))


def _classes(rng, batch_size, features, classes):
    import numpy as np

    return {
        "x": rng.normal(size=(batch_size, features)).astype(np.float32),
        "label": rng.integers(0, classes, size=batch_size, dtype=np.int32),
    }


# ----------------------------------------------------------------------------------------------
# The recipes: each builds its flax module (flax imported here, on first use).


def _mlp(widths):
    """A flax MLP of Dense layers of ``widths`` with tanh between them (none after the last)."""
    import flax.linen as nn
    import jax.numpy as jnp

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i, width in enumerate(widths):
                x = nn.Dense(width, name=f"dense_{i}")(x)
                if i < len(widths) - 1:
                    x = jnp.tanh(x)
            return x

    return MLP()


def _mlp4096(**_):
    module = _mlp((4096, 4096, 1024, 10))
    return _Recipe(
        description="MLP 1024-4096-4096-1024-10, tanh between, softmax cross-entropy; batch: 1024 "
        "features, a label",
        init=lambda key, b: module.init(key, b["x"]),
        loss=lambda v, b: _cross_entropy(module.apply(v, b["x"]), b["label"]),
        make_batch=lambda rng, n: _classes(rng, n, 1024, 10),
    )


def _mlp2041(**_):
    import jax.numpy as jnp
    import numpy as np

    width = 2041
    module = _mlp((width,) * 6)

    def make_batch(rng, n):
        return {
            "x": rng.normal(size=(n, width)).astype(np.float32),
            "y": rng.normal(size=(n, width)).astype(np.float32),
        }

    return _Recipe(
        description="MLP of six square 2041-wide Dense layers, tanh between, mean squared error "
        "(netbench's --params 25e6 model); batch: 2041 features and targets",
        init=lambda key, b: module.init(key, b["x"]),
        loss=lambda v, b: jnp.mean((module.apply(v, b["x"]) - b["y"]) ** 2),
        make_batch=make_batch,
    )


def _gpt2_module():
    """GPT-2 small in flax.linen: pre-LayerNorm blocks, fused qkv projection, tied output head."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    def dense(features, name):
        return nn.Dense(features, kernel_init=nn.initializers.normal(0.02), name=name)

    def norm(name):
        return nn.LayerNorm(epsilon=1e-5, name=name)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            batch, length, width = x.shape
            q, k, v = jnp.split(dense(3 * width, "attn_qkv")(norm("ln_1")(x)), 3, axis=-1)
            heads = [t.reshape(batch, length, _HEADS, width // _HEADS) for t in (q, k, v)]
            attended = jax.nn.dot_product_attention(*heads, is_causal=True).reshape(
                batch, length, width
            )
            x = x + dense(width, "attn_proj")(attended)
            return x + dense(width, "mlp_proj")(
                nn.gelu(dense(4 * width, "mlp_fc")(norm("ln_2")(x)))
            )

    class GPT2(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            wte = nn.Embed(_VOCAB, _WIDTH, embedding_init=nn.initializers.normal(0.02), name="wte")
            wpe = nn.Embed(
                _POSITIONS, _WIDTH, embedding_init=nn.initializers.normal(0.01), name="wpe"
            )
            x = wte(tokens) + wpe(jnp.arange(tokens.shape[-1]))
            for i in range(_BLOCKS):
                x = Block(name=f"h_{i}")(x)
            return wte.attend(norm("ln_f")(x))  # the head is the embedding

    return GPT2()


def _gpt2(*, seq_len, **_):
    import numpy as np

    module = _gpt2_module()

    def loss(variables, batch):
        logits = module.apply(variables, batch["tokens"])
        return _cross_entropy(logits[:, :-1], batch["tokens"][:, 1:])  # the next token

    return _Recipe(
        description="GPT-2 small: 50257x768 token and 1024x768 position embeddings, 12 blocks, "
        f"tied head; batch: {seq_len}-token sequences, next-token loss",
        init=lambda key, b: module.init(key, b["tokens"]),
        loss=loss,
        make_batch=lambda rng, n: {
            "tokens": rng.integers(0, _VOCAB, size=(n, seq_len), dtype=np.int32)
        },
    )


def _resnet50_module():
    """ResNet-50 v1.5 (torchvision's layout: stride on the 3x3 conv, convs without bias) in
    flax.linen."""
    import functools

    import flax.linen as nn
    import jax.numpy as jnp

    conv = functools.partial(nn.Conv, use_bias=False)

    class Bottleneck(nn.Module):
        features: int
        strides: int

        @nn.compact
        def __call__(self, x, train):
            norm = functools.partial(
                nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5
            )
            y = nn.relu(norm()(conv(self.features, (1, 1))(x)))
            y = nn.relu(norm()(conv(self.features, (3, 3), self.strides)(y)))
            y = norm()(conv(4 * self.features, (1, 1))(y))
            if x.shape != y.shape:  # the first block of a stage: project the shortcut
                x = norm()(conv(4 * self.features, (1, 1), self.strides)(x))
            return nn.relu(x + y)

    class ResNet50(nn.Module):
        @nn.compact
        def __call__(self, images, train):
            x = conv(64, (7, 7), 2, padding=((3, 3), (3, 3)))(images)
            x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)(x))
            x = nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
            for stage, (blocks, features) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
                for block in range(blocks):
                    x = Bottleneck(features, 2 if stage > 0 and block == 0 else 1)(x, train)
            return nn.Dense(1000)(jnp.mean(x, axis=(1, 2)))

    return ResNet50()


def _resnet50(*, image_size, **_):
    import numpy as np

    module = _resnet50_module()

    def loss(variables, batch):
        # Train mode: BatchNorm normalizes by the batch's statistics; the running averages it
        # would update are not trained and a speed benchmark drops them.
        logits, _ = module.apply(variables, batch["image"], train=True, mutable=["batch_stats"])
        return _cross_entropy(logits, batch["label"])

    def make_batch(rng, n):
        return {
            "image": rng.normal(size=(n, image_size, image_size, 3)).astype(np.float32),
            "label": rng.integers(0, 1000, size=n, dtype=np.int32),
        }

    return _Recipe(
        description=f"ResNet-50 v1.5: HWIO conv kernels, BatchNorm (train mode), 1000 classes; "
        f"batch: {image_size}x{image_size}x3 images and labels",
        init=lambda key, b: module.init(key, b["image"], train=False),
        loss=loss,
        make_batch=make_batch,
    )


def _many_small(**_):
    import flax.linen as nn
    import jax.numpy as jnp

    class ManySmall(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(_SMALL_WIDTH, name="embed")(x)
            for i in range(_SMALL_BLOCKS):
                x = x + jnp.tanh(
                    nn.Dense(_SMALL_WIDTH, name=f"dense_{i}")(nn.LayerNorm(name=f"norm_{i}")(x))
                )
            return nn.Dense(10, name="head")(nn.LayerNorm(name="norm_out")(x))

    module = ManySmall()
    return _Recipe(
        description=f"{_SMALL_BLOCKS} residual blocks of LayerNorm + Dense "
        f"{_SMALL_WIDTH}x{_SMALL_WIDTH}, softmax cross-entropy; batch: {_SMALL_WIDTH} features, "
        "a label",
        init=lambda key, b: module.init(key, b["x"]),
        loss=lambda v, b: _cross_entropy(module.apply(v, b["x"]), b["label"]),
        make_batch=lambda rng, n: _classes(rng, n, _SMALL_WIDTH, 10),
    )


_RECIPES = {
    "mlp4096": _mlp4096,
    "mlp2041": _mlp2041,
    "gpt2": _gpt2,
    "resnet50": _resnet50,
    "many_small": _many_small,
}
