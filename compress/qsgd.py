"""``qsgd``: stochastic quantisation to ``s`` levels per bucket (Alistarh et al. 2017, QSGD).

Each bucket of ``bucket_size`` elements sends its L2 norm (fp32) and, per element, an integer
level ``l`` in ``[-s, s]``, rounded stochastically from ``x * s / norm`` so that
``E[l * norm / s] = x``. Levels travel as fixed-width codes (no Elias coding): ``s = 127`` as
one int8 per element, smaller ``s`` as ``l + s`` packed into 2 bits (``s = 1``) or 4 bits
(``s <= 7``); ``s`` between 8 and 126 still costs 8 bits. The variance per bucket is at most
``min(d / s**2, sqrt(d) / s) * norm**2`` for ``d = bucket_size``.

Levels count units of the step ``norm / s`` exactly as the receiver computes it, so the
decoding is unbiased at every magnitude: where that step would be a float32 subnormal (norms
below ``s * 2**-126``) the wire norm is rounded up until the step is at least ``norm / s``
(never 0), and the levels are computed on the block scaled up exactly (see
``kernels.quant.unit_multipliers``). A decoded value beyond the largest finite value of the
gradient's dtype (fp16: within one step of 65504) saturates to it, never to inf.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gradcomp.kernels.bits import pack_codes, packed_nbytes, unpack_codes
from gradcomp.kernels.quant import (SMALLEST_NORMAL32, bucket_norms, clamp_blocks_, dequantize_levels,
                                   div_scalar, fp32_ceil, fp32_scales, may_hold, num_blocks, quantize_levels,
                                   tiny_safe_div, unit_multipliers)

from .base import (Capabilities, Compressor, CompressorConfig, Encoded, expect, meta_int, option, positive_int,
                   seed_option, tensor_spec, work_dtype)
from .registry import register
from .transaction import refuse


def code_bits(levels: int) -> int:
    """Packable width of the codes ``0 .. 2 * levels`` (one sign and ``ceil(log2(s + 1))`` bits)."""
    return 2 if levels == 1 else 4 if levels <= 7 else 8


@register("qsgd")
class QSGD(Compressor):
    """Unbiased stochastic rounding to ``levels`` levels of ``|x| / norm`` per bucket."""

    @dataclass(frozen=True)
    class Config(CompressorConfig):
        levels: int = option(127, "quantisation levels s per sign; more levels => lower variance, more "
                             "bits: s=1 -> 2 bits, s<=7 -> 4 bits, s<=127 -> 8 bits per element. 127 "
                             "fills a byte and keeps the variance below 3.2% of the norm**2 for "
                             "512-element buckets", lambda v: 1 <= v <= 127, "an int in [1, 127]")
        bucket_size: int = positive_int("elements per fp32 norm; smaller buckets => lower variance, 32 "
                                        "more bits per bucket", 512)
        seed: int = seed_option()

    config: Config
    capabilities = Capabilities(unbiased=True, stochastic=True)

    def _compress(self, flat, shape, key, step, want_decoded):
        x = flat.to(work_dtype(flat.dtype))
        s, bs = self.config.levels, self.config.bucket_size
        norms = _wire_norms(fp32_scales(x, bucket_norms(x, bs), bs, self.name, flat.dtype, refuse=refuse), s, x.dtype)
        xs, mult = unit_multipliers(x, div_scalar(norms.to(x.dtype), s), bs)  # the receiver's step
        u = self._uniform(x.numel(), key, step, x.device)
        levels = quantize_levels(xs, mult, bs, s, u, overwrite_u=True)
        bits = code_bits(s)
        if bits == 8:
            codes = levels  # one int8 per element is already packed
        else:
            codes = pack_codes(levels.add_(s).view(torch.uint8), bits)
        return Encoded([norms, codes], {"levels": s, "bucket_size": bs})

    def _decompress(self, payload):
        return self._decode(payload, 0, payload.numel)

    def _decode(self, payload, a, b):
        """Elements ``a:b`` (``a`` at a bucket start whose code starts a byte) in the work dtype."""
        norms, codes = payload.tensors
        s, bs = payload.meta["levels"], payload.meta["bucket_size"]
        bits = code_bits(s)
        if bits == 8:
            levels = codes[a:b]
        else:
            levels = unpack_codes(codes[a * bits // 8:packed_nbytes(b, bits)], b - a, bits).view(torch.int8).sub_(s)
        wd = work_dtype(payload.dtype)
        steps = div_scalar(norms[a // bs:num_blocks(b, bs)].to(wd), s)
        out = dequantize_levels(levels, steps, bs, wd)
        top = torch.finfo(payload.dtype).max
        if wd == torch.float32 and steps.numel():  # blocks that reach past the top of the range only
            clamp_blocks_(out, steps.double() * s, top, bs)
        return out

    def _decompress_into(self, payload, out, alpha, accumulate):
        # runs of whole buckets that start on a byte of the packed codes
        align = math.lcm(payload.meta["bucket_size"], 8 // code_bits(payload.meta["levels"]))
        self._decode_runs_into(payload, out, align, alpha, accumulate)

    def _wire_bytes(self, numel):
        c = self.config
        return 4.0 * num_blocks(numel, c.bucket_size) + packed_nbytes(numel, code_bits(c.levels))

    @classmethod
    def _check_tensors(cls, payload):
        s = meta_int(payload, "levels", cls.name, 1, 127)
        bs = meta_int(payload, "bucket_size", cls.name, 1)
        n = payload.numel
        bits = code_bits(s)
        tensor_spec(payload, [(torch.float32, num_blocks(n, bs)),
                              (torch.int8 if bits == 8 else torch.uint8, packed_nbytes(n, bits))], cls.name)
        expect(set(payload.meta) == {"levels", "bucket_size"}, cls.name, "meta must hold levels and bucket_size")


def _wire_norms(norms: torch.Tensor, s: int, dtype: torch.dtype) -> torch.Tensor:
    """The float32 wire norms, raised where the float32 step ``norm / s`` would be subnormal:
    to ``fp32_ceil(step * s)`` with ``step = norm / s`` rounded up, so the receiver's step (of
    the raised norm, rounded once) is at least ``norm / s`` and ``|x| / step <= s`` holds."""
    if work_dtype(dtype) != torch.float32:
        return norms  # float64 steps of float32 norms are never subnormal
    tiny = (norms > 0) & (norms < s * SMALLEST_NORMAL32)
    if not may_hold(tiny):
        return norms
    up = fp32_ceil(tiny_safe_div(norms, s).double() * s)
    return torch.where(tiny, up, norms)
