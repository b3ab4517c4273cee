"""Launchers of ``kernels/cuda/quant.cu``; the primitives and their references: :mod:`kernels.quant`."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import _cupy
from ._launch import FLOAT_SUFFIX, grid, key_words

_C = _cupy.constants("quant")
BLOCK = _C["BLOCK"]
SEGMENT = _C["SEGMENT"]  # elements a warp reduces at most in block_absmax / block_sumsq


def _per_segment(x: torch.Tensor, block_size: int, kernel: str, dtype: torch.dtype) -> torch.Tensor:
    """Run a one-warp-per-segment reduction of quant.cu over ``x`` in blocks of ``block_size``:
    the partial results, shaped (blocks, segments per block)."""
    x = x.reshape(-1).contiguous()
    n = x.numel()
    nb, spb = -(-n // block_size), -(-block_size // SEGMENT)
    part = torch.empty(nb * spb, dtype=dtype, device=x.device)
    if n:
        with _cupy.launcher(x.device) as k:
            k("quant", f"{kernel}_{FLOAT_SUFFIX[x.dtype]}", grid(k, nb * spb * 32, BLOCK), BLOCK, x, np.int64(n),
              np.int64(block_size), np.int64(spb), np.int64(nb * spb), part)
    return part.view(nb, spb)


def launch_block_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``max |x|`` per block in ``x``'s dtype (NaN if the block holds one): one read of x,
    then a deterministic max over each block's segments."""
    part = _per_segment(x, block_size, "block_absmax", torch.int32)
    # bit patterns of non-negative floats (and NaN above inf) order like int32
    return part.amax(dim=1).view(torch.float32).to(x.dtype)


def launch_bucket_norms(x: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """L2 norm per bucket in ``x``'s dtype; squares summed in float64, so no rescue pass is
    needed for very large or small values (the norm is inf only beyond the dtype)."""
    return _per_segment(x, bucket_size, "block_sumsq", torch.float64).sum(dim=1).sqrt_().to(x.dtype)


def launch_quantize_levels(x: torch.Tensor, mult: torch.Tensor, block_size: int, levels: int,
                           u: Optional[torch.Tensor]) -> torch.Tensor:
    """Flat int8 levels of fp32 ``x * mult[block]``: stochastic with draws ``u``, else nearest."""
    x = x.reshape(-1).contiguous()
    q = torch.empty(x.numel(), dtype=torch.int8, device=x.device)
    if x.numel():
        with _cupy.launcher(x.device) as k:
            k("quant", "quantize_levels", grid(k, -(-x.numel() // 8), BLOCK), BLOCK, x, mult.contiguous(),
              np.int64(x.numel()), np.int64(block_size), np.int32(levels),
              x if u is None else u.reshape(-1).contiguous(), np.int32(u is not None), q)
    return q


def launch_dequantize_sum(codes: torch.Tensor, bits: int, offset: int, scales: torch.Tensor, block_size: int,
                          out: torch.Tensor, weight: float = 1.0, accumulate: bool = False) -> torch.Tensor:
    """Decode many ranks' quantised payloads into ``out``: ``weight * ((out if accumulate) +
    sum_r level_r * scale_r[block])`` in fp32, rank order, rounded once to ``out``'s dtype;
    each payload read once, ``out`` written once. ``codes[r]``: rank r's int8 levels
    (``bits=8``) or packed ``level + offset`` fields; ``scales[r]``: its per-block scales.
    Reference: :func:`gradcomp.kernels.quant.dequantize_sum_reference`."""
    n = out.numel()
    if bits not in (2, 4, 8) or codes.dim() != 2 or codes.shape[1] != (n * bits + 7) // 8:
        raise ValueError(f"codes must be (ranks, {(n * bits + 7) // 8}) for {n} elements of {bits} bits, "
                         f"got {tuple(codes.shape)}")
    if scales.dim() != 2 or scales.shape[0] != codes.shape[0] or scales.shape[1] != -(-n // block_size):
        raise ValueError(f"scales must be (ranks, {-(-n // block_size)}), got {tuple(scales.shape)}")
    if n:
        with _cupy.launcher(out.device) as k:
            k("quant", f"dequantize_sum_{FLOAT_SUFFIX[out.dtype]}", grid(k, -(-n // 8), BLOCK), BLOCK,
              codes.contiguous().view(torch.uint8), np.int64(codes.shape[1]), np.int32(codes.shape[0]),
              np.int32(bits), np.int32(offset), scales.to(torch.float32).contiguous(), np.int64(scales.shape[1]),
              np.int64(block_size), np.int64(n), out, np.float32(weight), np.int32(bool(accumulate)))
    return out


def launch_natural_codes(y: torch.Tensor, u: Optional[torch.Tensor], key128: Optional[int] = None,
                         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Natural codes of fp32 ``y`` (shape kept) with draws ``u``, or made from stream ``key128``."""
    if out is None:
        out = torch.empty(y.shape, dtype=torch.uint8, device=y.device)
    n = y.numel()
    if n:
        with _cupy.launcher(y.device) as k:
            k("quant", "natural_codes", grid(k, -(-n // 8), BLOCK), BLOCK, y.contiguous(),
              y if u is None else u.contiguous(), np.int64(n), *key_words(key128 or 0), np.int32(u is None), out)
    return out


def launch_natural_decode_sum(codes: torch.Tensor, tables: torch.Tensor, out: torch.Tensor, weight: float = 1.0,
                              accumulate: bool = False) -> torch.Tensor:
    """Decode many ranks' natural codes (``codes[r]`` through ``tables[r]``, fp32 x 256) into
    ``out``: ``weight * ((out if accumulate) + sum_r value_r)``, fp32 in rank order."""
    n = out.numel()
    if codes.dim() != 2 or codes.shape[1] != n or tables.shape != (codes.shape[0], 256):
        raise ValueError(f"codes must be (ranks, {n}) and tables (ranks, 256), got {tuple(codes.shape)} "
                         f"and {tuple(tables.shape)}")
    if n:
        with _cupy.launcher(out.device) as k:
            k("quant", f"natural_decode_sum_{FLOAT_SUFFIX[out.dtype]}", grid(k, -(-n // 8), BLOCK), BLOCK,
              codes.contiguous(), np.int64(n), np.int32(codes.shape[0]), tables.to(torch.float32).contiguous(), out,
              np.float32(weight), np.int32(bool(accumulate)))
    return out
