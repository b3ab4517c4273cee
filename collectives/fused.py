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

Results are the same bits as the per-tensor calls, on every rank.

Wire format of one rank's bytes for one destination (or for everyone): ``n`` int64 lengths
(one per tensor, 0 for an empty one), then the payloads' wire bytes back to back. The header
is one row for the set as a whole: the layout (shapes and dtypes) and the keys and
compressors are compared by hash, so a mismatch raises ``ValueError`` on every rank, as for a
single allreduce.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from gradcomp.compress import transaction

from . import _telemetry as telemetry
from . import worker
from ._algorithm import ALGORITHMS
from ._comm import Comm
from .reduction import finish, label, make_spec, start
from ._header import IDX, build, check_same_call, h64, verify
from ._header import sizes as header_sizes
from ._wire import gather_bytes
from .scatter_reduce import exchange_status

__all__ = ["allreduce_fused"]

Item = Tuple[str, torch.Tensor, Any]  # (key, tensor, compressor)


FUSED_ALGORITHMS = ("allgather", "scatter-reduce")


def allreduce_fused(items: Sequence[Item], group=None, async_op: bool = False, *, algorithm: Optional[str] = None):
    """The mean over ``group`` of every tensor in ``items`` (``(key, tensor, compressor)``
    triples, the same order on every rank), each exchange shared by the whole set.

    Each tensor is compressed with its own compressor (a name, a compressor or an
    error-feedback wrapper) under its own key, as ``allreduce(tensor, compressor, key,
    algorithm=algorithm)`` does, and the results are the same bits. ``algorithm``:
    ``"allgather"``, ``"scatter-reduce"`` or None (allgather on two ranks, scatter-reduce on
    more, as ``allreduce`` chooses for compressors whose payloads cannot be summed). Returns a
    list of new tensors in order (or a ``torch.futures.Future`` of it with ``async_op=True``);
    inputs are never written to. Multi-round compressors (PowerSGD) are refused; errors are
    not measured (``measure_error`` is ignored here).
    """
    if algorithm is not None and algorithm not in FUSED_ALGORITHMS:
        raise ValueError(f"allreduce_fused: unknown algorithm {algorithm!r}; allowed: None (allgather on two ranks, "
                         f"scatter-reduce on more), {', '.join(repr(a) for a in FUSED_ALGORITHMS)}")
    items = list(items)
    specs = []
    for key, _, compressor in items:
        spec = make_spec(compressor, algorithm or "allgather", False, False)
        if spec.base.multi_round:
            raise ValueError(f"allreduce_fused cannot send {spec.base.name} for key {key!r}: it needs several "
                             f"rounds; use allreduce for multi-round compressors")
        specs.append(spec)
    return worker.submit(lambda eff: _fused_job(items, specs, eff(group), algorithm), (group,), async_op)


def _fused_job(items: List[Item], specs: list, group, algorithm: Optional[str]) -> List[torch.Tensor]:
    """The whole set is one step: its state is kept only if every mean is finite (see
    :mod:`gradcomp.compress.transaction`)."""
    with transaction.step() as txn:
        out = _fused_exchange(items, specs, group, algorithm)
        txn.observe(out)
    return out


def _fused_exchange(items: List[Item], specs: list, group, algorithm: Optional[str]) -> List[torch.Tensor]:
    labels = {label(s) for s in specs}
    rec = telemetry.Record("allreduce", "?", labels.pop() if len(labels) == 1 else "mixed", "fused", 1)
    comm = Comm(group, rec, "allreduce")
    rec.world_size = comm.size
    name = rec.algorithm = algorithm or ("allgather" if comm.size <= 2 else "scatter-reduce")
    algos: List[Optional[Any]] = [None] * len(items)
    accs: List[Optional[torch.Tensor]] = [None] * len(items)
    cls = ALGORITHMS[name]
    error = None
    try:  # local work first: a failure here must reach the other ranks through the header
        for i, ((key, tensor, _), spec) in enumerate(zip(items, specs)):
            if isinstance(tensor, torch.Tensor):
                rec.dense_bytes += tensor.numel() * tensor.element_size()
            algos[i], accs[i], _ = start(cls, tensor, spec, comm, key, spec.feedback)
    except Exception as exc:
        error = exc
    # after a local failure an algorithm may be half set up: only the lengths travel then
    device = next((t.device for _, t, _ in items if isinstance(t, torch.Tensor)), torch.device("cpu"))
    exact = not all(s.base.fixed_size for s in specs)
    if name == "allgather":
        buf = _pack([None if a is None or error is not None else a.buf for a in algos], device, error)
        table = comm.exchange(_header(comm.size, name, items, specs, error, [buf.numel()]))
        _verify(table, items, specs, error)
        bufs = gather_bytes(comm, buf, header_sizes(table)[:, 0].tolist(), exact=exact)
        per_rank = [_split(b, len(items), r) for r, b in enumerate(bufs)]
        results = [None if a is None else a.combine([parts[i] for parts in per_rank]) for i, a in enumerate(algos)]
    else:
        results = _scatter_reduce(comm, items, specs, algos, device, error, exact)
    out = [torch.empty_like(tensor) if algo is None else finish(algo, tensor, acc, spec.feedback, *result)
           for (_, tensor, _), spec, algo, acc, result in zip(items, specs, algos, accs, results)]
    telemetry.commit(rec)
    return out


