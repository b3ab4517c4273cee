"""``fp16``: cast to IEEE half precision for the wire (2x fewer bytes than fp32).

fp16 keeps 11 significant bits but overflows above 65504: such elements become inf, as with
PyTorch's ``fp16_compress_hook``, rather than being clipped silently.
"""
from __future__ import annotations

import torch

from .cast import CastCompressor
from .registry import register


@register("fp16")
class Float16(CastCompressor):
    """Round to IEEE half precision: 16 bits per element, deterministic rounding."""

    wire_dtype = torch.float16
