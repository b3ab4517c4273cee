"""``balance="auto"``: cut an ``nn.Sequential`` where compute is even and boundaries are cheap.

Pipe-torch's idea (Zhan & Zhang 2019: a dynamic programme over layer costs that accounts for
communication), with the boundary compressors in the cost: the bytes a boundary sends are
measured by compressing the real activation with the activation compressor (and a tensor of its
shape with the gradient compressor), so a cut lands where activations are small *or compress
well*.

Cost model, per stage ``[a, b)`` of layers: the measured forward + backward time of its layers
plus the time its rank's link spends on what that rank sends — the activation of boundary
``b`` forward and the gradient of boundary ``a`` back — at ``link_bps`` bits per second. (A
send overlaps the next pass only partly on CPU ranks, so the model charges it in full.) The
programme minimises the largest stage cost, which bounds a pipeline's steady-state rate.
"""
from __future__ import annotations

import time
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from gradcomp.compress import Compressor, get_compressor


class LayerCost(NamedTuple):
    """One layer, measured on one micro-batch."""

    seconds: float  # forward + backward, median over repeats
    act_bytes: int  # the layer's output through the activation compressor (payload bytes)
    grad_bytes: int  # a gradient of that shape through the gradient compressor


class Balance(NamedTuple):
    """What :func:`auto_balance` chose, and why."""

    balance: List[int]  # layers per stage
    stage_seconds: List[float]  # each stage's modelled cost (compute + its link's sends)
    costs: List[LayerCost]


def measure_layers(model: nn.Sequential, sample: torch.Tensor, compressors: Tuple[Compressor, Compressor],
                   repeats: int = 3) -> List[LayerCost]:
    """Each layer's forward + backward time on ``sample`` (one micro-batch) and the compressed
    bytes of its output, measured. The model is left as it was (parameters' ``.grad`` and
    buffers such as running statistics are restored)."""
    grads = [(p, p.grad) for p in model.parameters()]
    buffers = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        return _measure(model, sample, compressors, repeats)
    finally:
        model.load_state_dict(buffers)
        for p, g in grads:
            p.grad = g


def _measure(model: nn.Sequential, sample: torch.Tensor, compressors: Tuple[Compressor, Compressor],
             repeats: int) -> List[LayerCost]:
    act, grad = compressors
    times: List[List[float]] = [[] for _ in model]
    sizes: List[Tuple[int, int]] = []
    for r in range(repeats + 1):  # the first pass warms up and is discarded
        x: Any = sample
        for i, layer in enumerate(model):
            inp = _leaves(x)
            t = time.perf_counter()
            y = layer(inp)
            outs = [v for v in _tensors(y) if v.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(v) for v in outs])
            if r:
                times[i].append(time.perf_counter() - t)
            if r == 1:
                sizes.append(_boundary_bytes(y, act, grad))
            x = y
    return [LayerCost(sorted(ts)[len(ts) // 2], a, g) for ts, (a, g) in zip(times, sizes)]


def _tensors(y: Any) -> List[torch.Tensor]:
    """A layer output's tensors: itself, or those of a tuple or list (as a pipeline carries them)."""
    values = list(y) if isinstance(y, (tuple, list)) else [y]
    return [v for v in values if isinstance(v, torch.Tensor)]


def _leaves(x: Any) -> Any:
    """A layer's input cut from what made it: each floating-point tensor a leaf that requires a gradient."""
    def leaf(v: Any) -> Any:
        return v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v
    if isinstance(x, (tuple, list)):
        return type(x)(leaf(v) for v in x)
    return leaf(x)


def _boundary_bytes(y: Any, act: Compressor, grad: Compressor) -> Tuple[int, int]:
    """What a boundary after this output sends: each floating-point tensor through the activation
    compressor (and, where it needs one, its gradient through the gradient compressor), any other
    exact."""
    sent = back = 0
    for v in _tensors(y):
        needs_grad, v = v.requires_grad, v.detach()
        if v.is_floating_point():
            sent += act.compress(v).nbytes
            back += grad.compress(v.float()).nbytes if needs_grad else 0
        else:
            sent += v.numel() * v.element_size()
    return sent, back


def partition(costs: Sequence[LayerCost], stages: int, link_bps: Optional[float]) -> Balance:
    """The split of ``costs`` (in order) into ``stages`` non-empty runs that minimises the
    largest stage cost (see the module docstring)."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} stages; each stage needs at least one layer")
    per_byte = 0.0 if not link_bps else 8.0 / float(link_bps)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c.seconds)

    def cost(a: int, b: int) -> float:
        sends = (costs[b - 1].act_bytes if b < n else 0) + (costs[a - 1].grad_bytes if a > 0 else 0)
        return prefix[b] - prefix[a] + sends * per_byte

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[k][j]: first j layers in k stages
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], cost(i, j))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds, j = [n], n
    for k in range(stages, 0, -1):
        j = cut[k][j]
        bounds.append(j)
    bounds.reverse()
    balance = [b - a for a, b in zip(bounds, bounds[1:])]
    return Balance(balance, [cost(a, b) for a, b in zip(bounds, bounds[1:])], list(costs))


def auto_balance(model: nn.Sequential, sample: torch.Tensor, stages: int, *, activation_codec: Any = None,
                 grad_codec: Any = None, link_bps: Optional[float] = None, repeats: int = 3) -> Balance:
    """Measure ``model``'s layers on ``sample`` and split them into ``stages`` (see the module
    docstring); ``link_bps`` None balances compute alone."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"balance='auto' needs an nn.Sequential, got {type(model).__name__}")
    if not isinstance(sample, torch.Tensor):
        raise ValueError("balance='auto' needs sample=: one micro-batch of inputs to measure the layers on")
    if link_bps is not None and not (isinstance(link_bps, (int, float)) and link_bps > 0):
        raise ValueError(f"link_bps={link_bps!r} is not allowed; it must be a rate in bits per second > 0, or None")
    act, grad = (c if isinstance(c, Compressor) else get_compressor(c or "none")
                 for c in (activation_codec, grad_codec))
    return partition(measure_layers(model, sample, (act, grad), repeats), stages, link_bps)
