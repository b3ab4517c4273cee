"""Quantisation primitives: per-block scales, rounding to integer levels, power-of-two rounding.

A block (bucket) is ``block_size`` consecutive elements of a flat tensor; the last block may
be shorter. Every function is a pure function of its tensor inputs (``overwrite_u=True`` only
lets a function reuse the memory of its uniform draws ``u`` as scratch, which saves a 4-byte
per element allocation) and is the reference that a CUDA kernel must match bit for bit.

Rounding rules, stated exactly so that a kernel can reproduce them:

- stochastic levels: ``clamp(floor(fma(x, mult_b, u)), -levels, levels)`` with one rounding
  (``torch.addcmul``; ``__fmaf_rn`` / ``fma`` in CUDA), unbiased for ``x * mult_b`` up to that
  rounding; deterministic levels: round half to even of ``x * mult_b``;
- natural rounding of an fp32 ``y``: add ``floor(u * 2**23)`` to the bits of ``y`` and keep
  the exponent field; the carry out of the mantissa rounds ``|y| = 2**e (1 + f)`` up to
  ``2**(e+1)`` with probability exactly ``f`` (a subnormal ``y`` rounds to 0 or ``2**-126``
  with probability ``|y| / 2**-126``), so ``E[result] = y``.

Maxima and element-wise results are exact on every device; :func:`bucket_norms` is a sum, so
there a kernel matches only up to the rounding of its reduction order.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator, Optional, Tuple, Union

import numpy as np
import torch

from ._launch import FLOAT_SUFFIX, kernels_apply
from ._launch_quant import (launch_block_absmax, launch_bucket_norms, launch_dequantize_sum, launch_natural_codes,
                            launch_natural_decode_sum, launch_quantize_levels)
from .bits import unpack_codes

NATURAL_TOP = 125  # natural codes: magnitudes 2**(m - 125 + E) for m in 1..125
NATURAL_INF = 126  # magnitude field of +-inf
NATURAL_NAN = 127  # magnitude field of NaN
_CHUNK = 1 << 18  # elements per chunk on CPU: a chunk's fp32 temporaries fit in a 1-2 MiB L2 cache
_POW2_STEP = {torch.float32: 100, torch.float64: 1000}  # largest safe exponent per multiply
SMALLEST_NORMAL32 = 2.0 ** -126  # below it a float32 step is subnormal: few bits, no finite reciprocal
_LIFT = 2.0 ** 64  # lifts every nonzero subnormal float32 step (>= 2**-149) into the normals


def num_blocks(numel: int, block_size: int) -> int:
    """Number of blocks of ``block_size`` covering ``numel`` elements (0 for an empty tensor)."""
    if block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size}")
    return -(-numel // block_size)


def _split(x: torch.Tensor, block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The full blocks as a ``(nb, block_size)`` view and the ragged tail (maybe empty)."""
    full = x.numel() // block_size
    return x[:full * block_size].view(full, block_size), x[full * block_size:]


def _per_block(fn: Callable, block_size: int, *tensors: torch.Tensor) -> torch.Tensor:
    """``fn`` applied to the full blocks (dim 1) and to the tail, results concatenated."""
    parts = [_split(t, block_size) for t in tensors]
    out = [fn(*(p[0] for p in parts))]
    if parts[0][1].numel():
        out.append(fn(*(p[1].unsqueeze(0) for p in parts)))
    return torch.cat(out) if len(out) > 1 else out[0]


def _broadcast_op(dst: torch.Tensor, op: Callable, x: torch.Tensor, per_block: torch.Tensor,
                  block_size: int) -> None:
    """``op(dst_b, x_b, per_block[b])`` in place over every block of ``dst``, ``x``."""
    dmain, dtail = _split(dst, block_size)
    xmain, xtail = _split(x, block_size)
    nfull = dmain.shape[0]
    if nfull:
        op(dmain, xmain, per_block[:nfull].unsqueeze(1))
    if dtail.numel():
        op(dtail, xtail, per_block[nfull:nfull + 1])


