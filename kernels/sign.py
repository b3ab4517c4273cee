"""Sign compression primitives: one bit per element plus a per-tensor sum, and the decode.

``sign_pack(x, stats)`` sets bit ``i`` where ``x[i] >= 0`` (zero counts as positive, NaN as
negative), packed little-endian within a byte as in :mod:`kernels.bits`, and returns the sum
that a compressor needs to choose its decode values:

- ``"none"``: nothing; ``"sum"``: ``[sum(x)]``; ``"abs"``: ``[sum(|x|)]``;
- ``"split"``: ``[sum(max(x, 0)), sum(min(x, 0))]`` (the positive and negative parts).

NaN and Inf in ``x`` make every requested sum non-finite, so they propagate into the decode
values. ``sign_unpack`` writes ``pos_value`` where a bit is set and ``neg_value`` elsewhere,
bit-exactly, or adds them into ``out`` (``accumulate=True``): error feedback can subtract the
decoded tensor from its residual without materialising it.

On CPU both run over cache-sized chunks with numpy's C routines, so the input is read once and
the output written once (each extra pass over 100 MB costs 20-60 ms). A chunk is summed in its
own dtype (torch's pairwise sum; a float64 sum costs 10-20x more), the chunk sums are added in
float64, and a chunk whose sum overflows is summed again in float64: a sum of finite values is
finite whenever float64 holds it. On CUDA the kernels of ``kernels/cuda/sign.cu`` run
(``_launch_sign``); the ``*_reference`` functions are what runs on other devices and the
kernels' oracle (sums in float64); the results agree bit for bit, the sums up to float rounding.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np
import torch

from ._launch import FLOAT_SUFFIX, kernels_apply
from ._launch_sign import launch_count_set, launch_count_set_tensor, launch_sign_pack, launch_sign_unpack
from .bits import pack_bits, packed_nbytes, unpack_bits
from .memory import empty

STATS = ("none", "sum", "abs", "split")
_CHUNK = 1 << 18  # elements per chunk: its scratch stays in a 1-2 MiB L2; smaller chunks pay more per-call overhead
_NUMPY_FLOATS = (torch.float32, torch.float64)  # numpy reads these in place
_INT_OF_SIZE = {2: (torch.int16, np.int16), 4: (torch.int32, np.int32), 8: (torch.int64, np.int64)}


def sign_pack(x: torch.Tensor, stats: str = "none") -> Tuple[torch.Tensor, torch.Tensor]:
    """``(bits, sums)``: packed ``x >= 0`` (uint8, ``ceil(n/8)`` bytes) and float64 ``sums``.

    ``x`` is a 1-D contiguous float tensor and is not changed; see the module docstring for
    ``stats``.
    """
    if stats not in STATS:
        raise ValueError(f"stats={stats!r} is not allowed; use one of {STATS}")
    if x.dim() != 1 or not x.is_contiguous() or not x.is_floating_point():
        raise ValueError(f"sign_pack expects a 1-D contiguous float tensor, got {x.dtype} {tuple(x.shape)}")
    if x.device.type == "cpu":
        return _pack_cpu(x, stats)
    if kernels_apply(x) and x.dtype in FLOAT_SUFFIX:
        return launch_sign_pack(x, stats)
    return sign_pack_reference(x, stats)


def sign_unpack(bits: torch.Tensor, numel: int, pos_value: float, neg_value: float, *,
                out: Optional[torch.Tensor] = None, accumulate: bool = False,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``pos_value`` where a bit of ``bits`` is set, else ``neg_value``: a flat tensor of ``numel``.

    The values are rounded to the output dtype once, so every element equals them exactly.
    With ``out`` (1-D, contiguous, ``numel`` elements) the result is written there, or added
    to it when ``accumulate`` is true; otherwise a new tensor of ``dtype`` is returned.
    """
    out = _unpack_out(bits, numel, out, accumulate, dtype)
    if bits.device.type == "cpu" and out.device.type == "cpu":
        return _unpack_cpu(bits, numel, float(pos_value), float(neg_value), out, accumulate)
    if kernels_apply(bits, out) and out.dtype in FLOAT_SUFFIX:
        return launch_sign_unpack(bits, numel, pos_value, neg_value, out, accumulate)
    return sign_unpack_reference(bits, numel, pos_value, neg_value, out=out, accumulate=accumulate)


