"""Agreed layouts: payloads as raw tensors at places every rank derives, with no header.

A caller that has made every rank agree on a set of tensors (keys, shapes, dtypes,
compressors: the training runtime checks it when a bucket layout is first seen) passes a
``layouts`` dict. The first exchange of a layout runs the self-describing, validated path
(``frame.py``'s lengths and payloads, ``header.py``'s set row); every rank then keeps each
payload's structure (a :class:`Template`: its tensors' dtypes and shapes and its meta, which
for a fixed-size compressor depend only on the tensor and configuration) and later exchanges
of that layout send the payload tensors as they are, back to back in one flat device buffer
behind a status word (``status.py``): no header, no host copy, no host read. The receiver cuts
each rank's buffer by its own templates. Variable-size payloads keep a :class:`SizedLayout`
(their leading dimensions announced first); bounded ones an agreed capacity (``bounds.py``).

Point-to-point channels learn their layouts the same way, both ends alike: a
:class:`LayoutCache` keeps each channel's layout once every self-describing message of an
exchange on it had the same one (the pipeline's transport: a channel is a direction and a stage
boundary, its layout a message's structure), and later exchanges send the payloads raw on it.
"""
from __future__ import annotations

from typing import Any, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

import torch

from gradcomp.compress import Payload
from gradcomp.compress.payload import view_bytes
from gradcomp.compress.transaction import Deferred

from .frame import int64_vector
from .status import CHANGED, FAILED, OK, WORD, fail_where_refused, status_problem

Item = Tuple[str, torch.Tensor, Any]  # (key, tensor, compressor)


def device_of(items: List[Item]) -> torch.device:
    """Where the set's bytes travel: the first tensor's device (CPU for a set of no tensors)."""
    return next((t.device for _, t, _ in items if isinstance(t, torch.Tensor)), torch.device("cpu"))


_ALIGN = 8  # each tensor starts at a multiple of 8 bytes, so it can be viewed where it lies


