"""``int8``: block-wise absmax quantisation to int8 (as in LLM.int8 / 8-bit optimizers).

Each block of ``block_size`` elements sends ``scale = max |x| / 127`` (fp32) and the integers
``q = x / scale`` in ``[-127, 127]`` (int8; -128 is never used, so the grid is symmetric).
Rounding is to nearest (error at most ``scale / 2``, biased) or, with ``stochastic=True``,
stochastic (error below ``scale``, unbiased). A scale below float32's smallest normal (blocks
with ``max |x| < 1.5e-36``) is rounded up, so it is never 0 and ``|q| <= 127`` still holds,
and its levels are computed exactly (see ``kernels.quant.unit_multipliers``): such blocks
decode as accurately as their subnormal scale allows, never to ``±max |x|``. At the other end a
float32 scale whose 127 multiple would round past float32's max is one ulp lower, so finite
input never decodes to inf (the largest element may then lose that ulp).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gradcomp.kernels.quant import (block_absmax, block_runs, dequantize_levels, fp32_scales, may_hold, num_blocks,
                                   quantize_levels, tiny_safe_div, unit_multipliers)

from .base import (Capabilities, Compressor, CompressorConfig, Encoded, expect, meta_int, option, positive_int,
                   seed_option, tensor_spec, work_dtype)
from .registry import register
from .transaction import refuse

_LEVELS = 127
_FP32_MAX = torch.finfo(torch.float32).max


@register("int8")
class Int8(Compressor):
    """Absmax int8 per block: 8 bits per element plus an fp32 scale per block."""

    @dataclass(frozen=True)
    class Config(CompressorConfig):
        block_size: int = positive_int("elements per fp32 scale; smaller blocks => smaller error next to "
                                       "outliers, 32 more bits per block", 256)
        stochastic: bool = option(False, "round stochastically: unbiased, but up to twice the error of "
                                  "rounding to nearest", capability=True)
        seed: int = seed_option()

    config: Config

    @property
    def capabilities(self) -> Capabilities:
        # the option decides: stochastic rounding draws randomness and is what makes int8 unbiased
        return Capabilities(stochastic=self.config.stochastic, unbiased=self.config.stochastic)

    def _compress(self, flat, shape, key, step, want_decoded):
        x = flat.to(work_dtype(flat.dtype))
        scale32 = self._scales(x)
        u = self._uniform(x.numel(), key, step, x.device) if self.config.stochastic else None
        return Encoded([scale32, self._levels(x, scale32, u)], {"block_size": self.config.block_size})

    def _scales(self, x):
        """The fp32 wire scales ``max |x| / 127`` of ``x``'s blocks."""
        bs = self.config.block_size
        top = block_absmax(x, bs)
        scale = fp32_scales(x, tiny_safe_div(top, _LEVELS), bs, self.name, bounded=True, refuse=refuse)  # max |x| / 127
        if x.dtype == torch.float32 and scale.numel():
            # 127 * scale would round past float32's max: one ulp lower, 127 then costs that ulp
            over = torch.isfinite(scale) & (scale.double() * _LEVELS > _FP32_MAX)
            if may_hold(over):
                scale = torch.where(over, torch.nextafter(scale, torch.zeros_like(scale)), scale)
        return scale

    def _levels(self, x, scale32, u):
        bs = self.config.block_size
        xs, mult = unit_multipliers(x, scale32.to(x.dtype), bs)
        return quantize_levels(xs, mult, bs, _LEVELS, u, overwrite_u=True)

    def _compress_residual(self, flat, key, step):
        """One pass over ``flat`` (the fp32/fp64 accumulator) in cache-sized runs of whole
        blocks: scales, levels, and ``flat -= levels * scale``, with the bits of ``_compress``
        followed by ``_decompress`` and a subtraction."""
        bs, n = self.config.block_size, flat.numel()
        # fp64 scales can overflow the fp32 wire: found before anything is changed
        whole = self._scales(flat) if flat.dtype == torch.float64 else None
        scale32 = torch.empty(num_blocks(n, bs), dtype=torch.float32, device=flat.device)
        levels = torch.empty(n, dtype=torch.int8, device=flat.device)
        u = self._uniform(n, key, step, flat.device) if self.config.stochastic else None
        for a, b in block_runs(n, bs, flat.device):
            x, blocks = flat[a:b], slice(a // bs, num_blocks(b, bs))
            s = whole[blocks] if whole is not None else self._scales(x)
            scale32[blocks] = s
            q = levels[a:b]
            q.copy_(self._levels(x, s, None if u is None else u[a:b]))
            x.sub_(dequantize_levels(q, s.to(x.dtype), bs, x.dtype))
        return Encoded([scale32, levels], {"block_size": bs})

    def _decompress(self, payload):
        return self._decode(payload, 0, payload.numel)

    def _decode(self, payload, a, b):
        """Elements ``a:b`` (``a`` at a block start) in the work dtype."""
        scale, levels = payload.tensors
        bs, wd = payload.meta["block_size"], work_dtype(payload.dtype)
        return dequantize_levels(levels[a:b], scale[a // bs:num_blocks(b, bs)].to(wd), bs, wd)

    def _decompress_into(self, payload, out, alpha, accumulate):
        self._decode_runs_into(payload, out, payload.meta["block_size"], alpha, accumulate)

    def _wire_bytes(self, numel):
        return 4.0 * num_blocks(numel, self.config.block_size) + numel

    @classmethod
    def _check_tensors(cls, payload):
        bs = meta_int(payload, "block_size", cls.name, 1)
        expect(set(payload.meta) == {"block_size"}, cls.name, "meta must hold only block_size")
        n = payload.numel
        tensor_spec(payload, [(torch.float32, num_blocks(n, bs)), (torch.int8, n)], cls.name)
