"""``CastCompressor``: the shared base of the 16-bit casts (``fp16``, ``bf16``).

The payload is one tensor, the input cast to the subclass's ``wire_dtype``: 2 bytes per
element. It is ``native``: the payloads of many ranks may be averaged as they are, as PyTorch's
``fp16_compress_hook`` and ``bf16_compress_hook`` do. A subclass sets ``wire_dtype`` and may
adjust the cast.
"""
from __future__ import annotations

from typing import ClassVar

import torch

from gradcomp.kernels.memory import empty

from .base import Capabilities, Compressor, Encoded, tensor_spec


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
