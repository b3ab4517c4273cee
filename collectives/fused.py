"""``allreduce_fused``: many tensors, each compressed on its own, exchanged together.

Each tensor is compressed with its own compressor and key, exactly as ``allreduce(...,
algorithm=A)`` would (error feedback, residuals, server-side residuals and compressor state
per key, so payloads are the same bits), but the whole set shares each exchange instead of
making its own: small tensors are latency-bound, not bandwidth-bound. Two algorithms:

- ``allgather`` (two ranks by default): one header and one payload all-gather; every rank
  decodes every rank's payload of each tensor and sums in rank order (``AllGather``'s own
  decoding). Bytes per rank grow as ``w - 1`` payloads.
- ``scatter-reduce`` (three ranks or more by default): one header, one all-to-all carrying
  every tensor's chunk payloads, one status exchange and one all-gather of the reduced chunks
  (``ScatterReduce``'s own phases, run for each tensor between the exchanges). Bytes per rank
  stay below two payloads for any number of ranks.

Results are the same bits as the per-tensor calls, on every rank. Each algorithm runs its own
shared exchange (``Algorithm.exchange_many``; the wire format in ``collectives/wire/``), so
any registered algorithm that implements it is available here.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from gradcomp.compress import transaction

from . import _telemetry as telemetry
from . import worker
from ._algorithm import ALGORITHMS
from ._comm import Beside, Comm
from .reduction import exchange_started, label, make_spec, start_many
from .wire.bounds import local_bounds
from .wire.layouts import Item

__all__ = ["allreduce_fused"]

def _sharing() -> dict:
    """The registered algorithms that can share their exchanges among many tensors."""
    return {name: cls for name, cls in ALGORITHMS.items() if cls.shares_exchanges()}


def allreduce_fused(items: Sequence[Item], group=None, async_op: bool = False, *, algorithm: Optional[str] = None,
                    layouts: Optional[dict] = None, into: bool = False):
    """The mean over ``group`` of every tensor in ``items`` (``(key, tensor, compressor)``
    triples, the same order on every rank), each exchange shared by the whole set.

    Each tensor is compressed with its own compressor (a name, a compressor or an
    error-feedback wrapper) under its own key, as ``allreduce(tensor, compressor, key,
    algorithm=algorithm)`` does, and the results are the same bits. ``algorithm``:
    ``"allgather"``, ``"scatter-reduce"`` or None (allgather on two ranks, scatter-reduce on
    more, as ``allreduce`` chooses for compressors whose payloads cannot be summed). Returns a
    list of new tensors in order (or a ``torch.futures.Future`` of it with ``async_op=True``);
    inputs are never written to, unless ``into``. Multi-round compressors (PowerSGD) are
    refused; errors are not measured (``measure_error`` is ignored here).

    ``into``: each mean may be written into its own input tensor, as DDP's bucket is (the
    result is then that tensor; no result's allocation, no copy back): where the algorithm can
    (allgather: a contiguous input of the working dtype, fp32 or fp64), once everything that
    reads the input is done; otherwise the result is new. When the call raises, the inputs
    may hold part of a result; the compression state is kept or undone as always.

    ``layouts``: a dict the caller keeps across calls, for callers that have made every rank
    agree on each set it passes (keys, shapes, dtypes and compressors; the training runtime
    checks that when it first sees a bucket layout). The first exchange of a set is checked
    as always; later ones of the same set send fixed-size payloads as raw tensors, without
    the header and the self-describing format, and report a peer's failure or an invalid
    payload through the open transaction (read when it ends). Without it every call is
    checked on its own.
    """
    if algorithm is not None and algorithm not in _sharing():
        raise ValueError(f"allreduce_fused: unknown algorithm {algorithm!r}; allowed: None (allgather on two ranks, "
                         f"scatter-reduce on more), {', '.join(repr(a) for a in _sharing())}")
    items = list(items)
    specs = []
    for key, _, compressor in items:
        spec = make_spec(compressor, algorithm or "allgather", False, False)
        if spec.base.multi_round:
            raise ValueError(f"allreduce_fused cannot send {spec.base.name} for key {key!r}: it needs several "
                             f"rounds; use allreduce for multi-round compressors")
        specs.append(spec)
    tensors = [t for _, t, _ in items if isinstance(t, torch.Tensor)]
    return worker.submit(lambda twin: _fused_job(items, specs, twin(group), algorithm, layouts, into), (group,), async_op,
                         device=worker.device_of(tensors), inputs=tensors)


def _fused_job(items: List[Item], specs: list, group, algorithm: Optional[str],
               layouts: Optional[dict] = None, into: bool = False) -> List[torch.Tensor]:
    """The whole set is one step: its state is kept only if every mean is finite (see
    :mod:`gradcomp.compress.transaction`)."""
    with transaction.step() as txn:
        out = _fused_exchange(items, specs, group, algorithm, layouts, into)
        txn.observe(out)
    return out


class Prepared:
    """A fused set after its local phase (:func:`prepare`): the algorithm chosen, each tensor
    compressed, this rank's local failure kept for the exchange to report."""

    def __init__(self, items: List[Item], specs: list, group, algorithm: Optional[str], into: bool,
                 layouts: Optional[dict] = None) -> None:
        labels = {label(s) for s in specs}
        rec = self.rec = telemetry.Record("allreduce", "?", labels.pop() if len(labels) == 1 else "mixed", "fused", 1)
        comm = self.comm = Comm(group, rec, "allreduce", worker.device_of([t for _, t, _ in items]))
        rec.world_size = comm.size
        name = rec.algorithm = algorithm or next(c.name for c in sorted(_sharing().values(), key=lambda c: c.order)
                                                 if c.prefers(specs[0].base if specs else None, comm.size))
        for _, tensor, _ in items:
            if isinstance(tensor, torch.Tensor):
                rec.dense_bytes += tensor.numel() * tensor.element_size()
        self.items, self.specs, self.cls = items, specs, ALGORITHMS[name]
        self.feedbacks = [s.feedback for s in specs]
        self.started, self.error = start_many(self.cls, items, specs, comm, self.feedbacks, into,
                                              bounds=local_bounds(layouts, name, comm.size, items, specs))

    def exchange(self, layouts: Optional[dict] = None, beside: Optional[Beside] = None) -> List[torch.Tensor]:
        """The exchange and finish; ``beside``: work for the wire time of its collectives."""
        self.comm.beside = beside
        try:
            out = exchange_started(self.cls, self.items, self.specs, self.comm, self.feedbacks, self.started,
                                   self.error, shared=True, layouts=layouts)
        finally:
            self.comm.beside = None
        telemetry.commit(self.rec)
        return out


