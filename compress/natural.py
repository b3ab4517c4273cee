"""``natural``: stochastic rounding to powers of two (Horvath et al. 2019, natural compression).

Each value ``x`` with ``2**k <= |x| < 2**(k+1)`` becomes ``sign(x) * 2**(k+1)`` with
probability ``|x| / 2**k - 1``, else ``sign(x) * 2**k``: unbiased, and the relative variance is
at most 1/8. Zero stays zero.

What is sent: one byte per element, ``sign << 7 | m``, plus one int32 ``E`` per tensor, the
least exponent with ``max |x| < 2**E``. ``m`` in 1..125 stands for ``2**(m - 125 + E)``, so the
125 binades below the largest value are kept exactly (the paper's 9 bits keep fp32's whole
exponent range; gradients span far fewer binades). Magnitudes below ``2**(E - 124)`` round to
0 or ``2**(E - 124)``, still unbiasedly. ``m = 0`` is zero, 126 is inf and 127 NaN, so non-finite
inputs arrive as they were sent. Decoded powers of two above the largest one of the tensor's
dtype saturate to it (fp16: values above 2**15 may be rounded down), never to inf.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gradcomp.kernels.quant import natural_decode, natural_encode

from .base import Capabilities, Compressor, CompressorConfig, Encoded, expect, seed_option, tensor_spec, work_dtype
from .payload import Payload
from .registry import register

_EXP_RANGE = (-1074, 1024)  # frexp exponents of float64's smallest and largest magnitudes


@register("natural")
class Natural(Compressor):
    """Unbiased rounding to a neighbouring power of two: 8 bits per element plus 32 per tensor."""

    @dataclass(frozen=True)
    class Config(CompressorConfig):
        seed: int = seed_option()

    config: Config
    capabilities = Capabilities(unbiased=True, stochastic=True)

    def _compress(self, flat, shape, key, step, want_decoded):
        u = self._uniform(flat.numel(), key, step, flat.device)
        codes, exp = natural_encode(flat, u, overwrite_u=True)  # exp: an int on CPU, a device tensor elsewhere
        if isinstance(exp, torch.Tensor):
            exp = exp.reshape(1)
        else:
            exp = torch.tensor([exp], dtype=torch.int32, device=flat.device)
        return Encoded([codes, exp], {})

    def _decompress(self, payload):
        return self._decode(payload, 0, payload.numel)

    def _decode(self, payload, a, b):
        """Elements ``a:b`` in the work dtype (a table lookup)."""
        codes, exp = payload.tensors
        return natural_decode(codes[a:b], exp[0], work_dtype(payload.dtype), payload.dtype)

    def _decompress_into(self, payload, out, alpha, accumulate):
        self._decode_runs_into(payload, out, 1, alpha, accumulate)

    def _wire_bytes(self, numel):
        return numel + 4.0

    @classmethod
    def check_on_device(cls, payload):
        """The exponent of a payload on an agreed layout, clamped into range (the table stays
        finite) and flagged on the device when it was out of it."""
        codes, exp = payload.tensors
        lo, hi = _EXP_RANGE
        bad = torch.logical_or(exp < lo, exp > hi).any()
        return Payload(payload.compressor, payload.shape, payload.dtype, [codes, exp.clamp(lo, hi)],
                       dict(payload.meta), True), bad

    @classmethod
    def _check_tensors(cls, payload):
        tensor_spec(payload, [(torch.uint8, payload.numel), (torch.int32, 1)], cls.name)
        expect(not payload.meta, cls.name, "meta must be empty")
        lo, hi = _EXP_RANGE
        exp = int(payload.tensors[1][0])
        expect(lo <= exp <= hi, cls.name, f"exponent {exp} must be in [{lo}, {hi}]")
