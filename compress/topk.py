"""``topk``: send the k largest-magnitude elements and their positions (Aji & Heafield 2017).

Payload: ``[values, indices]`` — values in the input dtype, indices ascending, int32 (int64
from 2**31 elements on). ``k = max(1, round(ratio * numel))``, so the size depends only on
``numel``: 64 bits per kept fp32 element. Biased (small elements are dropped): pair it with
error feedback. NaN ranks as the largest magnitude, so it is sent and propagates.

The selection is exact (see ``gradcomp.kernels.select``); ties at the k-th magnitude go to the
lowest indices. The sparse payload helpers here are shared by ``threshold`` and ``dgc``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from gradcomp.kernels.memory import empty
from gradcomp.kernels.select import topk_abs_indices
from gradcomp.kernels.sparse import check_indices, densify, index_dtype, scatter_add_checked

from .base import Capabilities, Compressor, CompressorConfig, Encoded, expect, numel_of, option, work_dtype
from .payload import Payload
from .registry import register


def ratio_option(default: float) -> float:
    return option(default, "fraction of elements sent; smaller => fewer bytes, more error left to "
                  "error feedback", lambda v: 0.0 < v <= 1.0, "a float in (0, 1]")


def sparse_payload(flat: torch.Tensor, idx: torch.Tensor,
                   want_decoded: bool) -> Tuple[List[torch.Tensor], Optional[torch.Tensor]]:
    """``[values, indices]`` for the int64 positions ``idx``, and the dense decoding if asked."""
    values = flat.index_select(0, idx)  # index_select/index_copy_: several times faster than []
    decoded = None
    if want_decoded:
        decoded = empty(flat.numel(), flat.dtype, flat.device).zero_()
        decoded.index_copy_(0, idx, values)  # idx holds no repeats, so a plain put is the decoding
    return [values, idx.to(index_dtype(flat.numel()))], decoded


def sparse_residual(flat: torch.Tensor, idx: torch.Tensor) -> List[torch.Tensor]:
    """``[values, indices]`` for the positions ``idx``; ``flat`` becomes ``flat - decoded``
    in place. Only the sent positions change: to ``x - x``, which is 0 (NaN for NaN or Inf)."""
    values = flat.index_select(0, idx)
    flat.index_copy_(0, idx, values - values)
    return [values, idx.to(index_dtype(flat.numel()))]


def check_sparse(payload: Payload, cname: str) -> None:
    """Validate a ``[values, indices]`` payload: dtypes, sizes, index range and strict order."""
    n = numel_of(payload)
    expect(len(payload.tensors) == 2, cname, f"expected 2 tensors (values, indices), got {len(payload.tensors)}")
    values, indices = payload.tensors
    # Error feedback compresses in fp32 (fp64) and then labels the payload with the input dtype.
    allowed = (payload.dtype, work_dtype(payload.dtype))
    expect(values.dtype in allowed, cname, f"values have dtype {values.dtype}, expected one of {allowed}")
    expect(indices.dtype == index_dtype(n), cname,
           f"indices have dtype {indices.dtype}, expected {index_dtype(n)} for {n} elements")
    expect(values.dim() == 1 and indices.dim() == 1 and values.numel() == indices.numel() <= n, cname,
           f"values {tuple(values.shape)} and indices {tuple(indices.shape)} must be 1-D, of equal "
           f"length, at most {n}")
    try:
        check_indices(indices, n)
    except ValueError as exc:
        raise ValueError(f"{cname}: malformed payload: {exc}") from None
    expect(indices.numel() < 2 or bool((indices[1:] > indices[:-1]).all()), cname,
           "indices must be strictly increasing")


def decode_sparse(payload: Payload) -> torch.Tensor:
    values, indices = payload.tensors
    return densify(indices, values, numel_of(payload), values.dtype)


def decode_sparse_into(payload: Payload, out: torch.Tensor, alpha: float, accumulate: bool) -> None:
    """``Compressor.decompress_into`` for ``[values, indices]`` payloads."""
    values, indices = payload.tensors
    scatter_into(out, indices, values, payload.dtype, alpha, accumulate)


def scatter_into(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, dtype: torch.dtype,
                 alpha: float, accumulate: bool) -> None:
    """Add (or write) the sparse decoding ``values`` at distinct ``indices``, rounded to the
    payload ``dtype`` as ``decompress`` rounds it, into flat ``out``: a scatter of k values, not
    a dense pass (plus zeroing ``out`` without ``accumulate``)."""
    # "+ 0.0" turns -0.0 into +0.0, as adding into the zeros of a decompressed tensor does
    values = values.to(dtype).to(out.dtype) + 0.0
    if not accumulate:
        out.zero_()
    scatter_add_checked(out, indices, values if alpha == 1.0 else values * alpha)


@register("topk")
class TopK(Compressor):
    """Exact top-k by magnitude: ``k = max(1, round(ratio * numel))`` values and indices."""

    @dataclass(frozen=True)
    class Config(CompressorConfig):
        ratio: float = ratio_option(0.01)

    config: Config
    capabilities = Capabilities()

    def _k(self, numel: int) -> int:
        return 0 if numel == 0 else max(1, round(self.config.ratio * numel))

    def _select(self, flat: torch.Tensor, k: int, key: str, step: int) -> torch.Tensor:
        """Positions of the ``k`` largest magnitudes of ``flat`` (signed values)."""
        return topk_abs_indices(flat, k)

    def _compress(self, flat, shape, key, step, want_decoded):
        idx = self._select(flat, self._k(flat.numel()), key, step)
        tensors, decoded = sparse_payload(flat, idx, want_decoded)
        return Encoded(tensors, {}, decoded)

    def _compress_residual(self, flat, key, step):
        return Encoded(sparse_residual(flat, self._select(flat, self._k(flat.numel()), key, step)), {})

    def _decompress(self, payload):
        return decode_sparse(payload)

    def _decompress_into(self, payload, out, alpha, accumulate):
        decode_sparse_into(payload, out, alpha, accumulate)

    def _wire_bytes(self, numel):
        return self._k(numel) * (4 + index_dtype(numel).itemsize)

    @classmethod
    def _check_tensors(cls, payload):
        check_sparse(payload, cls.name)