def _scatter_reduce(comm: Comm, items: List[Item], specs: list, algos: list, device: torch.device, error,
                    exact: bool) -> list:
    """``ScatterReduce``'s two phases for every tensor, each exchange shared: ``(avg, sent)``
    per tensor (None for an empty one)."""
    w, n = comm.size, len(items)
    # what goes to rank j: every tensor's chunk-j payload, behind n lengths
    per_dest = [[None] * n for _ in range(w)]
    for i, a in enumerate(algos):
        if a is not None and error is None:
            for j, piece in enumerate(a.sendbuf.split(a.out_sizes)):
                per_dest[j][i] = piece
    sends = [_pack(parts, device, error) for parts in per_dest]
    table = comm.exchange(_header(w, "scatter-reduce", items, specs, error, [b.numel() for b in sends]))
    _verify(table, items, specs, error)
    in_sizes = header_sizes(table)[:, comm.rank].tolist()
    got = comm.all_to_all(torch.cat(sends), [b.numel() for b in sends], in_sizes)
    failure, reduced = None, [None] * n
    try:  # a failure here is mine alone: report it before the all-gather, not by hanging
        from_rank = [_split(b, n, r) for r, b in enumerate(got.split(in_sizes))]
        for i, a in enumerate(algos):
            if a is not None:
                reduced[i] = a.reduce_chunk([parts[i] for parts in from_rank])
        buf = _pack(reduced, device, None)
    except Exception as exc:
        failure, buf = exc, got.new_empty(0)
    sizes = exchange_status(comm, buf.numel(), failure)
    per_rank = [_split(b, n, r) for r, b in enumerate(gather_bytes(comm, buf, sizes, exact=exact))]
    return [None if a is None else a.finish([parts[i] for parts in per_rank]) for i, a in enumerate(algos)]


def _pack(parts: Sequence[Optional[torch.Tensor]], device: torch.device, error) -> torch.Tensor:
    """``len(parts)`` int64 lengths (0 for None), then the parts' bytes; only the lengths
    (all zero) when ``error`` is set."""
    lengths = [0 if p is None or error is not None else p.numel() for p in parts]
    prefix = torch.tensor(lengths, dtype=torch.int64).view(torch.uint8).to(device)
    if error is not None:
        return prefix
    return torch.cat([prefix, *(p for p in parts if p is not None)])


def _layout(items: List[Item]) -> str:
    return repr([(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else type(t).__name__
                 for _, t, _ in items])


def _header(world: int, algorithm: str, items: List[Item], specs: list, error, sizes: List[int]) -> List[int]:
    numel = sum(t.numel() for _, t, _ in items if isinstance(t, torch.Tensor))
    row = build(world, op="allreduce", algorithm=algorithm, tensor=torch.empty(numel, device="meta"),
                compressor="|".join(s.desc for s in specs), key="\n".join(k for k, _, _ in items),
                error=error is not None, sizes=sizes)
    row[IDX["shape"]] = h64(_layout(items))  # every tensor's shape and dtype, in order
    row[IDX["ndim"]] = len(items)
    return row


def _verify(table: torch.Tensor, items: List[Item], specs: list, error) -> None:
    def same(name: str) -> bool:
        return len(set(table[:, IDX[name]].tolist())) == 1

    check_same_call(table, op="allreduce")  # a rank in allreduce instead: say so, not "different tensors"
    if not (same("shape") and same("ndim") and same("numel")):
        per_rank = ", ".join(f"rank {r}: {row[IDX['ndim']]} tensors of {row[IDX['numel']]} elements"
                             for r, row in enumerate(table.tolist()))
        raise ValueError(f"allreduce_fused: ranks passed different tensors ({per_rank}, layouts compared by hash); "
                         f"every rank must pass the same shapes and dtypes in the same order")
    descs = sorted({s.desc for s in specs})
    keys = f"{items[0][0]}..{items[-1][0]}" if items else ""
    verify(table, op="allreduce", error=error, local={"compressor": ", ".join(descs), "key": keys})


def _split(buf: torch.Tensor, n: int, rank: int) -> List[torch.Tensor]:
    """Rank ``rank``'s bytes cut into its ``n`` payloads, by the lengths in front of them."""
    head = 8 * n
    lengths = np.frombuffer(buf[:head].cpu().numpy().tobytes(), dtype="<i8") if buf.numel() >= head else None
    if lengths is None or (lengths < 0).any() or head + int(lengths.sum()) != buf.numel():
        raise ValueError(f"allreduce_fused: the bytes from rank {rank} do not hold {n} payloads as announced; "
                         f"ranks run different gradcomp versions or the data was corrupted")
    return list(buf[head:].split([int(x) for x in lengths]))
