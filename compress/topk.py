"""``topk``: send the k largest-magnitude elements and their positions (Aji & Heafield 2017).

Payload: ``[values, indices]`` — values in the input dtype, indices ascending, int32 (int64
from 2**31 elements on). ``k = max(1, round(ratio * numel))``, so the size depends only on
``numel``: 64 bits per kept fp32 element. Biased (small elements are dropped): pair it with
error feedback. NaN ranks as the largest magnitude, so it is sent and propagates.

The selection is exact (see ``gradcomp.kernels.select``); ties at the k-th magnitude go to the
lowest indices. The payload is built, checked and decoded by ``gradcomp.compress.sparse``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from gradcomp.kernels import cpu
from gradcomp.kernels.select import topk_abs_indices
from gradcomp.kernels.sparse import index_dtype

from .base import Capabilities, Compressor, CompressorConfig, Encoded
from .payload import Payload
from .registry import register
from .sign import mean_into
from .transaction import vouch_finite
from .sparse import (check_sparse, decode_sparse, decode_sparse_into, ratio_option, sparse_on_device, sparse_payload,
                     sparse_residual)


@register("topk")
class TopK(Compressor):
    """Exact top-k by magnitude: ``k = max(1, round(ratio * numel))`` values and indices."""

    @dataclass(frozen=True)
    class Config(CompressorConfig):
        ratio: float = ratio_option(0.01)

    config: Config
    capabilities = Capabilities()
    payloads_checked = True  # the exact selection's positions: in range, ascending
    starts_from_zeros = True  # the sparse mean visits only the positions sent

    def _k(self, numel: int) -> int:
        return 0 if numel == 0 else max(1, round(self.config.ratio * numel))

    def _select(self, flat: torch.Tensor, k: int, key: str, step: int) -> torch.Tensor:
        """Positions of the ``k`` largest magnitudes of ``flat`` (signed values)."""
        if 0 < 4 * k < flat.numel() and cpu.applies(flat.numel(), flat):
            return cpu.topk_abs_indices(flat, k)  # the same indices, the candidate pass fused
        return topk_abs_indices(flat, k)

    def _compress(self, flat, shape, key, step, want_decoded):
        idx = self._select(flat, self._k(flat.numel()), key, step)
        tensors, decoded = sparse_payload(flat, idx, want_decoded)
        return Encoded(tensors, {}, decoded)

    def _compress_residual(self, flat, key, step):
        return Encoded(sparse_residual(flat, self._select(flat, self._k(flat.numel()), key, step)), {})

    def _compress_residual_sum(self, flat, a, b, key, step, defer=None):
        k = self._k(flat.numel())
        if type(self)._select is not TopK._select or not (0 < 4 * k < flat.numel() and cpu.applies(flat.numel(), flat, a, b)):
            return None
        return Encoded(sparse_residual(flat, cpu.topk_abs_indices(flat, k, sum_of=(a, b))), {})

    def _decompress(self, payload):
        return decode_sparse(payload)

    def _decompress_into(self, payload, out, alpha, accumulate):
        decode_sparse_into(payload, out, alpha, accumulate)

    def decompress_mean_into(self, payloads: Sequence[Payload], out: torch.Tensor, *,
                             zeroed: bool = False) -> torch.Tensor:
        """``out`` = the mean of the payloads' decodings, with the bits of
        ``SignCompressor.decompress_mean_into``'s reference (decode each in turn, divide once);
        where the fused CPU loops apply, zeros and one visit of each sent position, no dense
        division."""
        tensors = [t for p in payloads if isinstance(p, Payload) and p.compressor == self.name for t in p.tensors]
        if (len(tensors) != 2 * len(payloads) or not payloads or not out.is_contiguous() or
                not cpu.applies(out.numel(), out, *tensors) or any(p.numel != out.numel() for p in payloads)):
            return mean_into(self, payloads, out)
        for p in payloads:
            if not p.checked:  # range and strict order: what the merge relies on
                check_sparse(p, self.name)
        values = [p.tensors[0].to(p.dtype).to(out.dtype) for p in payloads]
        if cpu.sparse_mean([p.tensors[1] for p in payloads], values, out.view(-1), len(payloads), zeroed):
            vouch_finite(out)
        return out

    def _wire_bytes(self, numel):
        return self._k(numel) * (4 + index_dtype(numel).itemsize)

    @classmethod
    def _check_tensors(cls, payload):
        check_sparse(payload, cls.name)

    @classmethod
    def check_on_device(cls, payload):
        return sparse_on_device(payload)
