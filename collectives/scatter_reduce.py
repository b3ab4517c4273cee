"""``scatter-reduce``: the two-phase compressed allreduce of 1-bit Adam and CGX.

1. Split the tensor into ``w`` chunks; compress chunk ``j`` (key ``"{key}/chunk{j}"``); an
   all-to-all sends it to rank ``j``.
2. Rank ``j`` decodes the ``w`` payloads of its chunk, averages them in rank order, and
   compresses the average again (key ``"{key}/chunk{j}/server"``), with its own server-side
   error feedback when the caller uses error feedback; an all-gather brings every chunk to
   every rank, which decodes them all.

Each rank sends ``(w-1)/w`` of a payload in each phase: ``2 (w-1)/w`` payloads in all, bounded
by two payloads however many ranks there are (a ring allreduce has the same factor), where
``allgather`` sends ``w-1``. The price is a second compression of the average. Every rank
decodes the same phase-2 bytes, so every rank holds the same bits.

Payloads are decoded straight into their place (``decompress_into``), and error feedback that
keeps its residual in place (both phases) compresses the residual's pieces themselves, which
then hold the new residual: no decoded copies of this rank's own payloads.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from gradcomp.compress import ErrorFeedback, is_feedback, transaction
from gradcomp.compress.sparse import payload_bounds
from gradcomp.kernels.memory import empty, zeros

from ._algorithm import Algorithm, Cost, as_dtype, chunk_key, register_algorithm, ring, shares_memory, wdtype
from .wire.bounds import Bounds, bounded_layout, bounded_set, exact_sizes
from .wire.frame import decode, encode, gather_bytes, pack, split
from .wire.header import set_header, verify_set
from .wire.header import sizes as header_sizes
from .wire.layouts import Layout, SizedLayout, agreed_buffer, announce, device_of, local_status, padded_buffer, signature
from .wire.status import OK, Flags, checked, status_problem, statuses

def server_key(key: str, j: int) -> str:
    """The key of the server-side residual of chunk ``j`` (on rank ``j``) of an exchange under
    ``key``: where :func:`server_feedback` keeps it."""
    return chunk_key(key, j) + "/server"


def key_of(state_key: str) -> str:
    """The exchange key (``allreduce``'s ``key``, a training parameter's name) whose state a
    compressor or error feedback keeps under ``state_key``: a chunk's (``{key}/chunk{j}``) and
    a chunk's server-side residual (:func:`server_key`) are the key's own; any other is itself."""
    head, sep, tail = state_key.rpartition("/chunk")
    if sep and (tail.isdigit() or (tail.endswith("/server") and tail[:-len("/server")].isdigit())):
        return head
    return state_key


def server_feedback(compressor: Any) -> ErrorFeedback:
    """The server-side error feedback that scatter-reduce keeps for ``compressor`` (the object
    passed to ``allreduce``, an error-feedback wrapper): the wrapper's own ``server`` part,
    residuals per :func:`server_key`. Checkpoint it with its own ``state_dict``/
    ``load_state_dict`` (the wrapper's do not include it); the wrapper's ``owed``/``take`` do."""
    if not is_feedback(compressor):
        raise ValueError("server-side error feedback exists only for error-feedback wrappers such as ErrorFeedback(c)")
    server = getattr(compressor, "server", None)
    if not isinstance(server, ErrorFeedback):
        raise ValueError(f"scatter-reduce keeps the error of its second compression in the error feedback's "
                         f"server part (an ErrorFeedback, its .server); {type(compressor).__name__} has none: "
                         f"derive it from ErrorFeedback or EF21, or use algorithm='allgather'")
    return server


def serve(compressor: Any, key: str, numel: int, comm: Any) -> ErrorFeedback:
    """:func:`server_feedback` of ``compressor`` for an exchange of ``numel`` elements under
    ``key`` over ``comm``, told where this rank's server residual sits in the tensor."""
    server = server_feedback(compressor)
    server.place(key, server_key(key, comm.rank), numel, comm.size, comm.rank)
    return server


@register_algorithm
class ScatterReduce(Algorithm):
    name = "scatter-reduce"
    code = 3
    order = 3
    compresses_residual = True
    sums_in_place = True

    @classmethod
    def prefers(cls, compressor, world_size):
        return True

    @classmethod
    def wire(cls, payload, world):
        """Each chunk's payload to its server, the servers' compressed averages back: a ring's
        share of the payload, in two exchanges, each after its sizes."""
        return Cost(ring(world) * payload, 4)

    def local(self, acc, dtype):
        # in place, acc is the residual: each chunk (a contiguous view) keeps its own error
        flat = acc.view(-1) if self.in_place else as_dtype(acc, dtype).reshape(-1)
        self.device, self.dtype, self.wire_dtype = acc.device, wdtype(acc), dtype
        sent = []
        self.payloads = []  # every chunk's payload, encoded only for the checked format (sendbuf)
        self._sendbuf = None
        chunks = flat.tensor_split(self.comm.size)
        self.chunk_numels = [c.numel() for c in chunks]  # what every payload of chunk j must hold
        # in place with sum_of: chunk j of the residual is chunk j of res + gradient, added in
        # the compressor's first pass
        sums = None if self.sum_of is None else list(zip(*(t.reshape(-1).tensor_split(self.comm.size)
                                                           for t in self.sum_of)))
        for j, chunk in enumerate(chunks):
            if self.in_place:
                payload = self.comp.compress_residual(chunk, chunk_key(self.key, j),
                                                      sum_of=None if sums is None else sums[j], defer=self.pending)
            elif self.want_sent:
                payload, decoded = self.comp.compress_decoded(chunk, chunk_key(self.key, j))
                sent.append(decoded.reshape(-1))
            else:
                payload = self.comp.compress(chunk, chunk_key(self.key, j))
            self.payload_bytes += payload.nbytes
            self.payloads.append(payload)
        self.mine = self.payloads[self.comm.rank]  # this rank's own chunk: never parsed back
        self.sent = torch.cat(sent) if self.want_sent else None
        return 0, None

    def offer(self, tensor):
        """The input receives the mean when it is contiguous, of the wire's dtype and shares no
        memory with this rank's chunk payloads: the mean is written in the last phase, after
        every read of the input (its chunks' compression, the residual passes)."""
        if (tensor.is_contiguous() and tensor.dtype == self.wire_dtype and tensor.numel() == sum(self.chunk_numels)
                and tensor.numel() and not shares_memory(tensor, *(t for p in self.payloads for t in p.tensors))):
            self.target = tensor.view(-1)

    @property
    def sendbuf(self):
        """Every chunk's payload in the checked wire format, back to back (``out_sizes``)."""
        if self._sendbuf is None:
            bufs = [encode(p, self.device) for p in self.payloads]
            self.out_sizes = [b.numel() for b in bufs]
            self._sendbuf = torch.cat(bufs)
        return self._sendbuf

    def sizes(self):
        self.sendbuf  # made with its sizes
        return self.out_sizes

    @classmethod
    def exchange_many(cls, comm, items, specs, algos, error, layouts=None):
        """``ScatterReduce``'s two phases for every tensor, each exchange shared: ``(avg, sent)``
        per tensor (None for an empty one)."""
        w, n = comm.size, len(items)
        device, exact = device_of(items), exact_sizes(specs)
        sig = signature(cls.name, w, items, specs) if layouts is not None else None
        if sig is not None and sig in layouts:
            entry = layouts[sig]
            if not exact:
                return cls._agreed(comm, items, algos, error, entry, device)
            if entry.begin():  # payloads of the agreed capacities, the reduced chunks' too: fixed sizes
                with payload_bounds(entry.caps):  # the reduced chunks are compressed inside the exchange
                    return cls._agreed(comm, items, algos, error, entry.fixed, device)
            return cls._agreed_sized(comm, items, algos, error, entry, device)
        error = transaction.resolve(error)  # the checked header says it: refusals read now
        # what goes to rank j: every tensor's chunk-j payload, behind n lengths
        per_dest = [[None] * n for _ in range(w)]
        for i, a in enumerate(algos):
            if a is not None and error is None:
                for j, piece in enumerate(a.sendbuf.split(a.out_sizes)):
                    per_dest[j][i] = piece
        sends = [pack(parts, device, error) for parts in per_dest]
        table = comm.exchange(set_header(w, cls.name, items, specs, error, [b.numel() for b in sends]))
        verify_set(table, items, specs, error)
        in_sizes = header_sizes(table)[:, comm.rank].tolist()
        got = comm.all_to_all(torch.cat(sends), [b.numel() for b in sends], in_sizes, cls.finish_all(algos))
        failure, reduced = None, [None] * n
        try:  # a failure here is mine alone: report it before the all-gather, not by hanging
            from_rank = [split(b, n, r) for r, b in enumerate(got.split(in_sizes))]
            with transaction.deferring() as refused:
                for i, a in enumerate(algos):
                    if a is not None:
                        reduced[i] = a.reduce_chunk([parts[i] for parts in from_rank])
            if refused:  # read here: the status exchange below says it
                failure = transaction.Deferred(refused).resolve()
            buf = pack(reduced, device, None) if failure is None else got.new_empty(0)
        except Exception as exc:
            failure, buf = exc, got.new_empty(0)
        sizes = exchange_status(comm, buf.numel(), failure)
        per_rank = [split(b, n, r) for r, b in enumerate(gather_bytes(comm, buf, sizes, exact=exact,
                                                                      while_sending=cls.finish_all(algos)))]
        out = [None if a is None else a.finish([parts[i] for parts in per_rank]) for i, a in enumerate(algos)]
        if sig is not None:  # every rank got here: the layout is checked, later exchanges send it raw
            kind = SizedLayout if exact else Layout
            entry = (
                [kind([None if a is None else a.payloads[j] for a in algos]) for j in range(w)],
                [kind([None if a is None else a.reduced[j] for a in algos]) for j in range(w)])
            layouts[sig] = Bounds(entry, bounded_set(specs)) if exact else entry
        return out

    @classmethod
    def _agreed_sized(cls, comm, items, algos, error, entry, device):
        """Both phases on an agreed layout of variable-size payloads (``wire/layouts.py``): every
        rank's sizes for every destination in one small all-gather, read at once, then one
        all-to-all of the chunk payloads at their exact sizes; after the reduction the reduced
        chunks' sizes the same way, then one all-gather padded to the largest. Two host reads,
        one per phase; a failure in either is in the statuses read and raises on every rank.
        The sizes read set the capacities of the set's next exchanges (``Bounds``)."""
        w, me = comm.size, comm.rank
        sends, back = entry.sized
        bound = [a is not None and not a.comp.fixed_size for a in algos]
        flags = Flags(transaction.current())
        keys = [k for k, _, _ in items]
        # phase 1: every chunk payload to its destination
        states = [local_status(sends[j], [None if a is None else a.payloads[j] for a in algos], error)
                  for j in range(w)]
        status = max(st for st, _ in states)
        dims = None if status != OK else [d for _, ds in states for d in ds]
        table = announce(comm, status, dims, sum(x.count for x in sends), error, device)
        phase1 = [row[1:] for row in table]
        starts = [sum(x.count for x in sends[:j]) for j in range(w)]
        placed = [[sends[j].place(table[r][1 + starts[j]:1 + starts[j] + sends[j].count], r) for j in range(w)]
                  for r in range(w)]  # rank r's templates and bytes for destination j
        bufs = [padded_buffer(placed[me][j][0], [None if a is None else a.payloads[j] for a in algos],
                              placed[me][j][1], placed[me][j][1], device) for j in range(w)]
        in_splits = [placed[r][me][1] for r in range(w)]
        got = comm.all_to_all(torch.cat(bufs), [placed[me][j][1] for j in range(w)], in_splits,
                              cls.finish_all(algos)).split(in_splits)
        failure: Optional[BaseException] = None
        reduced: List[Any] = [None] * len(items)
        with transaction.deferring() as refused:  # the reduced chunks' compression may refuse too
            try:  # a failure here is mine alone: the others learn it from my status below
                for i, a in enumerate(algos):
                    if a is not None:
                        reduced[i] = a.reduce_payloads(
                            [None if r == me else checked(a.comp, placed[r][me][0][i].read(got[r]), keys[i], r, flags)
                             for r in range(w)])
            except Exception as exc:
                failure = exc
        if failure is None and refused:
            failure = transaction.Deferred(refused)
        # phase 2: every rank's reduced chunks to every rank
        count = max(x.count for x in back)
        status, dims = local_status(back[me], reduced, failure)
        table = announce(comm, status, None if dims is None else dims + [0] * (count - len(dims)), count, failure,
                         device)
        placed2 = [back[r].place(table[r][1:1 + back[r].count], r) for r in range(w)]
        if entry.bounded:
            entry.set(*_capacities(keys, bound, sends, back, phase1, [row[1:] for row in table]))
        buf = padded_buffer(placed2[me][0], reduced, placed2[me][1], max(n for _, n in placed2), device)
        rows = comm.all_gather(buf, cls.finish_all(algos))
        out = []
        for i, a in enumerate(algos):
            out.append(None if a is None else a.finish_payloads(
                [None if r == me else checked(a.comp, placed2[r][0][i].read(rows[r]), keys[i], r, flags)
                 for r in range(w)]))
        flags.settle()
        return out

    @classmethod
    def _agreed(cls, comm, items, algos, error, layout, device):
        """Both phases on an agreed layout: one all-to-all of the raw chunk payloads, one
        all-gather of the raw reduced chunks, each behind a status word (see ``wire/status.py``)."""
        w, me = comm.size, comm.rank
        sends, back = layout
        flags = Flags(transaction.current())
        bufs = [agreed_buffer(sends[j], [None if a is None else a.payloads[j] for a in algos], device, error)
                for j in range(w)]
        status = max(st for _, st in bufs)
        got = comm.all_to_all(torch.cat([b for b, _ in bufs]), [s.nbytes for s in sends], [sends[me].nbytes] * w,
                              cls.finish_all(algos))
        rows = got.view(w, sends[me].nbytes)
        flags.add(statuses(rows), status_problem)
        if isinstance(error, transaction.Deferred):  # in my status words; which refusal: said when read
            error.flag_into(flags.txn)
            error = None
        # a failure of mine goes on to the second phase too (the others are in it), then raises
        failure = error if error is not None else (
            ValueError(status_problem([status if r == me else OK for r in range(w)])) if status != OK else None)
        reduced = [None] * len(items)
        with transaction.deferring() as refused:  # the reduced chunks' compression may refuse too
            try:  # a failure here is mine alone: the others learn it from my status word below
                for i, (key, a) in enumerate(zip((k for k, _, _ in items), algos)):
                    if failure is not None:
                        break
                    if a is not None:
                        peers = [None if r == me else checked(a.comp, sends[me].templates[i].read(rows[r]), key, r,
                                                              flags) for r in range(w)]
                        reduced[i] = a.reduce_payloads(peers)
            except Exception as exc:
                failure = exc
        if failure is None and refused:
            deferred = transaction.Deferred(refused)
            deferred.flag_into(flags.txn)
            failure_or_deferred: Optional[BaseException] = deferred
        else:
            failure_or_deferred = failure
        width = max(b.nbytes for b in back)
        mine, status = agreed_buffer(back[me], reduced, device, failure_or_deferred)
        padded = mine.new_zeros(width)
        padded[:mine.numel()] = mine
        rows = comm.all_gather(padded, cls.finish_all(algos))
        flags.add(statuses(rows), status_problem)
        if failure is not None:
            raise failure
        if status != OK:  # the reduced payloads no longer fit
            raise ValueError(status_problem([status if r == me else OK for r in range(w)]))
        out = []
        for i, ((key, _, _), a) in enumerate(zip(items, algos)):
            out.append(None if a is None else a.finish_payloads(
                [None if r == me else checked(a.comp, back[r].templates[i].read(rows[r]), key, r, flags)
                 for r in range(w)]))
        flags.settle()
        return out

    def run(self, table):
        comm = self.comm
        in_sizes = header_sizes(table)[:, comm.rank].tolist()  # rank r's payload of my chunk
        got = comm.all_to_all(self.sendbuf, self.out_sizes, in_sizes, self.finish_local)
        error, buf = None, got.new_empty(0)
        try:  # a failure here is mine alone: report it before the all-gather, not by hanging
            with transaction.deferring() as refused:
                buf = self.reduce_chunk(list(got.split(in_sizes)))
            if refused:  # read here: the status exchange below says it
                error = transaction.Deferred(refused).resolve()
                buf = buf if error is None else got.new_empty(0)
        except Exception as exc:
            error = exc
        sizes = exchange_status(comm, buf.numel(), error)
        return self.finish(gather_bytes(comm, buf, sizes, exact=not self.comp.fixed_size,
                                        while_sending=self.finish_local))

    def reduce_chunk(self, parts):
        """Phase 1 on this rank: decode every rank's payload of my chunk (``parts``, byte
        tensors in rank order), average them in rank order, compress the average again; the
        wire bytes of that payload. Shared with ``allreduce_fused``."""
        with self.rec.timing("decompress"):
            me = self.comm.rank
            payloads = [None if r == me else decode(b, self.device, self.chunk_numels[me], r)
                        for r, b in enumerate(parts)]
        return encode(self.reduce_payloads(payloads), self.device)

    def reduce_payloads(self, payloads):
        """Phase 1 from decoded payloads (None for this rank's own): the reduced chunk's payload."""
        self.finish_local()
        with self.rec.timing("decompress"):
            payloads = [self.mine if r == self.comm.rank else p for r, p in enumerate(payloads)]
            # summed in rank order, then divided (the compressor's combine: one pass where it can)
            zeroed = self.comp.starts_from_zeros  # else the combine writes every element
            mine = (zeros if zeroed else empty)(payloads[0].numel, self.dtype, self.device)
            self.comp.decompress_mean_into(payloads, mine, zeroed=zeroed)
        with self.rec.timing("compress"):
            self.mine = self._recompress(mine)
            return self.mine

    def finish(self, bufs):
        """Phase 2: decode every rank's reduced chunk (``bufs``, in rank order) into the
        average; ``(average, sent)``."""
        with self.rec.timing("decompress"):
            payloads = [None if r == self.comm.rank else decode(b, self.device, self.chunk_numels[r], r)
                        for r, b in enumerate(bufs)]
        return self.finish_payloads(payloads)

    def finish_payloads(self, payloads):
        """Phase 2 from decoded reduced chunks (None for this rank's own): ``(average, sent)``."""
        self.finish_local()
        with self.rec.timing("decompress"):
            payloads = [self.mine if r == self.comm.rank else p for r, p in enumerate(payloads)]
            self.reduced = payloads  # every chunk's reduced payload: an agreed layout's second phase
            # in the wire dtype, as decompress gives it: the caller casts to the input's dtype
            avg = (self.target if self.target is not None
                   else empty(sum(p.numel for p in payloads), self.wire_dtype, self.device))
            for p, piece in zip(payloads, avg.split([p.numel for p in payloads])):
                self.comp.decompress_into(p, piece, accumulate=False)
            if all(self.comp.decodes_finite(p, self.wire_dtype) for p in payloads):
                transaction.vouch_finite(avg)  # the step's verdict needs no pass over avg
        return avg, self.sent

    def _recompress(self, mine: torch.Tensor):
        """Phase 2: compress the average of my chunk as the input's dtype, with server-side
        error feedback (kept in fp32) when there is one."""
        key = server_key(self.key, self.comm.rank)
        if self.server is None:
            return self.comp.compress(as_dtype(mine, self.wire_dtype), key)
        if mine.dtype == self.wire_dtype and self.server.keeps_residual_in_place(mine):
            if hasattr(self.server, "in_place_sum"):  # the sum with the server residual in the first pass
                buf, res = self.server.in_place_sum(mine, key)
                return self.comp.compress_residual(buf, key, sum_of=(res, mine), defer=self.pending)
            return self.comp.compress_residual(self.server.accumulate_in_place(mine, key), key)
        acc = self.server.accumulate(mine, key)
        payload, sent = self.comp.compress_decoded(as_dtype(acc, self.wire_dtype), key)
        self.server.update(key, acc, sent)
        return payload


def _capacities(keys: List[str], bound: List[bool], sends: list, back: list, phase1: list, phase2: list
                ) -> Tuple[Optional[Dict[str, int]], Any]:
    """The capacities (per compressor key: every chunk's and every reduced chunk's) and the
    fixed layouts ``(sends, back)`` of a sized exchange's sizes (``phase1``: every rank's
    sizes for every destination, ``phase2``: every rank's reduced chunks'); None when a
    fixed-size payload's sizes differ between ranks."""
    caps: Dict[str, int] = {}
    fixed_sends, fixed_back = [], []
    at = 0
    for j, layout in enumerate(sends):  # chunk j's payloads from every rank: one capacity per tensor
        found = bounded_layout(layout, [row[at:at + layout.count] for row in phase1], bound)
        at += layout.count
        if found is None:
            return None, None
        caps.update({chunk_key(k, j): c for k, c in zip(keys, found[0]) if c is not None})
        fixed_sends.append(found[1])
    for r, layout in enumerate(back):  # rank r's reduced chunk: compressed on rank r alone
        found = bounded_layout(layout, [phase2[r][:layout.count]], bound)
        if found is None:
            return None, None
        caps.update({server_key(k, r): c for k, c in zip(keys, found[0]) if c is not None})
        fixed_back.append(found[1])
    return caps, (fixed_sends, fixed_back)


def exchange_status(comm, nbytes: int, error) -> list:
    """Between the phases: every rank's reduced-chunk size, after checking that no rank failed
    (the failing rank raises its own error, the others say which rank failed)."""
    status = comm.exchange([nbytes, int(error is not None)])
    failed = [r for r in range(comm.size) if status[r, 1]]
    if failed:
        if error is not None:
            raise error
        raise ValueError(f"allreduce: scatter-reduce failed on rank(s) {failed} while reducing their chunk "
                         f"(the error is raised there)")
    return status[:, 0].tolist()
