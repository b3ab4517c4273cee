"""``int4`` and ``int2``: symmetric absmax quantisation per block of 32, packed.

Each block of 32 elements sends ``scale = max |x| / L`` (float32, rounded up as int8's are;
non-finite input follows int8's rules) and levels ``q = round(x / scale)`` in ``[-L, L]``:
``L = 7`` packed two per byte (``int4``), ``L = 1`` packed four per byte (``int2``). The
payload size follows from ``numel`` alone. Rounding to nearest: biased, use error feedback.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gradcomp.kernels import pack_codes, unpack_codes
from gradcomp.kernels.quant import (block_absmax, dequantize_levels, fp32_scales, num_blocks, quantize_levels,
                                   tiny_safe_div, unit_multipliers)

from .base import Capabilities, Compressor, CompressorConfig, Encoded, expect, tensor_spec, work_dtype
from .registry import register
from .transaction import refuse

_BLOCK = 32


class _LowBit(Compressor):
    levels = 7
    bits = 4

    @dataclass(frozen=True)
    class Config(CompressorConfig):
        pass

    config: Config

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(stochastic=False, unbiased=False)

    @classmethod
    def _per_byte(cls) -> int:
        return 8 // cls.bits

    def _compress(self, flat, shape, key, step, want_decoded):
        x = flat.to(work_dtype(flat.dtype))
        top = block_absmax(x, _BLOCK)
        scale = fp32_scales(x, tiny_safe_div(top, self.levels), _BLOCK, self.name, bounded=True, refuse=refuse)
        xs, mult = unit_multipliers(x, scale.to(x.dtype), _BLOCK)
        q = quantize_levels(xs, mult, _BLOCK, self.levels)
        return Encoded([scale, self._pack(q)], {})

    def _pack(self, q):
        """Levels ``[-L, L]`` as codes ``q + L``, packed by :func:`~gradcomp.kernels.pack_codes`."""
        return pack_codes((q.to(torch.int16) + self.levels).to(torch.uint8), self.bits)

    def _unpack(self, packed, n):
        return (unpack_codes(packed, n, self.bits).to(torch.int16) - self.levels).to(torch.int8)

    def _decompress(self, payload):
        scale, packed = payload.tensors
        q = self._unpack(packed, payload.numel)
        wd = work_dtype(payload.dtype)
        return dequantize_levels(q, scale.to(wd), _BLOCK, wd)

    def _wire_bytes(self, numel):
        return 4.0 * num_blocks(numel, _BLOCK) + -(-numel // self._per_byte())

    @classmethod
    def _check_tensors(cls, payload):
        expect(not payload.meta, cls.name, "meta must be empty")
        n = payload.numel
        tensor_spec(payload, [(torch.float32, num_blocks(n, _BLOCK)), (torch.uint8, -(-n // cls._per_byte()))],
                    cls.name)


@register("int4")
class Int4(_LowBit):
    """Absmax int4 per block of 32: 4 bits per element (two per byte) plus an fp32 scale."""

    levels = 7
    bits = 4


@register("int2")
class Int2(_LowBit):
    """Absmax ternary levels per block of 32: 2 bits per element (four per byte) plus an fp32 scale."""

    levels = 1
    bits = 2
