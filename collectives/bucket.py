"""Buckets: many tensors exchanged together, in two ways.

``allreduce_buckets`` packs named tensors into flat buckets and compresses each bucket as one
tensor; ``exchange_bucket`` (what the DDP hook and ``CompressedOptimizer`` send) compresses
every tensor of a bucket on its own and shares the exchanges (see its docstring).

Packed buckets:

Small tensors cost a header and a latency each; fused, they cost one per bucket. Buckets hold
tensors of one dtype and device, in the given order, up to ``bucket_mb`` (a larger tensor
gets a bucket of its own). Error feedback stays per tensor name: each tensor's residual is
added before fusing and its share of the bucket's error is kept under its own name, so the
state survives any change of bucket layout (and matches an unbucketed run). Compressor state
(step counters, warm starts, the scatter-reduce server residual) is kept per bucket key,
``"{key_prefix}bucket:{first}..{last}#{hash}"``, which changes when the layout changes.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from functools import partial
import time
from typing import (Any, Callable, Dict, Generator, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple,
                    Union)

import torch

from gradcomp.compress import EF21, Compressor, Payload, transaction
from gradcomp.compress.cast import CastCompressor

from . import worker
from ._comm import Beside, Comm
from .reduction import flat_job, make_spec
from .wire.header import h64
from ._telemetry import Record, commit, measure_error_default
from .fused import exchange_prepared
from .fused import prepare as prepare_fused

Tensors = Union[Mapping[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]]]


def plan_buckets(tensors: Sequence[Tuple[str, torch.Tensor]], bucket_mb: float, *,
                 bytes_per_element: Optional[int] = None) -> List[List[int]]:
    """Indices of ``tensors`` per bucket: grouped by (device, dtype) in order of first
    appearance, filled in order up to ``bucket_mb`` megabytes (2**20 bytes); a tensor larger
    than that is a bucket alone. ``bytes_per_element`` counts every element as that many bytes
    (None: the tensor's own element size)."""
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
        raise ValueError(f"bucket_mb={bucket_mb!r} must be a number > 0")
    cap = bucket_mb * 2**20
    kinds: Dict[Tuple[str, torch.dtype], List[int]] = {}
    for i, (_, t) in enumerate(tensors):
        kinds.setdefault((str(t.device), t.dtype), []).append(i)
    buckets: List[List[int]] = []
    for members in kinds.values():
        current: List[int] = []
        size = 0
        for i in members:
            t = tensors[i][1]
            nbytes = t.numel() * (t.element_size() if bytes_per_element is None else bytes_per_element)
            if current and size + nbytes > cap:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            buckets.append(current)
    return buckets


class _PerName:
    """Presents per-name error feedback as feedback over one flat bucket."""

    def __init__(self, feedback: Any, names: List[str], shapes: List[torch.Size]) -> None:
        self.compressor = self.base = feedback.compressor
        self.kind = getattr(feedback, "kind", "ef")
        self.fb, self.names, self.shapes = feedback, names, shapes
        self.numels = [s.numel() for s in shapes]

    def _pieces(self, flat: torch.Tensor):
        # empty tensors are skipped, as an allreduce of an empty tensor leaves feedback alone
        return [(n, s, p) for n, s, p in zip(self.names, self.shapes, flat.reshape(-1).split(self.numels)) if p.numel()]

    def accumulate(self, flat, key):
        return torch.cat([self.fb.accumulate(p.view(s), n).reshape(-1) for n, s, p in self._pieces(flat)])

    def update(self, key, acc, sent):
        for (n, s, a), (_, _, b) in zip(self._pieces(acc), self._pieces(sent)):
            self.fb.update(n, a.view(s), b.view(s))

    def keeps_residual_in_place(self, tensor) -> bool:
        return False  # each piece keeps its own residual under its own name

    def accumulate_in_place(self, tensor, key):
        raise ValueError("a bucket's per-name feedback keeps no residual in place")

    def combine(self, key, avg):
        return torch.cat([self.fb.combine(n, p.view(s)).reshape(-1) for n, s, p in self._pieces(avg)])


def _bucket_job(items: List[Tuple[str, torch.Tensor]], spec, key: str, group, twin) -> Dict[str, torch.Tensor]:
    names = [n for n, _ in items]
    shapes = [t.shape for _, t in items]
    flat = torch.cat([t.detach().reshape(-1) for _, t in items])
    if spec.feedback is not None:
        spec = replace(spec, feedback=_PerName(spec.feedback, names, shapes))
    out = flat_job(flat, spec, key, twin(group))
    return {n: piece.view(s) for n, s, piece in zip(names, shapes, out.split([s.numel() for s in shapes]))}


def allreduce_buckets(tensors: Tensors, compressor: Any = "none", *, bucket_mb: float = 25.0, group=None,
                      async_op: bool = False, algorithm: Optional[str] = None, key_prefix: str = "",
                      measure_error: Optional[bool] = None):
    """The mean over ``group`` of every named tensor, one compressed allreduce per bucket.

    ``tensors``: a mapping or ``(name, tensor)`` pairs, in the same order on every rank.
    Returns ``{name: mean}`` (new tensors; inputs untouched), or with ``async_op=True`` a
    ``torch.futures.Future`` of it. ``compressor`` and the other options as in ``allreduce``.
    """
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise ValueError("allreduce_buckets: tensor names must be unique")
    for n, t in items:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"allreduce_buckets: {n!r} is a {type(t).__name__}, not a torch.Tensor")
    spec = make_spec(compressor, algorithm, measure_error, False)
    if spec.feedback is not None:
        spec.desc = f"per-name {spec.desc}"
    futures = []
    for bucket in plan_buckets(items, bucket_mb):
        members = [items[i] for i in bucket]
        layout = ";".join(f"{n}:{tuple(t.shape)}" for n, t in members)
        key = f"{key_prefix}bucket:{members[0][0]}..{members[-1][0]}#{h64(layout) & 0xFFFFFFFF:08x}"
        inputs = [t for _, t in members]  # one device per bucket (plan_buckets)
        futures.append(worker.submit(partial(_bucket_job, members, spec, key, group), (group,), async_op,
                                     device=inputs[0].device, inputs=inputs))
    if async_op:
        return worker.all_of(futures, lambda parts: _merge(names, parts), devices=[t.device for _, t in items])
    return _merge(names, futures)