class Template:
    """The structure of one payload: compressor, shape, dtype, meta and each tensor's dtype,
    shape and byte offset in the agreed buffer."""

    def __init__(self, payload: Any, offset: int) -> None:
        self.compressor, self.shape, self.dtype = payload.compressor, tuple(payload.shape), payload.dtype
        self.meta = dict(payload.meta)
        self.tensors = [(t.dtype, tuple(t.shape), t.numel() * t.element_size()) for t in payload.tensors]
        self.offsets = []
        for _, _, size in self.tensors:
            self.offsets.append(offset)
            offset += -(-size // _ALIGN) * _ALIGN
        self.end = offset

    def matches(self, payload: Any) -> bool:
        """Whether ``payload`` has this structure (host metadata only, nothing is read)."""
        return (payload.compressor == self.compressor and tuple(payload.shape) == self.shape
                and payload.dtype == self.dtype and payload.meta == self.meta
                and [(t.dtype, tuple(t.shape)) for t in payload.tensors] == [(d, s) for d, s, _ in self.tensors])

    def write(self, payload: Any, buf: torch.Tensor) -> None:
        """``payload``'s tensors into ``buf`` at their places, each tensor's alignment bytes
        zeroed: the same bits on the wire every time."""
        for t, off, (_, _, size) in zip(payload.tensors, self.offsets, self.tensors):
            if size:
                buf[off:off + size].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
            buf[off + size:off + -(-size // _ALIGN) * _ALIGN].zero_()

    def read(self, row: torch.Tensor) -> Payload:
        """The payload a peer's buffer holds at this template's place (views of ``row``; an
        empty tensor for one of no bytes, wherever ``row`` starts: :func:`view_bytes`)."""
        tensors = [view_bytes(row[off:off + size], dtype, shape)
                   for off, (dtype, shape, size) in zip(self.offsets, self.tensors)]
        return Payload(self.compressor, self.shape, self.dtype, tensors, dict(self.meta))


class Layout:
    """One agreed set: a template per tensor (None for an empty one) and the buffer's size."""

    def __init__(self, payloads: Sequence[Any]) -> None:
        self.templates: List[Optional[Template]] = []
        offset = WORD  # the status word
        for p in payloads:
            t = None if p is None else Template(p, offset)
            self.templates.append(t)
            offset = offset if t is None else t.end
        self.nbytes = offset


def signature(algorithm: str, size: int, items: List[Item], specs: list) -> tuple:
    """What an agreed layout is known by: algorithm, group size and every tensor's key, shape,
    dtype and compressor configuration, in order."""
    return (algorithm, size, tuple((k, tuple(t.shape), t.dtype, s.desc) if isinstance(t, torch.Tensor) else (k,)
                                   for (k, t, _), s in zip(items, specs)))


def agreed_buffer(layout: Layout, payloads: Sequence[Any], device: torch.device, error) -> Tuple[torch.Tensor, int]:
    """This rank's buffer for an agreed exchange, and its status: the payloads at their places
    (zeros when this rank failed locally, or its payloads no longer fit the layout). A
    :class:`~gradcomp.compress.transaction.Deferred` error (refusals not read yet) leaves the
    status OK on the host and sets the word to FAILED on the device where one holds."""
    deferred = error if isinstance(error, Deferred) else None
    if deferred is not None:
        error = None
    status = FAILED if error is not None else OK
    if status == OK and any((p is None) != (t is None) or (t is not None and not t.matches(p))
                            for p, t in zip(payloads, layout.templates)):
        status = CHANGED
    buf = torch.zeros(layout.nbytes, dtype=torch.uint8, device=device) if status != OK else \
        torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
    buf[:WORD].view(torch.int64).fill_(status)
    if status == OK:
        for p, t in zip(payloads, layout.templates):
            if t is not None:
                t.write(p, buf)
        if deferred is not None:
            fail_where_refused(buf[:WORD].view(torch.int64), deferred)
    return buf, status


# ---- agreed layouts of variable-size payloads ------------------------------------------------
# A compressor whose payload sizes depend on the data (``fixed_size=False``: threshold's
# ``[values, indices]``) keeps everything of its payload's structure from one step to the next
# except each tensor's leading dimension. On an agreed layout those dimensions travel first, in
# one small all-gathered int64 vector per exchange, with each rank's status in front: its read
# is the exchange's one host read (the self-describing path reads a header, the lengths and every
# payload's checks). Every rank then knows every rank's sizes, checks them (the same values on
# every rank, so all raise alike) and cuts the payloads out of one all-gather padded to the
# largest rank's bytes, which NCCL needs (its all-gather takes equal sizes).


class Shape:
    """A payload's structure with given leading dimensions: what :class:`Template` reads off a
    payload (its tensors as meta tensors)."""

    def __init__(self, structure: Any, dims: Sequence[int]) -> None:
        self.compressor, self.shape, self.dtype, self.meta = structure.compressor, structure.shape, \
            structure.dtype, structure.meta
        lead = iter(dims)
        self.tensors = [torch.empty((next(lead), *tail) if nd else (), dtype=dtype, device="meta")
                        for dtype, nd, tail in structure.slots]


class _Structure:
    """One payload's agreed structure: compressor, shape, dtype, meta and each tensor's dtype,
    dimensionality and trailing shape; ``ties[j]``: the first varying tensor whose leading
    dimension equalled tensor ``j``'s when the layout was agreed (a values/indices pair), so a
    peer announcing unequal ones is refused."""

    def __init__(self, payload: Any) -> None:
        self.compressor, self.shape, self.dtype = payload.compressor, tuple(payload.shape), payload.dtype
        self.meta = dict(payload.meta)
        self.numel = int(payload.numel)
        self.slots = [(t.dtype, t.dim(), tuple(t.shape[1:])) for t in payload.tensors]
        lead = [t.shape[0] for t in payload.tensors if t.dim()]
        self.ties = [lead.index(d) for d in lead]

    def dims(self, payload: Any) -> Optional[List[int]]:
        """``payload``'s leading dimensions, or None when its structure is not this one."""
        if not (payload.compressor == self.compressor and tuple(payload.shape) == self.shape
                and payload.dtype == self.dtype and payload.meta == self.meta
                and [(t.dtype, t.dim(), tuple(t.shape[1:])) for t in payload.tensors] == self.slots):
            return None
        return [t.shape[0] for t in payload.tensors if t.dim()]

    def invalid(self, dims: Sequence[int]) -> bool:
        """Whether announced dimensions cannot be this structure's: negative, beyond the
        tensor's number of elements (a sparse payload keeps at most every element) or breaking
        a tie."""
        return any(d < 0 or d > max(self.numel, 1) for d in dims) or \
            any(dims[j] != dims[i] for j, i in enumerate(self.ties))


class SizedLayout:
    """One agreed set of variable-size payloads (see above): a structure per tensor (None for an
    empty one); ``count`` leading dimensions per rank."""

    def __init__(self, payloads: Sequence[Any]) -> None:
        self.structures = [None if p is None else _Structure(p) for p in payloads]
        self.counts = [0 if s is None else len(s.ties) for s in self.structures]
        self.count = sum(self.counts)

    def dims(self, payloads: Sequence[Any]) -> Optional[List[int]]:
        """This rank's leading dimensions, in order, or None when a payload left the layout."""
        out: List[int] = []
        for p, s in zip(payloads, self.structures):
            if (p is None) != (s is None):
                return None
            if s is not None:
                d = s.dims(p)
                if d is None:
                    return None
                out += d
        return out

    def place(self, dims: Sequence[int], rank: int) -> Tuple[List[Optional[Template]], int]:
        """The templates of a rank that announced ``dims`` and its bytes; ValueError (the same
        on every rank, which all read the same sizes) when they cannot be this layout's."""
        templates: List[Optional[Template]] = []
        offset, at = 0, 0
        for s, n in zip(self.structures, self.counts):
            if s is None:
                templates.append(None)
                continue
            mine = list(dims[at:at + n])
            at += n
            if s.invalid(mine):
                raise ValueError(f"allreduce_fused: rank {rank} announced payload sizes {mine} that a "
                                 f"{s.compressor} payload of {s.numel} elements cannot have; ranks run different "
                                 f"gradcomp versions or the data was corrupted")
            t = Template(Shape(s, mine), offset)
            templates.append(t)
            offset = t.end
        return templates, offset


def padded_buffer(templates: Sequence[Optional[Template]], payloads: Sequence[Any], nbytes: int, width: int,
                  device: torch.device) -> torch.Tensor:
    """``payloads`` at their templates' places in ``width`` bytes, the rest zeros."""
    buf = torch.empty(width, dtype=torch.uint8, device=device)
    for p, t in zip(payloads, templates):
        if t is not None:
            t.write(p, buf)
    buf[nbytes:].zero_()  # the same bits on the wire every time
    return buf


def announce(comm: Any, status: int, dims: Optional[Sequence[int]], count: int, error: Optional[BaseException],
             device: torch.device) -> List[List[int]]:
    """Every rank's status and ``count`` sizes (``dims``; zeros when None), all-gathered and read
    at once: the one host read of a variable-size agreed exchange. A refusal still on the
    device (``error`` a :class:`~gradcomp.compress.transaction.Deferred`) sets this rank's
    status there. When any rank is not OK every rank raises here, alike: the failing rank its
    own error, the others which rank failed. Returns the rows (status first)."""
    deferred = error if isinstance(error, Deferred) else None
    head = int64_vector([status, *(list(dims) if dims is not None else [0] * count)], device)
    if deferred is not None:
        fail_where_refused(head[:1], deferred)
    table = comm.all_gather(head).tolist()
    states = [row[0] for row in table]
    if any(states):
        if states[comm.rank] == FAILED and error is not None:
            raise (deferred.resolve() or deferred) if deferred is not None else error
        raise ValueError(status_problem(states))
    return table


def local_status(layout: SizedLayout, payloads: Sequence[Any], error: Optional[BaseException]
                 ) -> Tuple[int, Optional[List[int]]]:
    """This rank's status and sizes for :func:`announce`: FAILED for a local error (a refusal
    still on the device is decided there), CHANGED when a payload left the layout."""
    if error is not None and not isinstance(error, Deferred):
        return FAILED, None
    dims = layout.dims(payloads)
    return (OK, dims) if dims is not None else (CHANGED, None)


# ---- layouts learned per point-to-point channel ----------------------------------------------
_MIXED = object()  # a channel whose messages had more than one layout in the exchange


class LayoutCache:
    """\"Agree the layout once, then send raw" for point-to-point channels: what both ends of a
    channel (any hashable key) know of its messages' structure (any value compared with
    ``==``), learned at both ends from the self-describing messages of one exchange.

    An exchange that learns (:meth:`begin` with ``learn=True``: both ends alike, every message
    framed) notes each message's layout at both ends (:meth:`note`), the sender's on sending and
    the receiver's on decoding what arrived; at :meth:`end` each channel the exchange used takes the
    layout every one of its messages had, or forgets its layout when they differed. Both ends saw
    the same messages, so both end with the same cache. :meth:`knows` says whether a set of
    channels can travel raw; :meth:`forget` drops everything (the next exchanges are framed)."""

    __slots__ = ("_known", "_seen", "learning")

    def __init__(self) -> None:
        self._known: Dict[Hashable, Any] = {}
        self._seen: Dict[Hashable, Any] = {}  # this exchange's layout per channel (_MIXED: not one)
        self.learning = False  # the current exchange notes its messages' layouts

    def begin(self, learn: bool) -> None:
        """Start an exchange; ``learn``: its messages are framed and their layouts noted."""
        self.learning, self._seen = learn, {}

    def note(self, channel: Hashable, layout: Any) -> None:
        """A framed message of the learning exchange had ``layout`` on ``channel`` (no-op when
        the exchange does not learn)."""
        if not self.learning:
            return
        seen = self._seen.get(channel, layout)
        self._seen[channel] = layout if seen is not _MIXED and seen == layout else _MIXED

    def end(self) -> None:
        """The exchange is done (every message sent and received): what it learned replaces what
        earlier ones did, per channel it used."""
        if self.learning:
            for channel, layout in self._seen.items():
                if layout is _MIXED:
                    self._known.pop(channel, None)
                else:
                    self._known[channel] = layout
        self.learning, self._seen = False, {}

    def knows(self, channels: Iterable[Hashable]) -> bool:
        """Whether every one of ``channels`` has a layout (an exchange of them can travel raw)."""
        return all(ch in self._known for ch in channels)

    def __getitem__(self, channel: Hashable) -> Any:
        return self._known[channel]

    def __contains__(self, channel: Hashable) -> bool:
        return channel in self._known

    def forget(self) -> None:
        """Drop every channel's layout."""
        self._known.clear()
