"""The character-level language model that time-to-quality runs train: model, corpus, batches.

    config = charlm.MODELS["small"]
    corpus = charlm.load_corpus()
    loss_fn, params, heldout = charlm.task(config, corpus, seed=0)

A small GPT-style model (flax nnx; pre-LayerNorm blocks of causal self-attention and a GELU MLP)
learns to predict the next character of Python source: files of the standard library of the
running interpreter, read from its installation, so nothing is downloaded (:data:`CORPUS` names
them). The concatenation is split 90/10 into a training and a held-out part. Characters are bytes
folded into 7-bit ASCII.

``jaxcomp netbench --to-loss`` (:mod:`jaxcomp.cli.to_loss`) and the repository's
``benchmarks/quality.py`` and ``benchmarks/time_to_quality.py`` train it. Its sizes
(:data:`MODELS`):

==============  ======  =========  ============================================================
name            params  sequences  what it is for
                        x chars
==============  ======  =========  ============================================================
``small``       0.44M   32 x 64    the quality benchmark's default
``large``       2.45M   16 x 64    a few million parameters
``wide``        3.67M   16 x 64    a gradient large against its compute, so that the network
                                   matters on an emulated cluster
``small-8x32``  0.44M   8 x 32     the small model with 1/8 of its characters a step: little
                                   compute per host (2 sequences each on 4 hosts), so that the
                                   network is nearly all of a data-parallel step
``wide-8x32``   3.67M   8 x 32     the same for the wide model
==============  ======  =========  ============================================================

flax is imported by the functions that build the model, not by this module (``import
jaxcomp.training.charlm`` loads no JAX).
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig

#: The corpus: these files of the running interpreter's standard library, concatenated in this
#: order.
CORPUS = (
    "argparse.py",
    "dataclasses.py",
    "functools.py",
    "inspect.py",
    "pathlib.py",
    "typing.py",
    "subprocess.py",
    "threading.py",
    "tarfile.py",
    "collections/__init__.py",
    "enum.py",
    "ast.py",
    "difflib.py",
    "shutil.py",
    "zipfile.py",
    "configparser.py",
    "logging/__init__.py",
    "statistics.py",
)

#: Characters are bytes folded into 7-bit ASCII (the few non-ASCII bytes become 0).
VOCAB = 128


@dataclasses.dataclass(frozen=True)
class Config:
    """Model and training sizes.

    Attributes:
      layers, width, heads, context: the transformer (``context`` characters a sequence).
      batch: sequences per step, over all devices.
      steps: the learning-rate schedule's length (warm-up, then cosine decay to a tenth).
      learning_rate: Adam's peak (4e-3: the best of 2e-3, 4e-3 and 8e-3 for the small model).
      warmup: the schedule's linear warm-up steps.
      eval_sequences: held-out sequences of one evaluation.
      eval_points: evaluations over a quality run (``benchmarks/quality.py``).
    """

    layers: int = 2
    width: int = 128
    heads: int = 4
    context: int = 64
    batch: int = 32
    steps: int = 500
    learning_rate: float = 4e-3
    warmup: int = 25
    eval_sequences: int = 256
    eval_points: int = 10


#: A tiny model for a few steps: smoke tests.
QUICK = Config(
    layers=1,
    width=16,
    heads=2,
    context=8,
    batch=16,
    steps=6,
    warmup=1,
    eval_sequences=16,
    eval_points=2,
)

#: The model sizes by name (see the module docstring).
MODELS = {
    "small": Config(),
    "large": Config(layers=3, width=256, batch=16),
    "wide": Config(layers=2, width=384, heads=6, batch=16),
    "small-8x32": Config(context=32, batch=8),
    "wide-8x32": Config(layers=2, width=384, heads=6, context=32, batch=8),
}


def load_corpus():
    """The corpus, read from the running interpreter's standard library (:data:`CORPUS`).

    Returns:
      ``(train, heldout, files)``: the first 90% and the last 10% of the concatenated files as
      uint8 token arrays (bytes of 128 and above become 0), and ``[(path, bytes)]`` of the files
      read.

    Example:
      >>> train, heldout, files = load_corpus()
      >>> len(files) == len(CORPUS) and int(train.max()) < VOCAB
      True

    References:
      Karpathy, "The Unreasonable Effectiveness of Recurrent Neural Networks" (2015): a
      character-level model of source code.
    """
    import numpy as np

    root = sysconfig.get_paths()["stdlib"]
    parts, files = [], []
    for name in CORPUS:
        path = os.path.join(root, name)
        with open(path, "rb") as f:
            data = f.read()
        parts.append(data)
        files.append((path, len(data)))
    tokens = np.frombuffer(b"".join(parts), np.uint8).copy()
    tokens[tokens >= VOCAB] = 0
    split = int(0.9 * len(tokens))
    return tokens[:split], tokens[split:], files


def make_model(config: Config, seed: int):
    """The transformer as a flax nnx module.

    Pre-LayerNorm blocks of causal self-attention and a GELU MLP (4x wide), a learned position
    embedding, a final LayerNorm and an untied output layer.

    Args:
      config: its sizes (``layers``, ``width``, ``heads``, ``context``).
      seed: the initialization's seed.

    Returns:
      A flax nnx module: ``model(tokens[B, T]) -> logits[B, T, VOCAB]`` with ``T <= context``.

    Example:
      >>> model = make_model(QUICK, seed=0)
      >>> len(model.blocks), model.head.out_features
      (1, 128)

    References:
      Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2, 2019): the
      pre-LayerNorm decoder block.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.attention_norm = nnx.LayerNorm(config.width, rngs=rngs)
            self.attention = nnx.MultiHeadAttention(
                num_heads=config.heads, in_features=config.width, decode=False, rngs=rngs
            )
            self.mlp_norm = nnx.LayerNorm(config.width, rngs=rngs)
            self.up = nnx.Linear(config.width, 4 * config.width, rngs=rngs)
            self.down = nnx.Linear(4 * config.width, config.width, rngs=rngs)

        def __call__(self, x, mask):
            x = x + self.attention(self.attention_norm(x), mask=mask)
            return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(VOCAB, config.width, rngs=rngs)
            self.position = nnx.Param(
                0.02 * jax.random.normal(rngs.params(), (config.context, config.width))
            )
            self.blocks = (
                nnx.List([Block(rngs) for _ in range(config.layers)])
                if hasattr(nnx, "List")
                else [Block(rngs) for _ in range(config.layers)]
            )
            self.norm = nnx.LayerNorm(config.width, rngs=rngs)
            self.head = nnx.Linear(config.width, VOCAB, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens) + self.position[None, : tokens.shape[1]]
            mask = nnx.make_causal_mask(jnp.ones(tokens.shape, jnp.int32))
            for block in self.blocks:
                x = block(x, mask)
            return self.head(self.norm(x))

    return Model(nnx.Rngs(seed))


