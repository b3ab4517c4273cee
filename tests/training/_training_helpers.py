"""Small models and synthetic data shared by the training tests (run inside gloo ranks)."""
from __future__ import annotations

import io
from typing import Optional, Tuple

import torch


def mlp(*sizes: int, seed: int = 0) -> torch.nn.Sequential:
    """A ReLU MLP with the given layer widths, initialised from ``seed``."""
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        if i:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(a, b))
    return torch.nn.Sequential(*layers)


def teacher_data(n: int, dims: int, classes: int, seed: int = 123,
                 sample_seed: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gaussian inputs labelled by a random linear teacher drawn from ``seed`` (the same for
    every rank); ``sample_seed`` draws other inputs for the same teacher (a test set)."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(dims, classes, generator=g)
    if sample_seed is not None:
        g = torch.Generator().manual_seed(sample_seed)
    x = torch.randn(n, dims, generator=g)
    return x, (x @ teacher).argmax(1)


def batch(x: torch.Tensor, y: torch.Tensor, size: int, rank: int, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The mini-batch of ``rank`` at ``step``: a function of both, so a resumed run sees the same."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, x.shape[0], (size,), generator=g)
    return x[idx], y[idx]


def snapshot(model: torch.nn.Module, state) -> bytes:
    """A checkpoint of the model and a hook's state, as bytes."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "hook": state.state_dict()}, buf)
    return buf.getvalue()


def restore(model: torch.nn.Module, state, checkpoint: Optional[bytes]) -> None:
    """Load a :func:`snapshot` into the model and the hook's state (nothing when None)."""
    if checkpoint is not None:
        ck = torch.load(io.BytesIO(checkpoint), weights_only=True)
        model.load_state_dict(ck["model"])
        state.load_state_dict(ck["hook"])


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def full_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(x), y))


class AllReduceCounter:
    """Counts the bytes of every tensor handed to ``torch.distributed.all_reduce`` (patched
    while active), converted to what a ring allreduce sends per rank: ``2 (w-1)/w`` of them.
    PyTorch's hooks and gradcomp's bucket exchange both call it, so both are counted alike."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.bytes = 0

    def __enter__(self) -> "AllReduceCounter":
        import torch.distributed as dist

        self._real = dist.all_reduce

        def counting(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size() * 2 * (self.world - 1) // self.world
            return self._real(tensor, *args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        dist.all_reduce = self._real
