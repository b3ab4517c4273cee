"""``bf16``: cast to bfloat16 for the wire; fp32's exponent range, 8 significant bits."""
from __future__ import annotations

import torch

from .fp16 import CastCompressor
from .registry import register


@register("bf16")
class BFloat16(CastCompressor):
    """Round to bfloat16: 16 bits per element, no overflow where fp32 has none."""

    wire_dtype = torch.bfloat16
