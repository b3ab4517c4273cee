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

import threading
import weakref
from typing import Any

import torch

from gradcomp.compress import ErrorFeedback, Feedback
from gradcomp.kernels.memory import empty

from ._algorithm import Algorithm, as_dtype, chunk_key, register_algorithm, wdtype
from ._header import sizes as header_sizes
from ._shared import device_of, exact_sizes, header, pack, split, verify_many
from ._wire import decode, encode, gather_bytes

_servers: "weakref.WeakKeyDictionary[Any, ErrorFeedback]" = weakref.WeakKeyDictionary()
_servers_lock = threading.Lock()


def server_key(key: str, j: int) -> str:
    """The key of the server-side residual of chunk ``j`` (on rank ``j``) of an exchange under
    ``key``: where :func:`server_feedback` keeps it."""
    return chunk_key(key, j) + "/server"


def server_feedback(compressor: Any) -> ErrorFeedback:
    """The server-side error feedback that scatter-reduce keeps for ``compressor`` (the object
    passed to ``allreduce``, an error-feedback wrapper): residuals per :func:`server_key`.
    Use its ``state_dict``/``load_state_dict`` to checkpoint and resume it."""
    if not isinstance(compressor, Feedback):
        raise ValueError("server-side error feedback exists only for error-feedback wrappers such as ErrorFeedback(c)")
    with _servers_lock:
        server = _servers.get(compressor)
        if server is None:  # the feedback protocol's compressor: a wrapper's .base
            server = _servers[compressor] = ErrorFeedback(compressor.compressor)
        return server


