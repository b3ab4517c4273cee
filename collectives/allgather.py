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
payload is never decoded twice; the gradient is added to the residual in the compressor's first
pass, and a compressor that can (the sign family on large CPU tensors) leaves the residual's
own pass to run while the payloads are on the wire.
"""
from __future__ import annotations

from gradcomp.compress import transaction
from gradcomp.kernels.memory import empty, zeros

from ._algorithm import Algorithm, Cost, Pending, as_dtype, register_algorithm, shares_memory, wdtype
from .wire.bounds import Bounds, bounded_layout, bounded_set, exact_sizes
from .wire.frame import decode, encode, gather_bytes, pack, split
from .wire.header import set_header, verify_set
from .wire.header import sizes as header_sizes
from .wire.layouts import Layout, SizedLayout, agreed_buffer, announce, device_of, local_status, padded_buffer, signature
from .wire.status import OK, Flags, checked, status_problem, statuses


# CPU results from this many elements on are allocated and faulted in while the payloads are on
# the wire (the calling thread waits there anyway): 4 MB of fp32
PREFAULT_MIN = 1 << 20


@register_algorithm
class AllGather(Algorithm):
    name = "allgather"
    code = 2
    order = 2
    compresses_residual = True
    sums_in_place = True

    @classmethod
    def prefers(cls, compressor, world_size):
        return world_size <= 2

    @classmethod
    def wire(cls, payload, world):
        """Every rank's payload to every other rank: the sizes (a header), then the payloads."""
        return Cost((world - 1) * payload, 2)

    def local(self, acc, dtype):
        if self.in_place:  # acc is the residual: compressed whole, the error stays in it
            payload = self.comp.compress_residual(acc, self.key, sum_of=self.sum_of, defer=self.pending)
        elif self.want_sent:
            payload, self.sent = self.comp.compress_decoded(as_dtype(acc, dtype), self.key)
        else:
            payload = self.comp.compress(as_dtype(acc, dtype), self.key)
        self.payload = payload
        self.payload_bytes = payload.nbytes
        self._buf = None  # the wire bytes, made when the validated format is sent (not on an agreed layout)
        self.device = acc.device
        self.dtype = wdtype(acc)
        self._out = None
        if self.device.type == "cpu" and acc.numel() >= PREFAULT_MIN:  # the result's page faults on the wire's time
            self.pending.append(Pending("decompress", self._prefault))
        return 0, None

    def _prefault(self):
        if self.target is None:
            self._out = self._result(touch=True)

    def _result(self, touch: bool = False):
        """A new flat result: zeroed for a combine that starts from zeros (fresh zeros cost no
        more than an empty buffer's first touch, and a sparse combine writes only the positions
        sent), uninitialised for one that writes every element."""
        make = zeros if self.sent is None and self.comp.starts_from_zeros else empty
        return make(self.payload.numel, self.dtype, self.device, touch=touch)

    def offer(self, tensor):
        """The input receives the mean when it is contiguous, of the result's dtype and shares
        no memory with this rank's payload (which the combine reads while it writes)."""
        if (tensor.is_contiguous() and tensor.dtype == self.dtype and tensor.numel() == self.payload.numel
                and tensor.numel() and not shares_memory(tensor, *self.payload.tensors)):
            self.target = tensor.view(-1)

    @property
    def buf(self):
        if self._buf is None:
            self._buf = encode(self.payload, self.device)
        return self._buf

    def sizes(self):
        return [self.buf.numel()]

    @classmethod
    def exchange_many(cls, comm, items, specs, algos, error, layouts=None):
        """One header and one all-gather of every tensor's payload for the whole set; on a
        layout the ranks agreed on (``layouts``, see ``collectives/wire/layouts.py``) after its first
        exchange, one all-gather of the raw payload tensors and nothing else."""
        device, exact = device_of(items), exact_sizes(specs)
        sig = signature(cls.name, comm.size, items, specs) if layouts is not None else None
        if sig is not None and sig in layouts:
            entry = layouts[sig]
            if not exact:
                return cls._agreed(comm, items, algos, error, entry, device)
            if entry.begin():  # payloads of the agreed capacities: a fixed-size exchange
                return cls._agreed(comm, items, algos, error, entry.fixed, device)
            return cls._agreed_sized(comm, items, algos, error, entry, device)
        error = transaction.resolve(error)  # the checked header says it: refusals read now
        buf = pack([None if a is None or error is not None else a.buf for a in algos], device, error)
        table = comm.exchange(set_header(comm.size, cls.name, items, specs, error, [buf.numel()]))
        verify_set(table, items, specs, error)
        bufs = gather_bytes(comm, buf, header_sizes(table)[:, 0].tolist(), exact=exact,
                            while_sending=cls.finish_all(algos))
        per_rank = [split(b, len(items), r) for r, b in enumerate(bufs)]
        out = [None if a is None else a.combine([parts[i] for parts in per_rank]) for i, a in enumerate(algos)]
        if sig is not None:  # every rank got here: the layout is checked, later exchanges send it raw
            payloads = [None if a is None else a.payload for a in algos]
            layouts[sig] = Bounds(SizedLayout(payloads), bounded_set(specs)) if exact else Layout(payloads)
        return out

    @classmethod
    def _agreed_sized(cls, comm, items, algos, error, entry, device):
        """An agreed set of variable-size payloads (``collectives/wire/layouts.py``): every rank's
        status and leading dimensions in one small all-gather, read at once (the exchange's one
        host read), then the payloads in one all-gather padded to the largest rank's bytes.
        The sizes read set the capacities of the set's next exchanges (``Bounds``)."""
        layout = entry.sized
        payloads = [None if a is None else a.payload for a in algos]
        status, dims = local_status(layout, payloads, error)
        table = announce(comm, status, dims, layout.count, error, device)  # the one host read
        placed = [layout.place(row[1:], r) for r, row in enumerate(table)]
        if entry.bounded:
            found = bounded_layout(layout, [row[1:] for row in table],
                                   [a is not None and not a.comp.fixed_size for a in algos])
            if found is not None:
                entry.set({k: c for (k, _, _), c in zip(items, found[0]) if c is not None}, found[1])
        templates, nbytes = placed[comm.rank]
        buf = padded_buffer(templates, payloads, nbytes, max(n for _, n in placed), device)
        rows = comm.all_gather(buf, cls.finish_all(algos))
        flags = Flags(transaction.current())
        out = []
        for i, ((key, _, _), a) in enumerate(zip(items, algos)):
            if a is None:
                out.append(None)
                continue
            peers = [None if r == comm.rank else checked(a.comp, placed[r][0][i].read(rows[r]), key, r, flags)
                     for r in range(comm.size)]
            out.append(a.average(peers))
        flags.settle()
        return out

    @classmethod
    def _agreed(cls, comm, items, algos, error, layout, device):
        payloads = [None if a is None else a.payload for a in algos]
        buf, status = agreed_buffer(layout, payloads, device, error)
        rows = comm.all_gather(buf, cls.finish_all(algos))
        flags = Flags(transaction.current())
        flags.add(statuses(rows), status_problem)
        if isinstance(error, transaction.Deferred):  # which refusal: said here, when the flags are read
            error.flag_into(flags.txn)
        elif error is not None:
            raise error
        if status != OK:
            raise ValueError(status_problem([status if r == comm.rank else OK for r in range(comm.size)]))
        out = []
        for (key, _, _), a, t in zip(items, algos, layout.templates):
            if a is None:
                out.append(None)
                continue
            peers = []
            for r in range(comm.size):
                peers.append(None if r == comm.rank else checked(a.comp, t.read(rows[r]), key, r, flags))
            out.append(a.average(peers))
        flags.settle()
        return out

    def run(self, table):
        sizes = header_sizes(table)[:, 0].tolist()
        return self.combine(gather_bytes(self.comm, self.buf, sizes, exact=not self.comp.fixed_size,
                                         while_sending=self.finish_local))

    def combine(self, bufs):
        """Decode every rank's payload bytes (``bufs``, in rank order) and average them:
        ``(average, sent)``. Shared with ``allreduce_fused``, which gathers many at once."""
        with self.rec.timing("decompress"):
            payloads = [None if r == self.comm.rank else decode(buf, self.device, self.payload.numel, r)
                        for r, buf in enumerate(bufs)]
        return self.average(payloads)

    def average(self, payloads):
        """Average every rank's payload (``payloads`` in rank order, None for this rank's own):
        ``(average, sent)``."""
        self.finish_local()  # the input's last reads (the residual passes) before a target is written
        with self.rec.timing("decompress"):
            out = self.target if self.target is not None else self._out if self._out is not None else self._result()
            if self.sent is None:  # every payload decoded, this rank's too: the compressor's combine
                zeroed = out is not self.target and self.comp.starts_from_zeros
                self.comp.decompress_mean_into([self.payload if p is None else p for p in payloads], out, zeroed=zeroed)
                return out, self.sent
            for r, payload in enumerate(payloads):
                if r != self.comm.rank:
                    self.comp.decompress_into(payload, out, accumulate=r > 0)
                elif self.sent is not None:  # the same bits as decoding this rank's payload again
                    sent = self.sent.reshape(-1)
                    out.copy_(sent) if r == 0 else out.add_(sent.to(out.dtype))
                else:  # the bytes sent are this payload's: no need to parse them back
                    self.comp.decompress_into(self.payload, out, accumulate=r > 0)
            out.div_(self.comm.size)
        return out, self.sent
