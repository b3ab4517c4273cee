"""``allgather``: every rank's whole payload goes to every rank, which decodes and averages.

Works for any compressor. Sizes travel in the header, so variable payloads (top-k by
threshold) need no extra round trip; they go point to point at their exact size, fixed-size
ones in one all_gather. Every rank decodes the same payloads into one buffer, summed in rank
order in fp32 (fp64 for fp64) and then divided by the world size, so every rank holds the same
bits. Bytes per rank grow as ``(w-1)`` times the payload: the choice for two ranks, or when
decoding is cheap.

Cost: one pass per payload over the output (``decompress_into``: a sparse payload touches only
its own positions) and one division; no decoded temporaries. Under error feedback whose
residual can be kept in place, compression also leaves the new residual behind, so this rank's
payload is never decoded twice.
"""
from __future__ import annotations

from gradcomp.kernels.memory import empty

from ._algorithm import Algorithm, as_dtype, register_algorithm, wdtype
from ._header import sizes as header_sizes
from ._shared import device_of, exact_sizes, header, pack, split, verify_many
from ._wire import decode, encode, gather_bytes


@register_algorithm
class AllGather(Algorithm):
    name = "allgather"
    code = 2
    order = 2
    compresses_residual = True

    @classmethod
    def prefers(cls, compressor, world_size):
        return world_size <= 2

    def local(self, acc, dtype):
        if self.in_place:  # acc is the residual: compressed whole, the error stays in it
            payload = self.comp.compress_residual(acc, self.key)
        elif self.want_sent:
            payload, self.sent = self.comp.compress_decoded(as_dtype(acc, dtype), self.key)
        else:
            payload = self.comp.compress(as_dtype(acc, dtype), self.key)
        self.payload = payload
        self.payload_bytes = payload.nbytes
        self.buf = encode(payload, acc.device)
        self.device = acc.device
        self.dtype = wdtype(acc)
        return 0, [self.buf.numel()]

    @classmethod
    def exchange_many(cls, comm, items, specs, algos, error):
        """One header and one all-gather of every tensor's payload for the whole set."""
        device, exact = device_of(items), exact_sizes(specs)
        buf = pack([None if a is None or error is not None else a.buf for a in algos], device, error)
        table = comm.exchange(header(comm.size, cls.name, items, specs, error, [buf.numel()]))
        verify_many(table, items, specs, error)
        bufs = gather_bytes(comm, buf, header_sizes(table)[:, 0].tolist(), exact=exact)
        per_rank = [split(b, len(items), r) for r, b in enumerate(bufs)]
        return [None if a is None else a.combine([parts[i] for parts in per_rank]) for i, a in enumerate(algos)]

    def run(self, table):
        sizes = header_sizes(table)[:, 0].tolist()
        return self.combine(gather_bytes(self.comm, self.buf, sizes, exact=not self.comp.fixed_size))

    def combine(self, bufs):
        """Decode every rank's payload bytes (``bufs``, in rank order) and average them:
        ``(average, sent)``. Shared with ``allreduce_fused``, which gathers many at once."""
        with self.rec.timing("decompress"):
            out = empty(self.payload.numel, self.dtype, self.device)
            for r, buf in enumerate(bufs):
                if r != self.comm.rank:
                    self.comp.decompress_into(decode(buf, self.device, self.payload.numel, r), out, accumulate=r > 0)
                elif self.sent is not None:  # the same bits as decoding this rank's payload again
                    sent = self.sent.reshape(-1)
                    out.copy_(sent) if r == 0 else out.add_(sent.to(out.dtype))
                else:  # the bytes sent are this payload's: no need to parse them back
                    self.comp.decompress_into(self.payload, out, accumulate=r > 0)
            out.div_(self.comm.size)
        return out, self.sent
