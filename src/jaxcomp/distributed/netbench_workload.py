"""What a ``jaxcomp netbench`` job trains (:mod:`jaxcomp.distributed.netbench_worker` runs it):
the model and this host's batches (:func:`workload`), and the optimizer every step applies after
the gradients' mean (:func:`optimizer`)."""

from __future__ import annotations

from jaxcomp.distributed.netbench import Spec, width_for


def workload(spec: Spec, rng):
    """What a job trains: the model, its loss and four of this host's batches.

    Args:
      spec: the job; ``spec.model`` names a :mod:`jaxcomp.training.zoo` model, or None for the MLP
        of ``spec.layers`` square dense layers of about ``spec.params`` parameters.
      rng: a ``numpy.random.Generator`` the batches (``spec.batch`` rows each) are drawn from.

    Returns:
      ``(params, loss_fn, local_batches, about)``; ``about`` is what the results record of the
      model (``"model"``, ``"leaves"``, ``"width"``).

    Example:
      >>> import numpy as np
      >>> spec = Spec(2e3, ("pmean",), 1, 0, 2, 2, "out.json", None)
      >>> workload(spec, np.random.default_rng(0))[3]
      {'model': 'mlp_2x32', 'leaves': 4, 'width': 32}

    References:
      Agarwal et al., "On the Utility of Gradient Compression in Distributed Training Systems",
      MLSys 2022 (a model whose step is mostly communication); docs/network.md has the set-up.
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    if spec.model is not None:
        from jaxcomp.training import zoo

        model = zoo.build(spec.model)
        batches = [model.make_batch(rng, spec.batch) for _ in range(4)]
        return (
            model.params,
            model.loss_fn,
            batches,
            {"model": spec.model, "leaves": model.n_leaves, "width": None},
        )
    width = width_for(spec.params, spec.layers)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(spec.layers):
                x = nn.Dense(width)(x)
                if i < spec.layers - 1:
                    x = jnp.tanh(x)
            return x

    model = MLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, width)))

    def loss_fn(p, batch):
        return jnp.mean((model.apply(p, batch["x"]) - batch["y"]) ** 2)

    batches = [
        {
            "x": rng.normal(size=(spec.batch, width)).astype(np.float32),
            "y": rng.normal(size=(spec.batch, width)).astype(np.float32),
        }
        for _ in range(4)
    ]
    about = {
        "model": f"mlp_{spec.layers}x{width}",
        "leaves": len(jax.tree.leaves(params)),
        "width": width,
    }
    return params, loss_fn, batches, about


def optimizer(name: str):
    """The optax optimizer a job's steps apply after the mean: :data:`netbench.OPTIMIZERS`'s
    ``"adam"`` or ``"sgd"``, learning rate 1e-4.

    Args:
      name: ``"adam"`` or ``"sgd"``.

    Returns:
      An ``optax.GradientTransformation``.

    Example:
      >>> import jax.numpy as jnp
      >>> tx = optimizer("sgd")
      >>> [round(x, 6) for x in tx.update(jnp.ones(2), tx.init(jnp.ones(2)))[0].tolist()]
      [-0.0001, -0.0001]

    References:
      Kingma & Ba, "Adam", ICLR 2015; plain SGD, as the torch rows of ``benchmarks/peers.py``.
    """
    import optax

    if name == "adam":
        return optax.adam(1e-4)
    if name == "sgd":
        return optax.sgd(1e-4)
    raise ValueError(f"optimizer must be 'adam' or 'sgd', got {name!r}")
