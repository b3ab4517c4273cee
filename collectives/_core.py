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
from typing import Any, Dict, Optional

import torch

from gradcomp.compress import Compressor, available_compressors, get_compressor, transaction
from gradcomp.compress.base import FLOAT_DTYPES, work_dtype

from . import _telemetry as telemetry
from ._algorithm import fresh
from ._comm import Comm
from ._header import build, verify
from .allgather import AllGather
from .native import Native
from .rounds import Rounds
from .scatter_reduce import ScatterReduce, server_feedback

ALGORITHMS = {cls.name: cls for cls in (Native, AllGather, ScatterReduce, Rounds)}
_named: Dict[str, Compressor] = {}


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
    exchange); ``ValueError`` naming what is allowed."""
    if isinstance(compressor, str):
        if compressor not in _named:  # one shared instance per name, so per-key state persists
            _named[compressor] = get_compressor(compressor)
        base, feedback = _named[compressor], None
    elif isinstance(compressor, Compressor):
        base, feedback = compressor, None
    elif isinstance(getattr(compressor, "compressor", None), Compressor) and all(
            callable(getattr(compressor, m, None)) for m in ("accumulate", "update", "combine")):
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
    if spec.base.multi_round:
        return "rounds"
    if spec.base.native:
        return "native"
    return "allgather" if world_size <= 2 else "scatter-reduce"


def reduce(tensor: Any, spec: Spec, comm: Comm, *, key: str, feedback: Any, part: int = 0, parts: int = 1) -> torch.Tensor:
    """The compressed mean of ``tensor`` over ``comm``: header, algorithm, feedback, cast."""
    rec = comm.record
    name = choose_algorithm(spec.base, comm.size, spec.algorithm)
    # the second compression gets error feedback when the first has it, kept with the caller's wrapper
    server = server_feedback(spec.owner) if name == "scatter-reduce" and feedback is not None else None
    algo = ALGORITHMS[name](spec.base, key, comm, want_sent=feedback is not None, server=server, verify=spec.verify)
    error, acc, check, sizes = None, None, 0, []
    try:  # local work first: a failure here must reach the other ranks through the header
        check_input(tensor)
        if tensor.numel():
            with rec.timing("compress"):
                acc = tensor.detach()
                if (feedback is not None and getattr(algo, "takes_residual", False)
                        and _keeps_residual_in_place(feedback, tensor)):
                    algo.want_sent, algo.in_place = False, True
                    acc = feedback.accumulate_in_place(acc, key)
                elif feedback is not None:
                    acc = feedback.accumulate(acc, key)
                check, sizes = algo.local(acc, tensor.dtype)
    except Exception as exc:
        error = exc
    table = comm.exchange(build(comm.size, op="allreduce", algorithm=name, tensor=tensor, compressor=spec.desc,
                                key=key, part=part, parts=parts, measure=spec.measure, error=error is not None,
                                check=check, sizes=sizes))
    verify(table, op="allreduce", error=error, local={"compressor": spec.desc, "key": key})
    if tensor.numel() == 0:
        return torch.empty_like(tensor)
    avg, sent = algo.run(table)
    rec.payload_bytes += algo.payload_bytes
    with rec.timing("decompress"):
        if feedback is not None:
            if not getattr(algo, "in_place", False):  # in place, the residual already holds the error
                feedback.update(key, acc, sent.reshape(acc.shape).to(tensor.dtype))
            avg = feedback.combine(key, avg.reshape(acc.shape))
        return fresh(avg.reshape(tensor.shape).to(tensor.dtype), tensor, acc)


def _keeps_residual_in_place(feedback: Any, tensor: torch.Tensor) -> bool:
    keeps = getattr(feedback, "keeps_residual_in_place", None)
    return callable(keeps) and callable(getattr(feedback, "accumulate_in_place", None)) and bool(keeps(tensor))


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
