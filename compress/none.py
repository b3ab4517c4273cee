"""``none``: the identity. Sends the tensor as it is; the dense baseline."""
from __future__ import annotations

from .base import Capabilities, Compressor, Encoded, tensor_spec
from .registry import register


@register("none")
class NoCompression(Compressor):
    """Identity: 32 bits per fp32 element, exact."""

    capabilities = Capabilities(native=True, unbiased=True)

    def _compress(self, flat, shape, key, step, want_decoded):
        return Encoded([flat.clone()], {})

    def _decompress(self, payload):
        return payload.tensors[0]

    def _wire_bytes(self, numel):
        return 4.0 * numel

    @classmethod
    def _check_tensors(cls, payload):
        tensor_spec(payload, [(payload.dtype, payload.numel)], cls.name)
