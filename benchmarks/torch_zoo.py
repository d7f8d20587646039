"""``jaxcomp.training.zoo``'s models in PyTorch, for the torch rows of ``benchmarks/peers.py``.

    model, make_batch, loss_fn = torch_zoo.build("resnet50")
    inputs, targets = make_batch(torch.Generator().manual_seed(0), 2)
    loss_fn(model(inputs), targets).backward()

Each model has the zoo's layers and parameter shapes (the same counts of parameters and of
tensors, checked by ``tests/peers_test.py``), the zoo's loss and random batches of the zoo's shapes:

=============  ==========  ==========  ========================================================
name           params      tensors     what it is
=============  ==========  ==========  ========================================================
``mlp4096``    25,185,290           8  Linear 1024-4096-4096-1024-10, tanh between, cross-entropy
``mlp2041``    25,006,332          12  six square 2041-wide Linear layers, tanh between, MSE
``gpt2``       124,439,808        148  GPT-2 small, tied head, 64-token sequences
``resnet50``   25,557,032         161  ResNet-50 v1.5 (torchvision's layout), 64x64 images
``many_small`` 1,102,666        1,030  256 residual blocks of LayerNorm + Linear 64x64
=============  ==========  ==========  ========================================================

Initial values differ from the zoo's (each framework's own initializers, seeded): the benchmark
measures speed. Images are NCHW (PyTorch's layout); the zoo's are NHWC. Imports torch, and nothing
from jaxcomp: it runs in PyTorch's own environment.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

NAMES = ("mlp4096", "mlp2041", "gpt2", "resnet50", "many_small")
_VOCAB, _POSITIONS, _WIDTH, _BLOCKS, _HEADS = 50257, 1024, 768, 12, 12  # GPT-2 small
_SMALL_BLOCKS, _SMALL_WIDTH = 256, 64  # many_small


def build(name: str, *, mlp_widths=None, seq_len: int = 64, image_size: int = 64, seed: int = 0):
    """Builds a model: ``(module, make_batch, loss_fn)``.

    Args:
      name: one of :data:`NAMES`.
      mlp_widths: the MLP's layer sizes, input first (``mlp4096`` and ``mlp2041`` need them).
      seq_len: tokens per ``gpt2`` sequence (the zoo's default 64).
      image_size: height and width of ``resnet50``'s images (the zoo's default 64).
      seed: ``torch.manual_seed`` before the parameters are made (the same model on every host).

    Returns:
      The ``nn.Module``; ``make_batch(generator, rows) -> (inputs, targets)``; ``loss_fn(outputs,
      targets) -> scalar``.

    Example:
      >>> model, make_batch, loss_fn = build("many_small")
      >>> inputs, targets = make_batch(torch.Generator().manual_seed(0), 2)
      >>> loss_fn(model(inputs), targets).shape
      torch.Size([])
    """
    if name not in NAMES:
        raise ValueError(f"model must be one of {NAMES}, got {name!r}")
    torch.manual_seed(seed)
    if name in ("mlp4096", "mlp2041"):
        if not mlp_widths or len(mlp_widths) < 2:
            raise ValueError(
                f"{name} needs mlp_widths (input first, at least two sizes), got {mlp_widths!r}"
            )
        model = _mlp(mlp_widths)
        if name == "mlp2041":
            return model, _regression(mlp_widths[0], mlp_widths[-1]), F.mse_loss
        return model, _classes(mlp_widths[0], mlp_widths[-1]), F.cross_entropy
    if name == "many_small":
        return ManySmall(), _classes(_SMALL_WIDTH, 10), F.cross_entropy
    if name == "gpt2":
        return GPT2(), _tokens(seq_len), _next_token_loss
    return ResNet50(), _images(image_size), F.cross_entropy


def _mlp(widths):
    layers = []
    for i, (fan_in, fan_out) in enumerate(pairwise(widths)):
        layers.append(nn.Linear(fan_in, fan_out))
        if i < len(widths) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def _classes(features, classes):
    def make_batch(generator, rows):
        return (
            torch.randn(rows, features, generator=generator),
            torch.randint(0, classes, (rows,), generator=generator),
        )

    return make_batch


def _regression(features, outputs):
    def make_batch(generator, rows):
        return torch.randn(rows, features, generator=generator), torch.randn(
            rows, outputs, generator=generator
        )

    return make_batch


def _tokens(seq_len):
    def make_batch(generator, rows):
        tokens = torch.randint(0, _VOCAB, (rows, seq_len), generator=generator)
        return tokens, tokens[:, 1:]

    return make_batch


def _images(size):
    def make_batch(generator, rows):
        return (
            torch.randn(rows, 3, size, size, generator=generator),
            torch.randint(0, 1000, (rows,), generator=generator),
        )

    return make_batch


def _next_token_loss(logits, targets):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1))


class ManySmall(nn.Module):
    """The zoo's ``many_small``: an embedding Linear, 256 residual LayerNorm + Linear blocks, a
    head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(_SMALL_WIDTH, _SMALL_WIDTH)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(_SMALL_WIDTH), nn.Linear(_SMALL_WIDTH, _SMALL_WIDTH))
            for _ in range(_SMALL_BLOCKS)
        )
        self.norm_out = nn.LayerNorm(_SMALL_WIDTH)
        self.head = nn.Linear(_SMALL_WIDTH, 10)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(self.norm_out(x))


