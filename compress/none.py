"""``none``: the identity. Sends the tensor as it is; the dense baseline."""
from __future__ import annotations

from gradcomp.kernels.memory import clone

from .base import Capabilities, Compressor, Encoded, tensor_spec
from .payload import Payload
from .registry import register


@register("none")
class NoCompression(Compressor):
    """Identity: 32 bits per fp32 element, exact."""

    capabilities = Capabilities(native=True, unbiased=True)

    def _compress(self, flat, shape, key, step, want_decoded):
        return Encoded([clone(flat)], {})

    def compress_view(self, tensor, key=None, *, step=None):
        """The input itself as the payload's tensor (flattened; copied only when not
        contiguous), the key's counter advanced as :meth:`compress` advances it."""
        self._check_input(tensor)
        self._step(key, step)
        flat = tensor.detach().reshape(-1)
        return Payload(self.name, tuple(tensor.shape), tensor.dtype, [flat if flat.is_contiguous() else flat.contiguous()],
                       {}, self.payloads_checked)

    def _decompress(self, payload):
        return payload.tensors[0]

    def decoding_of(self, payload):
        t = payload.tensors[0] if payload.compressor == self.name and len(payload.tensors) == 1 else None
        if t is None or t.dtype != payload.dtype or not t.is_contiguous() or t.numel() != payload.numel:
            return None
        return t.view(payload.shape)

    def _wire_bytes(self, numel):
        return 4.0 * numel

    @classmethod
    def _check_tensors(cls, payload):
        tensor_spec(payload, [(payload.dtype, payload.numel)], cls.name)
