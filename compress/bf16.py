"""``bf16``: cast to bfloat16 for the wire; fp32's exponent range, 8 significant bits.

Rounding is to nearest, with one exception at the top of fp16's range: fp16 input from 65408
to 65504 would round to bf16's 65536, which decodes to inf in fp16, so it is sent as ±65280,
the largest bf16 value fp16 holds (rounded toward zero). Like ``fp16``, the cast follows IEEE
rounding elsewhere: only a value beyond bf16's overflow threshold (``|x| >= 3.3961e38``, the
top 0.2% of fp32's range, or a larger fp64) becomes inf, as with PyTorch's
``bf16_compress_hook``.
"""
from __future__ import annotations

import numpy as np
import torch

from .cast import CastCompressor
from .registry import register

_FP16_OVER = 0x4780  # bits of bf16's 65536, where fp16's 65408..65504 round to: beyond fp16
_FP16_TOP = 65280.0  # the largest bf16 value that fp16 holds


@register("bf16")
class BFloat16(CastCompressor):
    """Round to bfloat16: 16 bits per element; finite fp16 input never decodes to inf."""

    wire_dtype = torch.bfloat16

    def _compress(self, flat, shape, key, step, want_decoded):
        encoded = super()._compress(flat, shape, key, step, want_decoded)
        if flat.dtype == torch.float16 and _reaches_fp16_overflow(encoded.tensors[0]):
            wire = encoded.tensors[0]
            over = wire.abs() == 2.0 ** 16  # inf and NaN compare unequal: they stay as they are
            wire[over] = torch.where(wire[over] > 0, _FP16_TOP, -_FP16_TOP).to(wire.dtype)
        return encoded


def _reaches_fp16_overflow(wire: torch.Tensor) -> bool:
    """Whether some |element| of the bf16 ``wire`` is at least 65536 (inf and NaN included),
    from the bit patterns: their int16 maximum (positive side) and uint16 maximum (negative)."""
    bits = wire.view(torch.int16)
    if wire.device.type == "cpu":  # numpy's integer maxima: ~1.7 ms per 25M elements each
        ints = bits.numpy()
        return bool(ints.max(initial=0) >= _FP16_OVER or ints.view(np.uint16).max(initial=0) >= 0x8000 | _FP16_OVER)
    return bool(((bits & 0x7FFF) >= _FP16_OVER).any())