def _merge(names: List[str], parts: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    merged: Dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return {n: merged[n] for n in names}


# ---- one bucket, every tensor compressed on its own ----------------------------------------
Item = Tuple[str, torch.Tensor, Any]  # (key, tensor, codec: compressor, error-feedback wrapper, or None for dense)
# a round generator: yields what is averaged over the ranks, is sent the average, returns the result
Rounds = Generator[torch.Tensor, torch.Tensor, torch.Tensor]


def exchange_bucket(items: Sequence[Item], group, world: int, *, buffer: Optional[torch.Tensor] = None,
                    label: str = "?", observe: bool = True, layouts: Optional[dict] = None) -> List[torch.Tensor]:
    """The mean over ``group`` of every tensor in ``items`` (``(key, tensor, codec)``, the same
    order on every rank), in order (new tensors, or views of ``buffer``).

    Each gradient comes with its route: dense (None), a *summable* codec (its payload may be
    averaged element-wise as it is: native ones such as fp16, bf16, random-k, and multi-round
    PowerSGD, whose factors are averaged), or any other codec. Everything summable travels in
    lockstep: in each round, what every gradient needs averaged is concatenated per dtype into one
    flat tensor and allreduced once. A bucket of dense gradients and PowerSGD matrices thus costs
    one allreduce for the dense part and all P factors together and one for all Q factors, and no
    header. The other codecs (payloads whose size or meaning differ between ranks) follow, all in
    one ``allreduce_fused`` (``allgather`` on two ranks, ``scatter-reduce`` on more):
    each exchange is made once for the bucket, each payload still its own parameter's.

    A DDP bucket that is all dense, or all sent through one 16-bit cast, is averaged as a whole
    instead, in place, as DDP's own allreduce and PyTorch's fp16/bf16 hooks do (the same bits).

    Compression, error feedback and warm starts are per gradient, keyed by its parameter name,
    so the result does not depend on how the bucket is laid out. Every rank makes the same
    collectives in the same order: the rounds of a codec depend only on the tensor shapes.

    ``buffer``: a flat tensor whose consecutive views the gradients are (a DDP bucket); when
    every gradient is dense, or every one goes through the same 16-bit cast, the bucket is
    averaged as a whole (see :func:`_whole`); otherwise the compressed gradients' means are
    written into the gradients themselves where the algorithm can (``allreduce_fused``'s
    ``into``), which saves a result's allocation and the hook's copy back. ``observe``: tell the open state transaction
    (``gradcomp.compress.transaction``) whether every mean is finite, from the cheapest
    tensors that decide it (the same on every rank of ``group``). ``layouts``: the caller's
    agreed layouts (see ``allreduce_fused``), for a caller that has made the ranks agree on
    the bucket. It is :class:`BucketExchange`'s ``prepare()``, ``start()`` and ``finish()``
    in a row, under the transaction open here.
    """
    exchange = BucketExchange(items, group, world, buffer=buffer, label=label, layouts=layouts,
                              txn=transaction.current(), observe=observe)
    exchange.prepare()
    return exchange.finish(exchange.start())


class Work(NamedTuple):
    """A started :class:`BucketExchange`: every mean in order (``out``), and the compressed
    items' indices (``rest``), whose finiteness :meth:`BucketExchange.finish` reports."""

    out: List[torch.Tensor]
    rest: List[int]


class BucketExchange:
    """One bucket's exchange (:func:`exchange_bucket`) as an object a caller drives in phases:

    - :meth:`prepare`: the local phase (no communication, no host read): error feedback
      accumulates, every compressed gradient is compressed, PowerSGD computes its first
      factors. It may run early — the training runtime's worker runs it while the bucket
      before this one is on the wire — and runs once: a failure is kept and raised again by
      every later call, so it is raised where the local phase would have raised;
    - :meth:`start`: every collective, in the same order on every rank whether or not the
      bucket was prepared early (so the ranks need not prepare alike); ``beside``, the caller's
      local work (the next bucket's :meth:`prepare`), runs once while its largest exchange is
      on the wire;
    - :meth:`finish`: the means, in order (their finiteness told to the transaction).

    The bucket is split once, here: the dense and summable items go in lockstep
    (:class:`Lockstep`), the other compressed ones in one fused exchange (one allreduce each
    when errors are measured); a bucket averaged whole (:func:`_whole_applies`) has no local
    phase. ``txn``: the transaction the bucket belongs to (each phase runs with it open: the
    codecs record their state changes in the open one); ``observe``: tell it whether every mean
    is finite. The other arguments are :func:`exchange_bucket`'s; the results are its bits."""

    def __init__(self, items: Sequence[Item], group, world: int, *, buffer: Optional[torch.Tensor] = None,
                 label: str = "?", layouts: Optional[dict] = None, txn: Optional[Any] = None,
                 observe: bool = True) -> None:
        self.items = list(items)
        self.group, self.world, self.buffer, self.label, self.layouts = group, world, buffer, label, layouts
        self.txn, self.observe = txn, observe
        self.whole = _whole_applies(self.items, buffer)
        # the compressed payloads share one exchange, unless errors are measured (allreduce does that per tensor)
        self.fused = not measure_error_default() and any(c is not None and not _summable(c) for _, _, c in self.items)
        self.lockstep: Optional[Lockstep] = None
        self.prepared: Any = None  # the fused items after their local phase (fused.Prepared)
        self.ahead = False  # whether the local phase ran ahead (prepare(ahead=True): the worker's look-ahead)
        self.on_wire = False  # whether start() is running (what the bucket after it sees)
        self._done = False
        self._error: Optional[BaseException] = None

    def _open(self):
        return self.txn.active() if self.txn is not None else nullcontext()

    def prepare(self, *, ahead: bool = False) -> None:
        """The local phase (see the class docstring); a no-op once done. ``ahead``: it runs
        early, beside the bucket before this one (the worker's look-ahead; kept in ``ahead``)."""
        if self._done:
            if self._error is not None:
                raise self._error
            return
        self._done = True
        if self.whole:
            return
        self.ahead = ahead
        try:
            with self._open():
                lock = self.lockstep = Lockstep.start(self.items, self.world, self.label)
                rest = [item for i, item in enumerate(self.items) if lock is None or i not in lock.gens]
                if rest and self.fused:
                    self.prepared = prepare_fused(rest, self.group, into=self.buffer is not None,
                                                  layouts=self.layouts)
        except Exception as exc:
            self._error = exc
            raise

    def start(self, beside: Optional[Callable[[], None]] = None) -> Work:
        """Every collective (after :meth:`prepare`, when it has not run); ``beside`` runs once
        while the largest exchange is on the wire: the compressed payloads' when there are any,
        else the lockstep's (PowerSGD's factors, the dense part), from ``_OVERLAP_MIN_BYTES``
        per rank (not a header, a status word or a size vector, which take a round trip and no
        bandwidth). A bucket averaged whole runs it not."""
        self.prepare()
        txn = self.txn if self.observe else None
        items, n = self.items, len(self.items)
        self.on_wire = True
        try:
            with self._open():
                if self.whole:
                    whole = _exchange_whole(items, self.buffer, self.group, self.world, txn)
                    assert whole is not None
                    return Work(whole, [])
                out: List[Optional[torch.Tensor]] = [None] * n
                slot = Beside(beside, _OVERLAP_MIN_BYTES)
                _exchange_summable(items, out, self.group, self.world, txn, self.lockstep,
                                   beside=None if self.fused else slot)
                rest = [i for i in range(n) if out[i] is None]
                if self.prepared is not None:
                    for i, value in zip(rest, exchange_prepared(self.prepared, self.layouts, slot)):
                        out[i] = value
                _exchange_each(items, [i for i in rest if out[i] is None], out, self.group)
                return Work(out, rest)  # type: ignore[arg-type]
        finally:
            self.on_wire = False

    def finish(self, work: Work) -> List[torch.Tensor]:
        """The means of a :meth:`start`ed exchange, in order; the compressed ones' finiteness
        told to the transaction."""
        if self.observe and self.txn is not None and not self.whole:
            self.txn.observe([work.out[i] for i in work.rest])
        return work.out


def prepare_bucket(items: Sequence[Item], group, world: int, *, buffer: Optional[torch.Tensor] = None,
                   label: str = "?", layouts: Optional[dict] = None) -> BucketExchange:
    """A :class:`BucketExchange` of these arguments with its local phase done on the calling
    thread, inside the open transaction (its ``start()`` and ``finish()`` continue it)."""
    exchange = BucketExchange(items, group, world, buffer=buffer, label=label, layouts=layouts,
                              txn=transaction.current())
    exchange.prepare()
    return exchange


def _exchange_whole(items: Sequence[Item], buffer: Optional[torch.Tensor], group, world: int,
                    txn: Optional[Any]) -> Optional[List[torch.Tensor]]:
    """The bucket averaged as a whole (:func:`_whole`) when it is all dense, or one 16-bit cast
    with at most a few small dense tensors beside it; else None (nothing was sent)."""
    if not _whole_applies(items, buffer):
        return None
    assert buffer is not None
    casts = [c for c in {id(codec): codec for _, _, codec in items}.values() if c is not None]
    dense = [i for i, (_, _, c) in enumerate(items) if c is None] if casts else []
    whole, averaged = _whole(items, buffer, casts[0] if casts else None, group, world, exact=dense)
    if txn is not None:  # the 16-bit mean is finite exactly when its fp32 copy is: half the bytes to read
        txn.observe(averaged)
    return whole


# the smallest collective (bytes per rank) worth running the next bucket's local phase beside:
# not a header, a status word or a size vector, which take a round trip and no bandwidth
_OVERLAP_MIN_BYTES = 4096


def _summable(codec: Any) -> bool:
    """Whether a codec's payload travels in the lockstep (averaged as it is, or in rounds)."""
    return codec.base.multi_round or codec.base.native


def _whole_applies(items: Sequence[Item], buffer: Optional[torch.Tensor]) -> bool:
    """Whether :func:`_exchange_whole` averages the bucket whole: all dense, or one 16-bit cast
    with at most a few small dense tensors (a twentieth of the elements) beside it."""
    codecs = {id(codec): codec for _, _, codec in items}
    casts = [c for c in codecs.values() if c is not None]
    if not (buffer is not None and items and sum(g.numel() for _, g, _ in items) == buffer.numel()
            and (not casts or (len(casts) == 1 and isinstance(casts[0], CastCompressor)))):
        return False
    dense = [i for i, (_, _, c) in enumerate(items) if c is None] if casts else []
    return sum(items[i][1].numel() for i in dense) * 20 <= buffer.numel()


def _exchange_summable(items: Sequence[Item], out: List[Optional[torch.Tensor]], group, world: int,
                       txn: Optional[Any], lock: Optional["Lockstep"], beside: Optional[Beside] = None) -> None:
    """Dense gradients and summable codecs (native, multi-round) in lockstep (``lock``, started
    by the local phase; None when the bucket has none): their results into ``out``; the other
    items are left None. ``beside``: work for the wire time of the lockstep's collectives."""
    if lock is None:
        return
    results, last = lock.run(group, world, beside)
    for i, value in results.items():
        out[i] = value
    commit(lock.rec)
    if txn is not None:
        # Each item's last average decides: a dense mean is the result itself, a native
        # payload decodes to finite values only when it is finite, and PowerSGD's result
        # P Q^T (saturated) is finite exactly when its last average, Q, is. EF21 adds its
        # aggregate estimate, so its result itself is checked.
        txn.observe([last[i] for i in lock.gens])
        txn.observe([out[i] for i in lock.gens if isinstance(items[i][2], EF21)])


class Lockstep:
    """Round generators driven together: one allreduce per dtype and round for all of them.
    :meth:`start` makes them and runs each to its first average (local work only: what may run
    ahead), :meth:`run` drives the rounds."""

    def __init__(self, gens: Dict[int, Rounds], rec: Record) -> None:
        self.gens, self.rec = gens, rec
        self.results: Dict[int, torch.Tensor] = {}
        self.pending: Dict[int, torch.Tensor] = {}
        for i, gen in gens.items():
            _advance(i, gen, None, self.pending, self.results, rec)

    @classmethod
    def start(cls, items: Sequence[Item], world: int, label: str) -> Optional["Lockstep"]:
        """The lockstep of ``items``' dense gradients and summable codecs, started; None when
        the bucket has none."""
        gens: Dict[int, Rounds] = {}
        for i, (key, grad, codec) in enumerate(items):
            if codec is None:
                gens[i] = _dense(grad)
            elif codec.base.multi_round:
                # the result goes straight into the gradient, which the caller overwrites with it anyway
                gens[i] = codec.rounds(grad, key, out=grad if grad.is_contiguous() else None)
            elif codec.base.native:
                gens[i] = _native(codec, grad, key)
        if not gens:
            return None
        rec = Record("allreduce", "bucket", label, "bucket", world,
                     dense_bytes=sum(_nbytes(items[i][1]) for i in gens))
        return cls(gens, rec)

    def run(self, group, world: int, beside: Optional[Beside] = None
            ) -> Tuple[Dict[int, torch.Tensor], Dict[int, torch.Tensor]]:
        """Every round; each generator's result and the last average it was sent. ``beside``:
        work for the wire time of its allreduces."""
        gens, rec, results, pending = self.gens, self.rec, self.results, self.pending
        last: Dict[int, torch.Tensor] = {}
        while pending:
            sent, pending = pending, {}
            kinds: Dict[Tuple[torch.dtype, torch.device], List[int]] = {}
            for i in sorted(sent):
                kinds.setdefault((sent[i].dtype, sent[i].device), []).append(i)
            for idx in kinds.values():
                flat = torch.cat([sent[i].reshape(-1) for i in idx])
                rec.payload_bytes += _nbytes(flat)
                _mean_(flat, group, world, rec, beside)
                for i, avg in zip(idx, flat.split([sent[i].numel() for i in idx])):
                    last[i] = avg
                    _advance(i, gens[i], avg.view(sent[i].shape), pending, results, rec)
        return results, last


def _exchange_each(items: Sequence[Item], rest: Sequence[int], out: List[Optional[torch.Tensor]], group) -> None:
    """Items ``rest`` one allreduce each (what measuring the compression error needs)."""
    for i in rest:
        key, grad, codec = items[i]
        out[i] = flat_job(grad, make_spec(codec, None, None, False), key, group)


def _whole(items: Sequence[Item], buffer: torch.Tensor, cast: Optional[CastCompressor], group, world: int,
           exact: Sequence[int] = ()) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """The whole bucket in one allreduce, in place: dense (as DDP's own allreduce does), or
    cast to 16 bits (as PyTorch's fp16/bf16 hooks do). A cast is element-wise and keeps no
    state, so casting the bucket equals casting each gradient, with a pass less each way.
    ``exact``: items the policy keeps dense inside a cast bucket (biases, small tensors): they
    ride along in the cast (a few bytes more than leaving them out) and are then overwritten by
    their own exact fp32 mean, one small allreduce of their concatenation, so a bucket with a
    few dense tensors costs two passes, not one per tensor. Returns the gradients' views and
    the averaged tensors as they travelled."""
    rec = Record("allreduce", "bucket", "none" if cast is None else cast.name, "bucket", world,
                 dense_bytes=_nbytes(buffer))
    if cast is not None:  # each cast tensor's call counts, as if it had been cast alone
        for key, _, codec in items:
            if codec is cast:
                cast.count(key)
    offsets = [0]
    for _, g, _ in items:
        offsets.append(offsets[-1] + g.numel())
    views = [buffer[a:b] for a, b in zip(offsets, offsets[1:])]
    dense = torch.cat([views[i] for i in exact]) if exact else None
    flat = buffer if cast is None else buffer.to(cast.wire_dtype)
    rec.payload_bytes = _nbytes(flat) + (_nbytes(dense) if dense is not None else 0)
    _mean_(flat, group, world, rec)
    if dense is not None:
        _mean_(dense, group, world, rec)
    if flat is not buffer:
        buffer.copy_(flat)
    if dense is not None:
        for i, piece in zip(exact, dense.split([views[i].numel() for i in exact])):
            views[i].copy_(piece)
    commit(rec)
    return [v.view(g.shape) for (_, g, _), v in zip(items, views)], [flat] + ([dense] if dense is not None else [])


def _advance(i: int, gen: Rounds, value: Optional[torch.Tensor], pending: Dict[int, torch.Tensor],
             results: Dict[int, torch.Tensor], rec: Record) -> None:
    """One step of a round generator; its time counts as compression, except the last step
    (the decoding, e.g. PowerSGD's ``P Q^T`` and the residual update), which counts as
    decompression."""
    start = time.perf_counter()
    try:
        pending[i] = gen.send(value) if value is not None else next(gen)
    except StopIteration as stop:
        results[i] = stop.value
        rec.decompress_s += time.perf_counter() - start
    else:
        rec.compress_s += time.perf_counter() - start


def sum_counts(counts: torch.Tensor, group, world: int, label: str = "?") -> torch.Tensor:
    """The element-wise sum over ``group`` of ``counts`` (a small int tensor on the group's
    device, e.g. 1 where this rank has a parameter's gradient), in place; nothing is read. The
    training runtime sends it after an iteration's last bucket (``Runtime.submit``'s ``tally``)."""
    if world > 1:
        rec = Record("allreduce", "bucket", label, "tally", world, dense_bytes=_nbytes(counts))
        rec.payload_bytes = _nbytes(counts)
        Comm(group, rec, "training exchange", counts.device).all_reduce_(counts)
        commit(rec)
    return counts


def _mean_(flat: torch.Tensor, group, world: int, rec: Record, beside: Optional[Beside] = None) -> torch.Tensor:
    """Average ``flat`` over the group in place by the collectives' one rule (``Comm.mean_``),
    so the ``none`` and 16-bit cast hooks give the bits of DDP and of PyTorch's hooks."""
    return flat if world == 1 else Comm(group, rec, "training exchange", flat.device, beside=beside).mean_(flat)


def _dense(grad: torch.Tensor) -> Rounds:
    avg = yield grad.detach()
    return avg


def _native(codec: Any, grad: torch.Tensor, key: str) -> Rounds:
    """A native codec as one round: its first payload tensor is averaged as it is."""
    base = codec.base
    feedback = None if isinstance(codec, Compressor) else codec
    sent: Optional[torch.Tensor] = None
    if feedback is None:
        acc, payload = grad.detach(), base.compress(grad, key)
    else:
        acc = feedback.accumulate(grad.detach(), key)
        payload, sent = base.compress_decoded(acc, key)
    avg = yield payload.tensors[0]
    p = payload
    avg = base.decompress(Payload(p.compressor, p.shape, p.dtype, [avg, *p.tensors[1:]], p.meta))
    if feedback is not None and sent is not None:
        feedback.update(key, acc, sent.reshape(acc.shape))
        avg = feedback.combine(key, avg.reshape(acc.shape))
    return avg.reshape(grad.shape).to(grad.dtype)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

