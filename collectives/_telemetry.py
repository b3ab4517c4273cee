"""Telemetry: what every collective sent, received and spent, per rank, as plain dicts.

Each call fills one :class:`Record`; records are summed per ``"op/algorithm"`` (e.g.
``"allreduce/scatter-reduce"``, ``"send"``). Bytes are counted from the tensors handed to
``torch.distributed`` (see ``_comm.py`` for the per-operation convention), so framing,
headers and padding are included. ``measure_error`` adds the relative error and cosine
similarity against the dense mean; that costs one extra dense allreduce, whose bytes are not
counted.

Times: on the host clock for CPU tensors; for a call whose tensors are on a CUDA device (the
``Comm`` says so: :attr:`Record.device`) each phase is bracketed by two CUDA events on the
current stream, so the time is the GPU's, not that of queueing its work, and nothing waits for
them until the counters are read (:func:`telemetry`, which then waits for the events).
"""
from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

_SUMMED = ("calls", "bytes_sent", "bytes_recv", "dense_bytes", "payload_bytes",
           "compress_s", "comm_s", "decompress_s")


@dataclass
class Record:
    """One call of one collective on this rank."""

    op: str
    algorithm: str
    compressor: str
    key: str
    world_size: int
    bytes_sent: int = 0  # every byte this rank handed to the backend to send
    bytes_recv: int = 0  # every byte this rank received
    dense_bytes: int = 0  # bytes of the uncompressed input
    payload_bytes: int = 0  # this rank's compressed payload(s), the tensors only
    compress_s: float = 0.0
    comm_s: float = 0.0
    decompress_s: float = 0.0
    rel_error: Optional[float] = None  # ||result - dense mean|| / ||dense mean||
    cos_sim: Optional[float] = None
    # the tensors' device, set by the Comm: CUDA phases are timed with events
    device: Optional[torch.device] = field(default=None, repr=False, compare=False)
    # CUDA phases not read yet: (phase, start event, end event)
    _pending: List[Tuple[str, Any, Any]] = field(default_factory=list, repr=False, compare=False)

    @property
    def ratio(self) -> float:
        """Compression ratio: dense bytes over this rank's payload bytes."""
        return self.dense_bytes / self.payload_bytes if self.payload_bytes else math.inf if self.dense_bytes else 1.0

    @contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        """Add the time spent in the block to ``<phase>_s`` (compress, comm or decompress): the
        GPU's time on the current stream for a call on a CUDA device, read later (:meth:`settle`)."""
        if self.device is not None and self.device.type == "cuda":
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            try:
                yield
            finally:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._pending.append((phase, begin, end))
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            name = f"{phase}_s"
            setattr(self, name, getattr(self, name) + time.perf_counter() - start)

    def done(self) -> bool:
        """Whether every CUDA phase has finished (asked without waiting)."""
        return all(end.query() for _, _, end in self._pending)

    def settle(self) -> None:
        """Add the CUDA phases' times, waiting for their events (a host sync: called when the
        counters are read, never on the collectives' path)."""
        for phase, begin, end in self._pending:
            end.synchronize()
            name = f"{phase}_s"
            setattr(self, name, getattr(self, name) + begin.elapsed_time(end) / 1000.0)
        self._pending.clear()

    def as_dict(self) -> Dict[str, Any]:
        self.settle()
        d = {k: v for k, v in asdict(self).items() if k not in ("device", "_pending")}
        d["ratio"] = self.ratio
        return d


_lock = threading.Lock()
_by_op: Dict[str, Dict[str, Any]] = {}
_unsettled: Dict[str, List[Record]] = {}  # committed records whose CUDA phases are not read yet
_last: Optional[Record] = None
_measure_error = False


def commit(record: Record) -> None:
    """Add a finished record to the aggregates (thread-safe: async calls finish on workers)."""
    global _last
    name = record.op if record.op in ("send", "recv") else f"{record.op}/{record.algorithm}"
    with _lock:
        agg = _by_op.setdefault(name, {**{k: 0 for k in _SUMMED}, "measured": 0,
                                       "rel_error_sum": 0.0, "cos_sim_sum": 0.0})
        agg["calls"] += 1
        # CUDA phases are added when they have finished: the earlier records' now, when their
        # events say so without waiting (so the list holds only the calls still in flight),
        # the rest when the counters are read (telemetry())
        _settle_unsettled(finished_only=True)
        if record._pending:
            _unsettled.setdefault(name, []).append(record)
        for k in _SUMMED[1:]:
            agg[k] += getattr(record, k)
        if record.rel_error is not None:
            agg["measured"] += 1
            agg["rel_error_sum"] += record.rel_error
            agg["cos_sim_sum"] += record.cos_sim
        _last = record


def _settle_unsettled(finished_only: bool) -> None:
    """Add the CUDA phases of committed records to their aggregates: of those whose events
    have finished (``finished_only``, no wait), or of all (waiting for them). Under ``_lock``."""
    for name in list(_unsettled):
        agg, waiting = _by_op[name], []
        for record in _unsettled[name]:
            if finished_only and not record.done():
                waiting.append(record)
                continue
            before = {k: getattr(record, k) for k in ("compress_s", "comm_s", "decompress_s")}
            record.settle()
            for k, v in before.items():
                agg[k] += getattr(record, k) - v
        if waiting:
            _unsettled[name] = waiting
        else:
            del _unsettled[name]


def _finish(agg: Dict[str, Any]) -> Dict[str, Any]:
    out = {k: agg[k] for k in _SUMMED}
    out["ratio"] = agg["dense_bytes"] / agg["payload_bytes"] if agg["payload_bytes"] else (
        math.inf if agg["dense_bytes"] else 1.0)
    if agg["measured"]:
        out["rel_error"] = agg["rel_error_sum"] / agg["measured"]
        out["cos_sim"] = agg["cos_sim_sum"] / agg["measured"]
    return out


def telemetry() -> Dict[str, Any]:
    """This rank's counters as a plain dict.

    ``{"by_op": {"allreduce/native": {...}, ...}, "total": {...}, "last": {...} or None}``;
    each aggregate holds ``calls, bytes_sent, bytes_recv, dense_bytes, payload_bytes,
    compress_s, comm_s, decompress_s, ratio`` and, when errors were measured, the mean
    ``rel_error`` and ``cos_sim``; ``last`` is the most recent call's record.
    """
    with _lock:
        _settle_unsettled(finished_only=False)
        by_op = {k: _finish(v) for k, v in sorted(_by_op.items())}
        total = {k: 0 for k in _SUMMED}
        total.update(measured=0, rel_error_sum=0.0, cos_sim_sum=0.0)
        for agg in _by_op.values():
            for k in total:
                total[k] += agg[k]
        last = _last.as_dict() if _last is not None else None
    return {"by_op": by_op, "total": _finish(total), "last": last}


def reset_telemetry() -> None:
    """Forget every record of this rank."""
    global _last
    with _lock:
        _by_op.clear()
        _unsettled.clear()
        _last = None


def set_measure_error(enabled: bool) -> None:
    """Measure relative error and cosine similarity on every allreduce (an extra dense
    allreduce per call). Every rank must make the same choice."""
    global _measure_error
    if not isinstance(enabled, bool):
        raise ValueError(f"set_measure_error expects True or False, got {enabled!r}")
    _measure_error = enabled


def measure_error_default() -> bool:
    return _measure_error
