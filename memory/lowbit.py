"""Low-bit optimizer state: moment tensors kept in 8 bits between steps.

:class:`LowBitState` wraps any ``torch.optim`` optimizer whose state is per element (Adam,
AdamW, SGD with momentum, RMSprop, Adagrad, ...). Between steps each eligible state tensor
is stored *block-wise dynamic*: blocks of :data:`BLOCK` (256) elements, one fp32 scale per
block (its absmax) and one byte per element, the index of a value in a fixed table of small
floats (bitsandbytes' dynamic map has the same shape): first moments and momentum in a signed
format (3 exponent, 4 mantissa bits: 8 binades below the block's max at 1/16 to 1/32
relative precision), second moments (``exp_avg_sq``, ``max_exp_avg_sq``, ``square_avg``,
``sum``, never negative) in an unsigned one (4 exponent, 4 mantissa bits: 16 binades). Bytes
per element: ``1 + 4/256`` instead of 4 (0.254x).

**Error compensation** (``compensation=``). Rounding to nearest loses every update smaller
than half a grid step: Adam's second moment (``beta2 = 0.999``) moves by 0.1 % a step, far
below the grid, so it freezes and its error grows with time. Two remedies:

- ``"stochastic"`` (default, 1 byte per element): round up or down with the probabilities
  that make the stored value exact in expectation, so the part of an update the grid cannot
  hold is carried on in expectation; the moments' recursions contract (``beta < 1``), so the
  error settles at a level set by the grid instead of growing;
- ``"feedback"`` (2 bytes per element): error feedback on the state — the quantization error
  of each encode is kept (itself in 8 bits, evenly spaced, with its own block scale) and
  added before the next encode, so what the grid drops is re-sent instead of lost; the stored
  moment then stays within about one grid step of the exact one at every step;
- ``"none"``: round to nearest, for comparison.

Both are tested over 1000 steps against fp32 Adam. The randomness is counter-based
(``kernels.rng``, keyed by tensor, state name and encode count), so a resumed run draws what
the original drew. 4-bit state is not offered: with 16 levels per block the moments' error
is 40-80 % (measured the same way), which does not hold up.

**Small tensors.** A state tensor is stored in 8 bits only when its parameter has at least
``min_numel`` (default 4096, as bitsandbytes) elements; smaller ones, scalars (``step``) and
anything that is not per element stay as the optimizer made them. The decision is per
parameter, never per piece of one: :class:`~gradcomp.memory.ShardedOptimizer` decides on the
whole parameter group, so precision does not change with the number of ranks.

**Step.** ``step()`` decodes one tensor's state, runs the inner optimizer on that tensor
alone, re-encodes it, then goes to the next tensor: at most one tensor's state is in fp32 at
any time. A step whose gradients are not all finite changes nothing (no state, no parameter)
and is counted in :attr:`LowBitState.skipped`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from gradcomp.compress.transaction import all_finite
from gradcomp.kernels import rng

from gradcomp.training._wrapper import Wrapper

__all__ = ["LowBitState", "state_nbytes", "BLOCK", "MIN_NUMEL"]

BLOCK = 256  # elements per fp32 scale: smaller => less error next to outliers, 32 more bits per block
MIN_NUMEL = 4096  # parameters smaller than this keep fp32 state: they cost little, and are often norms/biases
SECOND_MOMENTS = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum"})
_COMPENSATIONS = ("stochastic", "feedback", "none")


# ---- the codec -------------------------------------------------------------------------------
class _Format(NamedTuple):
    """A table of 8-bit magnitudes: a small float with subnormals (its exact values, so the
    largest is ``unit``), or ``levels`` evenly spaced values in [0, 1] (``exp_bits == 0``)."""

    exp_bits: int
    man_bits: int
    signed: bool
    levels: int = 0

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
        if not self.exp_bits:
            return torch.linspace(0, 1, (self.levels + 1) // 2)
        m2 = 2 ** self.man_bits
        return torch.tensor([(m / m2) * 2.0 ** (1 - self.bias) if e == 0 else (1 + m / m2) * 2.0 ** (e - self.bias)
                             for e in range(2 ** self.exp_bits) for m in range(m2)], dtype=torch.float32)

    def round_index(self, a: torch.Tensor, u: Optional[torch.Tensor]) -> torch.Tensor:
        """For float32 magnitudes ``a`` in [0, unit], the index (int32) of a neighbouring table
        magnitude: the nearer (``u`` None), or the upper one with probability equal to the
        fraction of the gap ``a`` lies above the lower (``u``: uniform [0, 1) draws).

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
        return bits.sub_(sub, alpha=2 ** self.man_bits).clamp_(0, top)