@register_algorithm
class ScatterReduce(Algorithm):
    name = "scatter-reduce"
    code = 3
    order = 3
    compresses_residual = True

    @classmethod
    def prefers(cls, compressor, world_size):
        return True

    def local(self, acc, dtype):
        # in place, acc is the residual: each chunk (a contiguous view) keeps its own error
        flat = acc.view(-1) if self.in_place else as_dtype(acc, dtype).reshape(-1)
        self.device, self.dtype, self.wire_dtype = acc.device, wdtype(acc), dtype
        bufs, sent = [], []
        self.mine = None  # this rank's payload of its own chunk, kept to skip parsing it back
        chunks = flat.tensor_split(self.comm.size)
        self.chunk_numels = [c.numel() for c in chunks]  # what every payload of chunk j must hold
        for j, chunk in enumerate(chunks):
            if self.in_place:
                payload = self.comp.compress_residual(chunk, chunk_key(self.key, j))
            elif self.want_sent:
                payload, decoded = self.comp.compress_decoded(chunk, chunk_key(self.key, j))
                sent.append(decoded.reshape(-1))
            else:
                payload = self.comp.compress(chunk, chunk_key(self.key, j))
            self.payload_bytes += payload.nbytes
            if j == self.comm.rank:
                self.mine = payload
            bufs.append(encode(payload, acc.device))
        self.sent = torch.cat(sent) if self.want_sent else None
        self.out_sizes = [b.numel() for b in bufs]
        self.sendbuf = torch.cat(bufs)
        return 0, self.out_sizes

    @classmethod
    def exchange_many(cls, comm, items, specs, algos, error, layouts=None):
        """``ScatterReduce``'s two phases for every tensor, each exchange shared: ``(avg, sent)``
        per tensor (None for an empty one)."""
        w, n = comm.size, len(items)
        device, exact = device_of(items), exact_sizes(specs)
        # what goes to rank j: every tensor's chunk-j payload, behind n lengths
        per_dest = [[None] * n for _ in range(w)]
        for i, a in enumerate(algos):
            if a is not None and error is None:
                for j, piece in enumerate(a.sendbuf.split(a.out_sizes)):
                    per_dest[j][i] = piece
        sends = [pack(parts, device, error) for parts in per_dest]
        table = comm.exchange(header(w, cls.name, items, specs, error, [b.numel() for b in sends]))
        verify_many(table, items, specs, error)
        in_sizes = header_sizes(table)[:, comm.rank].tolist()
        got = comm.all_to_all(torch.cat(sends), [b.numel() for b in sends], in_sizes)
        failure, reduced = None, [None] * n
        try:  # a failure here is mine alone: report it before the all-gather, not by hanging
            from_rank = [split(b, n, r) for r, b in enumerate(got.split(in_sizes))]
            for i, a in enumerate(algos):
                if a is not None:
                    reduced[i] = a.reduce_chunk([parts[i] for parts in from_rank])
            buf = pack(reduced, device, None)
        except Exception as exc:
            failure, buf = exc, got.new_empty(0)
        sizes = exchange_status(comm, buf.numel(), failure)
        per_rank = [split(b, n, r) for r, b in enumerate(gather_bytes(comm, buf, sizes, exact=exact))]
        return [None if a is None else a.finish([parts[i] for parts in per_rank]) for i, a in enumerate(algos)]

    def run(self, table):
        comm = self.comm
        in_sizes = header_sizes(table)[:, comm.rank].tolist()  # rank r's payload of my chunk
        got = comm.all_to_all(self.sendbuf, self.out_sizes, in_sizes)
        error, buf = None, got.new_empty(0)
        try:  # a failure here is mine alone: report it before the all-gather, not by hanging
            buf = self.reduce_chunk(list(got.split(in_sizes)))
        except Exception as exc:
            error = exc
        sizes = exchange_status(comm, buf.numel(), error)
        return self.finish(gather_bytes(comm, buf, sizes, exact=not self.comp.fixed_size))

    def reduce_chunk(self, parts):
        """Phase 1 on this rank: decode every rank's payload of my chunk (``parts``, byte
        tensors in rank order), average them in rank order, compress the average again; the
        wire bytes of that payload. Shared with ``allreduce_fused``."""
        with self.rec.timing("decompress"):
            mine = None
            for r, b in enumerate(parts):  # summed in rank order, then divided
                p = self.mine if r == self.comm.rank else decode(b, self.device, self.chunk_numels[self.comm.rank], r)
                if mine is None:
                    mine = empty(p.numel, self.dtype, self.device)
                self.comp.decompress_into(p, mine, accumulate=r > 0)
            mine.div_(self.comm.size)
        with self.rec.timing("compress"):
            self.mine = self._recompress(mine)
            return encode(self.mine, self.device)

    def finish(self, bufs):
        """Phase 2: decode every rank's reduced chunk (``bufs``, in rank order) into the
        average; ``(average, sent)``."""
        with self.rec.timing("decompress"):
            payloads = [self.mine if r == self.comm.rank else decode(b, self.device, self.chunk_numels[r], r)
                        for r, b in enumerate(bufs)]
            # in the wire dtype, as decompress gives it: the caller casts to the input's dtype
            avg = empty(sum(p.numel for p in payloads), self.wire_dtype, self.device)
            for p, piece in zip(payloads, avg.split([p.numel for p in payloads])):
                self.comp.decompress_into(p, piece, accumulate=False)
        return avg, self.sent

    def _recompress(self, mine: torch.Tensor):
        """Phase 2: compress the average of my chunk as the input's dtype, with server-side
        error feedback (kept in fp32) when there is one."""
        key = server_key(self.key, self.comm.rank)
        if self.server is None:
            return self.comp.compress(as_dtype(mine, self.wire_dtype), key)
        if mine.dtype == self.wire_dtype and self.server.keeps_residual_in_place(mine):
            return self.comp.compress_residual(self.server.accumulate_in_place(mine, key), key)
        acc = self.server.accumulate(mine, key)
        payload, sent = self.comp.compress_decoded(as_dtype(acc, self.wire_dtype), key)
        self.server.update(key, acc, sent)
        return payload


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
