"""``efsignsgd``: scaled sign (Karimireddy et al. 2019, "Error feedback fixes SignSGD").

Decoded as ``+scale`` where ``x >= 0`` and ``-scale`` elsewhere, with ``scale = ||x||_1 / d``:
the sign vector then has the input's l1 norm, which makes it a contraction and lets error
feedback (``ErrorFeedback(get_compressor("efsignsgd"))``) converge like SGD. Wire: 1 bit per
element plus the fp32 scale; NaN/Inf in the input make the scale, hence the output, non-finite.
"""
from __future__ import annotations

from .registry import register
from .sign import SignCompressor


@register("efsignsgd")
class EFSignSGD(SignCompressor):
    """Sign times the mean absolute value: 1 bit per element plus one fp32 scale."""

    stats = "abs"

    def _values(self, x, sums, bits):
        return sums / max(x.numel(), 1)