def batches(tokens, config: Config, steps: int, seed: int):
    """Random windows of the corpus, as indices: the same for every run of a seed.

    Args:
      tokens: the token array the windows index.
      config: ``batch`` windows a step of ``context + 1`` characters (inputs and next-character
        labels).
      steps: batches.
      seed: the windows' seed.

    Returns:
      ``int[steps, batch, context + 1]``: indices into ``tokens`` (``tokens[batches(...)[i]]`` is
      step ``i``'s batch).

    Example:
      >>> import numpy as np
      >>> batches(np.zeros(100, np.uint8), QUICK, steps=3, seed=0).shape
      (3, 16, 9)

    References:
      Radford et al., GPT-2 (2019): next-token prediction on contiguous windows.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - config.context - 1, size=(steps, config.batch))
    return starts[..., None] + np.arange(config.context + 1)


def count_params(config: Config) -> int:
    """The model's parameters.

    Args:
      config: the model's sizes.

    Returns:
      The number of parameters (all float32).

    Example:
      >>> count_params(QUICK)
      7664

    References:
      Kaplan et al., "Scaling Laws for Neural Language Models" (arXiv 2001.08361): parameters
      counted with the embeddings.
    """
    import jax
    from flax import nnx

    return sum(x.size for x in jax.tree.leaves(nnx.state(make_model(config, 0), nnx.Param)))


def schedule(config: Config, peak: float | None = None):
    """The learning rate every row follows.

    Args:
      config: ``warmup`` steps of linear warm-up, then cosine decay until ``steps``.
      peak: the peak learning rate (default ``config.learning_rate``).

    Returns:
      An optax schedule: 0 to ``peak`` over ``config.warmup`` steps, then cosine decay to a
      tenth of ``peak`` at ``config.steps``, which it keeps afterwards.

    Example:
      >>> lr = schedule(Config(steps=100, warmup=10, learning_rate=1e-3))
      >>> [round(float(lr(s)), 6) for s in (0, 10, 100)]
      [0.0, 0.001, 0.0001]

    References:
      Loshchilov and Hutter, "SGDR: Stochastic Gradient Descent with Warm Restarts" (ICLR 2017):
      cosine decay; Goyal et al., "Accurate, Large Minibatch SGD" (arXiv 1706.02677): warm-up.
    """
    import optax

    peak = config.learning_rate if peak is None else peak
    return optax.warmup_cosine_decay_schedule(
        0.0, peak, config.warmup, config.steps, end_value=0.1 * peak
    )


def task(config: Config, corpus, seed: int):
    """The training task: its loss, initial params and held-out batch.

    Args:
      config: the model's sizes and ``eval_sequences``.
      corpus: :func:`load_corpus`'s ``(train, heldout, files)``.
      seed: the params' seed (the held-out windows use ``seed + 1``).

    Returns:
      ``(loss_fn, params, heldout)``: the mean next-character cross-entropy ``loss_fn(params,
      {"tokens": uint8[B, context + 1]})`` in nats, the initial params (numpy arrays, which
      ``init`` places on a mesh) and one held-out batch of ``config.eval_sequences`` sequences.

    Example:
      >>> loss_fn, params, heldout = task(QUICK, load_corpus(), seed=0)
      >>> import jax
      >>> 4.0 < float(jax.jit(loss_fn)(params, heldout)) < 5.5  # about log(128) untrained
      True

    References:
      Radford et al., GPT-2 (2019): next-token cross-entropy.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    _, heldout_tokens, _ = corpus
    graphdef, params = nnx.split(make_model(config, seed), nnx.Param)
    params = jax.tree.map(np.asarray, params)  # host arrays: init places them on the mesh

    def loss_fn(params, batch):
        tokens = batch["tokens"].astype(jnp.int32)
        logits = nnx.merge(graphdef, params)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    eval_config = dataclasses.replace(config, batch=config.eval_sequences)
    heldout = {"tokens": heldout_tokens[batches(heldout_tokens, eval_config, 1, seed + 1)[0]]}
    return loss_fn, params, heldout
