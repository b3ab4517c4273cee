"""Fused CPU loops of the codecs: each reads its input once and writes its output once.

The rule of use (:func:`applies`): every tensor on the CPU, float32/float64 data, at least
:data:`FUSED_MIN` elements, numba importable, and ``GRADCOMP_FUSED_CPU`` not ``0``. Everything
else (small tensors, fp16/bf16, other devices, no numba) takes the torch/numpy paths of
``kernels.sign``, ``kernels.select`` and ``compress.sparse``, which stay the oracle: the fused
loops give the same bits (sign bits, decodings, residuals, indices), except the sign sums,
which are float64 sums in a fixed order of 8 lanes (the reference's are float64 too, in
another order: equal up to float64 rounding, the same decode values in practice).

The threshold keeps numba out of processes that only ever see small tensors: importing it
costs ~0.5 s and loading the compiled loops from the on-disk cache (``cache=True``, beside this
file or in numba's cache directory) a few tens of ms more; the first compile on a machine,
~0.5 s per loop and dtype, is paid once. From 2**14 elements up the fused loops were measured
faster (ResNet-50's 23 tensors of 2**14 to 2**18 elements, one process: top-k+ef's compress
5.7-6.2 ms against 9.9-10.0 with the loops from 2**18 only, onebit+ef's 6.0-7.4 against 8.0-9.9;
``python tools/cpu_paths.py --fused-min``, bench/results/kernels.md, "Fused CPU loops"); smaller
tensors, where per-call costs dominate, keep the
reference paths (not measured below 2**14).
"""
from __future__ import annotations

import contextlib
import importlib
import math
import os
from typing import Any, Iterator, List, Optional, Tuple

import numpy as np
import torch

from .select import _exact_cpu, kth_smallest_cpu, topk_abs_indices as topk_abs_indices_reference

FUSED_MIN = 1 << 14  # elements: below, the reference paths run and numba is never imported
_FLOATS = (torch.float32, torch.float64)
_SAMPLE = 1 << 17  # elements of the strided sample that estimates the top-k threshold
_CODES = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(np.bool_)
_STATS = {"none": 0, "sum": 1, "abs": 2, "split": 3}
_enabled = os.environ.get("GRADCOMP_FUSED_CPU", "1") != "0"
_loops: Any = None  # the compiled loops (a namespace), False once numba failed to import


def applies(numel: int, *tensors: torch.Tensor) -> bool:
    """Whether the fused loops run for ``numel`` elements held in ``tensors``: see the module
    docstring. Integer tensors (bits, indices) only need to be on the CPU."""
    if not _enabled or numel < FUSED_MIN:
        return False
    for t in tensors:
        if t.device.type != "cpu" or (t.is_floating_point() and t.dtype not in _FLOATS):
            return False
    return _get() is not None


@contextlib.contextmanager
def threshold(numel: int) -> Iterator[None]:
    """Within this block the fused loops run from ``numel`` elements on (tests compare them
    with the reference on small tensors; ``numel`` beyond any size switches them off)."""
    global FUSED_MIN
    before, FUSED_MIN = FUSED_MIN, numel
    try:
        yield
    finally:
        FUSED_MIN = before


def _get() -> Any:
    global _loops
    if _loops is None:
        try:
            _loops = importlib.import_module("gradcomp.kernels._cpu_loops")
        except Exception:  # numba not installed, or built for another numpy: the reference paths run
            _loops = False
    return _loops or None


