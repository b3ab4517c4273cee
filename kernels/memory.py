"""Allocation helpers for the CPU path."""
from __future__ import annotations

import numpy as np
import torch

_NP_OF_SIZE = {2: np.int16, 4: np.int32, 8: np.int64}


def empty(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu", *, touch: bool = False) -> torch.Tensor:
    """An uninitialised flat tensor; on CPU backed by numpy, whose large allocations ask the
    kernel for huge pages (first touch of 100 MB: ~10 ms instead of ~45 ms of page faults).
    ``touch``: as :func:`zeros`'s (one write per 4 KB page)."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    inp = _NP_OF_SIZE.get(torch.empty((), dtype=dtype).element_size())
    if inp is None:
        return torch.empty(numel, dtype=dtype, device=device)
    return torch.from_numpy(_touched(np.empty(numel, dtype=inp), touch)).view(dtype)


def _touched(block: np.ndarray, touch: bool) -> np.ndarray:
    if touch:
        block[::4096 // block.itemsize] = 0
    return block


def clone(t: torch.Tensor) -> torch.Tensor:
    """A flat contiguous copy of ``t`` in memory from :func:`empty` (on CPU: huge pages where
    the kernel gives them, so a large copy pays a fraction of ``t.clone()``'s page faults)."""
    return empty(t.numel(), t.dtype, t.device).copy_(t.reshape(-1))


def zeros(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu", *, touch: bool = False) -> torch.Tensor:
    """A flat tensor of zeros; on CPU from numpy's zeroed allocation, whose large blocks are
    fresh pages the kernel zeroes on first touch: no pass of its own (100 MB zeroed and then
    scattered into: ~15 ms against ~22 ms for ``empty(...).zero_()``). ``touch``: on CPU, fault
    every page in now (one write of zero per 4 KB), so that the page faults are paid here, e.g.
    while the calling thread waits for the wire, and not by the pass that fills the tensor."""
    device = torch.device(device)
    inp = _NP_OF_SIZE.get(torch.empty((), dtype=dtype).element_size())
    if device.type != "cpu" or inp is None:
        return torch.zeros(numel, dtype=dtype, device=device)
    return torch.from_numpy(_touched(np.zeros(numel, dtype=inp), touch)).view(dtype)


def copy_from_host(dst: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(host)`` for a small host tensor, without making the host wait for a GPU:
    there ``host`` goes through pinned memory and the copy is asynchronous on the current
    stream (the caching host allocator keeps the pinned block until the copy is done)."""
    if dst.device.type == "cuda":
        return dst.copy_(host.pin_memory(), non_blocking=True)
    return dst.copy_(host)
