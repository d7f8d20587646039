"""The quality zoo's tasks: small models of several kinds that ``benchmarks/quality_zoo.py`` trains
with every recommended pairing, at dense Adam's tuned learning rate and at twice it.

Every task builds from what is on the machine (no download) and returns a :class:`Task`:

==================  ===================================================================  ========
name                what it learns                                                        Adam lr
==================  ===================================================================  ========
``transformer``     next character of stdlib source: 2 pre-LN blocks, width 64, 32 chars  2e-3
``mlp-charlm``      next character of stdlib source from the 16 before it: an embedding   4e-3
                    and two ReLU layers of 512
``digits-cnn``      scikit-learn's bundled 8x8 digits: two 3x3 convolutions and a linear  4e-3
                    layer, 1,437 training images (64 a step, shifted up to a pixel) and
                    360 held-out
``regression``      a random tanh teacher network on 16 Gaussian inputs, plus noise: a    4e-3
                    ReLU MLP of 128-128 by mean squared error, 1,024 fresh samples a step
``prose-conv``      next character of the Python reference manual's prose                 4e-3
                    (``pydoc_data.topics``): a causal dilated 1-D convolution network
==================  ===================================================================  ========

The learning rates are dense Adam's best of 1e-3, 2e-3, 4e-3 and 8e-3 at a constant rate over
1500 steps (``quality_zoo.py --tune``; ``benchmarks/results/quality_zoo_2026-12-05/tune.json``
keeps the sweep).
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from collections.abc import Callable
from typing import Any

#: Characters are bytes folded into 7-bit ASCII.
VOCAB = 128


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of the zoo.

    Attributes:
      name: the task's name.
      loss_fn: ``loss_fn(params, batch) -> scalar`` (the mean over the batch).
      params: the initial params (numpy arrays).
      batch: ``batch(step) -> pytree``: the global batch of a step, the same for every run.
      heldout: the held-out batch the final loss is measured on.
      learning_rate: dense Adam's tuned learning rate.
    """

    name: str
    loss_fn: Callable
    params: Any
    batch: Callable
    heldout: Any
    learning_rate: float


def _stdlib_text(names):
    import numpy as np

    root = sysconfig.get_paths()["stdlib"]
    data = b"".join(open(os.path.join(root, n), "rb").read() for n in names)
    tokens = np.frombuffer(data, np.uint8).copy()
    tokens[tokens >= VOCAB] = 0
    return tokens


def _prose():
    """The Python reference manual's text, as ``pydoc`` shows it (prose with a few examples)."""
    from pydoc_data import topics

    import numpy as np

    text = "\n".join(topics.topics[key] for key in sorted(topics.topics)).encode()
    tokens = np.frombuffer(text, np.uint8).copy()
    tokens[tokens >= VOCAB] = 0
    return tokens


def _windows(tokens, batch: int, length: int, seed: int):
    """``window(step)``: ``batch`` random windows of ``length`` tokens, the same for a seed."""
    import numpy as np

    def window(step):
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, len(tokens) - length, batch)
        return tokens[starts[:, None] + np.arange(length)].astype(np.int32)

    return window


def _split(tokens):
    cut = int(0.9 * len(tokens))
    return tokens[:cut], tokens[cut:]


def _normal(key, shape, scale):
    import jax

    return scale * jax.random.normal(key, shape)


def mlp_charlm(seed=0) -> Task:
    """An MLP over a 16-character context on stdlib source (:class:`Task`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jaxcomp.training.charlm import CORPUS

    context, embed, hidden = 16, 16, 512
    train, held = _split(_stdlib_text(CORPUS))
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    params = {
        "embed": _normal(k[0], (VOCAB, embed), 0.1),
        "w1": _normal(k[1], (context * embed, hidden), (context * embed) ** -0.5),
        "b1": jnp.zeros(hidden),
        "w2": _normal(k[2], (hidden, hidden), hidden**-0.5),
        "b2": jnp.zeros(hidden),
        "w3": _normal(k[3], (hidden, VOCAB), hidden**-0.5),
        "b3": jnp.zeros(VOCAB),
    }

    def loss_fn(p, batch):
        x = p["embed"][batch[:, :context]].reshape(batch.shape[0], -1)
        x = jax.nn.relu(x @ p["w1"] + p["b1"])
        x = jax.nn.relu(x @ p["w2"] + p["b2"])
        logits = x @ p["w3"] + p["b3"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, context]).mean()

    heldout = _windows(held, 4096, context + 1, seed + 1)(0)
    params = jax.tree.map(np.asarray, params)
    return Task(
        "mlp-charlm", loss_fn, params, _windows(train, 256, context + 1, seed), heldout, 4e-3
    )


def transformer(seed=0) -> Task:
    """The char-LM transformer of ``benchmarks/quality.py`` at a zoo's size (:class:`Task`)."""
    from jaxcomp.training import charlm

    config = charlm.Config(layers=2, width=64, heads=4, context=32, batch=32, eval_sequences=512)
    corpus = charlm.load_corpus()
    loss_fn, params, heldout = charlm.task(config, corpus, seed)
    window = _windows(corpus[0], config.batch, config.context + 1, seed)
    return Task(
        "transformer",
        loss_fn,
        params,
        lambda step: {"tokens": window(step)},
        heldout,
        2e-3,
    )


