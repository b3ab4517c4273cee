"""Transactions over compression state: a step's changes are kept only when the step counts.

Error feedback, EF21, DGC's momentum, PowerSGD's warm starts and every compressor's step
counter change as a step is compressed. A step whose exchange fails halfway, or whose averaged
result is not finite (the step a loss scaler skips), must leave all of that as it was, on every
rank. So the collectives run each step inside a :class:`Transaction`:

- every change of per-key state is announced first (:func:`replace`), and the transaction
  remembers the value it replaces (a reference: nothing is copied);
- a state tensor that would be updated in place is written into a second buffer instead (the
  same memory passes: ``out = old + g`` reads and writes what ``old += g`` does), so the old
  one stays intact until the transaction ends; the two buffers then alternate, no allocation
  in the steady state;
- :meth:`Transaction.commit` keeps the changes, :meth:`Transaction.rollback` restores every
  remembered value;
- whether the step counts is decided on the device: :meth:`Transaction.observe` keeps each
  result's extremes there and :meth:`Transaction.flag` the validity checks of received
  payloads, and :attr:`Transaction.finite` / :attr:`Transaction.problems` read all of them at
  once, when the owner ends the transaction (one host sync per step, not one per bucket);
  what else the owner must learn from the device that step rides along
  (:meth:`Transaction.read_with`), and may undo the changes of some keys then
  (:meth:`Transaction.rollback_keys`).

Without an open transaction (a compressor or ``ErrorFeedback`` used on its own) changes apply
at once, as they always did. A transaction is open in the current context
(``contextvars``): the collectives open one per call, the training runtime one per iteration
(all its buckets), and an inner one joins the outer (:func:`step`).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Dict, Iterator, List, MutableMapping, Optional, Sequence, Tuple

import torch

# what combines vouched for (see vouch), by the tensor's data pointer: (tensor, version, witness)
Vouched = Dict[int, List[Tuple[torch.Tensor, int, torch.Tensor]]]

_MISSING = object()
_current: contextvars.ContextVar[Optional["Transaction"]] = contextvars.ContextVar("gradcomp_transaction",
                                                                                  default=None)
_deferred: contextvars.ContextVar[Optional[List[Tuple[torch.Tensor, str]]]] = contextvars.ContextVar(
    "gradcomp_deferred_refusals", default=None)


class Transaction:
    """The state changes of one step; undone together by :meth:`rollback` unless committed."""

    def __init__(self) -> None:
        self._undo: List[Tuple[MutableMapping, Any, Any, Optional[Dict]]] = []
        self._seen: Dict[Tuple[int, Any], bool] = {}
        self._witnesses: List[torch.Tensor] = []  # device scalars: each observed result's min and max
        self._flags: List[Tuple[torch.Tensor, Callable[[List[int]], str]]] = []  # device flags, what they mean
        # results whose witness their combine computed on the way (see vouch), by data pointer:
        # the tensor (held, so its memory is not reused while this lives), its version then, the
        # witness
        self._vouched: Vouched = {}
        # device tensors of ints read with the step's read and handed to their receivers (read_with)
        self._riders: List[Tuple[torch.Tensor, Callable[[List[int]], None]]] = []
        self._verdict: Optional[Tuple[bool, List[str]]] = None
        self.failed = False  # an exchange of this step raised

    def remember(self, mapping: MutableMapping, key: Any, spares: Optional[Dict] = None) -> bool:
        """Remember ``mapping[key]`` (or its absence) before its first change in this
        transaction; True the first time. ``spares``: where the buffer that is no longer needed
        when the transaction ends (the old one on commit, the new one on rollback) is kept for
        reuse."""
        ident = (id(mapping), key)
        if ident in self._seen:
            return False
        self._seen[ident] = True
        self._undo.append((mapping, key, mapping.get(key, _MISSING), spares))
        return True

    def observe(self, results: Any) -> None:
        """Note whether every tensor in ``results`` (a tensor or a list of them) is finite,
        without reading anything back: the witnesses stay on the tensors' device until
        :attr:`finite` is read, once for the whole transaction (one host sync per iteration on
        the GPU, however many buckets it has)."""
        self._witnesses += _witnesses(results, self._vouched)
        self._verdict = None

    def flag(self, bad: torch.Tensor, problem: Callable[[List[int]], str]) -> None:
        """Note a device tensor of ints (``bad``; any non-zero element makes the step invalid),
        read together with the finiteness witnesses: :attr:`problems` then holds
        ``problem(values)`` (the flag's values as a list), e.g. which rank sent a payload whose
        indices are out of range. Nothing is read now."""
        self._flags.append((bad.reshape(-1), problem))
        self._verdict = None

    def read_with(self, values: torch.Tensor, receive: Callable[[List[int]], None]) -> None:
        """Read ``values`` (a device tensor of ints) with the step's one host read (the
        finiteness witnesses and the flags) and hand them to ``receive`` as a list. It runs at
        that read, before the transaction is committed or rolled back, and may undo part of it
        (:meth:`rollback_keys`); the values decide nothing about the step. Nothing is read now."""
        self._riders.append((values.reshape(-1), receive))
        self._verdict = None

    def rollback_keys(self, owned: Callable[[Any], bool]) -> None:
        """Undo now every change of an entry whose key ``owned`` accepts, as :meth:`rollback`
        would; the others stay, to be committed or rolled back with the transaction."""
        kept = []
        for entry in reversed(self._undo):
            if owned(entry[1]):
                self._restore(*entry)
                self._seen.pop((id(entry[0]), entry[1]), None)
            else:
                kept.append(entry)
        self._undo = kept[::-1]

    def flagged(self) -> Optional[torch.Tensor]:
        """A 0-d bool device tensor, true when any flag noted so far is set (nothing read), or
        None when there are none: for an owner that reduces it over ranks with its own flags."""
        if not self._flags:
            return None
        here = self._flags[0][0].device
        return torch.cat([f.ne(0).reshape(-1) if f.device == here else f.ne(0).reshape(-1).to(here)
                          for f, _ in self._flags]).any()

    def nonfinite(self, device: torch.device) -> torch.Tensor:
        """A float64 0-d tensor, 1.0 when some result observed so far is not finite (nothing
        read; on the witnesses' device, ``device`` when there are none): for an owner that
        reduces it over ranks with its own flags."""
        return _any_nonfinite(self._witnesses, device)

    @property
    def finite(self) -> bool:
        """Whether every result observed so far is finite (one host read of every witness and
        flag noted since the last read)."""
        return self._settle()[0]

    @property
    def problems(self) -> List[str]:
        """What the non-zero flags (:meth:`flag`) say; empty when every flag is zero."""
        return self._settle()[1]

    def _settle(self) -> Tuple[bool, List[str]]:
        if self._verdict is None:
            riders, self._riders = self._riders, []
            finite, problems, values = _read(self._witnesses, self._flags, [r for r, _ in riders])
            self._verdict = (finite, problems)
            for (_, receive), got in zip(riders, values):
                receive(got)
        return self._verdict

    def commit(self) -> None:
        for mapping, key, old, spares in self._undo:
            if spares is not None and isinstance(old, torch.Tensor) and mapping.get(key) is not old:
                spares[key] = old
        self._clear()

    def rollback(self) -> None:
        for entry in reversed(self._undo):
            self._restore(*entry)
        self._clear()

    @staticmethod
    def _restore(mapping: MutableMapping, key: Any, old: Any, spares: Optional[Dict]) -> None:
        new = mapping.get(key, _MISSING)
        if spares is not None and isinstance(new, torch.Tensor) and new is not old:
            spares[key] = new
        if old is _MISSING:
            mapping.pop(key, None)
        else:
            mapping[key] = old

    def _clear(self) -> None:
        self._undo.clear()
        self._seen.clear()
        self._witnesses, self._flags, self._verdict, self._vouched, self._riders = [], [], None, {}, []
        self.failed = False

    @contextlib.contextmanager
    def active(self) -> Iterator["Transaction"]:
        """Make this the open transaction of the current context while the block runs."""
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)


def current() -> Optional[Transaction]:
    """The transaction open in this context, or None."""
    return _current.get()


def refuse(bad: torch.Tensor, problem: str) -> None:
    """A bad input found on the device (``bad``: a bool tensor, true when ``problem`` holds).

    In a collective's local phase (:func:`deferring`) it is collected, and the collective
    tells every rank (:class:`Deferred`); elsewhere inside a transaction it is a flag, read
    with the step's finiteness, which then undoes the step and raises ``problem``; outside
    both, a ``ValueError`` at once (one host read)."""
    collected = _deferred.get()
    if collected is not None:
        collected.append((bad.reshape(-1).any().reshape(1), problem))
        return
    txn = _current.get()
    if txn is not None:
        txn.flag(bad, _saying(problem))
    elif bool(bad.any()):
        raise ValueError(problem)


class Deferred(ValueError):
    """The refusals of a collective's local phase (:func:`deferring`), not read yet: in place
    of the error the local phase would have raised. A checked exchange reads them at once
    (:meth:`resolve`: one host read before its header); an agreed one writes :meth:`bad` into
    this rank's status word on the device, so every rank flags the failure, and hands the
    problems to the transaction (:meth:`flag_into`), so this rank says which it was."""

    def __init__(self, refusals: List[Tuple[torch.Tensor, str]]) -> None:
        super().__init__("; ".join(p for _, p in refusals))
        self.refusals = refusals

    def bad(self) -> torch.Tensor:
        """A 1-element bool tensor on the refusals' device: some refusal holds."""
        return torch.cat([b for b, _ in self.refusals]).any().reshape(1)

    def resolve(self) -> Optional[ValueError]:
        """The error to raise (the refusals that hold), or None: one host read."""
        held = torch.cat([b for b, _ in self.refusals]).tolist()
        problems = [p for (_, p), h in zip(self.refusals, held) if h]
        return ValueError("; ".join(problems)) if problems else None

    def flag_into(self, txn: Transaction) -> None:
        for bad, problem in self.refusals:
            txn.flag(bad, _saying(problem))


def _saying(problem: str) -> Callable[[List[int]], str]:
    return lambda _: problem


def resolve(error: Optional[BaseException]) -> Optional[BaseException]:
    """``error`` as a checked exchange reports it: a :class:`Deferred` read now."""
    return error.resolve() if isinstance(error, Deferred) else error


@contextlib.contextmanager
def deferring() -> Iterator[List[Tuple[torch.Tensor, str]]]:
    """Collect the block's refusals (:func:`refuse`) instead of flagging or raising them: a
    collective's local phase, whose failures must reach the other ranks."""
    collected: List[Tuple[torch.Tensor, str]] = []
    token = _deferred.set(collected)
    try:
        yield collected
    finally:
        _deferred.reset(token)


def replace(mapping: MutableMapping, key: Any, spares: Optional[Dict] = None) -> bool:
    """Announce a change of ``mapping[key]``: remembered by the open transaction, if any. True
    when the current value must not be changed in place (a transaction is open and this is
    its first change of that entry): write a new buffer (see :func:`buffer_for`) instead."""
    txn = _current.get()
    return txn is not None and txn.remember(mapping, key, spares)


def writable(mapping: MutableMapping, key: Any, spares: Dict) -> torch.Tensor:
    """``mapping[key]``, a state tensor about to be updated in place, made safe for it: inside a
    transaction, the first time, a second buffer of the same shape, dtype and device (from
    ``spares`` when one fits) takes its place and the old one is remembered. The caller writes
    the whole new value into the returned buffer (``torch.add(old, g, out=buf)``), reading the
    old value from the tensor it held before the call."""
    old = mapping[key]
    if not replace(mapping, key, spares):
        return old
    buf = spares.pop(key, None)
    if buf is None or buf.shape != old.shape or buf.dtype != old.dtype or buf.device != old.device \
            or not buf.is_contiguous():
        from gradcomp.kernels.memory import empty  # numpy-backed on CPU: cheap to fault in

        buf = empty(old.numel(), old.dtype, old.device).view(old.shape)
    mapping[key] = buf
    return buf


class Step:
    """What a collective's :func:`step` block sees: ``observe(results)`` checks the results it
    returns when the step owns its transaction; a joined transaction's owner checks its own
    results (which contain these), so nothing is checked twice."""

    def __init__(self, txn: Transaction, owned: bool) -> None:
        self.txn, self.owned = txn, owned

    def observe(self, results: Any) -> None:
        if self.owned:
            self.txn.observe(results)


@contextlib.contextmanager
def step() -> Iterator[Step]:
    """A collective's step: join the open transaction, or open one that ends with the block —
    committed when the block finishes and every observed result is finite, rolled back when a
    result is not finite or the block raises. A joined transaction is told of a failure
    (``failed``) and left to its owner to end."""
    outer = _current.get()
    if outer is not None:
        try:
            yield Step(outer, owned=False)
        except BaseException:
            outer.failed = True
            raise
        return
    txn = Transaction()
    with txn.active():
        try:
            yield Step(txn, owned=True)
        except BaseException:
            txn.rollback()
            raise
    problems = txn.problems
    if txn.finite and not problems:
        txn.commit()
    else:
        txn.rollback()
    if problems:
        raise ValueError("; ".join(problems))


def vouch(t: torch.Tensor, witness: torch.Tensor) -> None:
    """Tell the open transaction (if any) that ``witness`` (a float64 device tensor, finite
    exactly when every element of ``t`` is) is ``t``'s: a combine that learnt it on its way
    (e.g. from the few values a sign mean is made of) spares :meth:`Transaction.observe` its
    pass over ``t``. It holds while ``t``'s version counter stands: an in-place change of
    ``t`` or a view of it voids it. Observing any tensor over exactly ``t``'s memory uses it."""
    txn = _current.get()
    if txn is not None and t.is_contiguous() and t.numel():
        txn._vouched.setdefault(t.data_ptr(), []).append((t, t._version, witness))


def vouch_finite(t: torch.Tensor) -> None:
    """:func:`vouch` that ``t`` (a CPU tensor whose every element its combine saw) is finite."""
    vouch(t, torch.zeros(1, dtype=torch.float64, device=t.device))


def _vouched_for(t: torch.Tensor, vouched: Vouched) -> Optional[torch.Tensor]:
    if not vouched or not t.is_contiguous():
        return None
    for v, version, witness in vouched.get(t.data_ptr(), ()):
        if (v.data_ptr() == t.data_ptr() and v.dtype == t.dtype and v.numel() == t.numel()
                and v._version == version):
            return witness
    return None


# tensors up to this many elements share one aminmax over their concatenation: what they cost
# is the call, not the pass (a bucket's biases and norm weights: ~100 calls fewer per iteration)
SMALL_WITNESS = 1 << 16


def _witnesses(results: Any, vouched: Optional[Vouched] = None) -> List[torch.Tensor]:
    """Minima and maxima, in float64, on the tensors' device: all of them are finite exactly
    when every element of every floating-point tensor is (a NaN propagates, an infinity is an
    extreme, and no sum can overflow). One read-only pass per tensor, small tensors of one
    device and dtype taken together; or what a combine vouched for (see :func:`vouch`)."""
    tensors = [results] if isinstance(results, torch.Tensor) else list(results)
    out = []
    small: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for t in tensors:
        if t is not None and t.numel() and t.is_floating_point():
            t = t.detach()
            known = _vouched_for(t, vouched) if vouched else None
            if known is not None:
                out.append(known)
            elif t.numel() <= SMALL_WITNESS:
                small.setdefault((t.device, t.dtype), []).append(t.reshape(-1))
            else:
                lo, hi = torch.aminmax(t.reshape(-1))
                out.append(torch.stack([lo, hi]).double())
    for group in small.values():
        lo, hi = torch.aminmax(group[0] if len(group) == 1 else torch.cat(group))
        out.append(torch.stack([lo, hi]).double())
    return out


def nonfinite(results: Any, device: Optional[torch.device] = None) -> torch.Tensor:
    """A float64 0-d tensor on the results' device (``device`` when there are none): 1.0 when
    some element of ``results`` is not finite, else 0.0 — nothing is read back, so it can be
    reduced over ranks on the device and read once with other flags."""
    return _any_nonfinite(_witnesses(results), device)


def _any_nonfinite(ws: List[torch.Tensor], device: Optional[torch.device]) -> torch.Tensor:
    """1.0 (float64, 0-d, on the first witness's device; ``device`` when there are none) when a
    witness is not finite, else 0.0; nothing read."""
    if not ws:
        return torch.zeros((), dtype=torch.float64, device=device)
    here = ws[0].device
    return (~torch.isfinite(torch.cat([w if w.device == here else w.to(here) for w in ws])).all()).double()


def _read(witnesses: List[torch.Tensor], flags: List[Tuple[torch.Tensor, Callable[[List[int]], str]]],
          riders: Sequence[torch.Tensor] = ()) -> Tuple[bool, List[str], List[List[int]]]:
    """Finiteness of every witness, the values of every flag and those of every rider (see
    :meth:`Transaction.read_with`), in one host read per device."""
    finite, problems = True, []
    by_device: Dict[torch.device, List[torch.Tensor]] = {}
    for w in witnesses:
        by_device.setdefault(w.device, []).append(w)
    for t in [*(f for f, _ in flags), *riders]:
        by_device.setdefault(t.device, [])
    got: Dict[int, List[int]] = {}
    for device, ws in by_device.items():
        fl = [f for f, _ in flags if f.device == device]
        mine_riders = [i for i, r in enumerate(riders) if r.device == device]
        parts = ([torch.isfinite(torch.cat(ws)).all().reshape(1).long()] if ws else []) + [f.long() for f in fl] \
            + [riders[i].long() for i in mine_riders]
        values = torch.cat(parts).tolist()  # the step's one host read on this device
        if ws:
            finite = finite and bool(values[0])
            values = values[1:]
        for f, problem in ((f, p) for f, p in flags if f.device == device):
            mine, values = values[:f.numel()], values[f.numel():]
            if any(mine):
                problems.append(problem(mine))
        for i in mine_riders:
            got[i], values = values[:riders[i].numel()], values[riders[i].numel():]
    return finite, problems, [got[i] for i in range(len(riders))]


def all_finite(results: Any) -> bool:
    """Whether every tensor in ``results`` (a tensor, or a list or tuple of them) is finite.

    One read-only pass: each tensor's dot product with itself (vectorised, ~4 ms per 100 MB of
    fp32 on one core; a 16-bit tensor's sum), all added into one number that is finite only if
    every element is; a single sync, and an exact check only when it is not (an element is
    non-finite, or a sum of squares overflowed)."""
    tensors = [results] if isinstance(results, torch.Tensor) else list(results)
    tensors = [t.detach().reshape(-1) for t in tensors if t is not None and t.numel() and t.is_floating_point()]
    if not tensors:
        return True
    quick = [torch.dot(t, t) if t.dtype in (torch.float32, torch.float64) else t.sum() for t in tensors]
    total = quick[0].double() if len(quick) == 1 else torch.stack([q.double() for q in quick]).sum()
    if bool(torch.isfinite(total)):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)
