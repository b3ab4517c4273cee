"""Models of other kinds than the digits MLP, for every layer's tests.

Layers that passed their own tests failed on other models (8-bit state on a small CNN,
recompute on BatchNorm), so each layer is also tried on:

- :func:`conv_bn_net`: a small 1-D CNN with BatchNorm (every parameter under 4096 elements,
  mixed shapes: conv kernels, BN affine pairs, biases);
- :func:`transformer_block`: one pre-norm transformer block on token ids (embedding,
  attention, MLP, LayerNorm; matrices next to vectors);
- :func:`many_small`: many tiny tensors (dozens of 1- to 20-element parameters) beside one
  large matrix;
- :func:`cnn1d`: the 1-D CNN of issue 21 (three stride-2 ``Conv1d`` of 25 channels, then
  ``Linear(125, 10)``, about 5.3k parameters), no BatchNorm.

``data(kind, n, seed)`` gives a learnable classification task for each model: inputs and
integer targets, the same on every call with the same arguments. ``sequential(kind)`` gives
the model as an ``nn.Sequential`` for the layers that need stages (planner, pipeline).
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import nn

KINDS = ("conv_bn", "transformer", "many_small", "cnn1d")
CLASSES = 10
SIGNAL = 40  # input length of the conv nets
VOCAB, SEQ, WIDTH = 32, 12, 32  # the transformer's task: tokens, sequence length, model width


class _Block(nn.Module):
    """Pre-norm self-attention and MLP, then mean-pooled logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.norm1 = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        a = self.norm1(h)
        h = h + self.attn(a, a, a, need_weights=False)[0]
        h = h + self.mlp(self.norm2(h))
        return self.head(h.mean(dim=1))


class _Embed(nn.Module):
    """Token embedding plus learned positions: the first stage of the sequential transformer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens) + self.pos


class _Residual(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.norm(x)
        return self.attn(a, a, a, need_weights=False)[0]


class _MeanPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


class _Tiny(nn.Module):
    """``y = x * w + b`` elementwise on a slice: a 1- to 20-element parameter pair."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.w = nn.Parameter(torch.ones(n))
        self.b = nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, : self.n] * self.w + self.b, x[:, self.n:]], dim=1)


def sequential(kind: str) -> nn.Sequential:
    """The model ``kind`` as an ``nn.Sequential`` (stages for the planner and the pipeline)."""
    if kind == "conv_bn":
        return nn.Sequential(
            nn.Conv1d(1, 16, 5, stride=2, padding=2), nn.BatchNorm1d(16), nn.ReLU(),
            nn.Conv1d(16, 24, 5, stride=2, padding=2), nn.BatchNorm1d(24), nn.ReLU(),
            nn.Conv1d(24, 24, 3, padding=1), nn.BatchNorm1d(24), nn.ReLU(),
            nn.Flatten(), nn.Linear(24 * (SIGNAL // 4), CLASSES))
    if kind == "cnn1d":
        return nn.Sequential(
            nn.Conv1d(1, 25, 5, stride=2, padding=2), nn.ReLU(),
            nn.Conv1d(25, 25, 5, stride=2, padding=2), nn.ReLU(),
            nn.Conv1d(25, 25, 5, stride=2, padding=2), nn.ReLU(),
            nn.Flatten(), nn.Linear(25 * (SIGNAL // 8), CLASSES))
    if kind == "transformer":
        return nn.Sequential(
            _Embed(), _Residual(_Attention()),
            _Residual(nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                    nn.Linear(4 * WIDTH, WIDTH))),
            _MeanPool(), nn.Linear(WIDTH, CLASSES))
    if kind == "many_small":
        tiny = [_Tiny(1 + (i * 7) % 20) for i in range(24)]
        return nn.Sequential(*tiny, nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, CLASSES))
    raise ValueError(f"unknown model kind {kind!r}; one of {KINDS}")


def conv_bn_net() -> nn.Module:
    return sequential("conv_bn")


def cnn1d() -> nn.Module:
    return sequential("cnn1d")


def transformer_block() -> nn.Module:
    return _Block()


def many_small() -> nn.Module:
    return sequential("many_small")


def model(kind: str) -> nn.Module:
    """A fresh model of ``kind`` (seed it first for identical replicas)."""
    return transformer_block() if kind == "transformer" else sequential(kind)


def data(kind: str, n: int, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``n`` examples of a learnable task for ``kind``: ``(inputs, targets)``.

    Conv nets: noisy sine waves whose frequency is the class. Transformer: token sequences
    whose class is the most frequent token modulo 10 (needs attention over the sequence).
    Many small: 64 features, the class a fixed random linear function of them."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    if kind in ("conv_bn", "cnn1d"):
        t = torch.linspace(0, 1, SIGNAL)
        phase = torch.rand(n, 1, generator=g) * 6.28
        x = torch.sin(6.28 * (1 + y.float()).unsqueeze(1) * t + phase)
        x = x + 0.3 * torch.randn(n, SIGNAL, generator=g)
        return x.unsqueeze(1), y
    if kind == "transformer":
        tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        planted = y + CLASSES * torch.randint(0, VOCAB // CLASSES, (n,), generator=g)
        where = torch.rand(n, SEQ, generator=g) < 0.5
        tokens = torch.where(where, planted.unsqueeze(1).expand(n, SEQ), tokens)
        return tokens, y
    if kind == "many_small":
        w = torch.randn(64, CLASSES, generator=torch.Generator().manual_seed(1234))
        x = torch.randn(n, 64, generator=g)
        return x, (x @ w).argmax(dim=1)
    raise ValueError(f"unknown model kind {kind!r}; one of {KINDS}")
