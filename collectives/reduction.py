"""The core of ``allreduce``: resolve the compressor, choose the algorithm, run one reduction.

The algorithm is chosen from what the compressor declares, never from its name:

- ``multi_round`` (PowerSGD) -> ``rounds``;
- ``native`` (payload summable as it is: fp16, bf16, shared-seed random-k) -> ``native``;
- otherwise ``allgather`` on two ranks (one compression, the same bytes) and
  ``scatter-reduce`` on more (bytes per rank bounded, at the cost of a second compression).

``algorithm=`` forces one; a pairing that cannot work raises ``ValueError``. Error-feedback
wrappers (``ErrorFeedback``, ``EF21``, ``DGCMomentum``: anything with ``compressor``,
``accumulate``, ``update`` and ``combine``) are applied around the whole tensor:
``acc = accumulate(tensor)``; the algorithm compresses ``acc`` cast to the input's dtype
(whole, in chunks or in rounds), as ``ErrorFeedback.compress`` does; ``update(key, acc,
sent)`` with what this rank's payload decoded to; ``combine`` finishes.

When the wrapper can keep its residual in place (``keeps_residual_in_place(tensor)``:
``ErrorFeedback`` around a compressor that ``compresses_in_place``, gradient in the residual's
dtype) and the algorithm compresses without a dtype cast (``allgather``, ``scatter-reduce``),
the same arithmetic takes fewer passes: ``accumulate_in_place`` adds the tensor to the
residual, the algorithm compresses the residual with ``compress_residual``, which leaves the
compression error there, and no decoded copy of this rank's payload is made.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Type

import torch

from gradcomp.compress import Compressor, Feedback, available_compressors, get_compressor, is_feedback, transaction
from gradcomp.compress.base import FLOAT_DTYPES, work_dtype
from gradcomp.compress.sparse import payload_bounds

from . import _telemetry as telemetry
from . import allgather, native, rounds  # noqa: F401  (importing each registers its algorithm)
from ._algorithm import ALGORITHMS, Algorithm, fresh
from ._comm import Comm
from .wire.bounds import local_bounds
from .scatter_reduce import serve


@dataclass
class Spec:
    """A call's compressor and options, resolved once, validated before any communication."""

    base: Compressor
    feedback: Any  # an error-feedback wrapper (or an adapter of it), or None
    owner: Any  # the caller's wrapper: keys the server-side feedback of scatter-reduce
    desc: str  # compressor and options, compared across ranks
    algorithm: Optional[str]
    measure: bool
    verify: bool


def make_spec(compressor: Any, algorithm: Optional[str], measure_error: Optional[bool], verify_native: bool) -> Spec:
    """Resolve and check what the caller passed (the same on every rank, so errors here need no
    exchange); ``ValueError`` naming what is allowed. A name makes a new compressor for this
    call alone: state kept per key (step counters of random streams, warm starts) lives in the
    object the caller passes, so nothing carries from one call by name to the next. A
    compressor unbiased through its random stream is refused by name: made anew, it would draw
    the same stream at every call of a key (the same positions for randomk), which no longer
    averages out over calls."""
    if isinstance(compressor, str):
        base, feedback = get_compressor(compressor), None
        if base.stochastic and base.unbiased:
            raise ValueError(f"compressor {compressor!r} is unbiased through a random stream per key and step; by name "
                             f"it is made anew at every call and would draw the same stream each time. Create it once "
                             f"and pass "
                             f"it at every call: c = get_compressor({compressor!r}); allreduce(t, c, key=...)")
    elif isinstance(compressor, Compressor):
        base, feedback = compressor, None
    elif is_feedback(compressor) and isinstance(compressor.compressor, Compressor):
        base, feedback = compressor.compressor, compressor
    else:
        raise ValueError(f"compressor must be a name ({', '.join(available_compressors())}), a Compressor, or an "
                         f"error-feedback wrapper such as ErrorFeedback(c); got {type(compressor).__name__}")
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; allowed: None (chosen from the compressor), "
                         f"{', '.join(repr(a) for a in ALGORITHMS)}")
    if algorithm is not None:
        reason = ALGORITHMS[algorithm].unsuitable(base)
        if reason:
            fits = [a for a, cls in ALGORITHMS.items() if cls.unsuitable(base) is None]
            raise ValueError(f"algorithm {algorithm!r} cannot serve {base.name}: {reason}; use one of {fits}")
    if measure_error is None:
        measure_error = telemetry.measure_error_default()
    if not isinstance(measure_error, bool) or not isinstance(verify_native, bool):
        raise ValueError("measure_error and verify must be True or False")
    return Spec(base, feedback, feedback, repr(feedback if feedback is not None else base),
                algorithm, measure_error, verify_native)


