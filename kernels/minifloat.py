"""Minifloats of the low-bit codecs: e2m1 elements (fp4) and block scales as fp16 or e8m0.

Rules, stated exactly (as in OCP's microscaling formats, MX):

- e2m1: code ``sign << 3 | i`` stands for ``±E2M1[i]``, ``E2M1 = (0, 0.5, 1, 1.5, 2, 3, 4, 6)``
  (IEEE's encoding: 2 exponent bits, bias 1, 1 mantissa bit, no inf or NaN). A value is
  rounded to the nearest, ties to the even code (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4, as
  IEEE rounds), keeping its sign (-0.1 -> the code of -0, which decodes to +0); magnitudes beyond 6 saturate to 6. NaN gives
  some code: the caller's NaN scale carries it.
- e8m0: code ``c`` stands for ``2**(c - 127)``, ``c`` in 0..254; 255 is NaN. A block's scale is
  OCP's: ``2**(floor(log2 max |x|) - emax)``, ``2**emax`` the element format's largest power of two.
- fp16 scales are rounded up (``ceil``), so that ``|x| <= top * scale`` still holds.

Every function is element-wise or per block, in torch ops that run on any device without
reading anything back.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .quant import _broadcast_op, block_runs, num_blocks, pow2

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TOP = 6.0
E8M0_BIAS = 127
E8M0_NAN = 255
E8M0_TOP = 254  # the largest code with a value, 2**127


def _magnitudes(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``E2M1`` as a tensor on ``device``, made there (a copy from the host would wait for it):
    code ``i`` is ``i / 2`` below 2, else ``2**(i // 2 - 1) * (1 + (i % 2) / 2)``."""
    i = torch.arange(8, device=device, dtype=torch.int64)
    normal = torch.ldexp(1.0 + (i % 2).to(dtype) / 2, i // 2 - 1)
    return torch.where(i < 2, i.to(dtype) / 2, normal)


def e2m1_codes(x: torch.Tensor, mult: torch.Tensor, block_size: int) -> torch.Tensor:
    """The e2m1 codes (uint8, one per element) of ``x * mult[block]``, rounded as the module
    docstring says; ``mult`` has one entry per block in ``x``'s dtype (float32 or float64).

    A magnitude ``a`` in binade ``b`` (0 below 2, 1 below 4, else 2), where neighbouring values
    are ``2**(b - 1)`` apart, has the code ``2b + round(a / 2**(b - 1))``: the quotient is exact,
    ``round`` is half to even and an even quotient is an even code. Runs of whole blocks on CPU,
    so the temporaries stay in cache.
    """
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    for a, b in block_runs(x.numel(), block_size, x.device):
        t = torch.empty(b - a, dtype=x.dtype, device=x.device)
        m = mult[a // block_size:num_blocks(b, block_size)]
        _broadcast_op(t, lambda d, xb, mb: torch.mul(xb, mb, out=d), x[a:b], m, block_size)
        sign = torch.signbit(t)
        t.abs_()
        ge2, ge4 = t >= 2, t >= 4
        binade = ge2.to(x.dtype).add_(ge4.to(x.dtype))  # b
        t.mul_(torch.where(ge4, 0.5, torch.where(ge2, 1.0, 2.0)).to(x.dtype)).round_().add_(binade, alpha=2)
        field = t.clamp_(max=7).to(torch.int32).bitwise_and_(7)  # NaN casts to some integer: a valid field
        codes[a:b].copy_(field.bitwise_or_(sign.to(torch.int32).bitwise_left_shift_(3)))
    return codes


def e2m1_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The 16 values of the e2m1 codes, as ``dtype``; the code of -0 decodes to +0, so a decoded
    zero is +0 whatever sign its input had (a zero's sign would otherwise depend on the order a
    sum adds in, and the ranks' results on who summed)."""
    half = _magnitudes(dtype, device)
    return torch.cat([half, (-half).add_(0.0)])  # -0 + 0 = +0


def e2m1_decode(codes: torch.Tensor, step: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``E2M1 value of codes * step[block]`` as a new tensor of ``dtype``: one rounding per element."""
    table = e2m1_table(dtype, codes.device)
    if codes.device.type == "cpu":
        out = torch.from_numpy(np.take(table.numpy(), codes.numpy()))
    else:
        out = table[codes.long()]
    _broadcast_op(out, lambda d, _, s: d.mul_(s), out, step.to(dtype), block_size)
    return out


def e8m0_codes(amax: torch.Tensor, emax: int, top_code: int = E8M0_TOP) -> torch.Tensor:
    """The e8m0 codes (uint8) of OCP MX's shared scale ``2**(floor(log2 amax) - emax)`` of
    blocks of largest magnitude ``amax`` (float32 or float64, >= 0), for elements whose largest
    power of two is ``2**emax``: the block's largest element lands in ``[2**emax, 2**(emax+1))``
    scale units. Clamped to codes ``[0, top_code]`` (a smaller scale saturates the block, a
    larger one is the least the format holds); 0 gives code 0, NaN and inf the NaN code."""
    _, exp = torch.frexp(amax)  # amax = m * 2**exp, m in [0.5, 1): floor(log2 amax) = exp - 1
    code = (exp.to(torch.int32) + (E8M0_BIAS - 1 - emax)).clamp_(0, top_code)
    code = torch.where(amax > 0, code, torch.zeros_like(code))
    return torch.where(torch.isfinite(amax), code, torch.full_like(code, E8M0_NAN)).to(torch.uint8)


def e8m0_values(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values ``2**(c - 127)`` of e8m0 codes (NaN for 255) as ``dtype`` (float32: exact,
    2**-127 as a subnormal)."""
    values = pow2(codes.long() - E8M0_BIAS, dtype)
    return torch.where(codes == E8M0_NAN, torch.full_like(values, math.nan), values)


def fp16_ceil(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` (>= 0 and at most 65504 where finite; NaN and inf pass) as float16, rounded up:
    a positive scale below fp16's smallest subnormal becomes that subnormal, never 0."""
    h = scale.to(torch.float16)
    low = h.to(scale.dtype) < scale
    up = (h.view(torch.int16) + 1).view(torch.float16)  # the next float16 of a finite h >= 0
    return torch.where(low, up, h)
