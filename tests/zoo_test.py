"""jaxcomp.training.zoo: every model builds with the published shapes and counts, and its loss
trains.

The big models (GPT-2, ResNet-50) are checked abstractly (``jax.eval_shape``); the small ones run a
real forward and backward pass.
"""

import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import subprocess_env

from jaxcomp.training import zoo

# (parameters, leaves). GPT-2 small with its tied head: 124,439,808 (Hugging Face's count);
# ResNet-50: 25,557,032 in torchvision's 161 parameter tensors.
COUNTS = {
    "mlp4096": (
        sum(i * o + o for i, o in ((1024, 4096), (4096, 4096), (4096, 1024), (1024, 10))),
        8,
    ),
    "mlp2041": (6 * (2041 * 2041 + 2041), 12),
    "gpt2": (124_439_808, 148),
    "resnet50": (25_557_032, 161),
    "many_small": (1_102_666, 1030),
}
PUBLISHED = {"mlp4096": 25.2e6, "mlp2041": 25.0e6, "gpt2": 124.4e6, "resnet50": 25.56e6}


@pytest.fixture(scope="module")
def abstract():
    return {name: zoo.build(name, abstract=True) for name in zoo.NAMES}


def shapes(params):
    return [leaf.shape for leaf in jax.tree.leaves(params)]


def test_the_zoo_names_its_models():
    assert zoo.NAMES == tuple(COUNTS)


def test_an_unknown_model_is_refused_with_the_names():
    with pytest.raises(
        ValueError, match=r"model must be one of mlp4096, .*many_small; got 'resnet18'"
    ):
        zoo.build("resnet18")


@pytest.mark.parametrize("option, value", [("seq_len", 0), ("seq_len", 1025), ("image_size", 16)])
def test_out_of_range_options_are_refused(option, value):
    with pytest.raises(ValueError, match=option):
        zoo.build("gpt2", abstract=True, **{option: value})


@pytest.mark.parametrize("name", zoo.NAMES)
def test_counts(abstract, name):
    model = abstract[name]
    assert (model.n_params, model.n_leaves) == COUNTS[name]
    assert model.n_leaves == len(jax.tree.leaves(model.params))
    if name in PUBLISHED:
        assert model.n_params == pytest.approx(PUBLISHED[name], rel=0.01)
    assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(model.params))
    assert model.description and "\n" not in model.description


def test_mlp4096_has_a_4096_square_leaf(abstract):
    assert (4096, 4096) in shapes(abstract["mlp4096"].params)
    assert (2041, 2041) in shapes(abstract["mlp2041"].params)


def test_gpt2_has_gpt2_small_shapes_and_a_tied_head(abstract):
    params = abstract["gpt2"].params
    assert params["wte"]["embedding"].shape == (50257, 768)
    assert params["wpe"]["embedding"].shape == (1024, 768)
    blocks = sorted(k for k in params if k.startswith("h_"))
    assert len(blocks) == 12
    block = jax.tree.map(lambda leaf: leaf.shape, params["h_0"])
    assert block["attn_qkv"]["kernel"] == (768, 2304) and block["attn_proj"]["kernel"] == (768, 768)
    assert block["mlp_fc"]["kernel"] == (768, 3072) and block["mlp_proj"]["kernel"] == (3072, 768)
    assert block["ln_1"]["scale"] == block["ln_2"]["scale"] == (768,)
    assert (768, 50257) not in shapes(params)  # the output head is the embedding


def test_resnet50_has_hwio_kernels_and_batchnorm_vectors(abstract):
    model = abstract["resnet50"]
    leaf_shapes = shapes(model.params)
    kernels = [s for s in leaf_shapes if len(s) == 4]
    assert len(kernels) == 53 and (7, 7, 3, 64) in kernels and (3, 3, 512, 512) in kernels
    assert (
        sum(len(s) == 1 for s in leaf_shapes) == 2 * 53 + 1
    )  # BatchNorm scale and bias; the fc bias
    assert (2048, 1000) in leaf_shapes
    # The running statistics are not trained: a collection of their own, outside params.
    assert len(jax.tree.leaves(model.state["batch_stats"])) == 2 * 53


def test_many_small_has_over_a_thousand_small_leaves(abstract):
    model = abstract["many_small"]
    assert model.n_leaves > 1000 and model.n_params < 5e6
    assert max(int(np.prod(s)) for s in shapes(model.params)) <= 64 * 64


@pytest.mark.parametrize(
    "name", ["mlp4096", "mlp2041", "gpt2", "resnet50"]
)  # many_small: trained below
def test_the_gradient_has_the_params_structure(abstract, name):
    model = abstract[name]
    batch = model.make_batch(np.random.default_rng(0), 2)
    loss, grads = jax.eval_shape(jax.value_and_grad(model.loss_fn), model.params, batch)
    assert loss.shape == () and loss.dtype == np.float32
    assert jax.tree.structure(grads) == jax.tree.structure(model.params)
    assert shapes(grads) == shapes(model.params)


@pytest.mark.parametrize(
    "name", ["mlp4096", "mlp2041", pytest.param("many_small", marks=pytest.mark.slow)]
)  # many_small: 1,030 leaves to compile
def test_small_models_train(name):
    model = zoo.build(name)
    batch = model.make_batch(np.random.default_rng(0), 2)
    loss, grads = jax.jit(jax.value_and_grad(model.loss_fn))(model.params, batch)
    assert np.isfinite(float(loss))
    assert jax.tree.structure(grads) == jax.tree.structure(model.params)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    assert any(np.abs(g).max() > 0 for g in jax.tree.leaves(grads))


def test_batches_follow_the_options():
    rng = np.random.default_rng(0)
    tokens = zoo.build("gpt2", seq_len=16, abstract=True).make_batch(rng, 3)["tokens"]
    assert (
        tokens.shape == (3, 16)
        and tokens.dtype == np.int32
        and 0 <= tokens.min()
        and tokens.max() < 50257
    )
    images = zoo.build("resnet50", image_size=32, abstract=True).make_batch(rng, 2)
    assert images["image"].shape == (2, 32, 32, 3) and images["label"].shape == (2,)
    with pytest.raises(ValueError, match="batch_size"):
        zoo.build("mlp4096", abstract=True).make_batch(rng, 0)


def test_importing_the_zoo_loads_no_jax():
    code = "import jaxcomp.training.zoo\nimport sys; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert not {"jax", "flax", "optax"} & set(out.stdout.split())