def prepare(items: Sequence[Item], group, *, algorithm: Optional[str] = None, into: bool = False,
            layouts: Optional[dict] = None) -> Prepared:
    """The local phase of ``allreduce_fused(items, group, algorithm=algorithm, into=into,
    layouts=layouts)`` on the calling thread (each tensor's error feedback and compression; no
    communication), for :func:`exchange_prepared` to finish later with the same ``layouts``:
    what a bucket's exchange does ahead while the previous bucket is on the wire. The caller
    checked ``items`` (compressors resolve, no multi-round one) and runs both phases inside the
    same open transaction."""
    items = list(items)
    specs = [make_spec(c, algorithm or "allgather", False, False) for _, _, c in items]
    return Prepared(items, specs, group, algorithm, into, layouts)


def exchange_prepared(prepared: Prepared, layouts: Optional[dict] = None,
                      beside: Optional[Beside] = None) -> List[torch.Tensor]:
    """The exchange of a :func:`prepare`d set: the bits ``allreduce_fused`` gives, on the
    calling thread (under the transaction the local phase ran in). ``beside``: local work run
    while one of its collectives is on the wire (see :class:`~gradcomp.collectives._comm.Beside`)."""
    with transaction.step() as txn:
        out = prepared.exchange(layouts, beside)
        txn.observe(out)
    return out


def _fused_exchange(items: List[Item], specs: list, group, algorithm: Optional[str],
                    layouts: Optional[dict] = None, into: bool = False) -> List[torch.Tensor]:
    return Prepared(items, specs, group, algorithm, into, layouts).exchange(layouts)
