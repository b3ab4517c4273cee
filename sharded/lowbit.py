"""Low-bit optimizer state: moment tensors kept in 8 bits between steps.

:class:`LowBitState` wraps any ``torch.optim`` optimizer whose state is per element (Adam,
AdamW, SGD with momentum, RMSprop, Adagrad, ...). Between steps each eligible state tensor
is a :class:`PackedState`: blocks of :data:`BLOCK` (128) elements, one fp32 scale per block
(its absmax) and a code per element, the index of a value in a fixed table (:data:`FORMATS`).
8 bits (bitsandbytes' dynamic map has the same shape): first moments and momentum signed (3
exponent, 4 mantissa bits: 8 binades below the block's max at 1/16 to 1/32 relative
precision), second moments (``exp_avg_sq``, ``max_exp_avg_sq``, ``square_avg``, ``sum``,
never negative) unsigned (4 exponent, 4 mantissa bits: 16 binades). 4 bits (two codes a
byte, the formats ``s4``/``u4``): signed linear (0, +-i/7) and unsigned linear (i+1)/16 —
packs only: 4-bit *state* is not offered, it lost 1.4-1.8 pp of accuracy on a model of many
small tensors (docs/sharding.md). Bytes per element: 1 + 4/128 (0.258x of fp32).

**No zero for second moments** (Li, Chen & Zhu, NeurIPS 2023, "the zero-point problem"): a
second moment that rounds to zero beside a first moment that does not makes Adam's step
``m / (sqrt(v) + eps)`` ~1e8 times too large. With zero a code, a small CNN's loss was NaN by
step 15 (issue 21); so second-moment tables start above zero, and a value below the smallest
code rounds up to it (its step is damped, never blown up).

**Error compensation** (``compensation=``). Rounding to nearest loses every update smaller
than half a grid step: Adam's second moment (``beta2 = 0.999``) moves by 0.1 % a step, far
below the grid, so it freezes and its error grows with time. Two remedies:

- ``"stochastic"`` (default): round up or down with the probabilities that make the stored
  value exact in expectation, so the part of an update the grid cannot hold is carried on in
  expectation; the moments' recursions contract (``beta < 1``), so the error settles at a
  level set by the grid instead of growing;
- ``"feedback"`` (one more byte per element): error feedback on the state — the quantization
  error of each encode is kept (itself in 8 bits, evenly spaced, with its own block scale) and
  added before the next encode, so what the grid drops is re-sent instead of lost;
- ``"none"``: round to nearest, for comparison.

The randomness is counter-based (``kernels.rng``, keyed by tensor, state name and encode
count), so a resumed run draws what the original drew. Measured figures: docs/sharding.md.

**Small tensors.** A state tensor is stored in low bits only when its parameter has at least
``min_numel`` (default 4096, as bitsandbytes) elements; smaller ones, scalars (``step``) and
anything that is not per element stay as the optimizer made them. The decision is per
parameter, never per piece of one: :class:`~gradcomp.sharded.ShardedOptimizer` decides on the
whole parameter group, so precision does not change with the number of ranks.

**Step.** ``step()`` decodes one tensor's state (in the dtype the inner optimizer made it),
runs the inner optimizer on that tensor alone, re-encodes it, then goes to the next tensor:
at most one tensor's state is decoded at any time. A step whose gradients are not all finite
changes nothing (no state, no parameter) and is counted in :attr:`LowBitState.skipped`, the
counter of its :class:`~gradcomp.training.step.StepDecision` (``decision``; this rank's
gradients alone: nothing is reduced, the caller's are the same on every rank or its own).

**Checkpoints.** ``state_dict()`` holds each pack as a plain dict (``PackedState.to_saved``:
tensors, ints, strings; loads with ``weights_only=True``); ``load_state_dict`` puts packs back
as they were saved, past ``torch.optim``'s cast to the parameter's dtype, so a resume is
bit-identical for fp32, fp16 and bf16 parameters. Packs saved by format version 1 (a dict
with a table number, 256-element blocks) still load and decode as they were made.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from gradcomp.compress.transaction import all_finite
from gradcomp.training.step import StepDecision, Stepping
from gradcomp.kernels import rng

from gradcomp.training.wrapper import Wrapper

__all__ = ["LowBitState", "PackedState", "state_nbytes", "BLOCK", "MIN_NUMEL", "BITS"]

BLOCK = 128  # elements per fp32 scale: smaller => less error next to outliers, 32 more bits per block
MIN_NUMEL = 4096  # parameters smaller than this keep fp32 state: they cost little, and are often norms/biases
SECOND_MOMENTS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum"})
_COMPENSATIONS = ("stochastic", "feedback", "none")


# ---- the codec -------------------------------------------------------------------------------
class _Format(NamedTuple):
    """A table of low-bit values. Float formats (``exp_bits > 0``): a small float with
    subnormals, rounded on the float32 bits (its largest magnitude is ``unit``). Others: the
    ascending ``values`` given (``levels`` evenly spaced in [-1, 1] when ``values`` is empty),
    rounded by search. ``zero=False``: zero is never a code (values below the smallest round
    up to it) — for second moments, whose zero would make ``m / sqrt(v)`` explode."""

    name: str
    bits: int
    signed: bool
    exp_bits: int = 0
    man_bits: int = 0
    levels: int = 0
    values: Tuple[float, ...] = ()
    zero: bool = True

    @property
    def per_byte(self) -> int:
        """Codes stored in one byte (the low bits first)."""
        return 8 // self.bits

    def pack_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """uint8 codes (one a byte, each below ``2 ** bits``) as this format stores them."""
        per = self.per_byte
        if per == 1:
            return codes
        if codes.numel() % per:
            codes = torch.nn.functional.pad(codes, (0, per - codes.numel() % per))
        groups = codes.view(-1, per)
        out = groups[:, 0].clone()
        for j in range(1, per):
            out |= groups[:, j] << (j * self.bits)
        return out

    def unpack_codes(self, stored: torch.Tensor, n: int) -> torch.Tensor:
        """The ``n`` codes (one a byte) of what :meth:`pack_codes` stored."""
        per = self.per_byte
        if per == 1:
            return stored
        mask = 2 ** self.bits - 1
        return torch.stack([(stored >> (j * self.bits)) & mask for j in range(per)], 1).view(-1)[:n]

    @property
    def bias(self) -> int:
        return 2 ** (self.exp_bits - 1) - 1

    @property
    def unit(self) -> float:
        """The largest magnitude: a block's absmax is scaled onto it."""
        if not self.exp_bits:
            return 1.0
        return 2.0 ** (2 ** self.exp_bits - 1 - self.bias) * (2 - 2.0 ** -self.man_bits)

    def magnitudes(self) -> torch.Tensor:
        if self.values:
            return torch.tensor([v for v in self.values if v >= 0], dtype=torch.float32)
        if not self.exp_bits:
            return torch.linspace(0, 1, (self.levels + 1) // 2)
        m2 = 2 ** self.man_bits
        return torch.tensor([(m / m2) * 2.0 ** (1 - self.bias) if e == 0 else (1 + m / m2) * 2.0 ** (e - self.bias)
                             for e in range(2 ** self.exp_bits) for m in range(m2)], dtype=torch.float32)

    def table(self) -> torch.Tensor:
        """Every code's value, ascending (the code is the index)."""
        if self.values:
            return torch.tensor(self.values, dtype=torch.float32)
        m = self.magnitudes()
        return torch.cat([-m.flip(0)[:-1], m]) if self.signed else m

    def round_index(self, a: torch.Tensor, u: Optional[torch.Tensor]) -> torch.Tensor:
        """For float32 magnitudes ``a`` in [0, unit] of a float or evenly spaced format, the
        index (int32) of a neighbouring table magnitude: the nearer (``u`` None), or the upper
        one with probability equal to the fraction of the gap ``a`` lies above the lower
        (``u``: uniform [0, 1) draws).

        A float format's magnitudes are the float32 values with ``man_bits`` mantissa bits in
        its exponent range, so this is float32 rounding done on the bits: add a random (or
        half) unit of the dropped bits, then drop them; a carry moves to the next binade as it
        should. Subnormals are first lifted by the smallest normal, which makes their grid the
        mantissa grid of the lowest binade."""
        top = (self.levels - 1) // 2 if not self.exp_bits else 2 ** (self.exp_bits + self.man_bits) - 1
        if not self.exp_bits:
            up = torch.full_like(a, 0.5) if u is None else u
            return (a * top + up).to(torch.int32).clamp_(0, top)
        drop = 23 - self.man_bits
        smallest = 2.0 ** (1 - self.bias)
        sub = (a < smallest).to(torch.int32)
        # in place where it can be: each pass over a fresh tensor also pays for its first touch
        bits = sub.to(a.dtype).mul_(smallest).add_(a).view(torch.int32)
        if u is not None:
            bits.add_(u.mul_(2 ** drop).to(torch.int32))
        else:
            bits.add_(2 ** (drop - 1))
        bits.bitwise_right_shift_(drop).sub_((127 - self.bias) << self.man_bits)
        return bits.sub_(sub, alpha=2 ** self.man_bits).clamp_(0 if self.zero else 1, top)


def _linear4(signed: bool) -> Tuple[float, ...]:
    """4-bit linear values: signed, 0 and +-i/7 (15 codes); unsigned without zero, (i+1)/16."""
    if signed:
        mags = [i / 7 for i in range(1, 8)]
        return tuple([-m for m in reversed(mags)] + [0.0] + mags)
    return tuple((i + 1) / 16 for i in range(16))


# the formats a pack may carry, by name:
# s8: signed moments, 1 sign, 3 exponent, 4 mantissa bits (255 values: 8 binades at 1/16..1/32);
# u8: second moments (>= 0), 4 exponent, 4 mantissa bits, no zero (16 binades);
# z8: u8 with zero, as packs of format version 1 were made (decoded the same way);
# r8: the error-feedback residual (bounded by one grid step): 255 evenly spaced levels;
# s4 / u4: the 4-bit formats, linear (signed with zero; unsigned (i+1)/16, without zero, as
# Li, Chen & Zhu (NeurIPS 2023) recommend for the second moment); linear measured a smaller
# update error than dynamic-exponent tables at 4 bits (docs/memory.md)
FORMATS: Dict[str, _Format] = {f.name: f for f in (
    _Format("s8", 8, True, 3, 4), _Format("u8", 8, False, 4, 4, zero=False), _Format("z8", 8, False, 4, 4),
    _Format("r8", 8, True, levels=255), _Format("s4", 4, True, values=_linear4(True)),
    _Format("u4", 4, False, values=_linear4(False), zero=False))}
_TABLES = {name: f.table() for name, f in FORMATS.items()}
_TOP = {name: float(t.abs().max()) for name, t in _TABLES.items()}
# tables of evenly spaced values round by arithmetic (first value, step), the others by search
_EVEN = {name: (float(t[0]), float(t[1] - t[0])) for name, t in _TABLES.items()
         if FORMATS[name].values and torch.allclose(t.diff(), t.diff()[:1].expand(t.numel() - 1))}
MOMENT_FORMATS = {8: ("s8", "u8"), 4: ("s4", "u4")}  # bits -> (signed moments, second moments)
# widths whose packs exist but whose state is not offered, and why
NOT_OFFERED = {4: "4-bit state is not offered: it lost 1.4-1.8 pp of test accuracy against fp32 state on the "
                  "many-small-tensors model (torchao's AdamW4bit 1.3 pp; docs/sharding.md)"}
BITS = tuple(b for b in MOMENT_FORMATS if b not in NOT_OFFERED)  # the widths of state offered
_LEGACY_TABLES = ("s8", "z8", "r8")  # format version 1: the table was a number
LEGACY_BLOCK = 256  # format version 1's block


def bits_problem(option: str, bits: Any, allowed: Sequence[int]) -> Optional[str]:
    """Why ``option=bits`` is refused (None if it is one of ``allowed``)."""
    if not isinstance(bits, bool) and bits in allowed:
        return None
    why = f" ({NOT_OFFERED[bits]})" if not isinstance(bits, bool) and bits in NOT_OFFERED else ""
    return f"{option}={bits!r} is not allowed{why}; allowed: {', '.join(map(str, allowed))}"


def _is_version_1(d: Mapping[str, Any]) -> bool:
    """Whether ``d`` is a pack saved by format version 1 (``{"lowbit": 8, "codes": ...}``)."""
    return d.get("lowbit") == 8 and "codes" in d


def _block_view(flat: torch.Tensor, block: int) -> torch.Tensor:
    n = flat.numel()
    blocks = -(-n // block)
    xb = flat if n == blocks * block else torch.nn.functional.pad(flat, (0, blocks * block - n))
    return xb.view(blocks, block)


def _block_ids(starts: torch.Tensor, n: int) -> torch.Tensor:
    """Each element's block for blocks starting at ``starts`` (ascending, from 0)."""
    lengths = torch.diff(starts, append=torch.tensor([n], device=starts.device))
    return torch.repeat_interleave(torch.arange(starts.numel(), device=starts.device), lengths)


def _round_search(y: torch.Tensor, table: torch.Tensor, u: Optional[torch.Tensor]) -> torch.Tensor:
    """Index of a neighbouring ``table`` value of each ``y`` (nearest, or stochastic and
    unbiased with ``u``); below the table's first value, the first."""
    hi = torch.searchsorted(table, y).clamp_(1, table.numel() - 1)
    lo = hi - 1
    vlo, vhi = table[lo], table[hi]
    frac = ((y - vlo) / (vhi - vlo)).clamp_(0, 1)
    return torch.where(frac > (0.5 if u is None else u), hi, lo)


def _encode(flat: torch.Tensor, fmt_name: str, block: int, stochastic: bool, key128: int,
            starts: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)``: each block (``block`` elements, or from each of ``starts``) scaled
    so its absmax is the format's largest value, each value rounded to a neighbouring table
    value — the nearer, or stochastically (unbiased) — codes one per byte (4-bit: two per
    byte, low nibble first)."""
    n = flat.numel()
    fmt = FORMATS[fmt_name]
    if starts is None:
        xb = _block_view(flat, block)
        scale = xb.abs().amax(1).div_(_TOP[fmt_name])
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        y = (xb * scale.reciprocal()[:, None]).view(-1)
    else:
        ids = _block_ids(starts, n)
        scale = torch.zeros(starts.numel(), device=flat.device).scatter_reduce_(0, ids, flat.abs(), "amax")
        scale = scale.div_(_TOP[fmt_name])
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        y = flat * scale.reciprocal().index_select(0, ids)
    u = rng.uniform(y.numel(), key128, y.device) if stochastic and n else None
    if fmt_name in _EVEN:
        first, step = _EVEN[fmt_name]
        k = y.sub_(first).div_(step).add_(0.5 if u is None else u).floor_().clamp_(0, _TABLES[fmt_name].numel() - 1)
        k = k.to(torch.int32)
    elif fmt.values:
        table = _TABLES[fmt_name].to(y.device)
        k = _round_search(y.clamp_(float(table[0]), float(table[-1])), table, u)
    else:
        k = fmt.round_index(y.abs().clamp_(max=fmt.unit), u)
        if fmt.signed:  # the magnitude's index, mirrored below the middle of the table for negatives
            k.mul_((y < 0).to(torch.int32).mul_(-2).add_(1)).add_(fmt.magnitudes().numel() - 1)
    return fmt.pack_codes(k[:n].to(torch.uint8)), scale


def _decode(codes: torch.Tensor, scales: torch.Tensor, fmt_name: str, block: int, n: int,
            starts: Optional[torch.Tensor] = None) -> torch.Tensor:
    values = _TABLES[fmt_name].to(codes.device).index_select(0, FORMATS[fmt_name].unpack_codes(codes, n).int())
    if starts is not None:
        return values * scales.float().index_select(0, _block_ids(starts, n))
    full = _block_view(values, block)
    return (full * scales.float()[:, None]).reshape(-1)[:n]


class PackedState:
    """One optimizer-state tensor stored in low bits: ``codes`` of ``format`` (a name in
    :data:`FORMATS`; 8 bits a code, or 4 bits two a byte), one fp32 scale per block, the
    tensor's ``shape`` and ``dtype``, and optionally the ``residual`` of its encoding (error
    feedback, itself a pack). Blocks are ``block`` elements from element 0, or, with
    ``starts`` (ascending block starts, from 0), cut at every multiple of ``block`` *and* at
    each extra start given — :class:`~gradcomp.sharded.ShardedOptimizer` starts a block at each
    parameter, so one block never spans two parameters. Packs of consecutive pieces cut on
    block boundaries :meth:`join` into the pack of the whole. ``to_saved``/``from_saved``
    convert to and from a plain dict (checkpoints)."""

    __slots__ = ("format", "block", "codes", "scales", "numel", "shape", "dtype", "residual", "starts")
    VERSION = 2

    def __init__(self, format: str, block: int, codes: torch.Tensor, scales: torch.Tensor, numel: int,
                 shape: Sequence[int], dtype: torch.dtype = torch.float32,
                 residual: Optional["PackedState"] = None, starts: Optional[torch.Tensor] = None) -> None:
        if format not in FORMATS:
            raise ValueError(f"unknown low-bit state format {format!r}; known: {', '.join(FORMATS)}")
        self.format, self.block, self.codes, self.scales = format, int(block), codes, scales
        self.numel, self.shape, self.dtype, self.residual = int(numel), tuple(int(s) for s in shape), dtype, residual
        self.starts = starts

    @property
    def fmt(self) -> _Format:
        """The format's entry in :data:`FORMATS`."""
        return FORMATS[self.format]

    @property
    def bits(self) -> int:
        return self.fmt.bits

    @property
    def nbytes(self) -> int:
        own = self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()
        return own + (self.residual.nbytes if self.residual is not None else 0)

    def __repr__(self) -> str:
        return (f"PackedState({self.format}, {self.numel} elements in {self.scales.numel()} blocks"
                f"{', with residual' if self.residual is not None else ''})")

    @staticmethod
    def block_starts(numel: int, block: int, extra: Sequence[int], device: Any = "cpu") -> Optional[torch.Tensor]:
        """Starts of blocks cut every ``block`` elements and at each of ``extra`` (None if
        those are the regular ones)."""
        extra = sorted({int(e) for e in extra if 0 < int(e) < numel} - set(range(0, numel, block)))
        if not extra:
            return None
        return torch.tensor(sorted(set(range(0, numel, block)) | set(extra)), dtype=torch.int64, device=device)

    @classmethod
    def encode(cls, x: torch.Tensor, format: str, *, block: int = 0, stochastic: bool = False, key128: int = 0,
               feedback: bool = False, residual: Optional[torch.Tensor] = None,
               starts: Optional[torch.Tensor] = None) -> "PackedState":
        """``x (+ residual)`` packed; ``feedback``: keep the new quantization error beside it."""
        block = block or BLOCK
        flat = x.detach().reshape(-1).float()
        if residual is not None:
            flat = flat + residual.reshape(-1).float()
        if starts is not None:
            starts = starts.to(flat.device)
        codes, scales = _encode(flat, format, block, stochastic, key128, starts)
        out = cls(format, block, codes, scales, flat.numel(), x.shape, x.dtype, starts=starts)
        if feedback:
            out.residual = cls.encode(flat - out.decode_flat(), "r8", block=block, starts=starts)
        return out

    def decode_flat(self) -> torch.Tensor:
        return _decode(self.codes, self.scales, self.format, self.block, self.numel, self.starts)

    def decode(self) -> torch.Tensor:
        """The tensor this pack stands for, in its shape and dtype (without its residual)."""
        return self.decode_flat().reshape(self.shape).to(self.dtype)

    def to(self, device: Any) -> "PackedState":
        return PackedState(self.format, self.block, self.codes.to(device), self.scales.to(device), self.numel,
                           self.shape, self.dtype, None if self.residual is None else self.residual.to(device),
                           None if self.starts is None else self.starts.to(device))

    def _starts(self) -> torch.Tensor:
        if self.starts is not None:
            return self.starts.cpu()
        return torch.arange(0, self.numel, self.block, dtype=torch.int64)

    def is_boundary(self, at: int) -> bool:
        """Whether a block starts at element ``at`` (or ``at`` is the end)."""
        if at == self.numel or (self.starts is None and at % self.block == 0):
            return True
        return self.starts is not None and bool((self.starts.cpu() == at).any())

    def cut(self, lo: int, hi: int) -> "PackedState":
        """Elements ``[lo, hi)`` of the flat tensor, ``lo`` on a block boundary."""
        per = self.fmt.per_byte
        if not self.is_boundary(lo) or lo % per:
            raise ValueError(f"a low-bit pack cannot be cut at element {lo}, inside one of its blocks "
                             f"({self.block} elements): cut on block boundaries")
        codes = self.codes[lo // per:-(-hi // per)].clone()
        res = None if self.residual is None else self.residual.cut(lo, hi)
        if self.starts is None:
            scales = self.scales[lo // self.block:-(-hi // self.block)].clone()
            starts = None
        else:
            allstarts = self._starts()
            keep = (allstarts >= lo) & (allstarts < hi)
            scales = self.scales[keep.to(self.scales.device)].clone()
            starts = (allstarts[keep] - lo).to(self.codes.device)
            if torch.equal(starts.cpu(), torch.arange(0, hi - lo, self.block)):
                starts = None
        return PackedState(self.format, self.block, codes, scales, hi - lo, (hi - lo,), self.dtype, res, starts)

    @classmethod
    def join(cls, parts: Sequence["PackedState"]) -> "PackedState":
        """Packs of consecutive pieces of one flat tensor (each but the last a whole number
        of bytes) as the pack of the whole."""
        first = parts[0]
        for i, p in enumerate(parts):  # the last one too: it may be of another format
            if p.format != first.format or p.block != first.block or (i < len(parts) - 1 and p.numel % p.fmt.per_byte):
                raise ValueError("low-bit packs join only when they have one format and block, and whole bytes")
        n = sum(p.numel for p in parts)
        regular = all(p.starts is None for p in parts) and all(p.numel % p.block == 0 for p in parts[:-1])
        starts = None
        if not regular:
            at, pieces = 0, []
            for p in parts:
                pieces.append(p._starts() + at)
                at += p.numel
            starts = torch.cat(pieces).to(first.codes.device)
        res = None if first.residual is None else cls.join([p.residual for p in parts])  # type: ignore[misc]
        return cls(first.format, first.block, torch.cat([p.codes for p in parts]),
                   torch.cat([p.scales for p in parts]), n, (n,), first.dtype, res, starts)

    def to_saved(self) -> Dict[str, Any]:
        """A plain dict of tensors, ints and strings (loads with ``torch.load(weights_only=True)``)."""
        out: Dict[str, Any] = {"packed_state": self.VERSION, "format": self.format, "block": self.block,
                               "codes": self.codes, "scales": self.scales, "numel": self.numel,
                               "shape": list(self.shape), "dtype": str(self.dtype).replace("torch.", "")}
        if self.starts is not None:
            out["starts"] = self.starts
        if self.residual is not None:
            out["residual"] = self.residual.to_saved()
        return out

    @classmethod
    def from_saved(cls, d: Mapping[str, Any]) -> "PackedState":
        """A pack from :meth:`to_saved`'s dict, or from format version 1's (``{"lowbit": 8,
        "table": ...}``: 256-element blocks, decoded as they were made)."""
        if d.get("packed_state") == cls.VERSION:
            missing = [k for k in ("format", "block", "codes", "scales", "numel", "shape") if k not in d]
            if missing:
                raise ValueError(f"not a saved low-bit state: version {cls.VERSION} without {', '.join(missing)}; "
                                 f"save it again with this gradcomp")
            dtype = getattr(torch, str(d.get("dtype", "float32")))
            res = d.get("residual")
            return cls(str(d["format"]), int(d["block"]), d["codes"], d["scales"], int(d["numel"]), d["shape"],
                       dtype, None if res is None else cls.from_saved(res), d.get("starts"))
        if _is_version_1(d) and "table" in d:
            fmt = _LEGACY_TABLES[int(d["table"])]
            res = None
            if "rcodes" in d:
                res = cls("r8", LEGACY_BLOCK, d["rcodes"], d["rscales"], int(d["numel"]), (int(d["numel"]),))
            return cls(fmt, LEGACY_BLOCK, d["codes"], d["scales"], int(d["numel"]), d["shape"], torch.float32, res)
        raise ValueError(f"not a saved low-bit state (version {d.get('packed_state', d.get('lowbit'))!r}; this "
                         f"gradcomp reads versions 1 and {cls.VERSION}): save it again with this gradcomp")


def is_packed(value: Any) -> bool:
    """Whether ``value`` is low-bit state: a :class:`PackedState` or one saved as a dict."""
    return isinstance(value, PackedState) or is_saved_pack(value)


def is_saved_pack(value: Any) -> bool:
    return isinstance(value, Mapping) and ("packed_state" in value or _is_version_1(value))


def as_packed(value: Any) -> PackedState:
    """A :class:`PackedState` from one or from its saved dict."""
    return value if isinstance(value, PackedState) else PackedState.from_saved(value)


def saved(tree: Any) -> Any:
    """``tree`` with every :class:`PackedState` in it replaced by its saved dict."""
    if isinstance(tree, PackedState):
        return tree.to_saved()
    if isinstance(tree, dict):
        return {k: saved(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [saved(v) for v in tree]
    return tree


def pack(x: torch.Tensor, *, format: str, compensation: str = "none", key128: int = 0,
         residual: Optional[torch.Tensor] = None, block: int = 0, starts: Optional[torch.Tensor] = None) -> PackedState:
    """``x`` (any shape, floating) packed block-wise in ``format``; with
    ``compensation="feedback"``, ``x + residual`` is encoded and its new error kept."""
    return PackedState.encode(x, format, block=block, stochastic=compensation == "stochastic", key128=key128,
                              feedback=compensation == "feedback", residual=residual, starts=starts)


def unpack(packed: Any) -> torch.Tensor:
    """The fp32 tensor a pack stands for (without its residual)."""
    p = as_packed(packed)
    return p.decode_flat().reshape(p.shape)


def state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by ``optimizer.state`` (every tensor in it, packed state included): what the
    optimizer keeps between steps, measured from the tensors."""
    def size(value: Any) -> int:
        if isinstance(value, PackedState):
            return value.nbytes
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, dict):
            return sum(size(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(size(v) for v in value)
        return 0

    return sum(size(s) for s in optimizer.state.values())


# ---- the wrapper -----------------------------------------------------------------------------
class LowBitState(Stepping, Wrapper):
    """``optimizer`` with its per-element state stored in 8 bits between steps (see the
    module docstring). ``param_groups`` and ``state`` are the inner optimizer's, so LR
    schedulers and gradient clipping work as usual; ``state_dict()`` holds the packed state
    as it is (and loads bit-identically).

    ``compensation``: ``"stochastic"`` (unbiased rounding, 1 byte per element),
    ``"feedback"`` (the quantization error kept, in 8 bits, and added back at the next encode:
    2 bytes per element, the smallest error) or ``"none"`` (round to nearest). ``min_numel``:
    parameters with fewer elements keep their state as it is; ``quantize``, a callable
    ``tensor -> bool``, overrides that rule; ``breaks``, a callable ``tensor -> element
    indices``, starts extra blocks there (where one tensor holds several parameters). ``seed``:
    the stochastic rounding's stream. ``bits``: 8.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, bits: int = 8, compensation: str = "stochastic",
                 min_numel: int = MIN_NUMEL, seed: int = 0,
                 quantize: Optional[Callable[[torch.Tensor], bool]] = None,
                 breaks: Optional[Callable[[torch.Tensor], Sequence[int]]] = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, LowBitState):
            raise ValueError(f"LowBitState wraps a torch.optim.Optimizer (once), got {type(optimizer).__name__}")
        problem = bits_problem("bits", bits, BITS)
        if problem is not None:
            raise ValueError(f"{problem} (32-bit state needs no wrapper)")
        if compensation not in _COMPENSATIONS:
            raise ValueError(f"compensation={compensation!r} is not allowed; allowed: {', '.join(_COMPENSATIONS)}")
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel={min_numel!r} must be an int >= 0")
        super().__init__()
        self.optimizer = optimizer
        self.bits, self.compensation, self.min_numel, self.seed = bits, compensation, min_numel, int(seed)
        self._quantize = quantize if quantize is not None else (lambda t: t.numel() >= self.min_numel)
        self._breaks = breaks
        self._starts: Dict[int, Optional[torch.Tensor]] = {}  # tensor position -> its blocks' starts
        self.decision = StepDecision(None, "LowBitState")  # skipped: steps refused, a gradient not finite
        self._draws: Dict[int, int] = {}  # tensor position -> encodes so far (the rounding stream's step)
        self._residuals: Dict[Tuple[int, str], torch.Tensor] = {}  # feedback residuals between decode and encode

    def __repr__(self) -> str:
        return f"LowBitState({self.optimizer!r}, bits={self.bits}, compensation={self.compensation})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> Dict[str, Any]:
        """The inner optimizer's, packed state as plain dicts (``PackedState.to_saved``)."""
        sd = self.optimizer.state_dict()
        sd["state"] = {k: saved(v) for k, v in sd["state"].items()}
        sd["lowbit"] = {"bits": self.bits, "compensation": self.compensation, "seed": self.seed,
                        "skipped": self.skipped, "draws": dict(self._draws)}
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Bit-identical: packed state bypasses ``torch.optim``'s cast to the parameter's dtype
        (which would turn codes into floats and 16-bit parameters' scales into 16 bits)."""
        sd = dict(state_dict)
        ours = sd.pop("lowbit", None)
        if (not isinstance(ours, Mapping) or ours.get("bits", 8) != self.bits
                or ours.get("compensation") != self.compensation):
            raise ValueError(f"the state_dict was not saved by a LowBitState with bits={self.bits} and "
                             f"compensation={self.compensation!r} (it has {ours!r}); load it into the same "
                             f"configuration")
        plain: Dict[Any, Dict[str, Any]] = {}
        packs: Dict[Any, Dict[str, PackedState]] = {}
        for index, state in sd.get("state", {}).items():
            plain[index] = {k: v for k, v in state.items() if not is_packed(v)}
            packs[index] = {k: as_packed(v) for k, v in state.items() if is_packed(v)}
        self.optimizer.load_state_dict({**sd, "state": plain})
        # torch maps saved ids to parameters by position in the groups: the same here
        saved_ids = [i for g in sd["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        by_id = dict(zip(saved_ids, params))
        for index, ps in packs.items():
            if ps:
                p = by_id[index]
                self.optimizer.state[p].update({k: v.to(p.device) for k, v in ps.items()})
        self.seed, self.skipped = int(ours["seed"]), int(ours["skipped"])
        self._draws = {int(k): int(v) for k, v in ours.get("draws", {}).items()}

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Run ``closure`` (once) if given, then step every tensor with a gradient, one at a
        time (decode its state, inner step, encode); nothing changes when a gradient is not
        finite."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        tensors = [(i, p) for i, p in enumerate(p for g in self.param_groups for p in g["params"])
                   if p.grad is not None]
        if not self.decision.settle(all_finite([p.grad for _, p in tensors])):  # nothing changed: skipped
            return loss
        for index, p in tensors:
            self._decode(index, p)
            with self._only(p):
                self.optimizer.step()
            self._encode(index, p)
        return loss

    # ---- internals ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _only(self, param: torch.Tensor) -> Iterator[None]:
        """The inner optimizer sees ``param`` alone (its group keeps its hyper-parameters)."""
        saved = [g["params"] for g in self.param_groups]
        try:
            for g in self.param_groups:
                g["params"] = [param] if any(q is param for q in g["params"]) else []
            yield
        finally:
            for g, params in zip(self.param_groups, saved):
                g["params"] = params

    def _decode(self, index: int, p: torch.Tensor) -> None:
        state = self.optimizer.state.get(p)
        if not state:
            return
        for k, v in list(state.items()):
            if isinstance(v, PackedState):
                # in the dtype the inner optimizer made it (its foreach kernels need that)
                state[k] = v.decode().to(p.device)
                if v.residual is not None:
                    self._residuals[(index, k)] = v.residual.decode_flat().to(p.device)

    def _encode(self, index: int, p: torch.Tensor) -> None:
        state = self.optimizer.state.get(p)
        if not state or not self._quantize(p):
            return
        count = self._draws.get(index, 0)
        self._draws[index] = count + 1
        for k, v in list(state.items()):
            if (isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() == p.numel()
                    and k != "step" and v.numel()):
                signed, unsigned = MOMENT_FORMATS[self.bits]
                state[k] = pack(v, format=unsigned if k in SECOND_MOMENTS else signed,
                                compensation=self.compensation,
                                key128=rng.stream_key(self.seed, f"{index}/{k}", count),
                                residual=self._residuals.pop((index, k), None), starts=self._starts_of(index, p))

    def _starts_of(self, index: int, p: torch.Tensor) -> Optional[torch.Tensor]:
        if self._breaks is None:
            return None
        if index not in self._starts:
            self._starts[index] = PackedState.block_starts(p.numel(), BLOCK, self._breaks(p), p.device)
        return self._starts[index]
