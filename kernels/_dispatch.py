"""Device dispatch: CUDA tensors go to the CuPy kernels when CuPy and a GPU are present.

Each ``cuda_<op>`` function returns ``None`` when the kernel path does not apply (CPU tensor,
no CuPy, no GPU, a dtype the kernels do not cover, kernels switched off) and the caller then
runs its torch reference. The function named ``<op>`` without the prefix is the kernel path
itself: it allocates with torch on the tensor's device and launches through
``_cupy.launcher`` (the tests run it on CPU tensors through an emulation of CUDA).
Importing this module never fails. ``GRADCOMP_CUDA_KERNELS=0`` in the environment switches the
kernels off for the whole process (every primitive then runs its torch code on CUDA tensors too).
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional, Tuple

import numpy as np
import torch

from . import _cupy

BLOCK = 256  # threads per block of the streaming kernels
_PER_SM = 8  # resident blocks per SM for a grid-stride launch: 2048 threads, full occupancy
_MASK64 = (1 << 64) - 1
_enabled = os.environ.get("GRADCOMP_CUDA_KERNELS", "1") != "0"


@contextlib.contextmanager
def torch_only() -> Iterator[None]:
    """Within this block every primitive runs its torch code, also on CUDA tensors."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def kernels_apply(*tensors: torch.Tensor) -> bool:
    """True when the kernels would run for these tensors: all on one CUDA device, CuPy there."""
    if not _enabled or not tensors:
        return False
    dev = tensors[0].device
    return dev.type == "cuda" and all(t.device == dev for t in tensors) and _cupy.available()


