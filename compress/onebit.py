"""``onebit``: 1-bit quantisation with two reconstruction values (Seide et al. 2014, 1-bit SGD).

Elements with ``x >= 0`` decode to the mean of those elements, the others to the mean of the
negative elements; both means travel as fp32 (1 bit per element plus 64 bits). Unlike a
scaled sign it keeps an asymmetric distribution's mean exactly: the decode keeps the input's
sum (up to rounding). Seide et al. always quantise with error feedback; wrap it in ``ErrorFeedback``. NaN/Inf
make the means, hence the output, non-finite.
"""
from __future__ import annotations

from gradcomp.kernels.sign import count_set

from .registry import register
from .sign import SignCompressor


@register("onebit")
class OneBit(SignCompressor):
    """Sign bit per element, decoded to the mean of its side: 1 bit per element plus two fp32."""

    n_values = 2
    stats = "split"

    def _values(self, x, sums, bits):
        n_pos = count_set(bits)
        n_neg = x.numel() - n_pos
        pos, neg = sums.tolist()
        # an empty side decodes nothing; NaN always lands on the negative side, so never here
        return [pos / n_pos if n_pos else 0.0, neg / n_neg if n_neg else 0.0]
