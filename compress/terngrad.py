"""``terngrad``: ternary gradients ``{-1, 0, 1} * scale`` (Wen et al. 2017, TernGrad).

Per bucket the scale is ``max |x|`` (fp32 on the wire) and each element becomes
``sign(x) * scale`` with probability ``|x| / scale``, else 0, so the result is unbiased. The
ternary codes ``level + 1`` are packed 2 bits per element. ``bucket_size=0`` uses one scale for
the whole tensor, as the paper's layer-wise TernGrad; smaller buckets lower the variance.

``clip=c`` (the paper uses 2.5) first clips ``x`` to ``[-c * sigma, c * sigma]`` with ``sigma``
the standard deviation of the whole tensor: a smaller scale and lower variance, but the clipped
elements make the result biased.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gradcomp.kernels.bits import pack_codes, packed_nbytes, unpack_codes
from gradcomp.kernels.quant import (block_absmax, dequantize_levels, fp32_scales, num_blocks,
                                   quantize_levels, unit_multipliers)

from .base import (Capabilities, Compressor, CompressorConfig, Encoded, expect, meta_int, option, seed_option,
                   tensor_spec, work_dtype)
from .registry import register
from .transaction import refuse


def _block(bucket_size: int, numel: int) -> int:
    return bucket_size if bucket_size else max(numel, 1)


@register("terngrad")
class TernGrad(Compressor):
    """Unbiased stochastic ternarisation, 2 bits per element plus an fp32 scale per bucket."""

    @dataclass(frozen=True)
    class Config(CompressorConfig):
        bucket_size: int = option(512, "elements per fp32 scale (0: one scale per tensor, as in the "
                                  "paper); smaller buckets => lower variance, 32 more bits per bucket",
                                  lambda v: v >= 0, "an int >= 0")
        clip: float = option(0.0, "clip |x| to clip * std(x) before ternarising (0: off; the paper uses "
                             "2.5); lower => lower variance but more bias",
                             lambda v: v == 0 or 0 < v < math.inf, "0 (off) or a finite float > 0")
        seed: int = seed_option()

    config: Config

    @property
    def capabilities(self) -> Capabilities:
        # the option decides: clipping biases the clipped elements
        return Capabilities(unbiased=self.config.clip == 0, stochastic=True)

    def _compress(self, flat, shape, key, step, want_decoded):
        x = flat.to(work_dtype(flat.dtype))
        bs = _block(self.config.bucket_size, x.numel())
        scale = block_absmax(x, bs)
        clip = self.config.clip
        if clip and x.numel() > 1:
            limit = clip * x.std()
            if float(limit) != 0:  # a constant tensor is not clipped to zero; NaN propagates
                scale = torch.minimum(scale, limit)
        scale32 = fp32_scales(x, scale, bs, self.name, flat.dtype, bounded=True, refuse=refuse)  # at most max |x|
        # a subnormal scale has no finite float32 reciprocal: such blocks are scaled up exactly
        xs, mult = unit_multipliers(x, scale32.to(x.dtype), bs)
        u = self._uniform(x.numel(), key, step, x.device)
        levels = quantize_levels(xs, mult, bs, 1, u, overwrite_u=True)  # clipped values saturate
        codes = pack_codes(levels.add_(1).view(torch.uint8), 2)
        return Encoded([scale32, codes], {"bucket_size": self.config.bucket_size})

    def _decompress(self, payload):
        return self._decode(payload, 0, payload.numel)

    def _decode(self, payload, a, b):
        """Elements ``a:b`` (``a`` at a bucket start that is a multiple of 4) in the work dtype."""
        scale, codes = payload.tensors
        bs = _block(payload.meta["bucket_size"], payload.numel)
        levels = unpack_codes(codes[a // 4:packed_nbytes(b, 2)], b - a, 2).view(torch.int8).sub_(1)
        wd = work_dtype(payload.dtype)
        return dequantize_levels(levels, scale[a // bs:num_blocks(b, bs)].to(wd), bs, wd)

    def _decompress_into(self, payload, out, alpha, accumulate):
        # runs of whole buckets that start on a byte of the packed codes
        align = math.lcm(_block(payload.meta["bucket_size"], payload.numel), 4)
        self._decode_runs_into(payload, out, align, alpha, accumulate)

    def _wire_bytes(self, numel):
        return 4.0 * num_blocks(numel, _block(self.config.bucket_size, numel)) + packed_nbytes(numel, 2)

    @classmethod
    def _check_tensors(cls, payload):
        bs = meta_int(payload, "bucket_size", cls.name, 0)
        expect(set(payload.meta) == {"bucket_size"}, cls.name, "meta must hold only bucket_size")
        n = payload.numel
        tensor_spec(payload, [(torch.float32, num_blocks(n, _block(bs, n))),
                              (torch.uint8, packed_nbytes(n, 2))], cls.name)
