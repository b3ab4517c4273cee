"""``MemoryMeter``: the peak bytes of saved activations, measured.

::

    with MemoryMeter() as meter:
        loss = model(x).sum()
        loss.backward()
    print(meter.peak_saved_bytes, meter.peak_cuda_bytes)

While open it stores every tensor autograd saves as it is (a pass-through
``saved_tensors_hooks``) and counts its storage once, from the moment it is saved until the
graph lets it go. Tensors stored by gradcomp's own hooks inside it (``compressed_activations``,
``offload_activations``, a memory plan's checkpoints) are counted at the size they are really
kept at: the compressed payload, or nothing on the device once offloaded. Parameters that
autograd saves are not activations and are not counted (they stay alive anyway). On CUDA it
also reports ``torch.cuda.max_memory_allocated`` over the block, less what was allocated when
it opened.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _ledger
from ._ledger import Ledger

__all__ = ["MemoryMeter", "is_parameter"]


def is_parameter(t: torch.Tensor) -> bool:
    """A tensor that outlives the step whatever autograd does with it: a parameter or another
    leaf that requires grad, or a view of one (``Linear`` saves its weight transposed); an
    input that is not one is an activation."""
    base = t._base if t._base is not None else t
    return isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)


class _Held:
    """A saved tensor as the meter keeps it: the tensor's data (``detach()``: the same storage,
    no autograd history, so a saved output does not keep its own graph alive through a
    reference cycle autograd cannot see), reported to the ledger."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()
        if not is_parameter(tensor):
            _ledger.hold(self, ("storage",) + _ledger.storage_key(tensor), _ledger.storage_nbytes(tensor))


class MemoryMeter:
    """Measures saved-activation bytes (and CUDA peak memory) over a ``with`` block; see the
    module docstring. ``device``: the CUDA device to read peak memory from (default: the
    current one when CUDA is available)."""

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.ledger = Ledger()
        self.device = device
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self._cuda_base = 0
        self.peak_cuda_bytes: Optional[int] = None

    @property
    def peak_saved_bytes(self) -> int:
        """The most bytes of saved activations alive at once on the device (CPU included)."""
        return self.ledger.peak["device"]

    @property
    def peak_host_bytes(self) -> int:
        """The most bytes of offloaded activations alive at once in host memory."""
        return self.ledger.peak["host"]

    @property
    def live_saved_bytes(self) -> int:
        return self.ledger.live["device"]

    def __enter__(self) -> "MemoryMeter":
        if self.device is None and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)
        _ledger.open_ledger(self.ledger)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(_Held, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        _ledger.close_ledger(self.ledger)
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_cuda_bytes = torch.cuda.max_memory_allocated(self.device) - self._cuda_base

    def __repr__(self) -> str:
        cuda = "" if self.peak_cuda_bytes is None else f", peak CUDA {self.peak_cuda_bytes / 2**20:.1f} MiB"
        return f"MemoryMeter(peak saved {self.peak_saved_bytes / 2**20:.2f} MiB{cuda})"


def _unpack(held: _Held) -> torch.Tensor:
    return held.tensor