# signed moments: 1 sign, 3 exponent, 4 mantissa bits (255 values: 8 binades at 1/16..1/32);
# second moments (>= 0): 4 exponent, 4 mantissa bits (256 values: 16 binades);
# the error-feedback residual (bounded by one grid step): 255 evenly spaced levels
FORMATS = (_Format(3, 4, True), _Format(4, 4, False), _Format(0, 0, True, 255))
SIGNED, UNSIGNED, LINEAR = 0, 1, 2
_MAGS = [f.magnitudes() for f in FORMATS]
TABLES = [torch.cat([-m.flip(0)[:-1], m]) / f.unit if f.signed else m / f.unit for f, m in zip(FORMATS, _MAGS)]


def _encode(flat: torch.Tensor, table: int, stochastic: bool, key128: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)``: each block scaled so its absmax is the table's largest magnitude,
    each magnitude rounded to a neighbouring table magnitude — the nearer, or stochastically
    (unbiased) — and the sign kept."""
    n = flat.numel()
    blocks = -(-n // BLOCK)
    fmt = FORMATS[table]
    xb = flat if n == blocks * BLOCK else torch.nn.functional.pad(flat, (0, blocks * BLOCK - n))
    xb = xb.view(blocks, BLOCK)
    scale = xb.abs().amax(1).div_(fmt.unit)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = (xb * scale.reciprocal()[:, None]).view(-1)
    u = rng.uniform(y.numel(), key128, y.device) if stochastic and n else None
    k = fmt.round_index(y.abs().clamp_(max=fmt.unit), u)
    if fmt.signed:  # the magnitude's index, mirrored below the middle of the table for negatives
        k.mul_((y < 0).to(torch.int32).mul_(-2).add_(1)).add_(_MAGS[table].numel() - 1)
    return k[:n].to(torch.uint8), scale


def _decode(codes: torch.Tensor, scales: torch.Tensor, table: int) -> torch.Tensor:
    n = codes.numel()
    fmt, mags = FORMATS[table], _MAGS[table].to(codes.device)
    values = (torch.cat([-mags.flip(0)[:-1], mags]) if fmt.signed else mags).index_select(0, codes.to(torch.int32))
    blocks = scales.numel()
    full = torch.nn.functional.pad(values, (0, blocks * BLOCK - n)).view(blocks, BLOCK)
    return (full * scales.float()[:, None]).reshape(-1)[:n]


def is_packed(value: Any) -> bool:
    """Whether ``value`` is a state tensor stored by :func:`pack`."""
    return isinstance(value, dict) and value.get("lowbit") == 8


def pack(x: torch.Tensor, *, table: int, compensation: str, key128: int,
         residual: Optional[torch.Tensor] = None) -> Dict[str, Any]:
    """``x`` (any shape, floating) as block-wise 8-bit codes and fp32 scales: a plain dict of
    tensors and ints, so ``torch.optim``'s state_dict machinery carries it unchanged. With
    ``compensation="feedback"``, ``x + residual`` is encoded and the new quantization error
    is kept beside it (``rcodes``/``rscales``, 8 bits too)."""
    flat = x.detach().reshape(-1).float()
    if residual is not None:
        flat = flat + residual.reshape(-1)
    codes, scales = _encode(flat, table, compensation == "stochastic", key128)
    out: Dict[str, Any] = {"lowbit": 8, "codes": codes, "scales": scales, "numel": flat.numel(), "table": table,
                           "shape": list(x.shape)}
    if compensation == "feedback":
        out["rcodes"], out["rscales"] = _encode(flat - _decode(codes, scales, table), LINEAR, False, 0)
    return out


def unpack(packed: Mapping[str, Any]) -> torch.Tensor:
    """The fp32 tensor a :func:`pack` result stands for (without its residual)."""
    out = _decode(packed["codes"], packed["scales"], int(packed["table"]))
    return out.reshape([int(s) for s in packed["shape"]])


def residual_of(packed: Mapping[str, Any]) -> Optional[torch.Tensor]:
    """The quantization error a ``"feedback"`` pack keeps (flat fp32), else None."""
    if "rcodes" not in packed:
        return None
    return _decode(packed["rcodes"], packed["rscales"], LINEAR)


def join_packed(parts: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Packs of consecutive pieces of one vector, each starting on a block boundary, as the
    pack of the whole (what each would have been: blocks do not cross pieces)."""
    n = sum(int(p["numel"]) for p in parts)
    out: Dict[str, Any] = {"lowbit": 8, "numel": n, "table": int(parts[0]["table"]), "shape": [n]}
    for key in ("codes", "scales", "rcodes", "rscales"):
        if key in parts[0]:
            out[key] = torch.cat([p[key] for p in parts])
    return out


