"""``int8``: block-wise absmax quantisation to int8 (as in LLM.int8 / 8-bit optimizers).

Each block of ``block_size`` elements sends ``scale = max |x| / 127`` (fp32) and the integers
``q = x / scale`` in ``[-127, 127]`` (int8; -128 is never used, so the grid is symmetric).
Rounding is to nearest (error at most ``scale / 2``, biased) or, with ``stochastic=True``,
stochastic (error below ``scale``, unbiased).
"""
from __future__ import annotations

import torch

from gradcomp.kernels.quant import (block_absmax, dequantize_levels, div_scalar, fp32_scales, num_blocks,
                                   quantize_levels)

from .base import Compressor, Option, expect, meta_int, positive_int, seed_option, tensor_spec, work_dtype
from .registry import register

_LEVELS = 127


@register("int8")
class Int8(Compressor):
    """Absmax int8 per block: 8 bits per element plus an fp32 scale per block."""

    options = {
        "block_size": positive_int("elements per fp32 scale; smaller blocks => smaller error next "
                                   "to outliers, 32 more bits per block", 256),
        "stochastic": Option(False, bool, "round stochastically: unbiased, but up to twice the "
                             "error of rounding to nearest"),
        "seed": seed_option(),
    }

    def _post_init(self):
        # the option itself sets the instance's ``stochastic`` flag; unbiased goes with it
        self.unbiased = self.stochastic

    def _compress(self, flat, key, step):
        x = flat.to(work_dtype(flat.dtype))
        bs = self.block_size
        scale32 = fp32_scales(x, div_scalar(block_absmax(x, bs), _LEVELS), bs)
        scale_x = scale32.to(x.dtype)
        mult = torch.where(scale_x > 0, 1.0 / scale_x, torch.zeros_like(scale_x))
        u = self._uniform(x.numel(), key, step, x.device) if self.stochastic else None
        levels = quantize_levels(x, mult, bs, _LEVELS, u, overwrite_u=True)
        return [scale32, levels], {"block_size": bs}

    def _decompress(self, payload):
        scale, levels = payload.tensors
        wd = work_dtype(payload.dtype)
        return dequantize_levels(levels, scale.to(wd), payload.meta["block_size"], wd)

    def _wire_bytes(self, numel):
        return 4.0 * num_blocks(numel, self.block_size) + numel

    @classmethod
    def _check_tensors(cls, payload):
        bs = meta_int(payload, "block_size", cls.name, 1)
        expect(set(payload.meta) == {"block_size"}, cls.name, "meta must hold only block_size")
        n = payload.numel
        tensor_spec(payload, [(torch.float32, num_blocks(n, bs)), (torch.int8, n)], cls.name)
