"""Launchers of ``kernels/cuda/bits.cu``; the primitives and their references: :mod:`kernels.bits`."""
from __future__ import annotations

import numpy as np
import torch

from . import _cupy
from ._launch import grid

BLOCK = _cupy.constants("bits")["BLOCK"]
KERNEL_BITS = (1, 2, 4)  # code widths the kernels pack (8 bits need no packing)


def launch_pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``codes`` (flat) into ``bits``-bit fields, as ``bits.pack_codes`` does."""
    codes = codes.reshape(-1).contiguous()
    n = codes.numel()
    out = torch.empty((n * bits + 7) // 8, dtype=torch.uint8, device=codes.device)
    if n:
        with _cupy.launcher(codes.device) as k:
            k("bits", "pack_codes", grid(k, out.numel(), BLOCK), BLOCK, codes, np.int64(n), np.int32(bits), out)
    return out


def launch_unpack_codes(packed: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """``numel`` uint8 codes of ``bits`` bits from ``packed`` (its size already checked)."""
    out = torch.empty(numel, dtype=torch.uint8, device=packed.device)
    if numel:
        with _cupy.launcher(packed.device) as k:
            k("bits", "unpack_codes", grid(k, packed.numel(), BLOCK), BLOCK, packed.contiguous(), np.int64(numel),
              np.int32(bits), out)
    return out
