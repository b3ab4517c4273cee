"""Bucketing: many tensors fused into flat buckets, one compressed allreduce per bucket.

Small tensors cost a header and a latency each; fused, they cost one per bucket. Buckets hold
tensors of one dtype and device, in the given order, up to ``bucket_mb`` (a larger tensor
gets a bucket of its own). Error feedback stays per tensor name: each tensor's residual is
added before fusing and its share of the bucket's error is kept under its own name, so the
state survives any change of bucket layout (and matches an unbucketed run). Compressor state
(step counters, warm starts, the scatter-reduce server residual) is kept per bucket key,
``"{key_prefix}bucket:{first}..{last}#{hash}"``, which changes when the layout changes.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from . import worker
from ._header import h64
from ._core import flat_job, make_spec

Tensors = Union[Mapping[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]]]


def plan_buckets(tensors: Sequence[Tuple[str, torch.Tensor]], bucket_mb: float) -> List[List[int]]:
    """Indices of ``tensors`` per bucket: grouped by (device, dtype) in order of first
    appearance, filled in order up to ``bucket_mb`` megabytes (2**20 bytes)."""
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
        raise ValueError(f"bucket_mb={bucket_mb!r} must be a number > 0")
    cap = bucket_mb * 2**20
    kinds: Dict[Tuple[str, torch.dtype], List[int]] = {}
    for i, (_, t) in enumerate(tensors):
        kinds.setdefault((str(t.device), t.dtype), []).append(i)
    buckets: List[List[int]] = []
    for members in kinds.values():
        current: List[int] = []
        size = 0
        for i in members:
            nbytes = tensors[i][1].numel() * tensors[i][1].element_size()
            if current and size + nbytes > cap:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            buckets.append(current)
    return buckets


class _PerName:
    """Presents per-name error feedback as feedback over one flat bucket."""

    def __init__(self, feedback: Any, names: List[str], shapes: List[torch.Size]) -> None:
        self.compressor = feedback.compressor
        self.kind = getattr(feedback, "kind", "ef")
        self.fb, self.names, self.shapes = feedback, names, shapes
        self.numels = [s.numel() for s in shapes]

    def _pieces(self, flat: torch.Tensor):
        # empty tensors are skipped, as an allreduce of an empty tensor leaves feedback alone
        return [(n, s, p) for n, s, p in zip(self.names, self.shapes, flat.reshape(-1).split(self.numels)) if p.numel()]

    def accumulate(self, flat, key):
        return torch.cat([self.fb.accumulate(p.view(s), n).reshape(-1) for n, s, p in self._pieces(flat)])

    def update(self, key, acc, sent):
        for (n, s, a), (_, _, b) in zip(self._pieces(acc), self._pieces(sent)):
            self.fb.update(n, a.view(s), b.view(s))

    def keeps_residual_in_place(self, tensor) -> bool:
        return False  # each piece keeps its own residual under its own name

    def accumulate_in_place(self, tensor, key):
        raise ValueError("a bucket's per-name feedback keeps no residual in place")

    def combine(self, key, avg):
        return torch.cat([self.fb.combine(n, p.view(s)).reshape(-1) for n, s, p in self._pieces(avg)])


def _bucket_job(items: List[Tuple[str, torch.Tensor]], spec, key: str, group, eff) -> Dict[str, torch.Tensor]:
    names = [n for n, _ in items]
    shapes = [t.shape for _, t in items]
    flat = torch.cat([t.detach().reshape(-1) for _, t in items])
    if spec.feedback is not None:
        spec = replace(spec, feedback=_PerName(spec.feedback, names, shapes))
    out = flat_job(flat, spec, key, eff(group))
    return {n: piece.view(s) for n, s, piece in zip(names, shapes, out.split([s.numel() for s in shapes]))}


def allreduce_buckets(tensors: Tensors, compressor: Any = "none", *, bucket_mb: float = 25.0, group=None,
                      async_op: bool = False, algorithm: Optional[str] = None, key_prefix: str = "",
                      measure_error: Optional[bool] = None):
    """The mean over ``group`` of every named tensor, one compressed allreduce per bucket.

    ``tensors``: a mapping or ``(name, tensor)`` pairs, in the same order on every rank.
    Returns ``{name: mean}`` (new tensors; inputs untouched), or with ``async_op=True`` a
    ``torch.futures.Future`` of it. ``compressor`` and the other options as in ``allreduce``.
    """
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise ValueError("allreduce_buckets: tensor names must be unique")
    for n, t in items:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"allreduce_buckets: {n!r} is a {type(t).__name__}, not a torch.Tensor")
    spec = make_spec(compressor, algorithm, measure_error, False)
    if spec.feedback is not None:
        spec.desc = f"per-name {spec.desc}"
    futures = []
    for bucket in plan_buckets(items, bucket_mb):
        members = [items[i] for i in bucket]
        layout = ";".join(f"{n}:{tuple(t.shape)}" for n, t in members)
        key = f"{key_prefix}bucket:{members[0][0]}..{members[-1][0]}#{h64(layout) & 0xFFFFFFFF:08x}"
        futures.append(worker.submit(partial(_bucket_job, members, spec, key, group), (group,), async_op))
    if async_op:
        return worker.all_of(futures, lambda parts: _merge(names, parts))
    return _merge(names, futures)


def _merge(names: List[str], parts: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    merged: Dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return {n: merged[n] for n in names}