def _unpack_out(bits: torch.Tensor, numel: int, out: Optional[torch.Tensor], accumulate: bool,
                dtype: torch.dtype) -> torch.Tensor:
    """The checked output of an unpack of ``numel`` sign bits: ``out``, or a new tensor."""
    if bits.dtype != torch.uint8 or bits.dim() != 1 or bits.numel() != packed_nbytes(numel, 1):
        raise ValueError(f"{numel} sign bits need a 1-D uint8 tensor of {packed_nbytes(numel, 1)} bytes, "
                         f"got {bits.dtype} {tuple(bits.shape)}")
    if out is None:
        if accumulate:
            raise ValueError("sign_unpack: accumulate=True needs an out tensor to add into")
        out = empty(numel, dtype, bits.device)
    elif out.dim() != 1 or not out.is_contiguous() or out.numel() != numel or not out.is_floating_point():
        raise ValueError(f"sign_unpack: out must be a 1-D contiguous float tensor of {numel} elements, "
                         f"got {out.dtype} {tuple(out.shape)}")
    return out


def sign_unpack_values(bits: torch.Tensor, numel: int, values: torch.Tensor, *,
                       out: Optional[torch.Tensor] = None, accumulate: bool = False,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`sign_unpack` with the decode values ``[pos_value, neg_value]`` in a 2-element
    float tensor on ``bits``' device: the same bits, and no host read of the values on a GPU."""
    if values.dim() != 1 or values.numel() != 2 or not values.is_floating_point():
        raise ValueError(f"sign_unpack_values: values must be a 1-D float tensor [pos, neg], "
                         f"got {values.dtype} {tuple(values.shape)}")
    if bits.device.type == "cpu" and values.device.type == "cpu" and (out is None or out.device.type == "cpu"):
        return _unpack_cpu_values(bits, numel, values, out, accumulate, dtype)
    out = _unpack_out(bits, numel, out, accumulate, dtype)
    # the reference's ops with the values left on the device (the fused kernel takes them as
    # host scalars, which would cost a sync per call)
    mask = unpack_bits(bits, numel).to(out.device)
    rounded = values.to(torch.float64).to(out.dtype).to(out.device)
    decoded = torch.where(mask, rounded[0], rounded[1])
    return out.add_(decoded) if accumulate else out.copy_(decoded)


def count_set(bits: torch.Tensor) -> int:
    """Number of set bits in a uint8 tensor (pad bits of :func:`sign_pack` are zero)."""
    if bits.device.type == "cpu":
        return int(np.bitwise_count(bits.numpy()).sum(dtype=np.int64))
    if kernels_apply(bits):
        return launch_count_set(bits)
    return int(unpack_bits(bits, bits.numel() * 8).sum())


def count_set_tensor(bits: torch.Tensor) -> torch.Tensor:
    """:func:`count_set` as a 0-d int64 tensor on ``bits``' device (no host read on a GPU)."""
    if bits.device.type == "cpu":
        return _count_set_cpu(bits)
    if kernels_apply(bits):
        return launch_count_set_tensor(bits)
    return unpack_bits(bits, bits.numel() * 8).sum()


# ---- torch reference ---------------------------------------------------------------------
def sign_pack_reference(x: torch.Tensor, stats: str = "none") -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`sign_pack` in plain torch ops (sums accumulated in float64)."""
    bits = pack_bits(x >= 0)
    xd = x.to(torch.float64)
    if stats == "none":
        sums = xd.new_zeros(0)
    elif stats == "sum":
        sums = xd.sum().reshape(1)
    elif stats == "abs":
        sums = xd.abs().sum().reshape(1)
    else:
        sums = torch.stack([xd.clamp(min=0).sum(), xd.clamp(max=0).sum()])
    return bits, sums


def sign_unpack_reference(bits: torch.Tensor, numel: int, pos_value: float, neg_value: float, *,
                          out: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    """Reference of :func:`sign_unpack` in plain torch ops."""
    mask = unpack_bits(bits, numel).to(out.device)
    values = torch.as_tensor([pos_value, neg_value], dtype=torch.float64).to(out.dtype).to(out.device)
    decoded = torch.where(mask, values[0], values[1])
    return out.add_(decoded) if accumulate else out.copy_(decoded)


# ---- CPU: chunked numpy --------------------------------------------------------------------
# (these run on host tensors only; tests/syncs.py lists them as CPU-only sites)
def _count_set_cpu(bits: torch.Tensor) -> torch.Tensor:
    return torch.tensor(int(np.bitwise_count(bits.numpy()).sum(dtype=np.int64)), dtype=torch.int64)


def _unpack_cpu_values(bits: torch.Tensor, numel: int, values: torch.Tensor, out: Optional[torch.Tensor],
                       accumulate: bool, dtype: torch.dtype) -> torch.Tensor:
    pos, neg = values.to(torch.float64).tolist()  # host memory: no device to wait for
    return sign_unpack(bits, numel, pos, neg, out=out, accumulate=accumulate, dtype=dtype)


def _pack_cpu(x: torch.Tensor, stats: str) -> Tuple[torch.Tensor, torch.Tensor]:
    n = x.numel()
    bits = np.empty(packed_nbytes(n, 1), dtype=np.uint8)
    k = min(n, _CHUNK)
    mask = np.empty(k, dtype=np.bool_)
    inplace = x.dtype in _NUMPY_FLOATS
    src = x.numpy() if inplace else None
    # fp16/bf16 chunks are widened into this buffer (numpy has no bf16)
    wide = None if inplace else torch.empty(k, dtype=torch.float32)
    scratch = torch.empty(k, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)
    acc = [0.0, 0.0]  # chunk sums accumulated in Python floats (float64)
    for start in range(0, n, _CHUNK):
        stop = min(start + _CHUNK, n)
        size = stop - start
        if inplace:
            chunk_np = src[start:stop]
            chunk = x[start:stop]
        else:
            chunk = wide[:size].copy_(x[start:stop])
            chunk_np = chunk.numpy()
        np.greater_equal(chunk_np, 0, out=mask[:size])
        bits[start // 8:(stop + 7) // 8] = np.packbits(mask[:size], bitorder="little")
        if stats == "sum":
            acc[0] += _sum(chunk)
        elif stats == "abs":
            acc[0] += _sum(torch.abs(chunk, out=scratch[:size]))
        elif stats == "split":
            acc[0] += _sum(torch.clamp(chunk, min=0, out=scratch[:size]))
            acc[1] += _sum(torch.clamp(chunk, max=0, out=scratch[:size]))
    count = {"none": 0, "sum": 1, "abs": 1, "split": 2}[stats]
    return torch.from_numpy(bits), torch.tensor(acc[:count], dtype=torch.float64)


def _sum(chunk: torch.Tensor) -> float:
    """Sum of a chunk as a Python float: in its dtype, again in float64 if that overflows."""
    total = chunk.sum().item()
    return total if math.isfinite(total) else chunk.sum(dtype=torch.float64).item()


def _patterns(dtype: torch.dtype, pos_value: float, neg_value: float):
    """Bit patterns of the two values rounded to ``dtype``, as signed ints of its width, and
    their difference wrapped to that width: ``neg + bit * diff`` is then exact integer math."""
    itorch, inp = _INT_OF_SIZE[torch.empty((), dtype=dtype).element_size()]
    pos, neg = torch.tensor([pos_value, neg_value], dtype=torch.float64).to(dtype).view(itorch).tolist()
    width = 8 * np.dtype(inp).itemsize
    diff = (pos - neg + (1 << (width - 1))) % (1 << width) - (1 << (width - 1))
    return itorch, inp(neg), inp(diff)


def _unpack_cpu(bits: torch.Tensor, numel: int, pos_value: float, neg_value: float,
                out: torch.Tensor, accumulate: bool) -> torch.Tensor:
    itorch, neg, diff = _patterns(out.dtype, pos_value, neg_value)
    packed = bits.numpy()
    target = out.view(itorch).numpy()
    k = min(numel, _CHUNK)
    scratch = torch.empty(k, dtype=out.dtype) if accumulate else None
    scratch_int = scratch.view(itorch).numpy() if accumulate else None
    # numpy adds fp32/fp64 with less overhead per call; fp16/bf16 chunks are added by torch
    floats = (out.numpy(), scratch.numpy()) if accumulate and out.dtype in _NUMPY_FLOATS else None
    for start in range(0, numel, _CHUNK):
        stop = min(start + _CHUNK, numel)
        size = stop - start
        codes = np.unpackbits(packed[start // 8:(stop + 7) // 8], count=size, bitorder="little")
        dst = scratch_int[:size] if accumulate else target[start:stop]
        np.multiply(codes, diff, out=dst)
        np.add(dst, neg, out=dst)  # integer add wraps: neg + diff == pos exactly
        if floats is not None:
            piece = floats[0][start:stop]
            np.add(piece, floats[1][:size], out=piece)
        elif accumulate:
            out[start:stop].add_(scratch[:size])
    return out