def choose_algorithm(compressor: Any, world_size: int, algorithm: Optional[str] = None) -> str:
    """The algorithm ``allreduce`` uses for ``compressor`` on ``world_size`` ranks."""
    spec = make_spec(compressor, algorithm, False, False)
    if spec.algorithm is not None:
        return spec.algorithm
    for cls in sorted(ALGORITHMS.values(), key=lambda c: c.order):
        if cls.unsuitable(spec.base) is None and cls.prefers(spec.base, world_size):
            return cls.name
    raise ValueError(f"no collective algorithm takes {spec.base.name} on {world_size} ranks")


def reduce(tensor: Any, spec: Spec, comm: Comm, *, key: str, feedback: Any, part: int = 0, parts: int = 1) -> torch.Tensor:
    """The compressed mean of ``tensor`` over ``comm``: :func:`reduce_many` of one tensor."""
    cls = ALGORITHMS[choose_algorithm(spec.base, comm.size, spec.algorithm)]
    return reduce_many(cls, [(key, tensor, spec.base)], [spec], comm, feedbacks=[feedback], part=part, parts=parts)[0]


def reduce_many(cls: Type[Algorithm], items: List[Tuple[str, Any, Any]], specs: List[Spec], comm: Comm, *,
                feedbacks: List[Optional[Feedback]], shared: bool = False, part: int = 0,
                parts: int = 1, layouts: Optional[dict] = None, into: bool = False) -> List[torch.Tensor]:
    """The compressed mean of every tensor of ``items`` (``(key, tensor, compressor)``) over
    ``comm`` with algorithm ``cls``, in three phases: each tensor's local work (:func:`start`:
    feedback accumulates, the algorithm compresses), the exchange (``cls.exchange``: the header
    and the algorithm's communication, one tensor alone or the whole set sharing each
    exchange), each tensor's finish (:func:`finish`: feedback keeps what the wire did not carry).
    ``allreduce`` is the case of one tensor on its own wire, ``allreduce_fused`` of any number
    sharing each exchange (``shared``; ``layouts`` and ``into``: see ``allreduce_fused``)."""
    started, error = start_many(cls, items, specs, comm, feedbacks, into,
                                bounds=local_bounds(layouts, cls.name, comm.size, items, specs))
    return exchange_started(cls, items, specs, comm, feedbacks, started, error, shared=shared, part=part, parts=parts,
                            layouts=layouts)


def start_many(cls: Type[Algorithm], items: List[Tuple[str, Any, Any]], specs: List[Spec], comm: Comm,
               feedbacks: List[Optional[Feedback]], into: bool = False, bounds: Optional[Dict[str, int]] = None
               ) -> Tuple[List["Started"], Optional[BaseException]]:
    """The local phase of :func:`reduce_many` for every tensor (no communication): each
    tensor's :func:`start` and this rank's local failure (None, the exception, or the
    :class:`~gradcomp.compress.transaction.Deferred` refusals found on the device), which the
    exchange reports to every rank. It may run early, while an earlier exchange is on the wire
    (the worker's look-ahead, see :class:`gradcomp.collectives.bucket.BucketExchange`).
    ``bounds``: the capacities agreed for variable-size payloads (``wire.bounds.local_bounds``)."""
    started: List[Started] = []
    error: Optional[BaseException] = None
    # local work first: a failure here must reach the other ranks, through the header or, on an
    # agreed layout, this rank's status word (a refusal found on the device stays there: Deferred)
    with transaction.deferring() as refused, payload_bounds(bounds):
        try:
            for (key, tensor, _), spec, feedback in zip(items, specs, feedbacks):
                started.append(start(cls, tensor, spec, comm, key, feedback, into))
        except Exception as exc:
            error = exc
    if error is None and refused:
        error = transaction.Deferred(refused)
    started += [Started(None, None, (0, []))] * (len(items) - len(started))
    return started, error


def exchange_started(cls: Type[Algorithm], items: List[Tuple[str, Any, Any]], specs: List[Spec], comm: Comm,
                     feedbacks: List[Optional[Feedback]], started: List["Started"], error: Optional[BaseException], *,
                     shared: bool = False, part: int = 0, parts: int = 1,
                     layouts: Optional[dict] = None) -> List[torch.Tensor]:
    """The exchange and finish of :func:`reduce_many` after its local phase (:func:`start_many`)."""
    results = cls.exchange(comm, items, specs, started, error, shared=shared, part=part, parts=parts,
                           layouts=layouts)
    return [torch.empty_like(tensor) if s.algo is None else finish(s.algo, tensor, s.acc, feedback, *result)
            for (_, tensor, _), s, feedback, result in zip(items, started, feedbacks, results)]


