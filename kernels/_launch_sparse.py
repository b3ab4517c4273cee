"""Launchers of ``kernels/cuda/sparse.cu``; the primitives and their references: :mod:`kernels.sparse`."""
from __future__ import annotations

import numpy as np
import torch

from . import _cupy
from ._launch import FLOAT_SUFFIX, grid

BLOCK = _cupy.constants("sparse")["BLOCK"]
INDEX_SUFFIX = {torch.int32: "i32", torch.int64: "i64"}
SCATTER_SUFFIX = {**FLOAT_SUFFIX, torch.float64: "f64"}


def launch_scatter_add_checked(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``out[indices] += values`` (repeats summed) when every index is in range, else nothing
    is written and ``ValueError`` is raised. The range is checked on the device before the
    scatter; reading it back for the error is one stream-ordered copy of two integers."""
    m, n = indices.numel(), out.numel()
    if m == 0:
        return out
    idx = indices.to(out.device).contiguous()
    vals = values.to(device=out.device, dtype=out.dtype).contiguous()
    bounds = torch.tensor([2**63 - 1, -2**63], dtype=torch.int64).to(out.device, non_blocking=True)
    isfx = INDEX_SUFFIX[idx.dtype]
    with _cupy.launcher(out.device) as k:
        blocks = grid(k, m, BLOCK)
        k("sparse", f"scatter_range_{isfx}", blocks, BLOCK, idx, np.int64(m), bounds)
        k("sparse", f"scatter_add_{SCATTER_SUFFIX[out.dtype]}_{isfx}", blocks, BLOCK, out, np.int64(n), idx, vals,
          np.int64(m), bounds)
    lo, hi = bounds.tolist()
    if lo < 0 or hi >= n:
        raise ValueError(f"indices must lie in [0, {n}), got values from {lo} to {hi}")
    return out
