"""``allreduce_fused``: many tensors, each compressed on its own, exchanged in one allgather.

Each tensor is compressed with its own compressor and key, exactly as ``allreduce(...,
algorithm="allgather")`` would (error feedback, residuals and compressor state per key, so
payloads are the same bits), but the whole set costs one header exchange and one payload
exchange instead of two per tensor: small tensors are latency-bound, not bandwidth-bound.
Every rank decodes every rank's payload of each tensor and sums in rank order (``AllGather``'s
own decoding), so results are the same bits as the per-tensor calls, on every rank.

Wire format of one rank: ``n`` int64 lengths (one per tensor, 0 for an empty one), then the
payloads' wire bytes back to back. The header is one row for the set as a whole: the layout
(shapes and dtypes) and the keys and compressors are compared by hash, so a mismatch raises
``ValueError`` on every rank, as for a single allreduce.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from . import _async
from . import _telemetry as telemetry
from ._algorithm import fresh
from ._comm import Comm
from ._core import _fuses, check_input, label, make_spec
from ._header import IDX, build, h64, verify
from ._header import sizes as header_sizes
from ._wire import gather_bytes
from .allgather import AllGather

__all__ = ["allreduce_fused"]

Item = Tuple[str, torch.Tensor, Any]  # (key, tensor, compressor)


def allreduce_fused(items: Sequence[Item], group=None, async_op: bool = False):
    """The mean over ``group`` of every tensor in ``items`` (``(key, tensor, compressor)``
    triples, the same order on every rank), with one header and one payload exchange.

    Each tensor is compressed with its own compressor (a name, a compressor or an
    error-feedback wrapper) under its own key, as ``allreduce(tensor, compressor, key,
    algorithm="allgather")`` does, and the results are the same bits. Returns a list of new
    tensors in order (or a ``torch.futures.Future`` of it with ``async_op=True``); inputs are
    never written to. Bytes per rank grow as ``(w-1)`` times the payloads: meant for two
    ranks or small tensors. Multi-round compressors (PowerSGD) are refused; errors are not
    measured (``measure_error`` is ignored here).
    """
    items = list(items)
    specs = []
    for key, _, compressor in items:
        spec = make_spec(compressor, "allgather", False, False)
        if spec.base.multi_round:
            raise ValueError(f"allreduce_fused cannot send {spec.base.name} for key {key!r}: it needs several "
                             f"rounds; use allreduce for multi-round compressors")
        specs.append(spec)
    return _async.submit(lambda eff: _fused_job(items, specs, eff(group)), (group,), async_op)


def _fused_job(items: List[Item], specs: list, group) -> List[torch.Tensor]:
    labels = {label(s) for s in specs}
    rec = telemetry.Record("allreduce", "allgather", labels.pop() if len(labels) == 1 else "mixed", "fused", 1)
    comm = Comm(group, rec, "allreduce")
    rec.world_size = comm.size
    algos: List[Optional[AllGather]] = [None] * len(items)
    accs: List[Optional[torch.Tensor]] = [None] * len(items)
    error = None
    try:  # local work first: a failure here must reach the other ranks through the header
        for i, ((key, tensor, _), spec) in enumerate(zip(items, specs)):
            check_input(tensor)
            rec.dense_bytes += tensor.numel() * tensor.element_size()
            if not tensor.numel():
                continue
            algo = algos[i] = AllGather(spec.base, key, comm, want_sent=spec.feedback is not None)
            with rec.timing("compress"):
                acc, feedback = tensor.detach(), spec.feedback
                if feedback is not None and _fuses(feedback, tensor):
                    algo.want_sent, algo.in_place = False, True
                    acc = feedback.accumulate_in_place(acc, key)
                elif feedback is not None:
                    acc = feedback.accumulate(acc, key)
                algo.local(acc, tensor.dtype)
                accs[i] = acc
    except Exception as exc:
        error = exc
    lengths = [0 if a is None else a.buf.numel() for a in algos]
    prefix = torch.tensor(lengths, dtype=torch.int64).view(torch.uint8)
    device = next((a.device for a in algos if a is not None), torch.device("cpu"))
    buf = torch.cat([prefix.to(device), *(a.buf for a in algos if a is not None)]) if error is None else prefix
    table = comm.exchange(_header(comm.size, items, specs, error, buf.numel()))
    _verify(table, items, specs, error)
    sizes = header_sizes(table)[:, 0].tolist()
    exact = not all(s.base.fixed_size for s in specs)
    bufs = gather_bytes(comm, buf, sizes, exact=exact)
    per_rank = [_split(b, len(items), r) for r, b in enumerate(bufs)]
    out = []
    for i, ((key, tensor, _), spec, algo, acc) in enumerate(zip(items, specs, algos, accs)):
        if algo is None:
            out.append(torch.empty_like(tensor))
            continue
        avg, sent = algo.combine([parts[i] for parts in per_rank])  # times its own decoding
        rec.payload_bytes += algo.payload_bytes
        with rec.timing("decompress"):
            feedback = spec.feedback
            if feedback is not None:
                if not algo.in_place:  # in place, the residual already holds the error
                    feedback.update(key, acc, sent.reshape(acc.shape).to(tensor.dtype))
                avg = feedback.combine(key, avg.reshape(acc.shape))
            out.append(fresh(avg.reshape(tensor.shape).to(tensor.dtype), tensor, acc))
    telemetry.commit(rec)
    return out


def _layout(items: List[Item]) -> str:
    return repr([(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else type(t).__name__
                 for _, t, _ in items])


def _header(world: int, items: List[Item], specs: list, error, nbytes: int) -> List[int]:
    numel = sum(t.numel() for _, t, _ in items if isinstance(t, torch.Tensor))
    row = build(world, op="allreduce", algorithm="allgather", tensor=torch.empty(numel, device="meta"),
                compressor="|".join(s.desc for s in specs), key="\n".join(k for k, _, _ in items),
                error=error is not None, sizes=[nbytes])
    row[IDX["shape"]] = h64(_layout(items))  # every tensor's shape and dtype, in order
    row[IDX["ndim"]] = len(items)
    return row


def _verify(table: torch.Tensor, items: List[Item], specs: list, error) -> None:
    def same(name: str) -> bool:
        return len(set(table[:, IDX[name]].tolist())) == 1

    if same("magic") and same("op") and not (same("shape") and same("ndim") and same("numel")):
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
