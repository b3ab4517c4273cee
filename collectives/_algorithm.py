"""What every allreduce algorithm shares: the two-phase interface and a few exact helpers.

An algorithm first works locally (``local``: compress, before any communication, so that a
failure there reaches the other ranks through the header instead of leaving them waiting),
then communicates (``run``) and returns the average plus what this rank's own payload decodes
to (``sent``), which error feedback keeps the difference to.

Every algorithm also states its cost (:meth:`Algorithm.wire`, :meth:`Algorithm.cost`): the bytes
one rank puts on the wire and the messages it waits for, a :class:`Cost`, which a link model
turns into time (``Cost.ms``). ``compressor="auto"`` predicts its exchanges with it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, Iterable, List, Optional, Protocol, Tuple, Type

import torch

from gradcomp.compress import Compressor, transaction
from gradcomp.compress.base import work_dtype
from gradcomp.compress.error_feedback import to_finite

from ._comm import Comm
from .wire.header import build, claim_code, verify


ALGORITHMS: Dict[str, Type["Algorithm"]] = {}  # name -> class, filled by @register_algorithm


def register_algorithm(cls: Type["Algorithm"]) -> Type["Algorithm"]:
    """Class decorator: make an algorithm available by its ``name`` (``allreduce(...,
    algorithm=name)``, the header's ``code``, the automatic choice); refuses a name or code
    that is taken."""
    if cls.name == "?":
        raise ValueError(f"{cls.__name__} must declare a name")
    claim_code(cls.name, cls.code)
    ALGORITHMS[cls.name] = cls
    return cls


class LinkModel(Protocol):
    """What :meth:`Cost.ms` needs of a link (``gradcomp.training.auto.Link`` is one)."""

    def ms(self, sent_bytes: float, messages: int) -> float: ...


@dataclass(frozen=True)
class Cost:
    """One exchange as one rank sees it on the wire: ``sent`` bytes it sends and ``messages``
    message latencies it waits for, one after another (the alpha-beta model)."""

    sent: float
    messages: int

    def ms(self, link: LinkModel) -> float:
        """Milliseconds on ``link``."""
        return link.ms(self.sent, self.messages)


def ring(world: int) -> float:
    """The share of a tensor one rank sends in a ring allreduce (reduce-scatter, then
    all-gather) over ``world`` ranks: ``2 (w - 1) / w``."""
    return 2 * (world - 1) / world


def payload_bytes(codec: Any, numel: int) -> float:
    """The bytes of one rank's payload for ``numel`` elements, as the compressor declares them
    (``bits_per_element``; a variable-size compressor's theoretical size)."""
    base = getattr(codec, "base", codec)
    return base.bits_per_element(numel) * numel / 8


class Pending:
    """Work for :attr:`Algorithm.pending` that telemetry counts as ``phase``."""

    def __init__(self, phase: str, fn: Callable[[], None]) -> None:
        self.phase, self.fn = phase, fn

    def __call__(self) -> None:
        self.fn()


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
    # with compresses_residual: local() takes the residual before the gradient is added to it
    # (``sum_of``) and lets the compressor add in its first pass
    sums_in_place: ClassVar[bool] = False
    needs: ClassVar[Optional[str]] = None  # a capability the compressor must declare (and is then preferred for)

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
        self.sum_of: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # see sums_in_place
        # residual passes a compressor left to run while the payloads are on the wire
        # (compress_residual's defer): see finish_local
        self.pending: List[Callable[[], None]] = []
        # the caller's tensor the mean may be written into (see offer); None: a new tensor
        self.target: Optional[torch.Tensor] = None

    def offer(self, tensor: torch.Tensor) -> None:
        """The input ``tensor`` may receive this tensor's mean (``allreduce_fused(into=True)``,
        a DDP bucket): an algorithm that can write its result there keeps it as
        :attr:`target`, once everything that reads the input is done. By default it cannot."""

    def finish_local(self) -> None:
        """Run the work left in :attr:`pending` (residual passes, timed as compression; a
        :class:`Pending` says its own phase): while an exchange is in flight
        (``Comm.all_gather``'s ``while_sending``), at the latest before the average is made."""
        while self.pending:
            fn = self.pending.pop(0)
            with self.rec.timing(fn.phase if isinstance(fn, Pending) else "compress"):
                fn()

    @staticmethod
    def finish_all(algos: Iterable[Optional["Algorithm"]]) -> Callable[[], None]:
        """What an exchange of ``algos`` runs while its payloads are on the wire."""
        def run() -> None:
            for a in algos:
                if a is not None:
                    a.finish_local()
        return run

    @classmethod
    def unsuitable(cls, compressor: Compressor) -> Optional[str]:
        """Why this algorithm cannot serve ``compressor`` (None when it can): by default, that
        it lacks the capability the algorithm ``needs``."""
        if cls.needs is not None and not getattr(compressor.capabilities, cls.needs):
            return f"{compressor.name} does not declare {cls.needs}=True, which algorithm {cls.name!r} needs"
        return None

    @classmethod
    def exchange(cls, comm: Comm, items: list, specs: list, started: list, error: Optional[BaseException], *,
                 shared: bool = False, part: int = 0, parts: int = 1, layouts: Optional[dict] = None) -> list:
        """The exchange phase of ``reduction.reduce_many``: the call header and this
        algorithm's communication for ``items`` (``started``: each tensor after its local phase;
        ``error``: this rank's local failure, reported to every rank through the header).
        Returns ``(average, sent)`` per tensor (None for an empty one). ``shared``: the set
        shares each exchange (:meth:`exchange_many`, ``allreduce_fused``'s wire, whatever the
        number of tensors); otherwise one tensor travels alone (its header, then :meth:`run`).
        ``layouts``: see ``collectives/wire/layouts.py`` (agreed layouts; shared exchanges only)."""
        if shared:
            return cls.exchange_many(comm, items, specs, [s.algo for s in started], error, layouts=layouts)
        if len(items) != 1:
            raise ValueError(f"{len(items)} tensors must share their exchanges (shared=True)")
        error = transaction.resolve(error)  # the header says it: refusals read now
        (key, tensor, _), spec, (algo, _, (check, sizes)) = items[0], specs[0], started[0]
        if sizes is None:  # made only when the header needs them (AllGather encodes then)
            sizes = algo.sizes() if algo is not None else []
        table = comm.exchange(build(comm.size, op="allreduce", algorithm=cls.name, tensor=tensor, compressor=spec.desc,
                                    key=key, part=part, parts=parts, measure=spec.measure, error=error is not None,
                                    check=check, sizes=sizes))
        verify(table, op="allreduce", error=error, local={"compressor": spec.desc, "key": key})
        return [None if algo is None or tensor.numel() == 0 else algo.run(table)]

    @classmethod
    def exchange_many(cls, comm: Comm, items: list, specs: list, algos: list, error: Optional[BaseException],
                      layouts: Optional[dict] = None) -> list:
        """Many tensors at once, each exchange shared by the set (``algos``: each tensor's
        instance after ``local``, None for an empty one; ``error``: this rank's local failure,
        reported through the shared header). Returns ``(average, sent)`` per tensor (None for an
        empty one). An algorithm that implements it is available to ``allreduce_fused`` (see
        ``collectives/wire/layouts.py``). ``layouts``: the caller's agreed layouts, which an
        algorithm may use to skip the header after a layout's first exchange (or ignore)."""
        raise NotImplementedError(f"algorithm {cls.name!r} cannot share its exchanges among tensors")

    @classmethod
    def shares_exchanges(cls) -> bool:
        """Whether :meth:`exchange_many` is implemented (``allreduce_fused`` can use it)."""
        return cls.exchange_many.__func__ is not Algorithm.exchange_many.__func__  # type: ignore[attr-defined]

    @classmethod
    def prefers(cls, compressor: Compressor, world_size: int) -> bool:
        """Whether the automatic choice takes this algorithm for ``compressor`` (asked in
        ``order``, only of suitable algorithms): by default, when it ``needs`` a capability
        (which the compressor then declares)."""
        return cls.needs is not None

    @classmethod
    def wire(cls, payload: float, world: int) -> Cost:
        """What one rank sends, and the messages it waits for, when every rank's payload is
        ``payload`` bytes (measured, or :func:`payload_bytes`), over ``world`` ranks."""
        raise NotImplementedError(f"algorithm {cls.name!r} does not state its cost")

    @classmethod
    def cost(cls, codec: Any, numel: int, world: int) -> Cost:
        """The wire cost of averaging ``numel`` elements with ``codec`` (a compressor or an
        error-feedback wrapper) over ``world`` ranks, from the compressor's declared payload
        size: :meth:`wire` of :func:`payload_bytes`."""
        return cls.wire(payload_bytes(codec, numel), world)

    def local(self, acc: torch.Tensor, dtype: torch.dtype) -> Tuple[int, Optional[List[int]]]:
        """Compress ``acc`` (the input's shape; fp32 under error feedback) as a tensor of the
        input's ``dtype``, so payloads are what the compressor sends without feedback and the
        cast's rounding lands in the residual. Returns (check hash, sizes for the header, or
        None when :meth:`sizes` makes them on demand)."""
        raise NotImplementedError

    def sizes(self) -> List[int]:
        """The header's sizes, for an algorithm whose ``local`` returned None for them."""
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


def shares_memory(t: torch.Tensor, *others: Optional[torch.Tensor]) -> bool:
    """Whether the non-empty ``t`` lies in the storage of any non-empty tensor of ``others``."""
    if not t.numel():
        return False
    storage = t.untyped_storage().data_ptr()
    return any(o is not None and o.numel() and o.untyped_storage().data_ptr() == storage for o in others)


def fresh(t: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """``t``, cloned if it shares memory with any of ``others`` (so it may be changed in place)."""
    return t.clone() if shares_memory(t, *others) else t


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
