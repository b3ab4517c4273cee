"""Launchers of ``kernels/cuda/sign.cu``; the primitives and their references: :mod:`kernels.sign`."""
from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

from . import _cupy
from ._launch import FLOAT_SUFFIX, grid

_C = _cupy.constants("sign")
BLOCK = _C["BLOCK"]
NSUMS = _C["NSUMS"]  # partial sums each block of sign_pack writes
PACK_STEP = 32 * _C["WORDS_PER_STEP"]  # elements a warp packs per loop step
STATS_CODE = {"none": _C["STATS_NONE"], "sum": _C["STATS_SUM"], "abs": _C["STATS_ABS"], "split": _C["STATS_SPLIT"]}
_NSUMS_OUT = {"none": 0, "sum": 1, "abs": 1, "split": 2}  # sums returned per stats


def launch_sign_pack(x: torch.Tensor, stats: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(bits, sums)`` of the 1-D contiguous tensor ``x``: one pass, then the per-block
    partial sums reduced in a fixed order (float64)."""
    n = x.numel()
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    sums = torch.zeros(_NSUMS_OUT[stats], dtype=torch.float64, device=x.device)
    if n == 0:
        return bits, sums
    with _cupy.launcher(x.device) as k:
        blocks = grid(k, -(-n // PACK_STEP) * 32, BLOCK)
        partial = torch.empty(blocks * NSUMS, dtype=torch.float64, device=x.device)
        k("sign", f"sign_pack_{FLOAT_SUFFIX[x.dtype]}", blocks, BLOCK, x, np.int64(n), bits, partial,
          np.int32(STATS_CODE[stats]))
        if sums.numel():
            k("sign", "sign_reduce", 1, BLOCK, partial, np.int32(blocks), sums, np.int32(sums.numel()))
    return bits, sums


def _as_dtype_f32(values, dtype: torch.dtype):
    """``values`` rounded once to ``dtype`` (as the reference rounds them), as numpy float32."""
    rounded = torch.tensor(values, dtype=torch.float64).to(dtype).to(torch.float32)
    return [np.float32(v) for v in rounded.tolist()]


def launch_sign_unpack(bits: torch.Tensor, numel: int, pos_value: float, neg_value: float,
                       out: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """``pos_value`` where a bit is set else ``neg_value``, written or added into ``out``."""
    if numel:
        pos, neg = _as_dtype_f32([pos_value, neg_value], out.dtype)
        with _cupy.launcher(out.device) as k:
            k("sign", f"sign_unpack_{FLOAT_SUFFIX[out.dtype]}", grid(k, -(-numel // 8), BLOCK), BLOCK,
              bits.contiguous(), np.int64(numel), out, pos, neg, np.int32(bool(accumulate)))
    return out


def launch_count_set(bits: torch.Tensor) -> int:
    """Number of set bits of a uint8 tensor (reads the count back: one stream-ordered copy)."""
    return int(launch_count_set_tensor(bits))


def launch_count_set_tensor(bits: torch.Tensor) -> torch.Tensor:
    """Number of set bits of a uint8 tensor, as a 0-d int64 tensor on its device (no read back)."""
    total = torch.zeros(1, dtype=torch.int64, device=bits.device)
    if bits.numel():
        with _cupy.launcher(bits.device) as k:
            k("sign", "count_set_bits", grid(k, bits.numel(), BLOCK), BLOCK, bits.contiguous(),
              np.int64(bits.numel()), total)
    return total[0]
