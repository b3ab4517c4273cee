"""``onebit``: 1-bit quantisation with two reconstruction values (Seide et al. 2014, 1-bit SGD).

Elements with ``x >= 0`` decode to the mean of those elements, the others to the mean of the
negative elements; both means travel as fp32 (1 bit per element plus 64 bits). Unlike a
scaled sign it keeps an asymmetric distribution's mean exactly: the decode keeps the input's
sum (up to rounding). Seide et al. always quantise with error feedback; wrap it in ``ErrorFeedback``. NaN/Inf
make the means, hence the output, non-finite.
"""
from __future__ import annotations

import torch

from gradcomp.kernels.sign import count_set_tensor

from .registry import register
from .sign import SignCompressor


@register("onebit")
class OneBit(SignCompressor):
    """Sign bit per element, decoded to the mean of its side: 1 bit per element plus two fp32."""

    n_values = 2
    stats = "split"

    def _values(self, x, sums, bits):
        counts = count_set_tensor(bits).to(torch.float64)
        counts = torch.stack([counts, x.numel() - counts])  # elements on each side, on the device
        # an empty side decodes nothing; NaN always lands on the negative side, so never here
        return torch.where(counts > 0, sums / counts, 0.0)
