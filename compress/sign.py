"""``SignCompressor``: the shared base of the 1-bit sign compressors (``signsgd``,
``efsignsgd``, ``signum``, ``onebit``).

Wire: the signs packed 1 bit per element (set where the sent tensor is ``>= 0``: one bit has
no room for a zero, which is sent as positive), plus ``n_values`` fp32 decode values; a
tensor of zeros decodes to zeros (its decode values are 0: sign(0) = 0). It packs in one pass over the input and
hands error feedback the decoded tensor without a second decode. A subclass says which sums
the packing computes and how they become the decode values, and what they are for NaN/Inf.
"""
from __future__ import annotations

import math
from typing import ClassVar, Sequence, Tuple, Union

import torch

from gradcomp.kernels import cpu
from gradcomp.kernels.bits import packed_nbytes
from gradcomp.kernels.memory import empty
from gradcomp.kernels.quant import may_hold
from gradcomp.kernels.sign import sign_pack, sign_unpack_values

from .base import Capabilities, Compressor, Encoded, tensor_spec
from .payload import Payload
from .transaction import refuse, vouch_finite

_FP32_BOUNDED = (torch.float32, torch.float16, torch.bfloat16)  # input dtypes whose values fit the fp32 wire


class SignCompressor(Compressor):
    """Base of the sign compressors: packed sign bits plus ``n_values`` fp32 decode values.

    With one value ``v`` the decode is ``+v`` / ``-v``; with two it is ``values[0]`` where the
    bit is set and ``values[1]`` elsewhere. Subclasses choose the sums ``sign_pack`` computes
    (``stats``) and turn them into the values (``_values``). Values of finite input are finite
    (the sums are overflow-safe) or, beyond the fp32 wire's range, a ``ValueError``.
    """

    n_values: ClassVar[int] = 1
    stats: ClassVar[str] = "sum"
    capabilities = Capabilities()

    def _values(self, x: torch.Tensor, sums: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        """The decode values as a float64 tensor of ``n_values`` on ``x``'s device (tensor ops:
        no host read)."""
        raise NotImplementedError

    def _signal(self, flat: torch.Tensor, key: str) -> Tuple[torch.Tensor, Union[bool, torch.Tensor]]:
        """The tensor whose signs are sent, and whether it is known to hold NaN/Inf: a bool, or
        a 0-d bool tensor when that is decided on the device (the wire values then turn NaN
        there)."""
        return flat, False

    def _compress(self, flat, shape, key, step, want_decoded):
        x, nonfinite = self._signal(flat, key)
        stats = "none" if nonfinite is True else self.stats
        bits, sums = cpu.sign_pack(x, stats) if cpu.applies(x.numel(), x) else sign_pack(x, stats)
        return self._encoded(flat, x, nonfinite, bits, sums, want_decoded)

    def _encoded(self, flat, x, nonfinite, bits, sums, want_decoded):
        """The payload of the packed ``bits`` of ``x`` (the sent tensor: ``flat`` or its
        signal) and their ``sums``."""
        if nonfinite is True:
            wire = torch.full((self.n_values,), math.nan, dtype=torch.float32, device=flat.device)
        else:
            wire = self._values(x, sums, bits).to(torch.float32)  # on x's device, which is flat's
            # Every decode value is 1 or a mean of |x| over some elements (the sums are
            # overflow-safe), so it is at most max|x|: for float32/16-bit input it fits the fp32
            # wire and no check is needed. Wider input may not: refused on the device (see
            # transaction.refuse; a collective tells every rank)
            if x.dtype not in _FP32_BOUNDED:
                over = torch.isfinite(wire).logical_not()
                if may_hold(over):
                    refuse(over.any() & torch.isfinite(x).all(), f"{self.name}: a decode value of this {x.dtype} "
                           f"tensor exceeds the float32 range of the wire (3.4e38); scale the tensor down")
            if isinstance(nonfinite, torch.Tensor):
                wire = torch.where(nonfinite, math.nan, wire)
        decoded = self._unpack(bits, wire, flat.numel(), flat.dtype) if want_decoded else None
        return Encoded([bits, wire], {}, decoded)

    def _compress_residual(self, flat, key, step):
        return self._subtract(flat, self._compress(flat, tuple(flat.shape), key, step, False))

    def _compress_residual_sum(self, flat, a, b, key, step, defer=None):
        # the sent tensor must be flat itself (no signal of its own, e.g. signum's momentum)
        if type(self)._signal is not SignCompressor._signal or not cpu.applies(flat.numel(), flat, a, b):
            return None
        bits, sums = cpu.sign_pack_sum(a, b, flat, self.stats)
        enc = self._encoded(flat, flat, False, bits, sums, False)
        if defer is None:
            return self._subtract(flat, enc)
        defer.append(lambda: self._subtract(flat, enc))  # the payload needs no more of flat
        return Encoded(enc.tensors, enc.meta)

    def _subtract(self, flat, enc):
        bits, values = enc.tensors
        pair = self._pair(values, flat.dtype)
        # flat - decoded, as flat + (-decoded): negation is exact, so these are the same bits
        _decode_into(bits, flat.numel(), -pair, flat, True)
        return Encoded(enc.tensors, enc.meta)

    @classmethod
    def _pair(cls, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The decode values ``[bit set, bit clear]`` rounded to ``dtype``, as a float64 tensor
        on the values' device (kept there: no host read)."""
        vals = values.to(dtype).to(torch.float64)
        return torch.cat([vals, -vals]) if cls.n_values == 1 else vals

    @classmethod
    def _unpack(cls, bits: torch.Tensor, values: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The decoding of packed ``bits`` with decode ``values``, in ``dtype``."""
        return _decode_into(bits, numel, cls._pair(values, dtype), empty(numel, dtype, bits.device), False)

    def _decompress(self, payload):
        bits, values = payload.tensors
        return self._unpack(bits, values, payload.numel, payload.dtype)

    def _decompress_into(self, payload, out, alpha, accumulate):
        bits, values = payload.tensors
        pair = self._pair(values, payload.dtype)  # rounded as decompress rounds them
        _decode_into(bits, payload.numel, pair * alpha, out, accumulate)

    def decompress_mean_into(self, payloads: Sequence[Payload], out: torch.Tensor, *,
                             zeroed: bool = False) -> torch.Tensor:
        """``out`` = the mean of the payloads' decodings (a collective's combine): the bits of
        ``decompress_into`` of each in turn (the first writing) and ``out.div_(len(payloads))``,
        in one pass over ``out`` where the fused CPU loops apply."""
        bits = [p.tensors[0] for p in payloads if isinstance(p, Payload) and p.compressor == self.name]
        if (len(bits) != len(payloads) or not bits or not out.is_contiguous() or
                not cpu.applies(out.numel(), out, *bits) or any(p.numel != out.numel() for p in payloads)):
            return mean_into(self, payloads, out)
        values = [self._pair(p.tensors[1], p.dtype) for p in payloads]
        if cpu.sign_decode_mean(bits, values, out.view(-1), len(payloads)):
            vouch_finite(out)
        return out

    def decodes_finite(self, payload, dtype=None):
        """Every element decodes to one of the payload's values (or their negations), rounded
        to the payload's dtype and then ``dtype``'s: finite when those are. Known without a
        host read for a CPU payload only."""
        values = payload.tensors[1] if payload.compressor == self.name and len(payload.tensors) == 2 else None
        if values is None or values.device.type != "cpu":
            return False
        return bool(torch.isfinite(self._pair(values, payload.dtype).to(dtype or payload.dtype)).all())

    def _wire_bytes(self, numel):
        return packed_nbytes(numel, 1) + 4.0 * self.n_values

    @classmethod
    def _check_tensors(cls, payload):
        tensor_spec(payload, [(torch.uint8, packed_nbytes(payload.numel, 1)), (torch.float32, cls.n_values)], cls.name)


def mean_into(comp: Compressor, payloads: Sequence[Payload], out: torch.Tensor) -> torch.Tensor:
    """The reference of ``decompress_mean_into``: each payload decoded into ``out`` in turn,
    then one division."""
    for r, payload in enumerate(payloads):
        comp.decompress_into(payload, out, accumulate=r > 0)
    return out.div_(len(payloads))


def _decode_into(bits: torch.Tensor, numel: int, values: torch.Tensor, out: torch.Tensor,
                 accumulate: bool) -> torch.Tensor:
    """``sign_unpack_values`` into ``out``: the fused loop on large CPU tensors (the same bits)."""
    if cpu.applies(numel, bits, values, out):
        return cpu.sign_decode(bits, values, out, accumulate)
    return sign_unpack_values(bits, numel, values, out=out, accumulate=accumulate)


def zero_or_one(abs_total: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The one decode value of ``x``'s signs, given ``abs_total`` (a 0-d float64 tensor) ==
    ``sum(|x|)`` as ``sign_pack`` sums it (``stats="abs"``): 1, or 0 when every element of
    ``x`` is 0 (sign(0) = 0: a tensor of zeros decodes to zeros), or NaN when ``x`` holds
    NaN/Inf; a float64 tensor of one element on ``x``'s device (no host read)."""
    one = torch.where(abs_total == 0, 0.0, 1.0)
    return torch.where(finite_flag(abs_total, x), one, math.nan).to(torch.float64).reshape(1)


def finite_flag(total: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor: whether ``x`` is finite, given ``total`` (a 0-d float64 tensor) ==
    ``sum(x)`` as ``sign_pack`` sums it (overflow-safe). Below float64 a sum of finite values
    is finite, so the sum settles it on the device; a float64 sum may overflow, so finite
    values are checked too (a pass, still no host read)."""
    finite = torch.isfinite(total)
    return finite if x.dtype in _FP32_BOUNDED else finite | torch.isfinite(x).all()


def nonfinite_sum(total: float, x: torch.Tensor) -> bool:
    """Whether ``x`` holds NaN/Inf, given ``total == sum(x)``: a finite sum settles it; a
    non-finite one may be an overflow of finite values, which the exact check rules out."""
    return not math.isfinite(total) and not bool(torch.isfinite(x).all())