def cut_packed(packed: Mapping[str, Any], lo: int, hi: int) -> Dict[str, Any]:
    """Elements ``[lo, hi)`` of a 1-D pack, ``lo`` on a block boundary."""
    if lo % BLOCK:
        raise ValueError(f"a pack is cut on block boundaries ({BLOCK} elements), not at {lo}")
    out: Dict[str, Any] = {"lowbit": 8, "numel": hi - lo, "table": int(packed["table"]), "shape": [hi - lo]}
    for key in ("codes", "rcodes"):
        if key in packed:
            out[key] = packed[key][lo:hi].clone()
    for key in ("scales", "rscales"):
        if key in packed:
            out[key] = packed[key][lo // BLOCK:-(-hi // BLOCK)].clone()
    return out


def state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by ``optimizer.state`` (every tensor in it, packed state included): what the
    optimizer keeps between steps, measured from the tensors."""
    def size(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, dict):
            return sum(size(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(size(v) for v in value)
        return 0

    return sum(size(s) for s in optimizer.state.values())


# ---- the wrapper -----------------------------------------------------------------------------
class LowBitState(Wrapper):
    """``optimizer`` with its per-element state stored in 8 bits between steps (see the
    module docstring). ``param_groups`` and ``state`` are the inner optimizer's, so LR
    schedulers and gradient clipping work as usual; ``state_dict()`` holds the packed state
    as it is (and loads bit-identically).

    ``compensation``: ``"stochastic"`` (unbiased rounding, 1 byte per element),
    ``"feedback"`` (the quantization error kept, in 8 bits, and added back at the next encode:
    2 bytes per element, the smallest error) or ``"none"`` (round to nearest). ``min_numel``:
    parameters with fewer elements keep their state as it is; ``quantize``, a callable
    ``tensor -> bool``, overrides that rule. ``seed``: the stochastic rounding's stream.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, bits: int = 8, compensation: str = "stochastic",
                 min_numel: int = MIN_NUMEL, seed: int = 0,
                 quantize: Optional[Callable[[torch.Tensor], bool]] = None) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, LowBitState):
            raise ValueError(f"LowBitState wraps a torch.optim.Optimizer (once), got {type(optimizer).__name__}")
        if bits != 8:
            raise ValueError(f"bits={bits!r} is not supported; allowed: 8 (32-bit state needs no wrapper)")
        if compensation not in _COMPENSATIONS:
            raise ValueError(f"compensation={compensation!r} is not allowed; allowed: {', '.join(_COMPENSATIONS)}")
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel={min_numel!r} must be an int >= 0")
        super().__init__()
        self.optimizer = optimizer
        self.bits, self.compensation, self.min_numel, self.seed = bits, compensation, min_numel, int(seed)
        self._quantize = quantize if quantize is not None else (lambda t: t.numel() >= self.min_numel)
        self.skipped = 0  # steps refused because a gradient was not finite
        self._draws: Dict[int, int] = {}  # tensor position -> encodes so far (the rounding stream's step)
        self._residuals: Dict[Tuple[int, str], torch.Tensor] = {}  # feedback residuals between decode and encode

    def __repr__(self) -> str:
        return f"LowBitState({self.optimizer!r}, bits={self.bits}, compensation={self.compensation})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> Dict[str, Any]:
        sd = self.optimizer.state_dict()
        sd["lowbit"] = {"bits": self.bits, "compensation": self.compensation, "seed": self.seed,
                        "skipped": self.skipped, "draws": dict(self._draws)}
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        sd = dict(state_dict)
        ours = sd.pop("lowbit", None)
        if (not isinstance(ours, Mapping) or ours.get("bits") != self.bits
                or ours.get("compensation") != self.compensation):
            raise ValueError(f"the state_dict was not saved by a LowBitState with bits={self.bits} and "
                             f"compensation={self.compensation!r} (it has {ours!r}); load it into the same "
                             f"configuration")
        self.optimizer.load_state_dict(sd)
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
        if not all_finite([p.grad for _, p in tensors]):
            self.skipped += 1
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
            if is_packed(v):
                state[k] = unpack(v).to(p.device)
                residual = residual_of(v)
                if residual is not None:
                    self._residuals[(index, k)] = residual.to(p.device)

    def _encode(self, index: int, p: torch.Tensor) -> None:
        state = self.optimizer.state.get(p)
        if not state or not self._quantize(p):
            return
        count = self._draws.get(index, 0)
        self._draws[index] = count + 1
        for k, v in list(state.items()):
            if (isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() == p.numel()
                    and k != "step" and v.numel()):
                table = UNSIGNED if k in SECOND_MOMENTS else SIGNED
                state[k] = pack(v, table=table, compensation=self.compensation,
                                key128=rng.stream_key(self.seed, f"{index}/{k}", count),
                                residual=self._residuals.pop((index, k), None))
