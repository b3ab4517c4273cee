"""The sparse payload ``[values, indices]`` that ``topk``, ``threshold`` and ``dgc`` send, and
the ``ratio`` option (fraction of elements sent) of ``topk``, ``dgc`` and ``randomk``.

``values`` are in the input dtype (or its fp32/fp64 work dtype under error feedback);
``indices`` are strictly increasing, int32 (int64 from 2**31 elements on). Here: building the
payload (with or without its dense decoding, or leaving the residual in the input), checking a
received one before anything is allocated, and decoding it densely or as a scatter into an
existing tensor (``scatter_into``, which ``randomk`` uses for its own positions).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from gradcomp.kernels import cpu
from gradcomp.kernels.memory import empty
from gradcomp.kernels.sparse import densify, index_dtype, scatter_add_checked

from .base import expect, numel_of, option, work_dtype
from .payload import Payload


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
    if cpu.applies(flat.numel(), flat, idx):
        values = cpu.take_and_clear(flat, idx)  # the same bits in one loop over the k positions
    else:
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
    if indices.numel():
        # range and order in one host read (a sync on CUDA: a bad payload is refused before any decode)
        lo, hi = torch.aminmax(indices)
        increasing = (indices[1:] > indices[:-1]).all()
        lo, hi, increasing = torch.stack([lo.long(), hi.long(), increasing.long()]).tolist()
        expect(0 <= lo and hi < n, cname, f"indices must lie in [0, {n}), got values from {lo} to {hi}")
        expect(bool(increasing), cname, "indices must be strictly increasing")


def sparse_on_device(payload: Payload) -> Tuple[Payload, Optional[torch.Tensor]]:
    """``Compressor.check_on_device`` for ``[values, indices]`` payloads of agreed sizes: the
    indices clamped into range (so the decode writes nothing out of bounds, whatever arrived)
    and a device flag, true when any was out of range or the order was not strictly
    increasing; the payload is then ``checked``, and nothing was read back."""
    values, indices = payload.tensors
    n = payload.numel
    if payload.checked or not indices.numel():
        return payload, None
    lo, hi = torch.aminmax(indices)
    bad = torch.logical_or(lo < 0, hi >= n)
    if indices.numel() > 1:
        bad = torch.logical_or(bad, torch.le(indices[1:], indices[:-1]).any())
    safe = indices.clamp(0, n - 1)
    return Payload(payload.compressor, payload.shape, payload.dtype, [values, safe], dict(payload.meta), True), bad


def decode_sparse(payload: Payload) -> torch.Tensor:
    values, indices = payload.tensors
    return densify(indices, values, numel_of(payload), values.dtype, payload.checked)


def decode_sparse_into(payload: Payload, out: torch.Tensor, alpha: float, accumulate: bool) -> None:
    """``Compressor.decompress_into`` for ``[values, indices]`` payloads."""
    values, indices = payload.tensors
    scatter_into(out, indices, values, payload.dtype, alpha, accumulate, payload.checked)


def scatter_into(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, dtype: torch.dtype,
                 alpha: float, accumulate: bool, checked: bool = False) -> None:
    """Add (or write) the sparse decoding ``values`` at distinct ``indices``, rounded to the
    payload ``dtype`` as ``decompress`` rounds it, into flat ``out``: a scatter of k values, not
    a dense pass (plus zeroing ``out`` without ``accumulate``). ``checked``: the indices are
    known in range (no host check; see ``scatter_add_checked``)."""
    # "+ 0.0" turns -0.0 into +0.0, as adding into the zeros of a decompressed tensor does
    values = values.to(dtype).to(out.dtype) + 0.0
    if not accumulate:
        out.zero_()
    scatter_add_checked(out, indices, values if alpha == 1.0 else values * alpha, checked)