# ---- entry points (tensors in, tensors out; callers check applies() first) --------------------
def sign_pack(x: torch.Tensor, stats: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kernels.sign.sign_pack`` of a 1-D contiguous float32/float64 CPU tensor, in one pass."""
    n = x.numel()
    bits = np.empty((n + 7) // 8, dtype=np.uint8)
    s0, s1 = _get().pack(x.numpy(), bits, _STATS[stats])
    return torch.from_numpy(bits), _sums(s0, s1, stats)


def sign_pack_sum(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                  stats: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``torch.add(a, b, out=out)`` and then :func:`sign_pack` of ``out``, in one pass over
    memory (the same bits as the two apart); 1-D contiguous CPU tensors of one float dtype,
    ``out`` may be ``a`` or ``b``."""
    n = out.numel()
    bits = np.empty((n + 7) // 8, dtype=np.uint8)
    s0, s1 = _get().pack_sum(a.numpy(), b.numpy(), out.numpy(), bits, _STATS[stats], True)
    return torch.from_numpy(bits), _sums(s0, s1, stats)


def _sums(s0: float, s1: float, stats: str) -> torch.Tensor:
    return torch.tensor([s0, s1][:(0, 1, 1, 2)[_STATS[stats]]], dtype=torch.float64)


def sign_decode(bits: torch.Tensor, values: torch.Tensor, out: torch.Tensor, accumulate: bool) -> torch.Tensor:
    """``out = where(bit, values[0], values[1])`` (``out += ...`` with ``accumulate``), the two
    values (a float CPU tensor) rounded to ``out``'s dtype once, as
    ``kernels.sign.sign_unpack_values`` does; one pass over ``out``."""
    _get().decode(bits.numpy(), _table(values, out.dtype), out.numpy(), bool(accumulate))
    return out


def _table(values: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """Row ``b``: the 8 decoded values of sign byte ``b``, the two values rounded to ``dtype``."""
    pair = values.to(torch.float64).to(dtype).numpy()
    return np.where(_CODES, pair[0], pair[1]).astype(pair.dtype)


def sign_decode_mean(bits: List[torch.Tensor], values: List[torch.Tensor], out: torch.Tensor,
                     divisor: int) -> bool:
    """``out = (decode_0 + decode_1 + ...) / divisor`` for sign payloads (``bits[r]``, decode
    values ``values[r]`` as in :func:`sign_decode`), summed in rank order: the bits of decoding
    each into ``out`` in turn and dividing once, in one pass over ``out``. True when ``out`` is
    known to be finite without looking (two payloads whose four possible means are finite),
    False when that is not known."""
    tables = np.stack([_table(v, out.dtype) for v in values])
    divisor = tables.dtype.type(divisor)
    if len(bits) == 2:  # by nibble pairs: each of the 256 x 4 values is decode_mean's own sum and quotient
        lut = (tables[0, :16, None, :4] + tables[1, None, :16, :4]) / divisor
        _get().decode_pair(bits[0].numpy(), bits[1].numpy(), np.ascontiguousarray(lut.reshape(256, 4)), out.numpy())
        return bool(np.isfinite(lut).all())  # every element is one of these (host values: no sync)
    _get().decode_mean(np.stack([b.numpy() for b in bits]), tables, out.numpy(), divisor)
    return False


def sparse_mean(indices: List[torch.Tensor], values: List[torch.Tensor], out: torch.Tensor,
                divisor: int, zeroed: bool = False) -> bool:
    """``out = (scatter_0 + scatter_1 + ...) / divisor`` for sparse payloads whose indices are
    strictly increasing and in range (checked by the caller) and whose values are in ``out``'s
    dtype: zeros, then each position touched once, its values added in rank order; the bits of
    scattering each payload into zeros in turn and dividing the whole tensor. ``zeroed``: ``out``
    holds +0.0 everywhere already (not written again). True when every element of ``out`` is
    finite (the loop sees each value it writes)."""
    starts = np.cumsum([0] + [i.numel() for i in indices]).astype(np.int64)
    if not zeroed:
        out.zero_()
    bad = _get().sparse_mean(np.concatenate([i.numpy() for i in indices]).astype(np.int64),
                             np.concatenate([v.numpy() for v in values]), starts, out.numpy(),
                             out.numpy().dtype.type(divisor))
    return bad == 0


def topk_abs_indices(x: torch.Tensor, k: int, sum_of: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """``kernels.select.topk_abs_indices(x, k)`` (the same indices: the exact top-k by magnitude,
    ties to the lowest positions) with the candidate pass fused into one loop; ``x``: 1-D
    contiguous, ``0 < k``, ``4 k < numel``. ``sum_of=(a, b)`` (1-D contiguous, ``x``'s dtype,
    either may be ``x``): ``x`` is first overwritten with ``a + b`` (``torch.add``'s bits), in
    the candidate pass itself."""
    n = x.numel()
    stride = max(16, n // _SAMPLE)
    if sum_of is None:
        sample = x[stride // 2::stride].abs()
    else:  # the sum's own elements: the same sample
        sample = torch.add(sum_of[0][stride // 2::stride], sum_of[1][stride // 2::stride]).abs_()
    s = sample.numel()
    # the sample element used as threshold: as kernels.select chooses it, a little low
    mean = s * k / n
    rank = math.ceil(1.05 * mean + 4.0 * math.sqrt(mean) + 1.0)
    while rank < s:
        t = float(kth_smallest_cpu(sample, s - rank + 1))
        if math.isnan(t):
            break
        if sum_of is not None:
            idx, sum_of = _at_least_sum(sum_of, x, t, n * rank // s), None
        else:
            idx = _at_least(x, t, n * rank // s)
        if idx.numel() >= k:
            return _exact_cpu(x.index_select(0, idx).abs(), idx, k)
        rank *= 4
    if sum_of is not None:
        torch.add(sum_of[0], sum_of[1], out=x)
    return topk_abs_indices_reference(x, k)


def _at_least_sum(sum_of: Tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, t: float, expect: int) -> torch.Tensor:
    """:func:`_at_least` of ``x`` after ``x = a + b``, written in the same pass."""
    cap = expect + (expect >> 3) + 1024
    out = np.empty(cap, dtype=np.int64)
    found = _get().at_least_sum(sum_of[0].numpy(), sum_of[1].numpy(), x.numpy(), max(t, 0.0), out)
    if found <= cap:
        return torch.from_numpy(out[:found])
    return _at_least(x, t, found)  # the estimate was low: x holds the sum, once more with room for all


def _at_least(x: torch.Tensor, t: float, expect: int) -> torch.Tensor:
    """Ascending int64 positions where ``|x| >= t`` or ``x`` is NaN (``t``: a value of ``x``'s
    dtype), compared as integers: the bits without the sign bit; ``expect``: the likely count."""
    itype = np.int32 if x.dtype == torch.float32 else np.int64
    mask = itype(np.iinfo(itype).max)
    key = np.array(t if t > 0 else 0, dtype=x.numpy().dtype).view(itype)[()]
    bits = x.numpy().view(itype)
    cap = expect + (expect >> 3) + 1024
    out = np.empty(cap, dtype=np.int64)
    found = _get().at_least(bits, key, mask, out)
    if found > cap:  # the estimate was low: once more with room for all
        out = np.empty(found, dtype=np.int64)
        _get().at_least(bits, key, mask, out)
    return torch.from_numpy(out[:found])


def take_and_clear(flat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``values = flat[idx]`` and then ``flat[idx] = values - values`` (0, NaN for NaN/Inf), for
    distinct int64 ``idx`` in range: ``compress.sparse.sparse_residual`` in one loop."""
    values = np.empty(idx.numel(), dtype=flat.numpy().dtype)
    _get().take_and_clear(flat.numpy(), idx.numpy(), values)
    return torch.from_numpy(values)


def warm(dtype: Optional[torch.dtype] = None) -> bool:
    """Compile (or load) the loops for ``dtype`` (float32 by default) now rather than at the
    first large tensor; False where they are not available."""
    if _get() is None:
        return False
    x = torch.zeros(64, dtype=dtype or torch.float32)
    bits, _ = sign_pack(x, "split")
    sign_decode(bits, torch.tensor([1.0, -1.0]), x, True)
    return True
