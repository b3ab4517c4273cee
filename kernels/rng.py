"""Counter-based randomness keyed by (seed, key, step).

Compressors never touch the global RNG: every draw comes from a stream whose 128-bit key is
derived from ``(seed, key, step)``, so two ranks with the same arguments draw identical values
(shared-seed random-k) and a resumed run draws what the original run drew.

The stream is numpy's Philox4x64-10 with ``counter = 0`` and the derived key: uniform float32
number ``j`` is ``(u32[j] >> 8) * 2**-24`` where ``u32`` are the 64-bit Philox outputs split
low half first. The CUDA kernel (``kernels/cuda/rng.cu``, run for CUDA devices) reproduces this
stream bit for bit.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from ._launch import device_applies  # CuPy itself is imported on the first CUDA call (_cupy)
from ._launch_rng import launch_uniform


def stream_key(seed: int, key: object, step: int) -> int:
    """A 128-bit Philox key for the stream named by ``(seed, key, step)``."""
    text = f"{int(seed)}\x1f{key}\x1f{int(step)}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=16).digest(), "little")


def uniform(numel: int, key128: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``numel`` float32 numbers uniform in [0, 1) from the stream ``key128``."""
    device = torch.device(device)
    if device_applies(device):
        return launch_uniform(numel, key128, device)
    gen = np.random.Generator(np.random.Philox(key=key128))
    values = torch.from_numpy(gen.random(numel, dtype=np.float32))
    return values if device.type == "cpu" else values.to(device)