def digits_cnn(seed=0) -> Task:
    """Two 3x3 convolutions and a linear layer on scikit-learn's 8x8 digits (:class:`Task`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(labels))
    images = (images[order] / 16.0).reshape(-1, 8, 8, 1).astype(np.float32)
    labels = labels[order].astype(np.int32)
    cut = int(0.8 * len(labels))
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    params = {
        "c1": _normal(k[0], (3, 3, 1, 16), 1 / 3),
        "c1b": jnp.zeros(16),
        "c2": _normal(k[1], (3, 3, 16, 32), 1 / 12),
        "c2b": jnp.zeros(32),
        "out": _normal(k[2], (4 * 4 * 32, 10), (4 * 4 * 32) ** -0.5),
        "outb": jnp.zeros(10),
    }

    def conv(x, w, b, stride):
        y = jax.lax.conv_general_dilated(
            x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return jax.nn.relu(y + b)

    def loss_fn(p, batch):
        x = conv(batch["x"], p["c1"], p["c1b"], 1)
        x = conv(x, p["c2"], p["c2b"], 2).reshape(batch["x"].shape[0], -1)
        logits = x @ p["out"] + p["outb"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    padded = np.pad(images[:cut], ((0, 0), (1, 1), (1, 1), (0, 0)))

    def batch(step):
        # 64 training images a step, each shifted by up to a pixel each way: 1,437 images
        # would be learnt by heart in 1500 steps, and the held-out loss then measures chance.
        rng = np.random.default_rng([seed, step])
        pick, shift = rng.integers(0, cut, 64), rng.integers(0, 3, (64, 2))
        rows = shift[:, :1, None] + np.arange(8)[None, :, None]
        cols = shift[:, 1:, None] + np.arange(8)[None, None, :]
        return {"x": padded[pick[:, None, None], rows, cols], "y": labels[pick]}

    heldout = {"x": images[cut:], "y": labels[cut:]}
    params = jax.tree.map(np.asarray, params)
    return Task("digits-cnn", loss_fn, params, batch, heldout, 4e-3)


def regression(seed=0) -> Task:
    """A ReLU MLP fitting a random tanh teacher plus noise, by squared error (:class:`Task`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    inputs, width = 16, 128
    teacher = np.random.default_rng(1234)
    t1 = teacher.normal(size=(inputs, 64)) / np.sqrt(inputs)
    t2 = teacher.normal(size=(64,)) / np.sqrt(64)

    def sample(rng, n):
        x = rng.normal(size=(n, inputs)).astype(np.float32)
        y = np.tanh(x @ t1) @ t2 * 3 + 0.1 * rng.normal(size=n)
        return {"x": x, "y": y.astype(np.float32)}

    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    params = {
        "w1": _normal(k[0], (inputs, width), inputs**-0.5),
        "b1": jnp.zeros(width),
        "w2": _normal(k[1], (width, width), width**-0.5),
        "b2": jnp.zeros(width),
        "w3": _normal(k[2], (width, 1), width**-0.5),
    }

    def loss_fn(p, batch):
        x = jax.nn.relu(batch["x"] @ p["w1"] + p["b1"])
        x = jax.nn.relu(x @ p["w2"] + p["b2"])
        return jnp.mean(jnp.square((x @ p["w3"])[:, 0] - batch["y"]))

    heldout = sample(np.random.default_rng([seed, 10**9]), 4096)
    params = jax.tree.map(np.asarray, params)
    return Task(
        "regression",
        loss_fn,
        params,
        lambda step: sample(np.random.default_rng([seed, step]), 1024),
        heldout,
        4e-3,
    )


def prose_conv(seed=0) -> Task:
    """A causal dilated 1-D convolution network over prose, next character (:class:`Task`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    length, embed, width, dilations = 64, 32, 128, (1, 2, 4, 8)
    train, held = _split(_prose())
    keys = jax.random.split(jax.random.PRNGKey(seed), len(dilations) + 2)
    params = {"embed": _normal(keys[0], (VOCAB, embed), 0.1), "out": None, "layers": []}
    fan_in = embed
    for key, _ in zip(keys[1:], dilations):
        params["layers"].append(
            {"w": _normal(key, (2, fan_in, width), (2 * fan_in) ** -0.5), "b": jnp.zeros(width)}
        )
        fan_in = width
    params["out"] = _normal(keys[-1], (width, VOCAB), width**-0.5)

    def loss_fn(p, batch):
        x = p["embed"][batch[:, :-1]]
        for layer, dilation in zip(p["layers"], dilations):
            # Kernel 2 over (t - dilation, t): causal by a left pad of ``dilation``.
            y = jax.lax.conv_general_dilated(
                x,
                layer["w"],
                (1,),
                [(dilation, 0)],
                rhs_dilation=(dilation,),
                dimension_numbers=("NWC", "WIO", "NWC"),
            )
            y = jax.nn.relu(y + layer["b"])
            x = y if x.shape[-1] != y.shape[-1] else x + y
        logits = x @ p["out"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    heldout = _windows(held, 512, length + 1, seed + 1)(0)
    params = jax.tree.map(np.asarray, params)
    return Task("prose-conv", loss_fn, params, _windows(train, 32, length + 1, seed), heldout, 4e-3)


#: The zoo: task name -> builder(seed).
TASKS = {
    "transformer": transformer,
    "mlp-charlm": mlp_charlm,
    "digits-cnn": digits_cnn,
    "regression": regression,
    "prose-conv": prose_conv,
}