class _GPT2Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(_WIDTH, eps=1e-5)
        self.attn_qkv = nn.Linear(_WIDTH, 3 * _WIDTH)
        self.attn_proj = nn.Linear(_WIDTH, _WIDTH)
        self.ln_2 = nn.LayerNorm(_WIDTH, eps=1e-5)
        self.mlp_fc = nn.Linear(_WIDTH, 4 * _WIDTH)
        self.mlp_proj = nn.Linear(4 * _WIDTH, _WIDTH)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.attn_qkv(self.ln_1(x)).split(width, dim=-1)

        def heads(t):
            return t.view(batch, length, _HEADS, width // _HEADS).transpose(1, 2)

        attended = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.attn_proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp_proj(
            F.gelu(self.mlp_fc(self.ln_2(x)), approximate="tanh")
        )  # flax's gelu


class GPT2(nn.Module):
    """The zoo's ``gpt2``: GPT-2 small, pre-LayerNorm blocks, fused qkv, the head tied to the
    embedding."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(_VOCAB, _WIDTH)
        self.wpe = nn.Embedding(_POSITIONS, _WIDTH)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.01)
        self.h = nn.ModuleList(_GPT2Block() for _ in range(_BLOCKS))
        self.ln_f = nn.LayerNorm(_WIDTH, eps=1e-5)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[-1]))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T


class _Bottleneck(nn.Module):
    def __init__(self, inputs, features, stride):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(inputs, features, 1, bias=False), nn.BatchNorm2d(features)
        self.conv2 = nn.Conv2d(features, features, 3, stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(features)
        self.conv3, self.bn3 = (
            nn.Conv2d(features, 4 * features, 1, bias=False),
            nn.BatchNorm2d(4 * features),
        )
        self.downsample = None
        if (
            stride != 1 or inputs != 4 * features
        ):  # the first block of a stage: project the shortcut
            self.downsample = nn.Sequential(
                nn.Conv2d(inputs, 4 * features, 1, stride, bias=False), nn.BatchNorm2d(4 * features)
            )

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    """The zoo's ``resnet50``: ResNet-50 v1.5, stride on the 3x3 convs, convs without bias, 1000
    classes."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, padding=3, bias=False), nn.BatchNorm2d(64)
        blocks, inputs = [], 64
        for stage, (count, features) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
            for block in range(count):
                blocks.append(_Bottleneck(inputs, features, 2 if stage > 0 and block == 0 else 1))
                inputs = 4 * features
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(inputs, 1000)

    def forward(self, images):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(images))), 3, 2, padding=1)
        return self.fc(self.blocks(x).mean(dim=(2, 3)))
