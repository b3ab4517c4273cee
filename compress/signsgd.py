"""``signsgd``: send only the sign of each element (Bernstein et al. 2018, signSGD).

Wire: the signs packed 1 bit per element, plus one fp32 word (``magnitude``). Decoded as
``+magnitude`` where ``x >= 0`` (zero counts as positive) and ``-magnitude`` elsewhere. The
magnitude is 1, or NaN when the input holds NaN or Inf: a sign cannot carry them, and AMP's
loss scaler must still see the overflow to skip the step. Biased; the gradient's scale is
lost, so the learning rate sets the step size (majority vote is a matter of the collective).

The packing, decoding and checks are :class:`gradcomp.compress.sign.SignCompressor`'s.
"""
from __future__ import annotations

import math

import torch

from .registry import register
from .sign import SignCompressor, finite_flag


@register("signsgd")
class SignSGD(SignCompressor):
    """Sign of each element, decoded as +1 / -1: 1 bit per element plus one fp32 word."""

    def _values(self, x, sums, bits):
        return torch.where(finite_flag(sums[0], x), 1.0, math.nan).to(torch.float64).reshape(1)
