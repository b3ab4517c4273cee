"""Launchers of ``kernels/cuda/rng.cu``; the primitive and its reference: :mod:`kernels.rng`."""
from __future__ import annotations

import numpy as np
import torch

from . import _cupy
from ._launch import grid, key_words

BLOCK = _cupy.constants("rng")["BLOCK"]


def launch_uniform(numel: int, key128: int, device: torch.device) -> torch.Tensor:
    """``numel`` uniform float32 numbers of the Philox stream ``key128``, made on ``device``
    (one thread per Philox call: 8 numbers)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    out = torch.empty(numel, dtype=torch.float32, device=device)
    if numel:
        with _cupy.launcher(out.device) as k:
            k("rng", "philox_uniform", grid(k, -(-numel // 8), BLOCK), BLOCK, out, np.int64(numel), *key_words(key128))
    return out