def _chunks(numel: int, block_size: int, device: torch.device) -> Iterator[Tuple[int, int, int, int]]:
    """``(start, stop, first_block, chunk_block_size)`` covering ``numel`` elements.

    On CPU a chunk holds about ``_CHUNK`` elements, whole blocks or a piece of one block (its
    block size is then the chunk's length), so per-chunk temporaries stay in cache instead of
    costing a fresh 4-byte-per-element allocation. Elsewhere the whole tensor is one chunk.
    """
    if device.type != "cpu" or numel <= _CHUNK:
        yield 0, numel, 0, block_size
        return
    if block_size <= _CHUNK:
        step = (_CHUNK // block_size) * block_size
        for a in range(0, numel, step):
            yield a, min(a + step, numel), a // block_size, block_size
        return
    a = 0
    while a < numel:
        b = min(a + _CHUNK, numel, (a // block_size + 1) * block_size)
        yield a, b, a // block_size, b - a
        a = b


def block_runs(numel: int, block_size: int, device: torch.device) -> Iterator[Tuple[int, int]]:
    """``(start, stop)`` runs of whole blocks covering ``numel`` elements: about ``_CHUNK``
    elements each on CPU (so a run's temporaries stay in cache), the whole tensor elsewhere or
    when one block alone is larger."""
    if device.type != "cpu" or numel <= _CHUNK or block_size >= _CHUNK:
        yield 0, numel
        return
    step = (_CHUNK // block_size) * block_size
    for a in range(0, numel, step):
        yield a, min(a + step, numel)


def block_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``max |x|`` of each block, in ``x``'s dtype; a block holding NaN gives NaN."""
    if x.numel() == 0:
        return x.new_empty(0)
    if kernels_apply(x) and x.dtype in FLOAT_SUFFIX:
        return launch_block_absmax(x, block_size)
    # amax and amin read x without the |x| temporary; maximum() propagates NaN
    return _per_block(lambda b: torch.maximum(b.amax(dim=1), b.amin(dim=1).neg()), block_size, x)


def may_hold(flags: torch.Tensor) -> bool:
    """Whether some element of the bool tensor ``flags`` may be set, as far as the host knows
    without waiting for a device: read for a CPU tensor (free there), always True elsewhere.
    Callers guard a branch that changes only the flagged elements (``torch.where``), so
    taking it when none is set gives the same bits as skipping it: on CPU the pass is saved,
    on a GPU the sync."""
    return flags.device.type != "cpu" or bool(flags.any())


def bucket_norms(x: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """L2 norm of each bucket, in ``x``'s dtype.

    A sum of squares overflows or underflows far inside the dtype's range (fp32: beyond 1e19
    or below 1e-19); buckets whose norm comes out 0 or inf although their values are nonzero
    and finite are recomputed scaled by their absmax, so the result is inf only where the norm
    exceeds the dtype or the bucket holds inf.
    """
    if x.numel() == 0:
        return x.new_empty(0)
    if kernels_apply(x) and x.dtype in FLOAT_SUFFIX:
        return launch_bucket_norms(x, bucket_size)
    norms = _per_block(lambda b: torch.linalg.vector_norm(b, dim=1), bucket_size, x)
    suspect = (norms == 0) | torch.isinf(norms)
    if x.device.type != "cpu":
        return _norms_again(x, norms, suspect, bucket_size)
    if may_hold(suspect):  # all-zero buckets are common; a second look is cheap
        amax = block_absmax(x, bucket_size)
        redo = (suspect & (amax > 0) & torch.isfinite(amax)).nonzero().flatten()
        if redo.numel():
            top = amax[redo].unsqueeze(1)
            rows = _gather_blocks(x, bucket_size, redo)
            norms[redo] = (top * torch.linalg.vector_norm(rows / top, dim=1, keepdim=True)).flatten()
    return norms


def _norms_again(x: torch.Tensor, norms: torch.Tensor, suspect: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """``bucket_norms``'s second look without reading anything back (tensors off the CPU):
    every bucket's norm again, scaled by its absmax, kept where the first was suspect and the
    bucket is nonzero and finite."""
    amax = block_absmax(x, bucket_size)
    redo = suspect & (amax > 0) & torch.isfinite(amax)
    top = torch.where(redo, amax, torch.ones_like(amax))
    scaled = torch.empty_like(x)
    _broadcast_op(scaled, lambda d, xb, tb: torch.div(xb, tb, out=d), x, top, bucket_size)
    again = top * _per_block(lambda b: torch.linalg.vector_norm(b, dim=1), bucket_size, scaled)
    return torch.where(redo, again, norms)


def _gather_blocks(x: torch.Tensor, block_size: int, idx: torch.Tensor) -> torch.Tensor:
    """Blocks ``idx`` (ascending) of ``x`` as rows of a ``(len(idx), block_size)`` tensor; the
    ragged last block is zero padded."""
    main, tail = _split(x, block_size)
    rows = main[idx[idx < main.shape[0]]]
    if tail.numel() and bool((idx == main.shape[0]).any()):
        last = x.new_zeros(1, block_size)
        last[0, :tail.numel()] = tail
        rows = torch.cat([rows, last])
    return rows


def fp32_ceil(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float32, rounded up where the cast rounded down (so ``|x| <= scale`` holds)."""
    t32 = t.to(torch.float32)
    if t.dtype == torch.float64:
        low = t32.double() < t
        t32 = torch.where(low, torch.nextafter(t32, torch.full_like(t32, math.inf)), t32)
    return t32


def fp32_scales(x: torch.Tensor, scales: torch.Tensor, block_size: int, owner: str = "",
                dtype: Optional[torch.dtype] = None, bounded: bool = False,
                refuse: Optional[Callable[[torch.Tensor, str], None]] = None) -> torch.Tensor:
    """Per-block ``scales`` of ``x`` as float32 for the wire, rounded up (:func:`fp32_ceil`).

    A block of finite values whose scale is beyond the float32 range is refused (naming
    ``owner``, the caller, and ``dtype``, the gradient's dtype, by default ``x``'s): decided on
    the device and handed to ``refuse(bad, problem)`` (the compressors pass
    ``compress.transaction.refuse``, which in a collective tells every rank through its status
    word); without one, a ``ValueError`` after one host read. A block holding inf
    keeps its inf scale, which carries the inf to the receiver. ``bounded``: no scale exceeds
    its block's ``max |x|`` (int8's and TernGrad's do), so for an ``x`` of float32 or
    narrower no finite block can overflow and nothing is checked.
    """
    s32 = fp32_ceil(scales)
    if bounded and x.dtype != torch.float64:
        return s32
    inf = torch.isinf(s32)
    if may_hold(inf):
        bad = (inf & torch.isfinite(block_absmax(x, block_size))).any()
        problem = (f"{owner + ': ' if owner else ''}a block's scale of this {dtype or x.dtype} tensor exceeds the "
                   f"float32 range of the wire (3.4e38); scale the tensor down")
        if refuse is not None:
            refuse(bad, problem)
        elif bool(bad):
            raise ValueError(problem)
    return s32


def tiny_safe_div(top: torch.Tensor, divisor: float) -> torch.Tensor:
    """``top / divisor`` rounded once (:func:`div_scalar`), except that a float32 quotient
    below the smallest normal (2**-126) is rounded up instead: a subnormal step keeps few
    significant bits, and rounding it down (or to 0) would push ``|x| / step`` past
    ``divisor`` for ``|x| <= top``. Other dtypes and quotients are rounded to nearest."""
    q = div_scalar(top, divisor)
    if q.dtype != torch.float32:
        return q
    tiny = (q < SMALLEST_NORMAL32) & (top > 0)
    # applied to every block rather than only when one is tiny: a pass over the per-block
    # values costs less than the host read that would decide it (a sync on CUDA)
    return torch.where(tiny, fp32_ceil(top.double() / divisor), q)


def unit_multipliers(x: torch.Tensor, step: torch.Tensor, block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(xs, mult)`` for :func:`quantize_levels` counting ``x`` in units of ``step`` (one
    entry per block, ``x``'s dtype): ``mult = 1 / step`` (0 where the step is not > 0).

    A float32 step below 2**-126 has no finite reciprocal (or none of full precision): such a
    block and its step are first multiplied by 2**64, which is exact, so ``xs`` is a new
    tensor with those blocks scaled; otherwise ``xs`` is ``x`` and no pass is spent.
    """
    mult = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    if x.dtype != torch.float32:
        return x, mult
    tiny = (step > 0) & (step < SMALLEST_NORMAL32)
    if not may_hold(tiny):
        return x, mult
    lift = torch.where(tiny, _LIFT, 1.0).to(x.dtype)
    lifted = step * lift
    mult = torch.where(step > 0, 1.0 / lifted, torch.zeros_like(step))
    xs = torch.empty_like(x)
    _broadcast_op(xs, lambda d, xb, fb: torch.mul(xb, fb, out=d), x, lift, block_size)
    return xs, mult


def clamp_blocks_(out: torch.Tensor, reach: torch.Tensor, limit: float, block_size: int) -> torch.Tensor:
    """Saturate the decoded blocks of ``out`` whose ``reach`` (largest decodable magnitude,
    one entry per block) is finite and above ``limit`` to ``[-limit, limit]``, in place; NaN
    and the values of blocks with a non-finite reach stay as they are."""
    over = torch.isfinite(reach) & (reach > limit)
    if may_hold(over):
        bound = torch.where(over, limit, math.inf).to(out.dtype)
        _broadcast_op(out, lambda d, _, b: torch.clamp_(d, -b, b), out, bound, block_size)
    return out


def div_scalar(t: torch.Tensor, v: float) -> torch.Tensor:
    """``t / v`` rounded once on every device (CUDA turns a division by a Python number into
    a multiplication by its rounded reciprocal, which can differ in the last bit)."""
    return torch.div(t, torch.tensor(v, dtype=t.dtype, device=t.device))


def stochastic_round(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``floor(x + u)``: one of the two integers around ``x``, the upper with probability
    ``frac(x)`` when ``u`` is uniform in [0, 1), so ``E[result] = x``."""
    return torch.floor(x + u.to(x.dtype))


def quantize_levels(x: torch.Tensor, mult: torch.Tensor, block_size: int, levels: int,
                    u: Optional[torch.Tensor] = None, *, overwrite_u: bool = False) -> torch.Tensor:
    """Integer levels (int8, within ``[-levels, levels]``) of ``x * mult[block]``.

    With uniform draws ``u`` the rounding is stochastic, ``floor(fma(x, mult_b, u))``, and
    unbiased; without, round half to even. ``mult`` has one entry per block in ``x``'s
    dtype. Values beyond ``levels`` (clipping, float rounding) saturate; a NaN product gives
    some valid level, so the caller's NaN scale must carry it.
    """
    if not 1 <= levels <= 127:
        raise ValueError(f"levels must be in [1, 127] to fit int8, got {levels}")
    tensors = (x, mult) if u is None else (x, mult, u)
    if kernels_apply(*tensors) and all(t.dtype == torch.float32 for t in tensors):
        return launch_quantize_levels(x, mult, block_size, levels, u).view(x.shape)
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scratch = None
    for a, b, blk, cbs in _chunks(x.numel(), block_size, x.device):
        m = mult[blk:blk + num_blocks(b - a, cbs)]
        if u is not None:
            t = u[a:b] if (overwrite_u and u.dtype == x.dtype) else u[a:b].to(x.dtype, copy=True)
            _broadcast_op(t, lambda d, xb, mb: d.addcmul_(xb, mb), x[a:b], m, cbs)
            t.floor_()
        else:
            if scratch is None:
                scratch = torch.empty(b - a, dtype=x.dtype, device=x.device)
            t = scratch[:b - a]
            _broadcast_op(t, lambda d, xb, mb: torch.mul(xb, mb, out=d), x[a:b], m, cbs)
            t.round_()
        t.clamp_(-levels, levels)  # keeps the int8 cast in range
        q[a:b].copy_(t)
    return q.clamp_(-levels, levels)  # NaN casts to an arbitrary integer


def dequantize_levels(q: torch.Tensor, scale: torch.Tensor, block_size: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale[block]`` as a new tensor of ``dtype``: one rounding per element."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if (kernels_apply(q, scale) and dtype in FLOAT_SUFFIX and q.dtype == torch.int8
            and scale.dtype in (torch.float32, torch.float64)):
        launch_dequantize_sum(q.reshape(1, -1), 8, 0, scale.reshape(1, -1), block_size, out.reshape(-1))
        return out
    out.copy_(q)  # no temporaries here, so chunks would not save anything
    _broadcast_op(out, lambda d, _, s: d.mul_(s), out, scale.to(dtype), block_size)
    return out


def dequantize_sum_reference(codes: torch.Tensor, bits: int, offset: int, scales: torch.Tensor, block_size: int,
                             out: torch.Tensor, weight: float = 1.0, accumulate: bool = False) -> torch.Tensor:
    """Reference of the kernel behind :func:`dequantize_levels` in its general form, which
    decodes many ranks' payloads into ``out``: ``weight * ((out if accumulate) + sum_r
    level_r * scale_r[block])`` in fp32, rank order, rounded once to ``out``'s dtype.

    ``codes[r]``: rank r's int8 levels (``bits=8``) or packed ``level + offset`` fields;
    ``scales[r]``: its per-block scales. One rank, weight 1 and no accumulation give exactly
    :func:`dequantize_levels`, the only form the library calls today.
    """
    n = out.numel()

    def decode(r: int) -> torch.Tensor:
        if bits == 8:
            q = codes[r].view(torch.int8)
        else:
            q = unpack_codes(codes[r], n, bits).view(torch.int8).sub_(offset)
        s = scales[r].to(out.dtype).to(torch.float32)  # each rank's scale rounded to out's dtype
        return dequantize_levels(q, s, block_size, torch.float32)

    acc = decode(0)  # the first rank's values as they are (a sum starting at +0 would lose -0)
    for r in range(1, codes.shape[0]):
        acc.add_(decode(r))
    if accumulate:
        acc = out.float().add_(acc)
    if weight != 1.0:
        acc.mul_(float(np.float32(weight)))  # the kernel's fp32 weight
    return out.copy_(acc)


# ---- natural (power-of-two) rounding ---------------------------------------------------------

def max_exponent(x: torch.Tensor) -> Tuple[int, bool]:
    """``(E, finite)``: the least ``E`` with ``|x| < 2**E`` over the finite elements of ``x``
    (0 when there are none or all are zero), and whether every element is finite."""
    if x.numel() == 0:
        return 0, True
    top = float(torch.maximum(x.amax(), x.amin().neg()))
    finite = math.isfinite(top)
    if not finite:
        fin = x[torch.isfinite(x)]
        top = float(fin.abs().amax()) if fin.numel() else 0.0
    return (math.frexp(top)[1] if top > 0 else 0), finite


def mul_pow2_(t: torch.Tensor, k: int) -> torch.Tensor:
    """Multiply the float32/float64 tensor ``t`` in place by ``2**k`` with one rounding.

    A factor beyond the dtype's range is split; only upward steps are split, and scaling up
    is exact, so the single rounding (into the subnormals) happens at most once.
    """
    step = _POW2_STEP[t.dtype]
    while k > step:
        t.mul_(2.0 ** step)
        k -= step
    while k < -2 * step:  # only for factors below the subnormals, which gradcomp never needs
        t.mul_(2.0 ** -step)
        k += step
    return t.mul_(2.0 ** k)  # 2**k >= 2**-149 (fp32) / 2**-1074 (fp64) is exact


def mul_pow2_on_device_(t: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """:func:`mul_pow2_` for an int64 tensor ``k`` (broadcast against ``t``), nothing read
    back: factors beyond the dtype's range are split in two, each an exact power of two, so
    the product is rounded at most once. ``|k|`` at most twice the dtype's step."""
    step = _POW2_STEP[t.dtype]
    first = k.clamp(-step, step)
    return t.mul_(pow2(first, t.dtype)).mul_(pow2(k - first, t.dtype))


def _scaled_fp32(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x * 2**k`` as a new float32 tensor (float64 input is scaled first, then rounded)."""
    wd = torch.float64 if x.dtype == torch.float64 else torch.float32
    if x.dtype == wd and k <= _POW2_STEP[wd]:
        y = torch.mul(x, 2.0 ** k)  # one pass, no copy first
    else:
        y = mul_pow2_(x.to(wd, copy=True), k)
    return y if wd == torch.float32 else y.to(torch.float32)


def natural_codes(y: torch.Tensor, u: torch.Tensor, *, overwrite_u: bool = False,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """8-bit codes ``sign << 7 | field`` of ``y`` rounded stochastically to a power of two.

    ``y`` is finite float32 with ``|y| < 2**-2``, so the rounded exponent field is in
    ``[0, 125]`` (0 only for zero); see the module docstring for the rounding rule. The codes
    go to ``out`` (uint8, ``y``'s shape) when given.
    """
    if y.dtype != torch.float32 or u.dtype != torch.float32 or u.shape != y.shape:
        raise ValueError("natural_codes expects float32 y and u of the same shape")
    tensors = (y, u) if out is None else (y, u, out)
    if kernels_apply(*tensors) and (out is None or out.is_contiguous()):
        return launch_natural_codes(y, u, out=out)
    r = u if overwrite_u else u.clone()
    r.mul_(float(1 << 23))
    r = r.view(torch.int32).copy_(r)  # floor(u * 2**23), converted in place
    r.add_(y.view(torch.int32))  # the mantissa carry rounds up; the sign bit is untouched
    neg = r < 0
    r.bitwise_right_shift_(23)  # = field - 256 * sign
    codes = r.to(torch.uint8) if out is None else out.copy_(r)  # = field
    return codes.bitwise_or_(neg.view(torch.uint8).bitwise_left_shift_(7))


def natural_encode(x: torch.Tensor, u: torch.Tensor, *,
                   overwrite_u: bool = False) -> Tuple[torch.Tensor, Union[int, torch.Tensor]]:
    """``(codes, E)``: natural compression of the flat float tensor ``x`` with draws ``u``.

    ``E`` is :func:`max_exponent` of ``x``: an int for a CPU ``x``; elsewhere a 0-d int32
    tensor on ``x``'s device, found there with nothing read back (:func:`_natural_encode_on_device`,
    the same codes). Code ``c = sign << 7 | m`` stands for
    ``±2**(m - 125 + E)`` for ``m`` in 1..125, ``±0`` for ``m = 0``, ``±inf`` for 126 and NaN
    for 127. Every value is rounded to one of its two neighbouring powers of two, unbiasedly;
    magnitudes below ``2**(E - 124)`` round to 0 or ``2**(E - 124)``, also unbiasedly (for
    float64 input the probabilities are resolved to 2**-24, as the draws are).
    """
    if x.device.type != "cpu":
        return _natural_encode_on_device(x, u, overwrite_u)
    exp, finite = max_exponent(x)
    xs = x if finite else torch.where(torch.isfinite(x), x, torch.zeros((), dtype=x.dtype, device=x.device))
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    for a, b, _, _ in _chunks(x.numel(), x.numel() or 1, x.device):
        y = _scaled_fp32(xs[a:b], -2 - exp)  # the largest magnitude lands in [2**-3, 2**-2)
        natural_codes(y, u[a:b], overwrite_u=overwrite_u, out=codes[a:b])
    if not finite:
        codes[torch.isnan(x)] = NATURAL_NAN
        codes[x == math.inf] = NATURAL_INF
        codes[x == -math.inf] = NATURAL_INF | 0x80
    return codes, exp


def _natural_encode_on_device(x: torch.Tensor, u: torch.Tensor, overwrite_u: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`natural_encode` with ``E`` kept on the device: the same codes, bit for bit (the
    scaling by ``2**(-2 - E)`` is the same exact power of two, built from its bits)."""
    wd = torch.float64 if x.dtype == torch.float64 else torch.float32
    finite = torch.isfinite(x)
    xs = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device)).to(wd)
    top = xs.abs().amax() if x.numel() else torch.zeros((), dtype=wd, device=x.device)
    exp = torch.where(top > 0, torch.frexp(top).exponent, 0).to(torch.int32)
    k = (-2 - exp).long()
    y = mul_pow2_on_device_(xs, k).to(torch.float32)  # float64 scaled first, then rounded
    codes = natural_codes(y, u, overwrite_u=overwrite_u)
    nan, inf = torch.isnan(x), torch.isinf(x)
    special = torch.where(nan, NATURAL_NAN, torch.where(x > 0, NATURAL_INF, NATURAL_INF | 0x80)).to(torch.uint8)
    return torch.where(nan | inf, special, codes), exp


def pow2(k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``2**k`` (``k``: an int64 tensor, each in float64's range [-1074, 1023], its value
    representable in ``dtype``) as a tensor of ``dtype``, exact: built from float64's bits
    (normal or subnormal) on the device, then cast, which is exact for a power of two."""
    bits = torch.where(k >= -1022, (k + 1023) << 52, torch.ones_like(k) << (k + 1074).clamp(0, 51))
    return bits.view(torch.float64).to(dtype)


def _max_pow2_exponent(dtype: torch.dtype) -> int:
    return math.frexp(torch.finfo(dtype).max)[1] - 1


def natural_table(exp: Union[int, torch.Tensor], dtype: torch.dtype,
                  limit_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The 256 values of the natural codes for exponent ``exp``, as ``dtype``.

    Powers of two above the largest one of ``limit_dtype`` (default ``dtype``) saturate to it,
    so that a finite input never decodes to inf (a slight bias at the very top of the range).
    ``exp`` may be a 0-d integer tensor: the table is then built on its device, nothing read.
    """
    top = _max_pow2_exponent(limit_dtype or dtype)
    if isinstance(exp, torch.Tensor):
        m = torch.arange(1, NATURAL_TOP + 1, device=exp.device)
        e = torch.clamp(m - NATURAL_TOP + exp.long(), max=top)
        powers = torch.where(e >= -1074, pow2(e.clamp(min=-1074), torch.float64), 0.0)
        edge = [torch.full((1,), v, dtype=torch.float64, device=exp.device) for v in (0.0, math.inf, math.nan)]
        half = torch.cat([edge[0], powers, edge[1], edge[2]])  # fills, not copies from the host
        return torch.cat([half, -half]).to(dtype)
    mags = [0.0] + [math.ldexp(1.0, min(m - NATURAL_TOP + exp, top)) for m in range(1, NATURAL_TOP + 1)]
    mags += [math.inf, math.nan]
    half = torch.tensor(mags, dtype=torch.float64)
    return torch.cat([half, -half]).to(dtype)


def natural_decode(codes: torch.Tensor, exp: Union[int, torch.Tensor], dtype: torch.dtype = torch.float32,
                   limit_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The values of natural ``codes`` (uint8) for exponent ``exp`` (an int, or a 0-d integer
    tensor on the codes' device): a new tensor of ``dtype`` (float32 or float64)."""
    if isinstance(exp, torch.Tensor) and codes.device.type == "cpu":
        exp = int(exp)  # on the host already
    table = natural_table(exp, dtype, limit_dtype)  # on exp's device: the host for an int
    if table.device != codes.device:
        table = table.to(codes.device)
    if codes.device.type == "cpu":
        return torch.from_numpy(np.take(table.numpy(), codes.numpy()))
    if kernels_apply(codes) and dtype in FLOAT_SUFFIX:
        out = torch.empty(codes.numel(), dtype=dtype, device=codes.device)
        tables = table.to(torch.float32).reshape(1, 256)
        return launch_natural_decode_sum(codes.reshape(1, -1), tables, out).view(codes.shape)
    return table[codes.long()]
