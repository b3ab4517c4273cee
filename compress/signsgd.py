"""``signsgd``: send only the sign of each element (Bernstein et al. 2018, signSGD).

Wire: the signs packed 1 bit per element, plus one fp32 word (``magnitude``). Decoded as
``+magnitude`` where ``x >= 0`` and ``-magnitude`` elsewhere. The magnitude is 1; 0 when
every element is 0, so that sign(0) = 0 for a gradient of zeros (a layer that got none moves
nothing); NaN when the input holds NaN or Inf: a sign cannot carry them, and AMP's loss
scaler must still see the overflow to skip the step. One bit per element has no room for a
third value, so a zero among non-zero elements is sent as +1 (error feedback keeps the -1
of it). Biased; the gradient's scale is
lost, so the learning rate sets the step size (majority vote is a matter of the collective).

The packing, decoding and checks are :class:`gradcomp.compress.sign.SignCompressor`'s.
"""
from __future__ import annotations

from .registry import register
from .sign import SignCompressor, zero_or_one


@register("signsgd")
class SignSGD(SignCompressor):
    """Sign of each element, decoded as +1 / -1 (0 for a tensor of zeros): 1 bit per element
    plus one fp32 word."""

    stats = "abs"  # sum(|x|): finite exactly when x is, and 0 exactly when every element is 0

    def _values(self, x, sums, bits):
        return zero_or_one(sums[0], x)
