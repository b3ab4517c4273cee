"""What every allreduce algorithm shares: the two-phase interface and a few exact helpers.

An algorithm first works locally (``local``: compress, before any communication, so that a
failure there reaches the other ranks through the header instead of leaving them waiting),
then communicates (``run``) and returns the average plus what this rank's own payload decodes
to (``sent``), which error feedback keeps the difference to.
"""
from __future__ import annotations

from typing import ClassVar, Dict, Iterable, List, Optional, Tuple, Type

import torch

from gradcomp.compress import Compressor
from gradcomp.compress.base import work_dtype
from gradcomp.compress.error_feedback import to_finite

from ._comm import Comm


ALGORITHMS: Dict[str, Type["Algorithm"]] = {}  # name -> class, filled by @register_algorithm


def register_algorithm(cls: Type["Algorithm"]) -> Type["Algorithm"]:
    """Class decorator: make an algorithm available by its ``name`` (``allreduce(...,
    algorithm=name)``, the header's ``code``, the automatic choice); refuses a name or code
    that is taken."""
    for other in ALGORITHMS.values():
        if other.name == cls.name or other.code == cls.code:
            raise ValueError(f"algorithm {cls.name!r} (code {cls.code}) collides with {other.name!r} (code {other.code})")
    if cls.code <= 0 or cls.name == "?":
        raise ValueError(f"{cls.__name__} must declare a name and a header code > 0")
    ALGORITHMS[cls.name] = cls
    return cls


class Algorithm:
    """Average a tensor over ``comm`` with ``compressor``; one instance per call.

    What every algorithm declares (class attributes, read by ``allreduce`` and the header):
    ``name``; ``code``, its number in the call header (unique, never reused); ``order`` and
    :meth:`prefers`, the automatic choice (the first suitable algorithm by ``order`` that
    prefers the compressor wins); ``compresses_residual``, whether it can compress an
    error-feedback residual in place (no dtype cast between what is compressed and what is
    remembered). Per call, the caller says whether error feedback wants what this rank sent
    (``feedback``) and whether the residual is compressed in place (``in_place``).
    """

    name: ClassVar[str] = "?"
    code: ClassVar[int] = 0
    order: ClassVar[int] = 100
    compresses_residual: ClassVar[bool] = False

    def __init__(self, compressor: Compressor, key: str, comm: Comm, *, feedback: bool = False,
                 in_place: bool = False, server=None, verify: bool = False) -> None:
        if in_place and not self.compresses_residual:
            raise ValueError(f"algorithm {self.name!r} cannot compress an error-feedback residual in place")
        self.comp = compressor
        self.key = key
        self.comm = comm
        self.rec = comm.record
        self.in_place = in_place  # acc is the residual buffer: the compression error stays in it
        self.want_sent = feedback and not in_place  # error feedback needs this rank's decoded payload
        self.server = server  # scatter-reduce: error feedback of the second compression
        self.verify = verify
        self.payload_bytes = 0
        self.sent: Optional[torch.Tensor] = None

    @classmethod
    def unsuitable(cls, compressor: Compressor) -> Optional[str]:
        """Why this algorithm cannot serve ``compressor`` (None when it can)."""
        return None

    @classmethod
    def exchange_many(cls, comm: Comm, items: list, specs: list, algos: list, device: torch.device,
                      error: Optional[BaseException], exact: bool) -> list:
        """``allreduce_fused``'s exchange: run this algorithm for many tensors at once, each
        exchange shared by the set (``algos``: each tensor's instance after ``local``, None for
        an empty one; ``error``: this rank's local failure, reported through the shared
        header). Returns ``(average, sent)`` per tensor (None for an empty one). An algorithm
        that implements it is available to ``allreduce_fused`` (see ``collectives/_shared.py``)."""
        raise NotImplementedError(f"algorithm {cls.name!r} cannot share its exchanges among tensors")

    @classmethod
    def shares_exchanges(cls) -> bool:
        """Whether :meth:`exchange_many` is implemented (``allreduce_fused`` can use it)."""
        return cls.exchange_many.__func__ is not Algorithm.exchange_many.__func__  # type: ignore[attr-defined]

    @classmethod
    def prefers(cls, compressor: Compressor, world_size: int) -> bool:
        """Whether the automatic choice takes this algorithm for ``compressor`` (asked in
        ``order``, only of suitable algorithms)."""
        return False

    def local(self, acc: torch.Tensor, dtype: torch.dtype) -> Tuple[int, List[int]]:
        """Compress ``acc`` (the input's shape; fp32 under error feedback) as a tensor of the
        input's ``dtype``, so payloads are what the compressor sends without feedback and the
        cast's rounding lands in the residual. Returns (check hash, sizes for the header)."""
        raise NotImplementedError

    def run(self, table: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Communicate and decode: ``(average, sent)``, both with ``acc``'s number of elements."""
        raise NotImplementedError


def mean_in_order(tensors: Iterable[torch.Tensor], count: int, dtype: torch.dtype) -> torch.Tensor:
    """Sum in the given (rank) order in ``dtype``, divide by ``count``: every rank that runs
    this on the same tensors gets the same bits."""
    total = None
    for t in tensors:
        t = t.reshape(-1)
        total = t.to(dtype, copy=True) if total is None else total.add_(t.to(dtype))
    return total.div_(count)


def fresh(t: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """``t``, cloned if it shares memory with any of ``others`` (so it may be changed in place)."""
    if t.numel() and any(o is not None and o.numel() and
                         t.untyped_storage().data_ptr() == o.untyped_storage().data_ptr() for o in others):
        return t.clone()
    return t


def chunk_sizes(numel: int, parts: int) -> List[int]:
    """Sizes of ``torch.tensor_split`` into ``parts``: the first ``numel % parts`` one larger."""
    q, r = divmod(numel, parts)
    return [q + (j < r) for j in range(parts)]


def chunk_key(key: str, j: int) -> str:
    """The compressor key of chunk ``j`` in scatter-reduce (its own step counter and seed)."""
    return f"{key}/chunk{j}"


def wdtype(t: torch.Tensor) -> torch.dtype:
    return work_dtype(t.dtype)


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in the wire ``dtype``; finite values beyond its range saturate (see ``to_finite``)."""
    return t if t.dtype == dtype else to_finite(t, dtype)
