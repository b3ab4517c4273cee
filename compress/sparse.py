"""The sparse payload ``[values, indices]`` that ``topk``, ``threshold`` and ``dgc`` send, and
the ``ratio`` option (fraction of elements sent) of ``topk``, ``dgc`` and ``randomk``.

``values`` are in the input dtype (or its fp32/fp64 work dtype under error feedback);
``indices`` are strictly increasing, int32 (int64 from 2**31 elements on). Here: building the
payload (with or without its dense decoding, or leaving the residual in the input), checking a
received one before anything is allocated, and decoding it densely or as a scatter into an
existing tensor (``scatter_into``, which ``randomk`` uses for its own positions).

Bounded payloads. A compressor whose count depends on the data (``threshold``) sends, where
the collectives have agreed a capacity for a key (:func:`payload_bounds`), exactly that many
values and indices: the first ones selected, then fillers (value +0.0 at the last position,
which adds nothing to a decoding or a residual). Its size is then known in advance, so it
travels as a fixed-size payload, and nothing is read back to learn it. Fillers make the
indices non-decreasing at the end instead of strictly increasing; the checks accept exactly
that (``padded=True``). What did not fit stays in error feedback's residual.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, List, Mapping, Optional, Tuple

import torch

from gradcomp.kernels import cpu
from gradcomp.kernels.memory import empty
from gradcomp.kernels.sparse import densify, index_dtype, scatter_add_checked

from .base import expect, numel_of, option, work_dtype
from .payload import Payload


_bounds: contextvars.ContextVar[Optional[Mapping[str, int]]] = contextvars.ContextVar("gradcomp_payload_bounds",
                                                                                   default=None)


@contextlib.contextmanager
def payload_bounds(capacities: Optional[Mapping[str, int]]) -> Iterator[None]:
    """Within: a compressor with ``bounded_sizes`` sends, for each key in ``capacities``,
    a payload of exactly that many elements (see the module docstring); None changes nothing.
    Only for compression under error feedback, which keeps what did not fit."""
    token = _bounds.set(capacities)
    try:
        yield
    finally:
        _bounds.reset(token)


def bound_for(key: str) -> Optional[int]:
    """The capacity agreed for ``key``'s payload (:func:`payload_bounds`), or None."""
    caps = _bounds.get()
    return None if caps is None else caps.get(key)


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


def bounded_payload(flat: torch.Tensor, idx: torch.Tensor, filler: torch.Tensor,
                    want_decoded: bool) -> Tuple[List[torch.Tensor], Optional[torch.Tensor]]:
    """:func:`sparse_payload` of a fixed-size selection (positions ``idx``, ``filler`` marking
    the fillers: see the module docstring); the decoding adds every value (a filler adds +0.0)."""
    values = flat.index_select(0, idx).masked_fill_(filler, 0.0)
    decoded = None
    if want_decoded:
        decoded = empty(flat.numel(), flat.dtype, flat.device).zero_().index_add_(0, idx, values)
    return [values, idx.to(index_dtype(flat.numel()))], decoded


def bounded_residual(flat: torch.Tensor, idx: torch.Tensor, filler: torch.Tensor) -> List[torch.Tensor]:
    """:func:`sparse_residual` of a fixed-size selection: each sent position becomes
    ``x + (-x)``, the bits of ``x - x`` (0; NaN for NaN or Inf), and a filler adds -0.0, which
    changes no value, whatever order the adds run in."""
    values = flat.index_select(0, idx).masked_fill_(filler, 0.0)
    flat.index_add_(0, idx, values.neg())
    return [values, idx.to(index_dtype(flat.numel()))]


def _steps_ok(values: torch.Tensor, indices: torch.Tensor, n: int, padded: bool) -> torch.Tensor:
    """Per neighbouring pair: strictly increasing, or (``padded``) a filler after it (the last
    position again, value zero)."""
    ok = torch.gt(indices[1:], indices[:-1])
    if padded:
        ok = torch.logical_or(ok, torch.logical_and(indices[1:] == n - 1, values[1:] == 0))
    return ok


def check_sparse(payload: Payload, cname: str, padded: bool = False) -> None:
    """Validate a ``[values, indices]`` payload: dtypes, sizes, index range and strict order
    (``padded``: fillers allowed at the end, see the module docstring)."""
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
        increasing = _steps_ok(values, indices, n, padded).all()
        lo, hi, increasing = torch.stack([lo.long(), hi.long(), increasing.long()]).tolist()
        expect(0 <= lo and hi < n, cname, f"indices must lie in [0, {n}), got values from {lo} to {hi}")
        expect(bool(increasing), cname, "indices must be strictly increasing"
               + (" (but for fillers at the end: value 0 at the last position)" if padded else ""))


def sparse_on_device(payload: Payload, padded: bool = False) -> Tuple[Payload, Optional[torch.Tensor]]:
    """``Compressor.check_on_device`` for ``[values, indices]`` payloads of agreed sizes: the
    indices clamped into range (so the decode writes nothing out of bounds, whatever arrived)
    and a device flag, true when any was out of range or the order was not strictly
    increasing (``padded``: but for fillers at the end); the payload is then ``checked``, and
    nothing was read back."""
    values, indices = payload.tensors
    n = payload.numel
    if payload.checked or not indices.numel():
        return payload, None
    lo, hi = torch.aminmax(indices)
    bad = torch.logical_or(lo < 0, hi >= n)
    if indices.numel() > 1:
        bad = torch.logical_or(bad, torch.logical_not(_steps_ok(values, indices, n, padded).all()))
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
