"""Bit packing: 1-, 2- and 4-bit codes packed into bytes, little-endian within a byte.

Element ``i`` of a ``b``-bit code stream lives in byte ``i * b // 8`` at bit offset
``(i * b) % 8``. The CPU path uses numpy's C routines (``packbits`` is ~50x faster than torch
arithmetic), CUDA tensors the kernels of ``kernels/cuda/bits.cu`` (``_launch_bits``), and other
devices torch shifts (``*_reference``, also the kernels' oracle). All give the same bytes.
"""
from __future__ import annotations

import sys

import numpy as np
import torch

from ._launch import kernels_apply
from ._launch_bits import KERNEL_BITS, launch_pack_codes, launch_unpack_codes

_ALLOWED_BITS = (1, 2, 4, 8)
# CPU packing of 2- and 4-bit codes by one integer multiply per word: the codes of a
# little-endian uint32 (uint16) word, one per byte, are gathered into its top byte.
_WORD = {2: (np.uint32, 0x01041040, 24), 4: (np.uint16, 0x0110, 8)}
_FAST_CPU = sys.byteorder == "little"


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes needed to hold ``numel`` codes of ``bits`` bits each."""
    return (numel * bits + 7) // 8


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean tensor (any shape) into a flat uint8 tensor of ``ceil(n/8)`` bytes."""
    flat = mask.reshape(-1)
    if flat.dtype != torch.bool:
        flat = flat != 0
    if flat.device.type == "cpu":
        return torch.from_numpy(np.packbits(flat.numpy(), bitorder="little"))
    return _pack_device(flat.to(torch.uint8), 1)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: a flat bool tensor of ``numel`` elements."""
    _check_packed(packed, numel, 1)
    if packed.device.type == "cpu":
        bits = np.unpackbits(packed.numpy(), count=numel, bitorder="little")
        return torch.from_numpy(bits.view(np.bool_))
    return _unpack_device(packed, numel, 1).bool()


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned integer codes (values < 2**bits) into a flat uint8 tensor."""
    if bits not in _ALLOWED_BITS:
        raise ValueError(f"bits must be one of {_ALLOWED_BITS}, got {bits!r}")
    flat = codes.reshape(-1).to(torch.uint8)
    if bits == 8:
        return flat.clone()
    if bits == 1:
        return pack_bits(flat)
    if flat.device.type == "cpu" and _FAST_CPU:
        return torch.from_numpy(_pack_numpy(flat.contiguous().numpy(), bits))
    return _pack_device(flat, bits)


def unpack_codes(packed: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: a flat uint8 tensor of ``numel`` codes."""
    if bits not in _ALLOWED_BITS:
        raise ValueError(f"bits must be one of {_ALLOWED_BITS}, got {bits!r}")
    _check_packed(packed, numel, bits)
    if bits == 8:
        return packed[:numel].clone()
    if bits == 1:
        return unpack_bits(packed, numel).to(torch.uint8)
    if packed.device.type == "cpu" and _FAST_CPU:
        return torch.from_numpy(_unpack_numpy(packed.numpy(), numel, bits))
    return _unpack_device(packed, numel, bits)


def _check_packed(packed: torch.Tensor, numel: int, bits: int) -> None:
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"packed codes must be a 1-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    need = packed_nbytes(numel, bits)
    if packed.numel() != need:
        raise ValueError(f"{numel} codes of {bits} bits need {need} bytes, got {packed.numel()}")


def _pack_numpy(codes: np.ndarray, bits: int) -> np.ndarray:
    word, mult, shift = _WORD[bits]
    per_byte = 8 // bits
    n = codes.size
    full = n - n % per_byte
    out = np.empty(packed_nbytes(n, bits), dtype=np.uint8)
    words = codes[:full].view(word)
    out[:full // per_byte] = (words * mult) >> shift  # wraps modulo the word size, as intended
    if full < n:
        tail = codes[full:].astype(np.int64) << (bits * np.arange(n - full))
        out[-1] = tail.sum()
    return out


def _unpack_numpy(packed: np.ndarray, numel: int, bits: int) -> np.ndarray:
    word = _WORD[bits][0]
    shifts = np.arange(0, 8, bits)
    # entry b of the table holds the codes of byte b, one per byte of a word
    table = ((np.arange(256)[:, None] >> shifts) & ((1 << bits) - 1)).astype(np.uint8)
    return np.take(table.view(word).reshape(-1), packed).view(np.uint8)[:numel]


def _pack_device(flat: torch.Tensor, bits: int) -> torch.Tensor:
    """Packing of flat uint8 codes off the fast CPU path: the kernel, else the reference."""
    if kernels_apply(flat) and bits in KERNEL_BITS:
        return launch_pack_codes(flat, bits)
    return pack_codes_reference(flat, bits)


def _unpack_device(packed: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """Unpacking off the fast CPU path: the kernel, else the reference."""
    if kernels_apply(packed) and bits in KERNEL_BITS:
        return launch_unpack_codes(packed, numel, bits)
    return unpack_codes_reference(packed, numel, bits)


def pack_codes_reference(flat: torch.Tensor, bits: int) -> torch.Tensor:
    """Reference of the packing of flat uint8 codes into ``bits``-bit fields, in torch shifts."""
    per_byte = 8 // bits
    n = flat.numel()
    pad = (-n) % per_byte
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    groups = flat.view(-1, per_byte).to(torch.int32)
    shifts = torch.arange(0, 8, bits, device=flat.device, dtype=torch.int32)
    return (groups << shifts).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_codes_reference(packed: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """Reference of :func:`unpack_codes` (a checked size), in torch shifts."""
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.int32)
    mask = (1 << bits) - 1
    codes = (packed.to(torch.int32).unsqueeze(1) >> shifts) & mask
    return codes.reshape(-1)[:numel].to(torch.uint8)
