"""Launchers of ``kernels/cuda/select.cu``; the primitives and their references: :mod:`kernels.select`."""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from . import _cupy
from ._launch import FLOAT_SUFFIX, grid

_C = _cupy.constants("select")
BLOCK = _C["BLOCK"]
WIDE_BLOCK = _C["WIDE_BLOCK"]  # threads of the one-block kernels topk_sample and topk_scan
WS_COUNTS = _C["WS_COUNTS"]  # workspace: state and 3 histograms, then 2 counts per chunk
CHUNK_WORDS = _C["CHUNK_WORDS"]  # bitmap words per block of topk_count / topk_write
SAMPLE = _C["SAMPLE"]  # sample size of topk_sample
STEP_WORDS = _C["PASS_WORDS"] * BLOCK // 32  # bitmap words a block of topk_pass handles per step
FULL_N = 1 << 15  # up to this size (or for k >= n/4) the exact path runs on the whole tensor
SIGMAS = 4.0  # half-width of the sampled window in standard deviations of the sample rank


def _window(n: int, k: int) -> Tuple[int, int, int]:
    """Sample ranks (from the top) bounding the k-th largest, and the candidate capacity."""
    mean = SAMPLE * k / n
    sd = mean ** 0.5
    r_hi = max(0, int(mean - SIGMAS * sd - 1.0))
    r_lo = min(SAMPLE, int(mean + SIGMAS * sd + 2.0))
    cap = int(2.0 * (r_lo - r_hi) / SAMPLE * n) + 1024  # twice the expected window count
    return r_hi, r_lo, cap


def launch_topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 indices of the exact top-k of the 1-D tensor ``x`` (see select.cu):
    one read of ``x`` in the common case, no host synchronisation, fixed-size buffers."""
    n = x.numel()
    if not 0 <= k <= n:
        raise ValueError(f"topk_indices: k={k} must be in [0, {n}] for a tensor of {n} elements")
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    if k == n:
        return torch.arange(n, device=x.device)
    x = x.contiguous()
    sfx = FLOAT_SUFFIX[x.dtype]
    words = (n + 31) // 32
    chunks = -(-words // CHUNK_WORDS)
    sampled = n > FULL_N and 4 * k < n
    r_hi, r_lo, cap = _window(n, k) if sampled else (0, 0, 0)
    dev = x.device
    ws = torch.empty(WS_COUNTS + 2 * (chunks + 1), dtype=torch.int64, device=dev)
    bm = torch.empty(2 * words, dtype=torch.int32, device=dev)
    cidx = torch.empty(max(cap, 1), dtype=torch.int64, device=dev)
    ckey = torch.empty(max(cap, 1), dtype=torch.int32, device=dev)
    out = torch.empty(k, dtype=torch.int64, device=dev)
    n64, k64, cw, w64 = np.int64(n), np.int64(k), np.int64(cap), np.int64(words)
    with _cupy.launcher(dev) as kl:
        blocks = grid(kl, n, BLOCK)
        kl("select", f"topk_sample_{sfx}", 1, WIDE_BLOCK, x, n64, np.int64(r_hi), np.int64(r_lo), ws)
        if sampled:
            kl("select", f"topk_pass_{sfx}", grid(kl, -(-words // STEP_WORDS) * BLOCK, BLOCK), BLOCK, x, n64, ws,
               bm, w64, cidx, ckey, cw)
        for r in range(3):
            kl("select", f"topk_hist_{sfx}", blocks, BLOCK, x, n64, ws, k64, cw, ckey, np.int32(r))
        kl("select", f"topk_mark_{sfx}", blocks, BLOCK, x, n64, ws, k64, cw, cidx, ckey, bm, w64)
        _write_bits(kl, bm, words, chunks, ws, True, k, out)
    return out


def _write_bits(kl, bm: torch.Tensor, words: int, chunks: int, ws: torch.Tensor, use_need: bool, k: int,
                out: Optional[torch.Tensor], scan: bool = True) -> None:
    if scan:
        kl("select", "topk_count", chunks, BLOCK, bm, np.int64(words), ws)
        kl("select", "topk_scan", 1, WIDE_BLOCK, ws, np.int64(chunks))
    if out is not None and k:
        kl("select", "topk_write", chunks, BLOCK, bm, np.int64(words), ws, np.int64(use_need), np.int64(k), out)


def launch_threshold_indices(x: torch.Tensor, tau: float) -> torch.Tensor:
    """Ascending int64 indices of ``|x| >= tau`` and NaN (``tau`` exact in ``x``'s dtype).

    The number of indices is read back once (a stream-ordered copy, as ``torch.nonzero``
    does): the output's size depends on the data.
    """
    n = x.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    x = x.contiguous()
    words = (n + 31) // 32
    chunks = -(-words // CHUNK_WORDS)
    ws = torch.empty(WS_COUNTS + 2 * (chunks + 1), dtype=torch.int64, device=x.device)
    bm = torch.empty(2 * words, dtype=torch.int32, device=x.device)
    with _cupy.launcher(x.device) as kl:
        kl("select", f"threshold_mark_{FLOAT_SUFFIX[x.dtype]}", grid(kl, n, BLOCK), BLOCK, x, np.int64(n),
           np.float32(tau), bm, np.int64(words))
        _write_bits(kl, bm, words, chunks, ws, False, 0, None)
    total = int(ws[WS_COUNTS + 2 * chunks])
    out = torch.empty(total, dtype=torch.int64, device=x.device)
    with _cupy.launcher(x.device) as kl:
        _write_bits(kl, bm, words, chunks, ws, False, total, out, scan=False)
    return out
