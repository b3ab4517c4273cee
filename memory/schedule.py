"""The schedule of a chain: which stages keep what they save, store it compressed, offload
it, or recompute, and the exact dynamic programme that chooses under a byte budget.

A chain is stages ``0 .. L-1``; stage ``i`` turns activation ``a[i-1]`` into ``a[i]``. A
schedule of stages ``s .. t`` is a list of blocks covering them in order, ending with a
:class:`Plain` block:

- ``Plain(i, mode)``: stage ``i`` runs with autograd; what it saves is kept until its
  backward, as it is (``"keep"``), through a codec (``"compress:<codec>"``) or in host memory
  (``"offload"``).
- ``Recompute(s, k, inner)``: stages ``s .. k`` run without autograd (nothing saved); their
  input is stored; in backward they run again from it, by the schedule ``inner``.

This is rotor's model (Beaumont, Herrmann et al., "Optimal checkpointing for heterogeneous
chains"), extended with the storage mode of each stage. What a stage holds has two parts:

- ``internal[i][mode]``: the bytes of what it saves that is neither its input nor its output;
- its output ``a[i]``, the boundary to the next block, held once in one form
  (:func:`boundary`): as it is (``out[i]`` bytes), compressed (``form[i][mode]``) or offloaded
  (0 on the device), or not at all when neither stage saves it (``saves_out[i]``,
  ``saves_in[i + 1]``). Which form follows from both sides of the boundary, by the rules the
  executor applies (``memory/executor.py``).

So the cost of a block depends on the block after it. With ``first(rest)`` the kind of the
next block (a plain mode, ``"recompute"``, or ``"end"``) and the input of a schedule held by
its caller::

    peak([Plain(s, m), *rest]) = max(spike[s][m], internal[s][m] + boundary(s, m, first(rest)) + peak(rest))
    peak([Recompute(s, k, inner), *rest])
        = max(boundary_after_recompute(k, first(rest)) + peak(rest), peak(inner))
    time([Plain(s, m), *rest]) = fwd[s][m] + bwd[s][m] + time(rest)
    time([Recompute(s, k, inner), *rest]) = sum(rerun[s..k]) + time(rest) + time(inner)

The chain's own input (``inp`` bytes) is the caller's; it counts where a stage saves it
(``saves_in[0]``: kept as it is) or a recomputation stores it (:func:`total_peak`). The
chain's output counts once, as what the loss saves (cross-entropy and MSE save a tensor of the
output's size).

:func:`solve` finds the fastest schedule whose peak fits a budget, exactly, for the budget
discretised into ``slots`` (each cost rounded up to whole slots, so the schedule found always
fits); :func:`min_peak` gives the smallest peak any schedule reaches, in exact bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = ["Plain", "Recompute", "Block", "Costs", "solve", "min_peak", "peak", "total_peak", "time",
           "boundary", "to_json", "from_json", "stages_of", "RECOMPUTE", "END"]

RECOMPUTE, END = "recompute", "end"


@dataclass(frozen=True)
class Plain:
    stage: int
    mode: str = "keep"


@dataclass(frozen=True)
class Recompute:
    start: int
    end: int  # inclusive
    inner: Tuple["Block", ...]


Block = Union[Plain, Recompute]


@dataclass
class Costs:
    """Per stage: times in seconds and bytes, one entry per allowed mode ("keep" always) in
    ``fwd``, ``bwd``, ``internal`` and ``form`` (see the module docstring)."""

    fwd: List[Dict[str, float]]
    bwd: List[Dict[str, float]]
    internal: List[Dict[str, int]]
    form: List[Dict[str, int]]  # the output's bytes in each mode's form
    out: List[int]
    saves_in: List[bool]
    saves_out: List[bool]
    inp: int = 0
    # bytes a stage holds at its own forward, above what it keeps afterwards: a compressing
    # stage holds what it saves as it is until it returns (then encodes it)
    spike: List[Dict[str, int]] = field(default_factory=list)
    # seconds of the stage's forward without autograd (a recomputation's first pass)
    rerun: List[float] = field(default_factory=list)
    # whether the stage changes its input in place (a recomputation starting there copies it)
    inplace: List[bool] = field(default_factory=list)
    modes: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.out)
        if n == 0 or not all(len(x) == n for x in (self.fwd, self.bwd, self.internal, self.form,
                                                   self.saves_in, self.saves_out)):
            raise ValueError("Costs: every field needs one entry per stage (at least one stage)")
        self.modes = sorted(self.fwd[0], key=lambda m: (m != "keep", m))
        if not self.spike:
            self.spike = [{m: 0 for m in self.modes} for _ in range(n)]
        if not self.rerun:
            self.rerun = [f["keep"] for f in self.fwd]
        if not self.inplace:
            self.inplace = [False] * n
        if not len(self.spike) == len(self.rerun) == len(self.inplace) == n:
            raise ValueError("Costs: spike, rerun and inplace need one entry per stage")
        for i in range(n):
            if "keep" not in self.fwd[i] or not (set(self.fwd[i]) == set(self.bwd[i]) == set(self.internal[i])
                                                 == set(self.form[i]) == set(self.modes)):
                raise ValueError(f"Costs: stage {i} needs the same modes in fwd, bwd, internal and form, 'keep' among them")

    @property
    def length(self) -> int:
        return len(self.out)


def boundary(c: Costs, i: int, mode: str, after: str) -> int:
    """Device bytes of ``a[i]`` when stage ``i`` runs plain in ``mode`` and the next block is
    ``after`` (a mode, ``RECOMPUTE`` or ``END``)."""
    so = c.saves_out[i]
    if after == END:
        if i == c.length - 1:  # the chain's output: the loss saves a tensor of its size (cross-entropy, MSE)
            return c.out[i]
        # a recomputed segment's last output: used as it is by the backward around it
        return c.out[i] if so and mode != "offload" else 0
    if after == RECOMPUTE:  # the recomputation stores it as it is; a compressing stage leaves it so
        return c.out[i]
    si = c.saves_in[i + 1]
    if after == mode:  # one run: held once, in the run's form
        return c.form[i][mode] if (so or si) else 0
    if so:
        if mode == "keep" or (after == "keep" and si):  # held as it is: the other side shares it
            return c.out[i]
        # held in this stage's form; a compressing next stage stores its own copy if it saves it
        return c.form[i][mode] + (c.form[i][after] if si else 0)
    return c.form[i][after] if si else 0


def after_recompute(c: Costs, k: int, after: str) -> int:
    """Device bytes of ``a[k]``, the output of a recomputation, before the block ``after``."""
    if after == RECOMPUTE:
        return c.out[k]
    return c.form[k][after] if c.saves_in[k + 1] else 0


def _first(blocks: Sequence[Block]) -> str:
    if not blocks:
        return END
    b = blocks[0]
    return b.mode if isinstance(b, Plain) else RECOMPUTE


def peak(blocks: Sequence[Block], c: Costs) -> int:
    """The peak bytes of a schedule, its input held by the caller."""
    if not blocks:
        return 0
    b, rest = blocks[0], blocks[1:]
    if isinstance(b, Plain):
        return max(c.spike[b.stage][b.mode],
                   c.internal[b.stage][b.mode] + boundary(c, b.stage, b.mode, _first(rest)) + peak(rest, c))
    return max(after_recompute(c, b.end, _first(rest)) + peak(rest, c), peak(b.inner, c))


def _top(c: Costs, first: str) -> int:
    """What the chain's input costs the plan: kept as it is where stage 0 saves it, stored
    by a recomputation that starts the chain."""
    if first == RECOMPUTE:
        return c.inp
    return c.inp if c.saves_in[0] else 0


def total_peak(blocks: Sequence[Block], c: Costs) -> int:
    """The peak bytes of a schedule of the whole chain, its input included where stored."""
    return peak(blocks, c) + _top(c, _first(blocks))


def time(blocks: Sequence[Block], c: Costs) -> float:
    """The predicted seconds of a schedule: forward, recomputation and backward."""
    if not blocks:
        return 0.0
    b, rest = blocks[0], blocks[1:]
    if isinstance(b, Plain):
        return c.fwd[b.stage][b.mode] + c.bwd[b.stage][b.mode] + time(rest, c)
    return sum(c.rerun[i] for i in range(b.start, b.end + 1)) + time(rest, c) + time(b.inner, c)


def min_peak(c: Costs, recompute: bool = True) -> Tuple[int, List[Block]]:
    """The smallest total peak (exact bytes) of any schedule of the whole chain (``recompute``:
    whether it may recompute), and one schedule that reaches it."""
    n, modes = c.length, c.modes
    # best[(s, t)][kind]: (peak, time, blocks) of the best schedule of s..t starting with kind
    best: Dict[Tuple[int, int], Dict[str, Tuple[int, float, List[Block]]]] = {}
    for d in range(n):
        for s in range(n - d):
            t = s + d
            row: Dict[str, Tuple[int, float, List[Block]]] = {}
            for m in modes:
                step = c.fwd[s][m] + c.bwd[s][m]
                sp = c.spike[s][m]
                head: List[Block] = [Plain(s, m)]
                if s == t:
                    row[m] = (max(sp, c.internal[s][m] + boundary(c, s, m, END)), step, head)
                    continue
                opts = [(max(sp, c.internal[s][m] + boundary(c, s, m, k) + p), step + tt, head + bl)
                        for k, (p, tt, bl) in best[(s + 1, t)].items()]
                row[m] = min(opts, key=lambda x: (x[0], x[1]))
            if recompute and s < t:
                opts = []
                for k in range(s, t):
                    rec: List[Block]
                    p2, t2, inner = min(best[(s, k)].values(), key=lambda x: (x[0], x[1]))
                    f = sum(c.rerun[i] for i in range(s, k + 1))
                    rec = [Recompute(s, k, tuple(inner))]
                    for kind, (p1, t1, rest) in best[(k + 1, t)].items():
                        opts.append((max(after_recompute(c, k, kind) + p1, p2), f + t1 + t2, rec + rest))
                row[RECOMPUTE] = min(opts, key=lambda x: (x[0], x[1]))
            best[(s, t)] = row
    p, _, blocks = min(((p + _top(c, kind), tt, bl) for kind, (p, tt, bl) in best[(0, n - 1)].items()),
                       key=lambda x: (x[0], x[1]))
    return p, blocks


def solve(c: Costs, budget: int, slots: int = 500, recompute: bool = True) -> Optional[List[Block]]:
    """The fastest schedule of the whole chain whose total peak (:func:`total_peak`) is at
    most ``budget`` bytes, optimal at a resolution of ``budget / slots`` bytes; None if none
    fits at that resolution (:func:`min_peak` gives the exact minimum). ``recompute``: whether
    it may recompute (otherwise only each stage's storage mode is chosen).

    Costs are rounded down to whole slots first: every schedule that fits in exact bytes then
    fits in slots too, so when the schedule found also fits in exact bytes it is the exact
    optimum. While it overshoots, the programme runs again on the budget less the overshoot;
    rounding every cost up instead (always fitting, losing up to one slot per stage) is the
    last resort."""
    if budget < 0:
        return None
    target = float(budget)
    for _ in range(6):
        blocks = _solve(c, target, slots, recompute, math.floor)
        if blocks is None:  # not even the relaxation fits
            return None
        over = total_peak(blocks, c) - budget
        if over <= 0:
            return blocks
        target -= over + budget / max(slots, 1)
        if target <= 0:
            break
    return _solve(c, budget, slots, recompute, math.ceil)


def _solve(c: Costs, budget: float, slots: int, recompute: bool, rounding: Any) -> Optional[List[Block]]:
    """:func:`solve` at one budget, with each cost rounded to slots by ``rounding``."""
    n, M = c.length, (int(slots) if budget > 0 else 0)
    unit = budget / M if M else 1.0  # budget 0: only schedules that hold nothing
    inf = math.inf
    modes = c.modes
    kinds = modes + [RECOMPUTE]
    K, R = len(kinds), len(modes)  # kind index R is "recompute"

    def units(nbytes: int) -> int:
        if nbytes <= 0:
            return 0
        if rounding is math.ceil:
            return int(math.ceil(nbytes / unit - 1e-9))
        return max(int(math.floor(nbytes / unit + 1e-9)), 0)

    def shift(a: np.ndarray, d: int) -> np.ndarray:  # r[m] = a[m - d] (inf below d)
        r = np.empty(a.shape)
        d = min(d, M + 1)
        r[..., :d] = inf
        r[..., d:] = a[..., :M + 1 - d]
        return r

    slots_m = np.arange(M + 1)

    def shift_rows(a: np.ndarray, d: np.ndarray) -> np.ndarray:  # r[s, m] = a[s, m - d[s]] (inf below)
        idx = slots_m[None, :] - d[:, None]
        return np.where(idx >= 0, np.take_along_axis(a, np.maximum(idx, 0), axis=1), np.float32(inf))

    nm = len(modes)
    internal = np.array([[units(c.internal[i][m]) for m in modes] for i in range(n)], dtype=np.int64)
    spike = np.array([[units(c.spike[i][m]) for m in modes] for i in range(n)], dtype=np.int64)
    step = np.array([[c.fwd[i][m] + c.bwd[i][m] for m in modes] for i in range(n)])
    # bnd[i, a, b]: slots of a[i] between plain mode a and the next kind b
    bnd = np.array([[[units(boundary(c, i, m, kinds[b])) if i + 1 < n else 0 for b in range(K)] for m in modes]
                    for i in range(n)], dtype=np.int64)
    bnd_end = np.array([[units(boundary(c, i, m, END)) for m in modes] for i in range(n)], dtype=np.int64)
    aft = np.array([[units(after_recompute(c, k, kinds[b])) if k + 1 < n else 0 for b in range(K)] for k in range(n)],
                   dtype=np.int64)
    prefix = np.concatenate([[0.0], np.cumsum([c.rerun[i] for i in range(n)])]).astype(np.float32)
    # by interval length d, all starts s at once (intervals of one length do not depend on each
    # other): opt[d][s, kind, m] is the fastest schedule of s..s+d starting with kind within m slots
    opt: List[np.ndarray] = []
    # float32: seconds to 7 digits are plenty to rank schedules, and half the memory traffic
    best = np.empty((n, n, M + 1), dtype=np.float32)  # best[s, t]: min over kinds (only t >= s is used)
    after = np.empty((n + 1, n, M + 1), dtype=np.float32)  # after[u, t]: u..t after a recomputation ending at u - 1
    # only minima here: which choice reached one is found again when the schedule is built
    # (for the few entries it visits), not stored for every entry
    for d in range(n):
        S = n - d
        s_idx = np.arange(S)
        o = np.full((S, K, M + 1), inf, dtype=np.float32)
        for mi in range(nm):
            if d == 0:
                o[:, mi] = np.where(slots_m[None, :] >= np.maximum(spike[:, mi], internal[:, mi] + bnd_end[:, mi])[:, None],
                                    step[:, mi, None], inf)
                continue
            prev = opt[d - 1][1:]  # (s + 1 .. s + d) for every s
            cands = np.stack([shift_rows(prev[:, b], internal[:S, mi] + bnd[:S, mi, b]) for b in range(K)])
            o[:, mi] = cands.min(axis=0) + step[:S, mi, None]
            o[:, mi][slots_m[None, :] < spike[:S, mi, None]] = inf
        if d > 0 and recompute:
            j = np.arange(d)[:, None]
            s_ = s_idx[None, :]
            cands = ((prefix[s_ + j + 1] - prefix[s_])[..., None] + after[s_ + j + 1, s_ + d] + best[s_, s_ + j])
            o[:, R] = cands.min(axis=0)
        opt.append(o)
        best[s_idx, s_idx + d] = o.min(axis=1)
        if S > 1:  # after[u, t] for u >= 1
            u = s_idx[1:]
            after[u, u + d] = np.min([shift_rows(o[1:, b], aft[u - 1, b]) for b in range(K)], axis=0)
    top = np.stack([shift(opt[n - 1][0, b], units(_top(c, kinds[b]))) for b in range(K)])
    first = int(np.argmin(top[:, M]))
    if not np.isfinite(top[first, M]):
        return None

    def build(s: int, t: int, kind: int, m: int) -> List[Block]:
        d = t - s
        if kind < R:
            mode = modes[kind]
            if s == t:
                return [Plain(s, mode)]
            cost = [int(internal[s, kind] + bnd[s, kind, b]) for b in range(K)]
            b = int(np.argmin([opt[d - 1][s + 1, b, m - cost[b]] if cost[b] <= m else inf for b in range(K)]))
            return [Plain(s, mode)] + build(s + 1, t, b, m - cost[b])
        vals = [prefix[s + j + 1] - prefix[s] + after[s + j + 1, t, m] + best[s, s + j, m] for j in range(d)]
        k = s + int(np.argmin(vals))
        inner_kind = int(np.argmin(opt[k - s][s, :, m]))
        rest = int(np.argmin([opt[t - k - 1][k + 1, b, m - aft[k, b]] if aft[k, b] <= m else inf for b in range(K)]))
        return [Recompute(s, k, tuple(build(s, k, inner_kind, m)))] + build(k + 1, t, rest, m - int(aft[k, rest]))

    return build(0, n - 1, first, M - units(_top(c, kinds[first])))


# ---- serialisation ---------------------------------------------------------------------
def to_json(blocks: Sequence[Block]) -> List[Any]:
    return [["plain", b.stage, b.mode] if isinstance(b, Plain) else ["recompute", b.start, b.end, to_json(b.inner)]
            for b in blocks]


def from_json(data: Sequence[Any]) -> List[Block]:
    out: List[Block] = []
    for item in data:
        if item[0] == "plain":
            out.append(Plain(int(item[1]), str(item[2])))
        elif item[0] == "recompute":
            out.append(Recompute(int(item[1]), int(item[2]), tuple(from_json(item[3]))))
        else:
            raise ValueError(f"not a schedule block: {item!r}")
    return out


def stages_of(blocks: Sequence[Block]) -> List[int]:
    """The stages a schedule covers, in order (each exactly once in a valid schedule)."""
    out: List[int] = []
    for b in blocks:
        if isinstance(b, Plain):
            out.append(b.stage)
        else:
            inner = stages_of(b.inner)
            if inner != list(range(b.start, b.end + 1)):
                raise ValueError(f"a recompute block of stages {b.start}..{b.end} schedules stages {inner}")
            out.extend(inner)
    return out