def _grid(launcher, work_items: int, block: int = BLOCK) -> int:
    """Blocks for a grid-stride loop over ``work_items``: enough to fill the device, no more."""
    return max(1, min(-(-work_items // block), launcher.sms * _PER_SM * BLOCK // block))


# ---- rng -------------------------------------------------------------------------------------
def cuda_uniform(numel: int, key128: int, device: torch.device) -> Optional[torch.Tensor]:
    """Kernel path of :func:`gradcomp.kernels.rng.uniform`, or ``None``."""
    device = torch.device(device)
    if not (_enabled and device.type == "cuda" and _cupy.available()):
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return uniform(numel, key128, device)


def uniform(numel: int, key128: int, device: torch.device) -> torch.Tensor:
    """``numel`` uniform float32 numbers of the Philox stream ``key128``, made on ``device``."""
    out = torch.empty(numel, dtype=torch.float32, device=device)
    if numel:
        with _cupy.launcher(out.device) as k:
            k("rng", "philox_uniform", _grid(k, -(-numel // 8)), BLOCK, out, np.int64(numel),
              np.uint64(key128 & _MASK64), np.uint64((key128 >> 64) & _MASK64))
    return out


# ---- sign --------------------------------------------------------------------------------------
_FLOAT_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_STATS = {"none": 0, "sum": 1, "abs": 2, "split": 3}
_NSUMS = {"none": 0, "sum": 1, "abs": 1, "split": 2}
_EF_MODES = {"signsgd": (0, "none", 1), "efsignsgd": (1, "abs", 1), "onebit": (2, "split", 2)}
_PARTIALS = 4  # float64 partial sums each block of the sign kernels writes
_PACK_STEP = 128  # elements a warp packs per loop step (4 words of 32 bits)


def _pack_grid(k, n: int) -> int:
    return _grid(k, -(-n // _PACK_STEP) * 32)


def cuda_sign_pack(x: torch.Tensor, stats: str) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Kernel path of :func:`gradcomp.kernels.sign.sign_pack`, or ``None``."""
    if not (kernels_apply(x) and x.dtype in _FLOAT_SUFFIX and x.is_contiguous() and stats in _STATS):
        return None
    return sign_pack(x, stats)


def sign_pack(x: torch.Tensor, stats: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(bits, sums)`` of the 1-D tensor ``x``: one pass, sums reduced in a fixed order."""
    n = x.numel()
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    sums = torch.zeros(_NSUMS[stats], dtype=torch.float64, device=x.device)
    if n == 0:
        return bits, sums
    with _cupy.launcher(x.device) as k:
        grid = _pack_grid(k, n)
        partial = torch.empty(grid * _PARTIALS, dtype=torch.float64, device=x.device)
        k("sign", f"sign_pack_{_FLOAT_SUFFIX[x.dtype]}", grid, BLOCK, x, np.int64(n), bits, partial,
          np.int32(_STATS[stats]))
        if sums.numel():
            k("sign", "sign_reduce", 1, BLOCK, partial, np.int32(grid), sums, np.int32(sums.numel()))
    return bits, sums


def cuda_sign_unpack(bits: torch.Tensor, numel: int, pos_value: float, neg_value: float,
                     out: torch.Tensor, accumulate: bool) -> Optional[torch.Tensor]:
    """Kernel path of :func:`gradcomp.kernels.sign.sign_unpack` (``out`` given), or ``None``."""
    if not (kernels_apply(bits, out) and out.dtype in _FLOAT_SUFFIX and out.is_contiguous()):
        return None
    return sign_unpack(bits, numel, pos_value, neg_value, out, accumulate)


def _as_dtype_f32(values, dtype: torch.dtype):
    """``values`` rounded once to ``dtype`` (as the reference rounds them), as numpy float32."""
    rounded = torch.tensor(values, dtype=torch.float64).to(dtype).to(torch.float32)
    return [np.float32(v) for v in rounded.tolist()]


def sign_unpack(bits: torch.Tensor, numel: int, pos_value: float, neg_value: float,
                out: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """``pos_value`` where a bit is set else ``neg_value``, written or added into ``out``."""
    if numel:
        pos, neg = _as_dtype_f32([pos_value, neg_value], out.dtype)
        with _cupy.launcher(out.device) as k:
            k("sign", f"sign_unpack_{_FLOAT_SUFFIX[out.dtype]}", _grid(k, -(-numel // 8)), BLOCK, bits.contiguous(),
              np.int64(numel), out, pos, neg, np.int32(bool(accumulate)))
    return out


def cuda_sign_unpack_sum(bits: torch.Tensor, values: torch.Tensor, numel: int, out: torch.Tensor,
                         weight: float = 1.0, accumulate: bool = False) -> Optional[torch.Tensor]:
    """Kernel path of :func:`sign_unpack_sum_torch`, or ``None``."""
    if not (kernels_apply(bits, values, out) and out.dtype in _FLOAT_SUFFIX and out.is_contiguous()):
        return None
    return sign_unpack_sum(bits, values, numel, out, weight, accumulate)


def _check_unpack_sum(bits: torch.Tensor, values: torch.Tensor, numel: int, out: torch.Tensor) -> None:
    rows = bits.shape[0] if bits.dim() == 2 else -1
    if bits.dtype != torch.uint8 or rows < 0 or bits.shape[1] != (numel + 7) // 8 or not bits.is_contiguous():
        raise ValueError(f"bits must be a contiguous uint8 tensor of shape (ranks, {(numel + 7) // 8}), "
                         f"got {bits.dtype} {tuple(bits.shape)}")
    if values.dtype != torch.float32 or values.dim() != 2 or values.shape[0] != rows or values.shape[1] not in (1, 2):
        raise ValueError(f"values must be float32 of shape ({rows}, 1) or ({rows}, 2), got "
                         f"{values.dtype} {tuple(values.shape)}")
    if out.dim() != 1 or out.numel() != numel or not out.is_floating_point():
        raise ValueError(f"out must be a 1-D float tensor of {numel} elements, got {out.dtype} {tuple(out.shape)}")


def sign_unpack_sum_torch(bits: torch.Tensor, values: torch.Tensor, numel: int, out: torch.Tensor,
                          weight: float = 1.0, accumulate: bool = False) -> torch.Tensor:
    """Decode many ranks' sign payloads into one output: ``out = weight * ((out if accumulate
    else 0) + sum_r decode_r)``, in float32 in rank order, rounded once to ``out``'s dtype.

    ``bits[r]`` are rank r's packed signs and ``values[r]`` its wire values (one: ``+-v``;
    two: the values of set and clear bits). The reference of the kernel ``sign_unpack_sum``.
    """
    _check_unpack_sum(bits, values, numel, out)
    from .bits import unpack_bits

    acc = out.float() if accumulate else torch.zeros(numel, dtype=torch.float32, device=out.device)
    for r in range(bits.shape[0]):
        p = values[r, 0]
        q = values[r, 1] if values.shape[1] == 2 else -p
        acc.add_(torch.where(unpack_bits(bits[r], numel).to(acc.device), p, q))
    return out.copy_(acc.mul_(np.float32(weight)))


def sign_unpack_sum(bits: torch.Tensor, values: torch.Tensor, numel: int, out: torch.Tensor,
                    weight: float = 1.0, accumulate: bool = False) -> torch.Tensor:
    """Kernel of :func:`sign_unpack_sum_torch`: reads every payload once and writes ``out`` once."""
    _check_unpack_sum(bits, values, numel, out)
    if numel:
        with _cupy.launcher(out.device) as k:
            k("sign", f"sign_unpack_sum_{_FLOAT_SUFFIX[out.dtype]}", _grid(k, -(-numel // 8)), BLOCK, bits,
              np.int64(bits.shape[1]), np.int32(bits.shape[0]), values.contiguous(), np.int32(values.shape[1]),
              np.int64(numel), out, np.float32(weight), np.int32(bool(accumulate)))
    return out


def cuda_sign_ef(x: torch.Tensor, residual: torch.Tensor, mode: str) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Kernel path of :func:`sign_ef_torch`, or ``None``."""
    if not (kernels_apply(x, residual) and x.dtype in _FLOAT_SUFFIX and mode in _EF_MODES):
        return None
    return sign_ef(x, residual, mode)


def _check_ef(x: torch.Tensor, residual: torch.Tensor, mode: str) -> None:
    if mode not in _EF_MODES:
        raise ValueError(f"mode={mode!r} is not allowed; use one of {tuple(_EF_MODES)}")
    if x.dim() != 1 or not x.is_contiguous() or not x.is_floating_point():
        raise ValueError(f"x must be a 1-D contiguous float tensor, got {x.dtype} {tuple(x.shape)}")
    if residual.dtype != torch.float32 or residual.shape != x.shape or not residual.is_contiguous():
        raise ValueError(f"residual must be a contiguous float32 tensor of shape {tuple(x.shape)}, "
                         f"got {residual.dtype} {tuple(residual.shape)}")


def sign_ef_torch(x: torch.Tensor, residual: torch.Tensor, mode: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """One error-feedback step of a sign compressor, as ``ErrorFeedback(get_compressor(mode))``
    does it: ``acc = x + residual`` (fp32) is rounded to ``x``'s dtype and compressed to
    ``(bits, values)``; ``residual`` becomes ``acc - decoded`` (decoded in ``x``'s dtype).

    ``mode`` is the compressor: ``signsgd`` (values ``[1]``), ``efsignsgd`` (``[mean |acc|]``)
    or ``onebit`` (``[mean of acc >= 0, mean of acc < 0]``); NaN/Inf give non-finite values.
    Written with the primitives of ``kernels.sign``: the reference of :func:`sign_ef`.
    """
    _check_ef(x, residual, mode)
    from .sign import sign_pack_torch, sign_unpack_torch

    acc = residual + x
    src = acc.to(x.dtype)
    _, stats, nvalues = _EF_MODES[mode]
    bits, sums = sign_pack_torch(src, "sum" if mode == "signsgd" else stats)
    n = x.numel()
    if mode == "signsgd":
        vals = [1.0 if bool(torch.isfinite(src).all()) else float("nan")]
    elif mode == "efsignsgd":
        vals = [float(sums[0]) / max(n, 1)]
    else:
        npos = int((src >= 0).sum())
        vals = [float(sums[0]) / npos if npos else 0.0, float(sums[1]) / (n - npos) if n - npos else 0.0]
    values = torch.tensor(vals, dtype=torch.float32)
    v = values.tolist()
    pos, neg = (v[0], -v[0]) if nvalues == 1 else v
    decoded = sign_unpack_torch(bits, n, pos, neg, out=torch.empty(n, dtype=x.dtype, device=x.device))
    torch.sub(acc, decoded.to(torch.float32), out=residual)
    return bits, values.to(x.device)


def sign_ef(x: torch.Tensor, residual: torch.Tensor, mode: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Kernel of :func:`sign_ef_torch`: two streaming passes, no host synchronisation.

    The decode value is a reduction over the whole tensor, so the residual can only be
    written after it is known: the first pass reads ``x`` and ``residual`` and writes the bits
    and per-block sums, the second re-reads both and writes the residual (fp32: 20 bytes per
    element moved; writing ``x + residual`` in between would move as many and change the input).
    """
    _check_ef(x, residual, mode)
    code, stats, nvalues = _EF_MODES[mode]
    n = x.numel()
    bits = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    if n == 0:
        return bits, torch.tensor([1.0 if mode == "signsgd" else 0.0] * nvalues, dtype=torch.float32, device=x.device)
    values = torch.empty(nvalues, dtype=torch.float32, device=x.device)
    sfx = _FLOAT_SUFFIX[x.dtype]
    with _cupy.launcher(x.device) as k:
        grid = _pack_grid(k, n)
        partial = torch.empty(grid * _PARTIALS, dtype=torch.float64, device=x.device)
        k("sign", f"sign_ef_pack_{sfx}", grid, BLOCK, x, residual, np.int64(n), bits, partial,
          np.int32(_STATS[stats]))
        k("sign", f"sign_ef_update_{sfx}", _grid(k, n), BLOCK, x, residual, np.int64(n), partial, np.int32(grid),
          np.int32(code), values)
    return bits, values


def cuda_count_set(bits: torch.Tensor) -> Optional[int]:
    """Kernel path of :func:`gradcomp.kernels.sign.count_set`, or ``None``."""
    if not kernels_apply(bits):
        return None
    return count_set(bits)


def count_set(bits: torch.Tensor) -> int:
    """Number of set bits of a uint8 tensor (reads the count back: one stream-ordered copy)."""
    total = torch.zeros(1, dtype=torch.int64, device=bits.device)
    if bits.numel():
        with _cupy.launcher(bits.device) as k:
            k("sign", "count_set_bits", _grid(k, bits.numel()), BLOCK, bits.contiguous(), np.int64(bits.numel()),
              total)
    return int(total[0])


# ---- select ------------------------------------------------------------------------------------
_WS_COUNTS = 16 + 3 * 2048  # = WS_COUNTS of select.cu: state, 3 histograms, then chunk counts
_CHUNK_WORDS = 2048  # bitmap words per block of topk_count / topk_write
_SAMPLE = 8192  # = SAMPLE of select.cu
_FULL_N = 1 << 15  # up to this size (or for k >= n/4) the exact path runs on the whole tensor
_SIGMAS = 4.0  # half-width of the sampled window in standard deviations of the sample rank


def cuda_topk_indices(x_abs: torch.Tensor, k: int) -> Optional[torch.Tensor]:
    """Kernel path of :func:`gradcomp.kernels.select.topk_indices`, or ``None``."""
    if not (kernels_apply(x_abs) and x_abs.dtype in _FLOAT_SUFFIX and x_abs.dim() == 1):
        return None
    return topk_indices(x_abs, k)


def _window(n: int, k: int):
    """Sample ranks (from the top) bounding the k-th largest, and the candidate capacity."""
    mean = _SAMPLE * k / n
    sd = mean ** 0.5
    r_hi = max(0, int(mean - _SIGMAS * sd - 1.0))
    r_lo = min(_SAMPLE, int(mean + _SIGMAS * sd + 2.0))
    cap = int(2.0 * (r_lo - r_hi) / _SAMPLE * n) + 1024  # twice the expected window count
    return r_hi, r_lo, cap


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
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
    sfx = _FLOAT_SUFFIX[x.dtype]
    words = (n + 31) // 32
    chunks = -(-words // _CHUNK_WORDS)
    sampled = n > _FULL_N and 4 * k < n
    r_hi, r_lo, cap = _window(n, k) if sampled else (0, 0, 0)
    dev = x.device
    ws = torch.empty(_WS_COUNTS + 2 * (chunks + 1), dtype=torch.int64, device=dev)
    bm = torch.empty(2 * words, dtype=torch.int32, device=dev)
    cidx = torch.empty(max(cap, 1), dtype=torch.int64, device=dev)
    ckey = torch.empty(max(cap, 1), dtype=torch.int32, device=dev)
    out = torch.empty(k, dtype=torch.int64, device=dev)
    n64, k64, cw, w64 = np.int64(n), np.int64(k), np.int64(cap), np.int64(words)
    with _cupy.launcher(dev) as kl:
        grid = _grid(kl, n)
        kl("select", f"topk_sample_{sfx}", 1, 1024, x, n64, np.int64(r_hi), np.int64(r_lo), ws)
        if sampled:
            kl("select", f"topk_pass_{sfx}", _grid(kl, -(-words // 64) * BLOCK), BLOCK, x, n64, ws, bm, w64,
               cidx, ckey, cw)
        for r in range(3):
            kl("select", f"topk_hist_{sfx}", grid, BLOCK, x, n64, ws, k64, cw, ckey, np.int32(r))
        kl("select", f"topk_mark_{sfx}", grid, BLOCK, x, n64, ws, k64, cw, cidx, ckey, bm, w64)
        _write_bits(kl, bm, words, chunks, ws, True, k, out)
    return out


def _write_bits(kl, bm, words: int, chunks: int, ws, use_need: bool, k: int, out, scan: bool = True) -> None:
    if scan:
        kl("select", "topk_count", chunks, BLOCK, bm, np.int64(words), ws)
        kl("select", "topk_scan", 1, 1024, ws, np.int64(chunks))
    if out is not None and k:
        kl("select", "topk_write", chunks, BLOCK, bm, np.int64(words), ws, np.int64(use_need), np.int64(k), out)


def cuda_threshold_indices(x: torch.Tensor, tau: torch.Tensor) -> Optional[torch.Tensor]:
    """Kernel path of :func:`gradcomp.kernels.select.threshold_indices` (``tau`` already
    rounded up to ``x``'s dtype), or ``None``."""
    if not (kernels_apply(x) and x.dtype in _FLOAT_SUFFIX and x.dim() == 1):
        return None
    return threshold_indices(x, float(tau))


def threshold_indices(x: torch.Tensor, tau: float) -> torch.Tensor:
    """Ascending int64 indices of ``|x| >= tau`` and NaN (``tau`` exact in ``x``'s dtype).

    The number of indices is read back once (a stream-ordered copy, as ``torch.nonzero``
    does): the output's size depends on the data.
    """
    n = x.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    x = x.contiguous()
    words = (n + 31) // 32
    chunks = -(-words // _CHUNK_WORDS)
    ws = torch.empty(_WS_COUNTS + 2 * (chunks + 1), dtype=torch.int64, device=x.device)
    bm = torch.empty(2 * words, dtype=torch.int32, device=x.device)
    with _cupy.launcher(x.device) as kl:
        kl("select", f"threshold_mark_{_FLOAT_SUFFIX[x.dtype]}", _grid(kl, n), BLOCK, x, np.int64(n),
           np.float32(tau), bm, np.int64(words))
        _write_bits(kl, bm, words, chunks, ws, False, 0, None)
    total = int(ws[_WS_COUNTS + 2 * chunks])
    out = torch.empty(total, dtype=torch.int64, device=x.device)
    with _cupy.launcher(x.device) as kl:
        _write_bits(kl, bm, words, chunks, ws, False, total, out, scan=False)
    return out


# ---- bits --------------------------------------------------------------------------------------
def cuda_pack_codes(codes: torch.Tensor, bits: int) -> Optional[torch.Tensor]:
    """Kernel path of the torch packing in :mod:`gradcomp.kernels.bits`, or ``None``."""
    if not (kernels_apply(codes) and codes.dtype == torch.uint8 and bits in (1, 2, 4)):
        return None
    return pack_codes(codes, bits)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``codes`` (flat) into ``bits``-bit fields, as ``bits.pack_codes`` does."""
    codes = codes.reshape(-1).contiguous()
    n = codes.numel()
    out = torch.empty((n * bits + 7) // 8, dtype=torch.uint8, device=codes.device)
    if n:
        with _cupy.launcher(codes.device) as k:
            k("bits", "pack_codes", _grid(k, out.numel()), BLOCK, codes, np.int64(n), np.int32(bits), out)
    return out


def cuda_unpack_codes(packed: torch.Tensor, numel: int, bits: int) -> Optional[torch.Tensor]:
    """Kernel path of the torch unpacking in :mod:`gradcomp.kernels.bits`, or ``None``."""
    if not (kernels_apply(packed) and bits in (1, 2, 4)):
        return None
    return unpack_codes(packed, numel, bits)


def unpack_codes(packed: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """``numel`` uint8 codes of ``bits`` bits from ``packed`` (its size already checked)."""
    out = torch.empty(numel, dtype=torch.uint8, device=packed.device)
    if numel:
        with _cupy.launcher(packed.device) as k:
            k("bits", "unpack_codes", _grid(k, packed.numel()), BLOCK, packed.contiguous(), np.int64(numel),
              np.int32(bits), out)
    return out


# ---- sparse ------------------------------------------------------------------------------------
_INDEX_SUFFIX = {torch.int32: "i32", torch.int64: "i64"}
_SCATTER_SUFFIX = {**_FLOAT_SUFFIX, torch.float64: "f64"}


def cuda_scatter_add_checked(out_flat: torch.Tensor, indices: torch.Tensor,
                             values: torch.Tensor) -> Optional[torch.Tensor]:
    """Kernel path of :func:`gradcomp.kernels.sparse.scatter_add_checked`, or ``None``."""
    if not (kernels_apply(out_flat, values) and out_flat.dtype in _SCATTER_SUFFIX and out_flat.is_contiguous()
            and indices.dtype in _INDEX_SUFFIX and indices.dim() == 1):
        return None
    return scatter_add_checked(out_flat, indices, values)


def scatter_add_checked(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``out[indices] += values`` (repeats summed) when every index is in range, else nothing
    is written and ``ValueError`` is raised. The range is checked on the device before the
    scatter; reading it back for the error is one stream-ordered copy of two integers."""
    m, n = indices.numel(), out.numel()
    if m == 0:
        return out
    idx = indices.to(out.device).contiguous()
    vals = values.to(device=out.device, dtype=out.dtype).contiguous()
    bounds = torch.tensor([2**63 - 1, -2**63], dtype=torch.int64).to(out.device, non_blocking=True)
    isfx = _INDEX_SUFFIX[idx.dtype]
    with _cupy.launcher(out.device) as k:
        grid = _grid(k, m)
        k("sparse", f"scatter_range_{isfx}", grid, BLOCK, idx, np.int64(m), bounds)
        k("sparse", f"scatter_add_{_SCATTER_SUFFIX[out.dtype]}_{isfx}", grid, BLOCK, out, np.int64(n), idx, vals,
          np.int64(m), bounds)
    lo, hi = bounds.tolist()
    if lo < 0 or hi >= n:
        raise ValueError(f"indices must lie in [0, {n}), got values from {lo} to {hi}")
    return out


# ---- quant -------------------------------------------------------------------------------------
_SEGMENT = 1024  # = SEGMENT of quant.cu


def _segments(n: int, block_size: int):
    nb = -(-n // block_size)
    spb = -(-block_size // _SEGMENT)
    return nb, spb


def cuda_block_absmax(x: torch.Tensor, block_size: int) -> Optional[torch.Tensor]:
    """Kernel path of :func:`gradcomp.kernels.quant.block_absmax`, or ``None``."""
    if not (kernels_apply(x) and x.dtype in _FLOAT_SUFFIX):
        return None
    return block_absmax(x, block_size)


def block_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``max |x|`` per block in ``x``'s dtype (NaN if the block holds one): one read of x,
    then a deterministic max over each block's segments."""
    part = _per_segment(x, block_size, "block_absmax", torch.int32)
    # bit patterns of non-negative floats (and NaN above inf) order like int32
    return part.amax(dim=1).view(torch.float32).to(x.dtype)


def _per_segment(x: torch.Tensor, block_size: int, kernel: str, dtype: torch.dtype) -> torch.Tensor:
    """Run a one-warp-per-segment reduction of quant.cu over ``x`` in blocks of ``block_size``:
    the partial results, shaped (blocks, segments per block)."""
    x = x.reshape(-1).contiguous()
    n = x.numel()
    nb, spb = _segments(n, block_size)
    part = torch.empty(nb * spb, dtype=dtype, device=x.device)
    if n:
        with _cupy.launcher(x.device) as k:
            k("quant", f"{kernel}_{_FLOAT_SUFFIX[x.dtype]}", _grid(k, nb * spb * 32), BLOCK, x, np.int64(n),
              np.int64(block_size), np.int64(spb), np.int64(nb * spb), part)
    return part.view(nb, spb)


def cuda_bucket_norms(x: torch.Tensor, bucket_size: int) -> Optional[torch.Tensor]:
    """Kernel path of :func:`gradcomp.kernels.quant.bucket_norms`, or ``None``."""
    if not (kernels_apply(x) and x.dtype in _FLOAT_SUFFIX):
        return None
    return bucket_norms(x, bucket_size)


def bucket_norms(x: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """L2 norm per bucket in ``x``'s dtype; squares summed in float64, so no rescue pass is
    needed for very large or small values (the norm is inf only beyond the dtype)."""
    return _per_segment(x, bucket_size, "block_sumsq", torch.float64).sum(dim=1).sqrt_().to(x.dtype)


def cuda_quantize_levels(x: torch.Tensor, mult: torch.Tensor, block_size: int, levels: int,
                         u: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Kernel path of :func:`gradcomp.kernels.quant.quantize_levels`, or ``None``."""
    tensors = (x, mult) if u is None else (x, mult, u)
    if not (kernels_apply(*tensors) and x.dtype == torch.float32 and mult.dtype == torch.float32
            and (u is None or u.dtype == torch.float32)):
        return None
    return quantize_levels(x, mult, block_size, levels, u).view(x.shape)


def quantize_levels(x: torch.Tensor, mult: torch.Tensor, block_size: int, levels: int,
                    u: Optional[torch.Tensor]) -> torch.Tensor:
    """int8 levels of fp32 ``x * mult[block]``: stochastic with draws ``u``, else nearest."""
    x = x.reshape(-1).contiguous()
    q = torch.empty(x.numel(), dtype=torch.int8, device=x.device)
    if x.numel():
        with _cupy.launcher(x.device) as k:
            k("quant", "quantize_levels", _grid(k, -(-x.numel() // 8)), BLOCK, x, mult.contiguous(),
              np.int64(x.numel()), np.int64(block_size), np.int32(levels), x if u is None else u.reshape(-1).contiguous(),
              np.int32(u is not None), q)
    return q


def cuda_quantize_codes(x: torch.Tensor, mult: torch.Tensor, block_size: int, levels: int,
                        key128: Optional[int], bits: int) -> Optional[torch.Tensor]:
    """Kernel path of :func:`quantize_codes_torch`, or ``None``."""
    if not (kernels_apply(x, mult) and x.dtype == torch.float32 and mult.dtype == torch.float32):
        return None
    return quantize_codes(x, mult, block_size, levels, key128, bits)


def _check_codes(levels: int, bits: int) -> None:
    if bits not in (2, 4, 8) or not 1 <= levels <= 127 or (bits < 8 and 2 * levels >= 1 << bits):
        raise ValueError(f"levels={levels} with bits={bits} is not allowed: bits must be 2, 4 or 8 "
                         f"and 2 * levels < 2**bits (levels <= 127 for 8 bits)")


def quantize_codes_torch(x: torch.Tensor, mult: torch.Tensor, block_size: int, levels: int,
                         key128: Optional[int], bits: int) -> torch.Tensor:
    """The wire codes of a quantiser: levels of ``x * mult[block]``, rounded stochastically
    with the draws of stream ``key128`` (``None``: to nearest), then int8 levels (``bits=8``)
    or ``level + levels`` packed in 2/4-bit fields. The reference of :func:`quantize_codes`,
    written with the primitives of ``kernels.quant``, ``kernels.rng`` and ``kernels.bits``."""
    _check_codes(levels, bits)
    from .bits import pack_codes as pack_codes_ref
    from .quant import quantize_levels as levels_ref
    from .rng import uniform as uniform_ref

    u = None if key128 is None else uniform_ref(x.numel(), key128, x.device)
    q = levels_ref(x, mult, block_size, levels, u)
    return q if bits == 8 else pack_codes_ref(q.add_(levels).view(torch.uint8), bits)


def quantize_codes(x: torch.Tensor, mult: torch.Tensor, block_size: int, levels: int,
                   key128: Optional[int], bits: int) -> torch.Tensor:
    """Kernel of :func:`quantize_codes_torch`: one read of ``x``, the draws made in registers
    (8 per Philox call), the codes written packed."""
    _check_codes(levels, bits)
    x = x.reshape(-1).contiguous()
    n = x.numel()
    out = torch.empty((n * bits + 7) // 8, dtype=torch.uint8, device=x.device)
    if n:
        key = 0 if key128 is None else key128
        with _cupy.launcher(x.device) as k:
            k("quant", "quantize_codes", _grid(k, -(-n // 8)), BLOCK, x, mult.contiguous(), np.int64(n),
              np.int64(block_size), np.int32(levels), np.uint64(key & _MASK64), np.uint64((key >> 64) & _MASK64),
              np.int32(key128 is not None), np.int32(bits), out)
    return out.view(torch.int8) if bits == 8 else out


def cuda_dequantize_levels(q: torch.Tensor, scale: torch.Tensor, block_size: int,
                           dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Kernel path of :func:`gradcomp.kernels.quant.dequantize_levels`, or ``None``."""
    if not (kernels_apply(q, scale) and dtype in _FLOAT_SUFFIX and q.dtype == torch.int8
            and scale.dtype in (torch.float32, torch.float64)):
        return None
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    return dequantize_sum(q.reshape(1, -1), 8, 0, scale.reshape(1, -1), block_size, out.reshape(-1)).view(q.shape)


def dequantize_sum_torch(codes: torch.Tensor, bits: int, offset: int, scales: torch.Tensor, block_size: int,
                         out: torch.Tensor, weight: float = 1.0, accumulate: bool = False) -> torch.Tensor:
    """Decode many ranks' quantised payloads into ``out``: ``weight * ((out if accumulate) +
    sum_r level_r * scale_r[block])`` in fp32, rank order, rounded once to ``out``'s dtype.

    ``codes[r]``: rank r's int8 levels (``bits=8``) or packed ``level + offset`` fields;
    ``scales[r]``: its per-block scales. One rank, weight 1 and no accumulation give exactly
    ``quant.dequantize_levels``. The reference of :func:`dequantize_sum`.
    """
    from .bits import unpack_codes as unpack_ref
    from .quant import dequantize_levels as dequant_ref

    n = out.numel()
    acc = None
    for r in range(codes.shape[0]):
        if bits == 8:
            q = codes[r].view(torch.int8)
        else:
            q = unpack_ref(codes[r], n, bits).view(torch.int8).sub_(offset)
        s = scales[r].to(out.dtype).to(torch.float32)  # each rank's scale rounded to out's dtype
        part = dequant_ref(q, s, block_size, torch.float32)
        acc = part if acc is None else acc.add_(part)
    if accumulate:
        acc = out.float().add_(acc)
    if weight != 1.0:
        acc.mul_(np.float32(weight))
    return out.copy_(acc)


def cuda_dequantize_sum(codes: torch.Tensor, bits: int, offset: int, scales: torch.Tensor, block_size: int,
                        out: torch.Tensor, weight: float = 1.0, accumulate: bool = False) -> Optional[torch.Tensor]:
    """Kernel path of :func:`dequantize_sum_torch`, or ``None``."""
    if not (kernels_apply(codes, scales, out) and out.dtype in _FLOAT_SUFFIX and out.is_contiguous()):
        return None
    return dequantize_sum(codes, bits, offset, scales, block_size, out, weight, accumulate)


def dequantize_sum(codes: torch.Tensor, bits: int, offset: int, scales: torch.Tensor, block_size: int,
                   out: torch.Tensor, weight: float = 1.0, accumulate: bool = False) -> torch.Tensor:
    """Kernel of :func:`dequantize_sum_torch`: each payload read once, ``out`` written once."""
    n = out.numel()
    if bits not in (2, 4, 8) or codes.dim() != 2 or codes.shape[1] != (n * bits + 7) // 8:
        raise ValueError(f"codes must be (ranks, {(n * bits + 7) // 8}) for {n} elements of {bits} bits, "
                         f"got {tuple(codes.shape)}")
    if scales.dim() != 2 or scales.shape[0] != codes.shape[0] or scales.shape[1] != -(-n // block_size):
        raise ValueError(f"scales must be (ranks, {-(-n // block_size)}), got {tuple(scales.shape)}")
    if n:
        with _cupy.launcher(out.device) as k:
            k("quant", f"dequantize_sum_{_FLOAT_SUFFIX[out.dtype]}", _grid(k, -(-n // 8)), BLOCK,
              codes.contiguous().view(torch.uint8), np.int64(codes.shape[1]), np.int32(codes.shape[0]),
              np.int32(bits), np.int32(offset), scales.to(torch.float32).contiguous(), np.int64(scales.shape[1]),
              np.int64(block_size), np.int64(n), out, np.float32(weight), np.int32(bool(accumulate)))
    return out


def cuda_natural_codes(y: torch.Tensor, u: torch.Tensor, out: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Kernel path of :func:`gradcomp.kernels.quant.natural_codes`, or ``None``."""
    tensors = (y, u) if out is None else (y, u, out)
    if not (kernels_apply(*tensors) and (out is None or out.is_contiguous())):
        return None
    return natural_codes(y, u, None, out)


def natural_codes(y: torch.Tensor, u: Optional[torch.Tensor], key128: Optional[int] = None,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Natural codes of fp32 ``y`` (shape kept) with draws ``u``, or made from stream ``key128``."""
    if out is None:
        out = torch.empty(y.shape, dtype=torch.uint8, device=y.device)
    n = y.numel()
    if n:
        key = key128 or 0
        with _cupy.launcher(y.device) as k:
            k("quant", "natural_codes", _grid(k, -(-n // 8)), BLOCK, y.contiguous(),
              y if u is None else u.contiguous(), np.int64(n), np.uint64(key & _MASK64), np.uint64((key >> 64) & _MASK64), np.int32(u is None), out)
    return out


def cuda_natural_decode(codes: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Kernel path of :func:`gradcomp.kernels.quant.natural_decode` (``table``: its 256 values
    in ``dtype``), or ``None``."""
    if not (kernels_apply(codes) and dtype in _FLOAT_SUFFIX):
        return None
    out = torch.empty(codes.numel(), dtype=dtype, device=codes.device)
    tables = table.to(torch.float32).reshape(1, 256).to(codes.device)
    return natural_decode_sum(codes.reshape(1, -1), tables, out).view(codes.shape)


def natural_decode_sum(codes: torch.Tensor, tables: torch.Tensor, out: torch.Tensor, weight: float = 1.0,
                       accumulate: bool = False) -> torch.Tensor:
    """Decode many ranks' natural codes (``codes[r]`` through ``tables[r]``, fp32 x 256) into
    ``out``: ``weight * ((out if accumulate) + sum_r value_r)``, fp32 in rank order."""
    n = out.numel()
    if codes.dim() != 2 or codes.shape[1] != n or tables.shape != (codes.shape[0], 256):
        raise ValueError(f"codes must be (ranks, {n}) and tables (ranks, 256), got {tuple(codes.shape)} "
                         f"and {tuple(tables.shape)}")
    if n:
        with _cupy.launcher(out.device) as k:
            k("quant", f"natural_decode_sum_{_FLOAT_SUFFIX[out.dtype]}", _grid(k, -(-n // 8)), BLOCK,
              codes.contiguous(),
              np.int64(n), np.int32(codes.shape[0]), tables.to(torch.float32).contiguous(), out, np.float32(weight),
              np.int32(bool(accumulate)))
    return out
