"""Codecs for stored activations: what :func:`~gradcomp.memory.saved.compressed_activations`
keeps instead of a tensor autograd saves.

A codec turns a tensor into a :class:`Packed` payload (``encode``) and back
(``Packed.decode``)::

    codec = get_codec("int8")            # or "lossless", "fp16", "bf16", "int4", "int2"
    packed = codec.encode(x, key=7)      # a keyed stream drives the stochastic rounding
    packed.nbytes                        # the payload bytes really kept
    y = packed.decode()                  # same shape, dtype and device as x

- ``"lossless"``: bit-exact for every dtype. A bitmap of the elements whose bit pattern is not
  zero plus those elements: post-ReLU activations (about half zeros) shrink to 53-56 %;
  dense data does not shrink, and the hook then keeps the tensor as it is.
- ``"fp16"``, ``"bf16"``: 16-bit casts; finite values beyond the range saturate (never inf).
- ``"int8"``, ``"int4"``, ``"int2"``: per-block min/max quantization with stochastic rounding
  (ActNN-style); see :class:`BlockQuant`.

Everything is torch ops on the tensor's device (CPU included); randomness comes from
:mod:`gradcomp.kernels.rng`, never from the global torch RNG.
"""
from __future__ import annotations

import difflib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from gradcomp.compress.error_feedback import to_finite
from gradcomp.kernels import bits as _bits
from gradcomp.kernels import rng
from gradcomp.kernels.memory import empty as _empty
from gradcomp.kernels.quant import block_runs, num_blocks

__all__ = ["ActivationCodec", "BlockQuant", "Cast", "Lossless", "Packed", "available_codecs", "get_codec"]

LOSSY_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bit-pattern views by size


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


class Packed:
    """An encoded tensor: the payload ``tensors`` and what decoding needs (the original
    ``shape`` and ``dtype``, the codec, small integer ``meta``). Payload tensors are never
    modified after encoding, so a Packed may be decoded any number of times."""

    __slots__ = ("codec", "tensors", "shape", "dtype", "device", "meta", "__weakref__")

    def __init__(self, codec: "ActivationCodec", tensors: List[torch.Tensor], shape: torch.Size,
                 dtype: torch.dtype, device: torch.device, meta: Tuple[int, ...] = ()) -> None:
        self.codec = codec
        self.tensors = tensors
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = device  # where the payload lives (and where decode() puts its result)
        self.meta = meta

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        """Bytes of payload kept alive: the storages of the payload tensors, each counted once."""
        seen: Dict[int, int] = {}
        for t in self.tensors:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the original tensor's elements."""
        return self.numel * self.dtype.itemsize

    def decode(self) -> torch.Tensor:
        """The tensor, as a new contiguous tensor on the payload's device."""
        return self.codec._decode(self)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Packed":
        """The payload moved to ``device`` (CUDA -> CPU with ``non_blocking=True`` lands in
        pinned memory, so the copy can overlap compute)."""
        device = torch.device(device)
        moved = [t.to(device, non_blocking=non_blocking) for t in self.tensors]
        return Packed(self.codec, moved, self.shape, self.dtype, moved[0].device if moved else device, self.meta)

    def pin_memory(self) -> "Packed":
        """A copy of a CPU payload in pinned memory (for a later asynchronous upload)."""
        return Packed(self.codec, [t.pin_memory() for t in self.tensors], self.shape, self.dtype, self.device,
                      self.meta)

    def __repr__(self) -> str:
        ratio = self.raw_nbytes / self.nbytes if self.nbytes else float("inf")
        return (f"Packed({self.codec.name}, {tuple(self.shape)} {str(self.dtype).replace('torch.', '')}, "
                f"{self.nbytes} bytes, {ratio:.2f}x)")


