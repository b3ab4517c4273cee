"""``allgather``: every rank's whole payload goes to every rank, which decodes and averages.

Works for any compressor. Sizes travel in the header, so variable payloads (top-k by
threshold) need no extra round trip; they go point to point at their exact size, fixed-size
ones in one all_gather. Every rank decodes the same bytes and sums them in rank order in
fp32 (fp64 for fp64), so every rank holds the same bits. Bytes per rank grow as ``(w-1)``
times the payload: the choice for two ranks, or when decoding is cheap.
"""
from __future__ import annotations

from ._algorithm import Algorithm, as_dtype, mean_in_order, wdtype
from ._header import sizes as header_sizes
from ._wire import decode, encode, gather_bytes


class AllGather(Algorithm):
    name = "allgather"

    def local(self, acc, dtype):
        payload = self.comp.compress(as_dtype(acc, dtype), self.key)
        self.payload_bytes = payload.nbytes
        self.buf = encode(payload, acc.device)
        self.device = acc.device
        self.dtype = wdtype(acc)
        return 0, [self.buf.numel()]

    def run(self, table):
        sizes = header_sizes(table)[:, 0].tolist()
        bufs = gather_bytes(self.comm, self.buf, sizes, exact=not self.comp.fixed_size)
        with self.rec.timing("decompress"):
            avg = mean_in_order(self._decoded(bufs), self.comm.size, self.dtype)
        return avg, self.sent

    def _decoded(self, bufs):
        """Decode one payload at a time (peak memory: two dense tensors, not ``w``)."""
        for r, buf in enumerate(bufs):
            out = self.comp.decompress(decode(buf, self.device))
            if r == self.comm.rank and self.want_sent:
                self.sent = out
            yield out