class Started(NamedTuple):
    """One tensor after its local phase: the algorithm set up, what it compressed (``acc``: the
    residual itself when in place), and what its ``local`` returned for the header."""

    algo: Optional[Algorithm]  # None for an empty tensor
    acc: Optional[torch.Tensor]
    local: Tuple[int, List[int]]


def start(cls: Type[Algorithm], tensor: Any, spec: Spec, comm: Comm, key: str, feedback: Optional[Feedback],
          into: bool = False) -> Started:
    """The local phase of one tensor: check it, let error feedback accumulate (in place when
    both the feedback and the algorithm can), compress; ``into``: offer the algorithm the
    tensor for its mean (``Algorithm.offer``). Raises what the caller must report through
    the header."""
    check_input(tensor)
    if not tensor.numel():
        return Started(None, None, (0, []))
    in_place = cls.compresses_residual and feedback is not None and bool(feedback.keeps_residual_in_place(tensor))
    # the second compression of scatter-reduce gets error feedback when the first has it
    server = serve(spec.owner, key, tensor.numel(), comm) if cls.name == "scatter-reduce" and feedback is not None \
        else None
    algo = cls(spec.base, key, comm, feedback=feedback is not None, in_place=in_place, server=server,
               verify=spec.verify)
    with comm.record.timing("compress"):
        acc = tensor.detach()
        if in_place and cls.sums_in_place and hasattr(feedback, "in_place_sum"):
            # the residual's sum with the gradient left to the compressor's first pass
            acc, res = feedback.in_place_sum(acc, key)
            algo.sum_of = (res, tensor.detach())
        elif in_place:
            acc = feedback.accumulate_in_place(acc, key)
        elif feedback is not None:
            acc = feedback.accumulate(acc, key)
        local = algo.local(acc, tensor.dtype)
        if into:
            algo.offer(tensor.detach())
        return Started(algo, acc, local)


def finish(algo: Algorithm, tensor: torch.Tensor, acc: torch.Tensor, feedback: Optional[Feedback],
           avg: torch.Tensor, sent: Optional[torch.Tensor]) -> torch.Tensor:
    """The last phase of one tensor: error feedback keeps what the wire did not carry (unless
    the residual already holds it, in place), combines, and the result takes the input's
    shape and dtype."""
    algo.rec.payload_bytes += algo.payload_bytes
    with algo.rec.timing("decompress"):
        if feedback is not None:
            if not algo.in_place:
                feedback.update(algo.key, acc, sent.reshape(acc.shape).to(tensor.dtype))
            avg = feedback.combine(algo.key, avg.reshape(acc.shape))
        if algo.target is not None and avg.data_ptr() == algo.target.data_ptr():
            return tensor  # the mean was written into it (Algorithm.offer)
        return fresh(avg.reshape(tensor.shape).to(tensor.dtype), tensor, acc)


def check_input(tensor: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"allreduce expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(f"allreduce: tensor dtype {tensor.dtype} is not supported; use float16, bfloat16, float32 or float64")


def measure(rec: telemetry.Record, result: torch.Tensor, tensor: torch.Tensor, comms) -> None:
    """Relative error and cosine similarity against the dense mean (uncounted allreduces)."""
    dense = tensor.detach().to(work_dtype(tensor.dtype), copy=True)
    for comm in comms:
        comm.all_reduce_(dense, count=False).div_(comm.size)
    d, r = dense.reshape(-1).double(), result.detach().reshape(-1).double()
    dn, rn = float(d.norm()), float(r.norm())
    diff = float((r - d).norm())
    rec.rel_error = diff / dn if dn else (0.0 if diff == 0 else math.inf)
    rec.cos_sim = float(r @ d) / (rn * dn) if rn and dn else float(rn == dn)


def flat_job(tensor, spec: Spec, key: str, group) -> torch.Tensor:
    rec = telemetry.Record("allreduce", "?", label(spec), key, 1)
    comm = Comm(group, rec, "allreduce")
    rec.world_size = comm.size
    rec.algorithm = choose_algorithm(spec.base, comm.size, spec.algorithm)
    if isinstance(tensor, torch.Tensor):
        rec.dense_bytes = tensor.numel() * tensor.element_size()
    with transaction.step() as txn:  # state kept only if the exchange completes with a finite mean
        out = reduce(tensor, spec, comm, key=key, feedback=spec.feedback)
        txn.observe(out)
    if spec.measure:
        measure(rec, out, tensor, [comm])
    telemetry.commit(rec)
    return out


def label(spec: Spec) -> str:
    return spec.base.name if spec.feedback is None else f"{getattr(spec.feedback, 'kind', 'ef')}+{spec.base.name}"