class ActivationCodec:
    """Base of the codecs. ``lossless``: decode gives the input bit for bit; ``stochastic``:
    encode draws randomness from the stream named by its ``key`` (same key and tensor, same
    bits). Subclasses implement ``_encode`` (a contiguous flat input) and ``_decode``."""

    name: str = ""
    lossless: bool = False
    stochastic: bool = False

    def accepts(self, dtype: torch.dtype) -> bool:
        """Whether :meth:`encode` takes tensors of ``dtype``."""
        return dtype in LOSSY_DTYPES

    def _check(self, dtype: torch.dtype) -> None:
        if not self.accepts(dtype):
            raise ValueError(f"codec {self.name!r} encodes floating tensors ({_dtype_names(LOSSY_DTYPES)}); "
                             f"got {dtype}: keep such tensors as they are or use 'lossless'")

    def encode(self, t: torch.Tensor, key: int) -> Packed:
        """``t`` (any shape and strides) encoded; ``key`` names the random stream of a
        stochastic codec (ignored otherwise)."""
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise ValueError(f"codec {self.name!r} encodes dense (strided) tensors, got {type(t).__name__}"
                             f"{'' if not isinstance(t, torch.Tensor) else ' with layout ' + str(t.layout)}")
        self._check(t.dtype)
        return self._encode(t.detach().reshape(-1), t.shape, int(key))

    def encode_if_smaller(self, t: torch.Tensor, key: int, limit: int) -> Optional[Packed]:
        """``encode(t, key)`` if its payload is smaller than ``limit`` bytes, else None; when
        the size is known in advance nothing is encoded to find out."""
        self._check(t.dtype)
        predicted = self.predicted_nbytes(t.numel(), t.dtype)
        if predicted is not None and predicted >= limit:
            return None
        packed = self.encode(t, key)
        return packed if packed.nbytes < limit else None

    def predicted_nbytes(self, numel: int, dtype: torch.dtype) -> Optional[int]:
        """Payload bytes of a tensor of ``numel`` elements of ``dtype``, or None where they
        depend on the values."""
        return None

    def _encode(self, flat: torch.Tensor, shape: torch.Size, key: int) -> Packed:
        raise NotImplementedError

    def _decode(self, packed: Packed) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


# ---- lossless: bitmap of non-zero bit patterns + those elements ----------------------------

