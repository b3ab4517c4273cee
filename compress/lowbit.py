"""``int4``, ``int2`` and ``fp4``: block-scaled 4- and 2-bit codes, one scale per block of 32, packed.

Each block of 32 elements sends a scale ``s`` and one code per element; the block's largest
magnitude maps to the top of the code grid, ``top``:

- ``int4`` / ``int2``: symmetric levels ``q = round(x / s)`` in ``[-top, top]``, ``top = 7`` packed
  two per byte, ``top = 1`` (ternary) four per byte;
- ``fp4``: e2m1 minifloats, ``±{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` times ``s`` (``top = 6``), two per
  byte: OCP microscaling's FP4, rounded as ``kernels.minifloat`` states.

The ``scale`` option sets what a scale costs:

- ``"fp32"`` (32 bits): ``s = max |x| / top`` rounded as int8's is; non-finite input follows
  int8's rules (an fp64 block beyond float32's range is refused);
- ``"fp16"`` (16 bits): ``max |x| / top`` rounded up to a float16 (a positive one below 2**-24
  becomes 2**-24, never 0);
- ``"e8m0"`` (8 bits, a power of two ``2**(c - 127)``): OCP MX's shared scale
  ``2**(floor(log2 max |x|) - emax)``, ``2**emax`` the grid's largest power of two (4 for fp4 and
  int4, 1 for int2), so the largest element lands in ``[2**emax, 2**(emax+1))`` scale units and
  clips to ``top`` above it; ``2**-127`` at least. A block holding NaN or inf sends the NaN code.

Per element that is 4 + 32/32 = 5 bits (int4 and fp4 with fp32 scales), 4.5 (fp16) or 4.25
(e8m0); int2 3, 2.5 or 2.25. A scale whose ``top`` multiple would decode to inf in the gradient's
dtype is lowered to the largest that does not: finite input never decodes to inf or NaN; such
a block saturates at the largest decodable value (error feedback carries the rest).

Relative error ``||x - decoded|| / ||x||`` on ``torch.randn(2**20)`` (tests/compress/
test_lowbit_codecs.py), scale fp32 / fp16 / e8m0: int4 0.097 / 0.097 / 0.133, int2 0.658 /
0.658 / 0.535, fp4 0.101 / 0.101 / 0.115. Defaults: ``fp32`` for int4 and int2 (the payload of
before the option); ``e8m0`` for fp4, as MX sends it: a quarter bit per element less than fp16
(4.25 against 4.5, 15% less than fp32's 5) for 14% more error, which error feedback carries;
``scale="fp16"`` is the choice where error weighs more than that quarter bit. OCP's rounded-down
exponent clips a block's largest element by up to a quarter (fp4) yet errs less than the least
power of two above ``max |x| / top``, which clips nothing (fp4 0.116, int4 0.144, int2 0.876)
and whose ternary grid overshoots a block's largest element by up to 2x, which stalled error
feedback on a quadratic. Rounding to nearest is biased: use error feedback.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Tuple

import torch

from gradcomp.kernels import pack_codes, unpack_codes
from gradcomp.kernels.minifloat import (E2M1_TOP, E8M0_BIAS, E8M0_TOP, e2m1_codes, e2m1_decode, e8m0_codes,
                                        e8m0_values, fp16_ceil)
from gradcomp.kernels.quant import (block_absmax, dequantize_levels, div_scalar, fp32_scales, num_blocks, quantize_levels,
                                   tiny_safe_div, unit_multipliers)

from .base import Capabilities, Compressor, CompressorConfig, Encoded, expect, option, tensor_spec, work_dtype
from .registry import register
from .transaction import refuse

_BLOCK = 32
SCALE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "e8m0": torch.uint8}  # the wire dtype of each
_SCALE_OF = {dtype: fmt for fmt, dtype in SCALE_DTYPES.items()}


def _scale_option(default: str) -> str:
    return option(default, "format of each block's scale: 'fp32' (32 bits per block of 32), 'fp16' (16 bits, "
                  "rounded up) or 'e8m0' (8 bits, a power of two as MX sends it); fewer bits => fewer bytes, a "
                  "coarser scale (more error for int4 and fp4)", choices=tuple(SCALE_DTYPES))


@functools.lru_cache(maxsize=None)
def scale_cap(fmt: str, top: float, dtype: torch.dtype) -> float:
    """The largest scale of format ``fmt`` whose ``top`` multiple, computed in the work dtype
    and cast to ``dtype``, is finite. Found on the host once, by bisection over the format's
    codes (a larger code is a larger scale)."""
    wd = work_dtype(dtype)
    if fmt == "e8m0":
        last = E8M0_TOP

        def value(c: int) -> float:
            return 2.0 ** (c - E8M0_BIAS)
    else:
        wire, bits = SCALE_DTYPES[fmt], {"fp32": torch.int32, "fp16": torch.int16}[fmt]
        last = int(torch.tensor(torch.finfo(wire).max, dtype=wire).view(bits))  # positive floats order as their bits

        def value(c: int) -> float:
            return float(torch.tensor(c, dtype=bits).view(wire))

    def finite(c: int) -> bool:
        return bool(torch.isfinite((torch.tensor(value(c), dtype=wd) * top).to(dtype)))

    lo, hi = 0, last  # finite(lo) holds: code 0 is the least scale
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if finite(mid) else (lo, mid - 1)
    return value(lo)


class _LowBit(Compressor):
    """A block-scaled codec: ``top`` (the grid's largest magnitude, in units of the scale) and
    ``bits`` per code; subclasses say how elements become codes and codes values."""

    top: float = 7.0
    bits: int = 4

    @dataclass(frozen=True)
    class Config(CompressorConfig):
        scale: str = _scale_option("fp32")

    config: Config

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(stochastic=False, unbiased=False)

    @classmethod
    def _per_byte(cls) -> int:
        return 8 // cls.bits

    # ---- what a subclass says ----------------------------------------------------------------
    def _codes(self, xs: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
        """uint8 codes of ``xs * mult[block]`` (``mult``: 1 / the decoded scale, per block)."""
        raise NotImplementedError

    @classmethod
    def _values(cls, codes: torch.Tensor, step: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The decoding of ``codes`` with decoded scales ``step``, as a new tensor of ``dtype``."""
        raise NotImplementedError

    @classmethod
    def _code_limit(cls) -> int:
        """The largest valid code (a field of ``bits`` may hold more)."""
        return (1 << cls.bits) - 1

    # ---- scales ------------------------------------------------------------------------------
    def _scales(self, x: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(wire, step)``: each block's scale of ``x`` (a gradient of ``dtype``, in its work
        dtype) as sent and as decoded (in ``x``'s dtype)."""
        fmt, top = self.config.scale, self.top
        amax = block_absmax(x, _BLOCK)
        cap = scale_cap(fmt, top, dtype)
        if fmt == "fp32":
            wire = fp32_scales(x, tiny_safe_div(amax, top), _BLOCK, self.name, bounded=True, refuse=refuse)
            wire = _lowered(wire, cap)
            return wire, wire.to(x.dtype)
        if fmt == "e8m0":  # the cap is a power of two: its code bounds the codes
            wire = e8m0_codes(amax, math.frexp(top)[1] - 1, int(math.log2(cap)) + E8M0_BIAS)
            return wire, e8m0_values(wire, x.dtype)
        wire = fp16_ceil(_lowered(div_scalar(amax.to(torch.float64), top), cap))  # one rounding, then fp16's
        return wire, wire.to(x.dtype)

    def _compress(self, flat, shape, key, step, want_decoded):
        x = flat.to(work_dtype(flat.dtype))
        wire, scale = self._scales(x, flat.dtype)
        xs, mult = unit_multipliers(x, scale, _BLOCK)
        return Encoded([wire, pack_codes(self._codes(xs, mult), self.bits)], {})

    def _decompress(self, payload):
        wire, packed = payload.tensors
        wd = work_dtype(payload.dtype)
        step = e8m0_values(wire, wd) if wire.dtype == torch.uint8 else wire.to(wd)
        return self._values(unpack_codes(packed, payload.numel, self.bits), step, wd)

    def _wire_bytes(self, numel):
        scale_bytes = SCALE_DTYPES[self.config.scale].itemsize
        return float(scale_bytes * num_blocks(numel, _BLOCK) + -(-numel // self._per_byte()))

    # ---- what a receiver checks --------------------------------------------------------------
    @classmethod
    def _check_tensors(cls, payload):
        expect(not payload.meta, cls.name, "meta must be empty")
        n = payload.numel
        wire = payload.tensors[0] if payload.tensors else None
        fmt = _SCALE_OF.get(wire.dtype) if isinstance(wire, torch.Tensor) else None
        expect(fmt is not None, cls.name, f"tensor 0 (the scales) must be one of "
                                          f"{', '.join(str(d) for d in SCALE_DTYPES.values())}")
        tensor_spec(payload, [(SCALE_DTYPES[fmt], num_blocks(n, _BLOCK)), (torch.uint8, -(-n // cls._per_byte()))],
                    cls.name)
        expect(not bool(_negative(wire)), cls.name, "a scale is negative")
        expect(not bool(cls._bad_codes(payload.tensors[1], n)), cls.name,
               f"a code exceeds {cls._code_limit()} or the last byte's unused bits are not zero")

    @classmethod
    def check_on_device(cls, payload):
        """Any bits of the agreed sizes decode without an out-of-range access; a negative scale,
        a code beyond the grid or padding bits set are flagged on the device."""
        wire, packed = payload.tensors
        return payload, _negative(wire) | cls._bad_codes(packed, payload.numel)

    @classmethod
    def _bad_codes(cls, packed: torch.Tensor, numel: int) -> torch.Tensor:
        """Whether a field of ``packed`` exceeds the largest code, or a padding field is set (0-d bool)."""
        bad = torch.zeros((), dtype=torch.bool, device=packed.device)
        if not packed.numel():
            return bad
        mask, limit = (1 << cls.bits) - 1, cls._code_limit()
        if limit < mask:
            for shift in range(0, 8, cls.bits):
                bad = bad | ((packed.bitwise_right_shift(shift) & mask) > limit).any()
        used = numel % cls._per_byte()
        if used:
            bad = bad | (packed[-1:].bitwise_right_shift(used * cls.bits) != 0).any()
        return bad


def _lowered(scale: torch.Tensor, cap: float) -> torch.Tensor:
    """``scale`` with its finite values above ``cap`` lowered to it (inf and NaN pass)."""
    over = (scale > cap) & (scale < float("inf"))
    return torch.where(over, torch.full_like(scale, cap), scale)


def _negative(wire: torch.Tensor) -> torch.Tensor:
    """Whether a float scale is negative (NaN is not; e8m0 has no sign): a 0-d bool tensor."""
    if wire.dtype == torch.uint8:
        return torch.zeros((), dtype=torch.bool, device=wire.device)
    return (wire < 0).any()


class _IntLevels(_LowBit):
    """Symmetric integer levels ``[-top, top]``, sent as codes ``q + top``."""

    def _codes(self, xs, mult):
        levels = int(self.top)
        q = quantize_levels(xs, mult, _BLOCK, levels)
        return (q.to(torch.int16) + levels).to(torch.uint8)

    @classmethod
    def _values(cls, codes, step, dtype):
        q = (codes.to(torch.int16) - int(cls.top)).to(torch.int8)
        return dequantize_levels(q, step, _BLOCK, dtype)

    @classmethod
    def _code_limit(cls):
        return 2 * int(cls.top)


@register("int4")
class Int4(_IntLevels):
    """Absmax int4 per block of 32: 4 bits per element (two per byte) plus a scale (fp32, fp16 or e8m0)."""

    top = 7.0
    bits = 4


@register("int2")
class Int2(_IntLevels):
    """Absmax ternary levels per block of 32: 2 bits per element (four per byte) plus a scale (fp32, fp16 or e8m0)."""

    top = 1.0
    bits = 2


@register("fp4")
class Fp4(_LowBit):
    """e2m1 minifloats (MX's FP4) per block of 32: 4 bits per element plus a scale (e8m0 by default)."""

    top = E2M1_TOP
    bits = 4

    @dataclass(frozen=True)
    class Config(_LowBit.Config):
        scale: str = _scale_option("e8m0")

    config: Config

    def _codes(self, xs, mult):
        return e2m1_codes(xs, mult, _BLOCK)

    @classmethod
    def _values(cls, codes, step, dtype):
        return e2m1_decode(codes, step, _BLOCK, dtype)
