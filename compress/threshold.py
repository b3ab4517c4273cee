"""``threshold``: send every element with ``|x| >= tau`` and its position (Strom 2015).

Payload: ``[values, indices]`` as for ``topk`` (values in the input dtype, indices ascending,
int32 or int64 from 2**31 elements). The count depends on the data, so the size is variable:
64 bits per kept fp32 element, at worst twice the dense size. On a layout the ranks agreed on,
under error feedback, the collectives fix a capacity per tensor from the sizes they saw (see
``collectives/_shared.py``) and the payload has exactly that many elements: the first ones
selected and fillers (``compress/sparse.py``); what does not fit stays in the residual.
``tau`` is absolute: it must suit the scale of the gradients. NaN and Inf are always kept.
Biased: pair it with error feedback.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gradcomp.kernels.select import threshold_bounded, threshold_indices
from gradcomp.kernels.sparse import index_dtype

from .base import Capabilities, Compressor, CompressorConfig, Encoded, option
from .registry import register
from .sparse import (bound_for, bounded_payload, bounded_residual, check_sparse, decode_sparse, decode_sparse_into,
                     sparse_on_device, sparse_payload, sparse_residual)


@register("threshold")
class Threshold(Compressor):
    """Keep the elements with ``|x| >= tau``; a data-dependent number of values and indices."""

    @dataclass(frozen=True)
    class Config(CompressorConfig):
        tau: float = option(0.01, "magnitude an element needs to be sent; larger => fewer bytes, more "
                            "error left to error feedback", lambda v: math.isfinite(v) and v >= 0.0,
                            "a finite float >= 0")

    config: Config
    capabilities = Capabilities(fixed_size=False)
    payloads_checked = True  # threshold_indices: in range, ascending
    bounded_sizes = True

    def _compress(self, flat, shape, key, step, want_decoded):
        size = bound_for(key)
        if size is not None:
            tensors, decoded = bounded_payload(flat, *threshold_bounded(flat, self.config.tau, size), want_decoded)
        else:
            tensors, decoded = sparse_payload(flat, threshold_indices(flat, self.config.tau), want_decoded)
        return Encoded(tensors, {}, decoded)

    def _compress_residual(self, flat, key, step):
        size = bound_for(key)
        if size is not None:
            return Encoded(bounded_residual(flat, *threshold_bounded(flat, self.config.tau, size)), {})
        return Encoded(sparse_residual(flat, threshold_indices(flat, self.config.tau)), {})

    def _decompress(self, payload):
        return decode_sparse(payload)

    def _decompress_into(self, payload, out, alpha, accumulate):
        decode_sparse_into(payload, out, alpha, accumulate)

    def _wire_bytes(self, numel):
        """The worst case, every element kept: the real size depends on the data."""
        return numel * (4 + index_dtype(numel).itemsize)

    @classmethod
    def check_on_device(cls, payload):
        return sparse_on_device(payload, padded=True)

    @classmethod
    def _check_tensors(cls, payload):
        check_sparse(payload, cls.name, padded=True)