class Lossless(ActivationCodec):
    """Exact for every dtype: elements are compared as bit patterns, so ``-0.0``, NaN payloads,
    inf and subnormals survive (only all-zero patterns, i.e. ``+0.0``, go in the bitmap alone).
    Payload: ``ceil(n / 8)`` bitmap bytes plus the non-zero elements."""

    name = "lossless"
    lossless = True

    def accepts(self, dtype: torch.dtype) -> bool:
        size = dtype.itemsize
        return size in _WORDS or size % 8 == 0

    def _check(self, dtype: torch.dtype) -> None:
        if not self.accepts(dtype):
            raise ValueError(f"codec 'lossless' encodes dtypes of 1, 2, 4 or a multiple of 8 bytes, got {dtype}")

    @staticmethod
    def _words(flat: torch.Tensor) -> torch.Tensor:
        size = flat.element_size()
        return flat.contiguous().view(_WORDS.get(size, torch.int64))

    def _plan(self, t: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """``(words, mask, payload bytes)``: the bit patterns, which are not zero, the size."""
        words = self._words(t.detach().reshape(-1))
        if words.device.type == "cpu":  # numpy's loops: several times faster than torch's here
            mask = torch.from_numpy(words.numpy() != 0)
            count = int(np.count_nonzero(mask.numpy()))
        else:
            mask = words != 0
            count = int(torch.count_nonzero(mask)) if words.numel() else 0
        return words, mask, _bits.packed_nbytes(words.numel(), 1) + count * words.element_size()

    def _build(self, words: torch.Tensor, mask: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> Packed:
        if words.device.type == "cpu":
            values = torch.from_numpy(np.compress(mask.numpy(), words.numpy()))
        else:
            values = torch.masked_select(words, mask)
        return Packed(self, [_bits.pack_bits(mask), values], shape, dtype, words.device, (words.numel(),))

    def _encode(self, flat: torch.Tensor, shape: torch.Size, key: int) -> Packed:
        words, mask, _ = self._plan(flat)
        return self._build(words, mask, shape, flat.dtype)

    def encode_if_smaller(self, t: torch.Tensor, key: int, limit: int) -> Optional[Packed]:
        self._check(t.dtype)
        words, mask, size = self._plan(t)  # the size is known before the values are gathered
        return self._build(words, mask, t.shape, t.dtype) if size < limit else None

    def _decode(self, packed: Packed) -> torch.Tensor:
        bitmap, values = packed.tensors
        nwords = packed.meta[0]
        if values.device.type == "cpu":
            out = np.zeros(nwords, dtype=values.numpy().dtype)
            out[_bits.unpack_bits(bitmap, nwords).numpy()] = values.numpy()
            words = torch.from_numpy(out)
        else:
            words = torch.zeros(nwords, dtype=values.dtype, device=values.device)
            if nwords:
                words.masked_scatter_(_bits.unpack_bits(bitmap, nwords).to(values.device), values)
        return words.view(packed.dtype).view(packed.shape)


# ---- 16-bit casts ----------------------------------------------------------------------------

class Cast(ActivationCodec):
    """A cast to ``wire`` (``float16`` or ``bfloat16``): finite values beyond its range
    saturate to its largest finite value (``compress.error_feedback.to_finite``) instead of
    becoming inf; inf and NaN stay as they are. Decoding casts back."""

    def __init__(self, name: str, wire: torch.dtype) -> None:
        self.name = name
        self.wire = wire

    def predicted_nbytes(self, numel: int, dtype: torch.dtype) -> Optional[int]:
        self._check(dtype)
        return numel * self.wire.itemsize

    def _encode(self, flat: torch.Tensor, shape: torch.Size, key: int) -> Packed:
        src = flat
        if flat.dtype.itemsize <= self.wire.itemsize and torch.finfo(flat.dtype).max > torch.finfo(self.wire).max:
            src = flat.float()  # bfloat16 -> float16: to_finite saturates only a narrowing cast
        wire = to_finite(src, self.wire)
        if wire.data_ptr() == flat.data_ptr():  # no cast happened: the payload must not alias the input
            wire = wire.clone()
        return Packed(self, [wire], shape, flat.dtype, flat.device)

    def _decode(self, packed: Packed) -> torch.Tensor:
        wire = packed.tensors[0]
        return _empty(packed.numel, packed.dtype, wire.device).view(packed.shape).copy_(wire.view(packed.shape))


# ---- block quantization ----------------------------------------------------------------------

def _block_minmax(x: torch.Tensor, bs: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-block min and max of the flat ``x`` (NaN where a block holds NaN)."""
    n = x.numel()
    full = n // bs
    parts: List[Tuple[torch.Tensor, torch.Tensor]] = []
    if full:
        parts.append(torch.aminmax(x[:full * bs].view(full, bs), dim=1))
    if full * bs < n:
        parts.append(torch.aminmax(x[full * bs:].view(1, -1), dim=1))
    if len(parts) == 1:
        return parts[0][0], parts[0][1]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _blockwise(bs: int, flats: Sequence[torch.Tensor], cols: Sequence[torch.Tensor],
               fn: Callable[..., Any]) -> None:
    """``fn(*block_views, *per_block_columns)`` over the full blocks of the equal-length flat
    tensors ``flats`` (``(nb, bs)`` views), then over the ragged tail (a ``(1, r)`` view)."""
    n = flats[0].numel()
    full = n // bs
    cut = full * bs
    if full:
        fn(*(f[:cut].view(full, bs) for f in flats), *(c[:full].unsqueeze(1) for c in cols))
    if cut < n:
        fn(*(f[cut:].view(1, -1) for f in flats), *(c[full:full + 1].unsqueeze(1) for c in cols))


def _block_elements(idx: torch.Tensor, bs: int, n: int) -> torch.Tensor:
    """The element indices of blocks ``idx`` (the ragged last block cut at ``n``)."""
    elems = (idx.unsqueeze(1) * bs + torch.arange(bs, device=idx.device)).reshape(-1)
    return elems[elems < n]


class BlockQuant(ActivationCodec):
    """``bits``-bit codes of blocks of ``block_size`` elements, ActNN-style.

    Per block, ``lo = min`` and a grid of ``L = 2**bits - 1`` steps up to the max; each value
    is rounded stochastically to one of the two grid points around it, with draws ``u``
    uniform from the stream of ``(key, numel)``: ``code = floor((x - lo) / step + u)``, so
    ``E[decoded] = x`` and ``|decoded - x| <= step`` (the block's ``step``, stored).

    Min/max rather than absmax: stored activations are mostly one-signed (post-ReLU/GELU),
    and a symmetric absmax grid would leave half its codes unused, a whole bit (int2 would
    keep 2 usable levels of 4); the price is a second per-block number.

    Zero-preserving blocks: where the block's min is 0 (post-ReLU data), ``x > 0`` must not
    decode to 0 -- ReLU's backward reads its saved output's ``> 0`` mask, and flipping the
    mask of the values within one step of 0 costs far more gradient accuracy than the values'
    own rounding (about 10x the gradient error of int8 on an MLP). There code 0 is exact 0 and
    codes ``1..L`` are the grid ``(k - 1 + 1/16) * step``, ``step = max / (L - 1)``: a positive
    value rounds stochastically on that grid (unbiased above ``step / 16``, rounded up to it
    below), so the mask survives at the cost of one level.

    Stats (``lo``, ``step``) are float32 (float64 for float64 input: its range). Payload:
    ``ceil(n * bits / 8)`` code bytes + 8 bytes per block (16 for float64); with the default
    256-element blocks, float32 shrinks 3.88x (int8), 7.5x (int4), 14.2x (int2).

    Non-finite values: a block holding inf or NaN, or whose range overflows, is stored raw
    (exact, in the input dtype) beside the codes, so inf/NaN reach backward exactly as
    without compression and never spoil the other blocks. Decoded values of the other blocks
    saturate at the dtype's largest finite value.
    """

    stochastic = True
    ZERO_OFFSET = 1.0 / 16  # code 1 of a zero-preserving block decodes to ZERO_OFFSET * step

    def __init__(self, bits: int, block_size: int = 256) -> None:
        if bits not in (2, 4, 8):
            raise ValueError(f"bits must be 2, 4 or 8, got {bits!r}")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.bits = bits
        self.block_size = block_size
        self.levels = (1 << bits) - 1
        self.name = f"int{bits}"

    @staticmethod
    def _work_dtype(dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if dtype == torch.float64 else torch.float32

    def predicted_nbytes(self, numel: int, dtype: torch.dtype) -> Optional[int]:
        """Exact when every block is finite (a non-finite block adds its raw bytes)."""
        self._check(dtype)
        stats = 2 * num_blocks(numel, self.block_size) * self._work_dtype(dtype).itemsize
        return _bits.packed_nbytes(numel, self.bits) + stats

    def _encode(self, flat: torch.Tensor, shape: torch.Size, key: int) -> Packed:
        n, bs, wd, dev, top = flat.numel(), self.block_size, self._work_dtype(flat.dtype), flat.device, self.levels
        x = flat.contiguous()
        if n == 0:
            empty = [torch.empty(0, dtype=torch.uint8, device=dev), torch.empty(2, 0, dtype=wd, device=dev)]
            return Packed(self, empty, shape, flat.dtype, dev)
        lo_x, hi_x = _block_minmax(x, bs)
        lo, span = lo_x.to(wd), hi_x.to(wd) - lo_x.to(wd)
        bad = ~torch.isfinite(span)  # inf, NaN, or a range beyond the dtype: stored raw
        any_bad = bool(bad.any())
        if any_bad:
            lo = torch.where(bad, 0.0, lo)
            span = torch.where(bad, 0.0, span)
        zero = lo == 0  # zero-preserving blocks (see the class docstring)
        any_zero = bool(zero.any())
        step = span / torch.where(zero, top - 1, top).to(wd) if any_zero else span / top
        divisor = torch.where(step > 0, step, 1.0)  # constant block: x - lo = 0, code 0
        base = lo + torch.where(zero, step * self.ZERO_OFFSET, 0.0) if any_zero else lo
        shift = zero.to(wd)

        def quantize(dv: torch.Tensor, xv: torch.Tensor, uv: torch.Tensor, bv: torch.Tensor, sv: torch.Tensor,
                     ev: torch.Tensor) -> None:
            # v = (x - base) / step + u: x - base first (exact for nearby values), one division
            torch.sub(xv, bv, out=dv)
            if any_zero:
                dv.clamp_(min=0)  # below the first grid point of a zero-preserving block
            uv.addcdiv_(dv, sv).floor_()
            if any_zero:  # code + 1 for x > 0 in zero-preserving blocks (x >= 0 there)
                uv.addcmul_(torch.sign(xv, out=dv), ev)
            uv.clamp_(0, top)

        u = rng.uniform(n, rng.stream_key(key, "activations", n), dev)
        codes = torch.empty(n, dtype=torch.uint8, device=dev)
        scratch: Optional[torch.Tensor] = None
        for a, b in block_runs(n, bs, dev):
            blocks = slice(a // bs, a // bs + num_blocks(b - a, bs))
            xs = x[a:b] if x.dtype == wd else x[a:b].to(wd)
            ur = u[a:b] if wd == torch.float32 else u[a:b].to(wd)
            if scratch is None:
                scratch = torch.empty(b - a, dtype=wd, device=dev)
            _blockwise(bs, [scratch[:b - a], xs, ur], [base[blocks], divisor[blocks], shift[blocks]], quantize)
            codes[a:b].copy_(ur)
        raw: List[torch.Tensor] = []
        if any_bad:
            idx = bad.nonzero().reshape(-1)
            elems = _block_elements(idx, bs, n)
            codes[elems] = 0  # NaN casts to any byte; packed codes must stay below 2**bits
            raw = [idx, x[elems]]
        packed = codes if self.bits == 8 else _bits.pack_codes(codes, self.bits)
        return Packed(self, [packed, torch.stack([lo, step])] + raw, shape, flat.dtype, dev)

    def _decode(self, packed: Packed) -> torch.Tensor:
        n, bs, dtype = packed.numel, self.block_size, packed.dtype
        wd = self._work_dtype(dtype)
        out = _empty(n, dtype, packed.tensors[0].device)
        if n == 0:
            return out.view(packed.shape)
        codes = packed.tensors[0] if self.bits == 8 else _bits.unpack_codes(packed.tensors[0], n, self.bits)
        codes = codes.to(out.device)
        lo, step = packed.tensors[1][0], packed.tensors[1][1]
        zero = lo == 0
        any_zero = bool(zero.any())
        offset = torch.where(zero, 1.0 - self.ZERO_OFFSET, 0.0).to(wd)  # code -> grid index

        def dequantize(dv: torch.Tensor, lv: torch.Tensor, sv: torch.Tensor, ov: torch.Tensor) -> None:
            if any_zero:
                dv.sub_(ov).clamp_(min=0)
            torch.addcmul(lv, dv, sv, out=dv)

        scratch: Optional[torch.Tensor] = None
        for a, b in block_runs(n, bs, out.device):
            blocks = slice(a // bs, a // bs + num_blocks(b - a, bs))
            if dtype == wd:
                dst = out[a:b]
            else:
                if scratch is None:
                    scratch = torch.empty(b - a, dtype=wd, device=out.device)
                dst = scratch[:b - a]
            dst.copy_(codes[a:b])
            _blockwise(bs, [dst], [lo[blocks], step[blocks], offset[blocks]], dequantize)
            if dst.dtype != dtype:
                out[a:b].copy_(dst)
        self._saturate(out, lo, step, offset)
        if len(packed.tensors) == 4:
            idx, raw = packed.tensors[2], packed.tensors[3]
            out[_block_elements(idx, bs, n)] = raw
        return out.view(packed.shape)

    def _saturate(self, out: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, offset: torch.Tensor) -> None:
        """Clamp to the finite range the blocks whose top grid point lies beyond it (rounding
        of the step can put it a few ulps past the block's max): finite in, finite out."""
        limit = torch.finfo(out.dtype).max
        lo64 = lo.double()
        reach = torch.maximum(lo64.abs(), (lo64 + step.double() * (self.levels - offset.double())).abs())
        over = (reach > limit) | torch.isinf(reach)  # inf: float64's own range overflowed
        if bool(over.any()):
            bound = torch.full(over.shape, torch.inf, dtype=out.dtype, device=out.device)
            bound[over] = limit
            _blockwise(self.block_size, [out], [bound], lambda ov, bv: ov.clamp_(min=-bv, max=bv))

    def __repr__(self) -> str:
        return f"BlockQuant({self.name!r}, block_size={self.block_size})"


# ---- registry --------------------------------------------------------------------------------

_FACTORIES: Dict[str, Callable[..., ActivationCodec]] = {
    "lossless": Lossless,
    "fp16": lambda: Cast("fp16", torch.float16),
    "bf16": lambda: Cast("bf16", torch.bfloat16),
    "int8": lambda block_size=256: BlockQuant(8, block_size),
    "int4": lambda block_size=256: BlockQuant(4, block_size),
    "int2": lambda block_size=256: BlockQuant(2, block_size),
}
_OPTIONS: Dict[str, Tuple[str, ...]] = {"int8": ("block_size",), "int4": ("block_size",), "int2": ("block_size",)}


def available_codecs() -> List[str]:
    """The names :func:`get_codec` knows."""
    return list(_FACTORIES)


def get_codec(name: str | ActivationCodec, **options: Any) -> ActivationCodec:
    """The codec called ``name`` (a codec instance is returned as it is), with ``options``
    (``block_size=`` for the int codecs). ``ValueError`` for an unknown name or option."""
    if isinstance(name, ActivationCodec):
        if options:
            raise ValueError(f"options {sorted(options)} apply to a codec name, not to the instance {name!r}")
        return name
    if not isinstance(name, str) or name.lower() not in _FACTORIES:
        close = difflib.get_close_matches(str(name).lower(), list(_FACTORIES), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown activation codec {name!r}; available: {', '.join(_FACTORIES)}{hint}")
    key = name.lower()
    allowed = _OPTIONS.get(key, ())
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        what = f"its options are {', '.join(allowed)}" if allowed else "it takes no options"
        raise ValueError(f"codec {key!r} got unknown options {unknown}; {what}")
    return _FACTORIES[key](**options)
