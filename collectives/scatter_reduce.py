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
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from gradcomp.compress import ErrorFeedback

from ._algorithm import Algorithm, as_dtype, chunk_key, mean_in_order, wdtype
from ._header import sizes as header_sizes
from ._wire import decode, encode, gather_bytes

_servers: "weakref.WeakKeyDictionary[Any, ErrorFeedback]" = weakref.WeakKeyDictionary()
_servers_lock = threading.Lock()


def server_feedback(compressor: Any) -> ErrorFeedback:
    """The server-side error feedback that scatter-reduce keeps for ``compressor`` (the object
    passed to ``allreduce``, an error-feedback wrapper): residuals per ``"{key}/chunk{j}/server"``.
    Use its ``state_dict``/``load_state_dict`` to checkpoint and resume it."""
    inner = getattr(compressor, "compressor", None)
    if inner is None:
        raise ValueError("server-side error feedback exists only for error-feedback wrappers such as ErrorFeedback(c)")
    with _servers_lock:
        server = _servers.get(compressor)
        if server is None:
            server = _servers[compressor] = ErrorFeedback(inner)
        return server


class ScatterReduce(Algorithm):
    name = "scatter-reduce"

    def local(self, acc, dtype):
        flat = as_dtype(acc, dtype).reshape(-1)
        self.device, self.dtype, self.wire_dtype = acc.device, wdtype(acc), dtype
        bufs, sent = [], []
        for j, chunk in enumerate(flat.tensor_split(self.comm.size)):
            if self.want_sent:
                payload, decoded = self.comp.compress_decoded(chunk, chunk_key(self.key, j))
                sent.append(decoded.reshape(-1))
            else:
                payload = self.comp.compress(chunk, chunk_key(self.key, j))
            self.payload_bytes += payload.nbytes
            bufs.append(encode(payload, acc.device))
        self.sent = torch.cat(sent) if self.want_sent else None
        self.out_sizes = [b.numel() for b in bufs]
        self.sendbuf = torch.cat(bufs)
        return 0, self.out_sizes

    def run(self, table):
        comm, w = self.comm, self.comm.size
        in_sizes = header_sizes(table)[:, comm.rank].tolist()  # rank r's payload of my chunk
        got = comm.all_to_all(self.sendbuf, self.out_sizes, in_sizes)
        error, buf = None, got.new_empty(0)
        try:  # a failure here is mine alone: report it before the all-gather, not by hanging
            with self.rec.timing("decompress"):
                decoded = (self.comp.decompress(decode(b, self.device)) for b in got.split(in_sizes))
                mine = mean_in_order(decoded, w, self.dtype)
            with self.rec.timing("compress"):
                buf = encode(self._recompress(mine), self.device)
        except Exception as exc:
            error = exc
        status = comm.exchange([buf.numel(), int(error is not None)])
        failed = [r for r in range(w) if status[r, 1]]
        if failed:
            if error is not None:
                raise error
            raise ValueError(f"allreduce: scatter-reduce failed on rank(s) {failed} while reducing their chunk "
                             f"(the error is raised there)")
        bufs = gather_bytes(comm, buf, status[:, 0].tolist(), exact=not self.comp.fixed_size)
        with self.rec.timing("decompress"):
            avg = torch.cat([self.comp.decompress(decode(b, self.device)).reshape(-1) for b in bufs])
        return avg, self.sent

    def _recompress(self, mine: torch.Tensor):
        """Phase 2: compress the average of my chunk as the input's dtype, with server-side
        error feedback (kept in fp32) when there is one."""
        key = chunk_key(self.key, self.comm.rank) + "/server"
        if self.server is None:
            return self.comp.compress(as_dtype(mine, self.wire_dtype), key)
        acc = self.server.accumulate(mine, key)
        payload, sent = self.comp.compress_decoded(as_dtype(acc, self.wire_dtype), key)
        self.server.update(key, acc, sent)
        return payload
