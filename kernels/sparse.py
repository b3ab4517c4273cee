"""Sparse to dense: scatter (index, value) pairs into a flat tensor, indices checked first.

Indices arrive from the wire, so every function here checks dtype, shape and range before it
writes anything: a bad index is a ``ValueError``, never an out-of-bounds write. Repeated
indices are summed.
"""
from __future__ import annotations

import torch

from ._launch import kernels_apply
from ._launch_sparse import INDEX_SUFFIX, SCATTER_SUFFIX, launch_scatter_add_checked

_INDEX_DTYPES = (torch.int32, torch.int64)


def index_dtype(numel: int) -> torch.dtype:
    """The wire dtype of indices into ``numel`` elements: int32, or int64 from 2**31 on."""
    return torch.int32 if numel < 2**31 else torch.int64


def check_indices(indices: torch.Tensor, numel: int) -> None:
    """``ValueError`` unless ``indices`` is a 1-D int32/int64 tensor with values in [0, numel)."""
    _check_index_tensor(indices)
    if indices.numel():
        # one host read for both bounds (a sync on CUDA: the error must be raised here, before the write)
        lo, hi = torch.stack(torch.aminmax(indices)).tolist()
        if lo < 0 or hi >= numel:
            raise ValueError(f"indices must lie in [0, {numel}), got values from {lo} to {hi}")


def _check_index_tensor(indices: torch.Tensor) -> None:
    if indices.dtype not in _INDEX_DTYPES or indices.dim() != 1:
        raise ValueError(f"indices must be a 1-D int32 or int64 tensor, got {indices.dtype} "
                         f"of shape {tuple(indices.shape)}")


def scatter_add_checked(out_flat: torch.Tensor, indices: torch.Tensor, values: torch.Tensor,
                        checked: bool = False) -> torch.Tensor:
    """``out_flat[indices] += values`` in place (repeats summed), after checking the indices.

    ``out_flat`` is a 1-D floating tensor; ``values`` is 1-D with one value per index and is
    cast to ``out_flat``'s dtype. ``checked``: the caller knows the indices lie in range (it
    built them, or clamped them on the device), so their host check, a sync on CUDA, is
    skipped; dtype and shapes are still checked. Returns ``out_flat``.
    """
    if out_flat.dim() != 1 or not out_flat.is_floating_point():
        raise ValueError(f"out_flat must be a 1-D floating tensor, got {out_flat.dtype} "
                         f"of shape {tuple(out_flat.shape)}")
    if values.dim() != 1 or values.numel() != indices.numel():
        raise ValueError(f"values must be 1-D with one value per index: {indices.numel()} indices, "
                         f"values of shape {tuple(values.shape)}")
    if (kernels_apply(out_flat, values) and out_flat.dtype in SCATTER_SUFFIX and out_flat.is_contiguous()
            and indices.dtype in INDEX_SUFFIX and indices.dim() == 1):
        return launch_scatter_add_checked(out_flat, indices, values)
    if checked:
        _check_index_tensor(indices)
    else:
        check_indices(indices, out_flat.numel())
    if indices.device != out_flat.device:
        indices = indices.to(out_flat.device)
    return out_flat.index_add_(0, indices, values.to(out_flat.dtype))


def densify(indices: torch.Tensor, values: torch.Tensor, numel: int, dtype: torch.dtype,
            checked: bool = False) -> torch.Tensor:
    """A flat tensor of ``numel`` zeros of ``dtype`` with ``values`` added at ``indices``
    (``checked``: as for :func:`scatter_add_checked`)."""
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be an int >= 0, got {numel!r}")
    out = torch.zeros(numel, dtype=dtype, device=values.device)
    return scatter_add_checked(out, indices, values, checked)
