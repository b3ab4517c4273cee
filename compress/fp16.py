"""``fp16``: cast to IEEE half precision for the wire (2x fewer bytes than fp32).

fp16 keeps 11 significant bits but overflows above 65504: such elements become inf, as with
PyTorch's ``fp16_compress_hook``, rather than being clipped silently.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from gradcomp.kernels.memory import empty

from .base import Capabilities, Compressor, Encoded, tensor_spec
from .registry import register


class CastCompressor(Compressor):
    """Base of the 16-bit casts: the wire dtype is the only difference."""

    wire_dtype: ClassVar[torch.dtype] = torch.float16
    capabilities = Capabilities(native=True)

    def _compress(self, flat, shape, key, step, want_decoded):
        # a numpy-backed buffer: no page-fault cost for a large gradient on CPU
        return Encoded([empty(flat.numel(), self.wire_dtype, flat.device).copy_(flat)], {})

    def _decompress(self, payload):
        return payload.tensors[0]

    def _decompress_into(self, payload, out, alpha, accumulate):
        wire = payload.tensors[0]
        if accumulate:
            out.add_(wire, alpha=alpha)
        elif alpha == 1.0:
            out.copy_(wire)
        else:
            torch.mul(wire.to(out.dtype), alpha, out=out)

    def _wire_bytes(self, numel):
        return 2.0 * numel

    @classmethod
    def _check_tensors(cls, payload):
        tensor_spec(payload, [(cls.wire_dtype, payload.numel)], cls.name)


@register("fp16")
class Float16(CastCompressor):
    """Round to IEEE half precision: 16 bits per element, deterministic rounding."""

    wire_dtype = torch.float16
