"""What exchanges shared by many tensors have in common (``allreduce_fused``).

Wire format of one rank's bytes for one destination (or for everyone): ``n`` int64 lengths
(one per tensor, 0 for an empty one), then the payloads' wire bytes back to back. The header
is one row for the set as a whole: the layout (shapes and dtypes) and the keys and
compressors are compared by hash, so a mismatch raises ``ValueError`` on every rank, as for a
single allreduce. An algorithm that can share its exchanges among many tensors implements
``Algorithm.exchange_many`` with these.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from gradcomp.compress import Payload
from gradcomp.compress.payload import view_bytes
from gradcomp.compress.transaction import Deferred, Transaction
from gradcomp.kernels.memory import copy_from_host

from ._header import IDX, build, check_same_call, h64, verify

Item = Tuple[str, torch.Tensor, Any]  # (key, tensor, compressor)


def pack(parts: Sequence[Optional[torch.Tensor]], device: torch.device, error) -> torch.Tensor:
    """``len(parts)`` int64 lengths (0 for None), then the parts' bytes; only the lengths
    (all zero) when ``error`` is set."""
    lengths = [0 if p is None or error is not None else p.numel() for p in parts]
    prefix = torch.tensor(lengths, dtype=torch.int64).view(torch.uint8).to(device)
    if error is not None:
        return prefix
    return torch.cat([prefix, *(p for p in parts if p is not None)])


def device_of(items: List[Item]) -> torch.device:
    """Where the set's bytes travel: the first tensor's device (CPU for a set of no tensors)."""
    return next((t.device for _, t, _ in items if isinstance(t, torch.Tensor)), torch.device("cpu"))


def exact_sizes(specs: list) -> bool:
    """Whether payload sizes may differ between ranks (so they travel point to point)."""
    return not all(s.base.fixed_size for s in specs)


def layout(items: List[Item]) -> str:
    return repr([(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else type(t).__name__
                 for _, t, _ in items])


def header(world: int, algorithm: str, items: List[Item], specs: list, error, sizes: List[int]) -> List[int]:
    numel = sum(t.numel() for _, t, _ in items if isinstance(t, torch.Tensor))
    row = build(world, op="allreduce", algorithm=algorithm, tensor=torch.empty(numel, device="meta"),
                compressor="|".join(s.desc for s in specs), key="\n".join(k for k, _, _ in items),
                error=error is not None, sizes=sizes)
    row[IDX["shape"]] = h64(layout(items))  # every tensor's shape and dtype, in order
    row[IDX["ndim"]] = len(items)
    return row


def verify_many(table: torch.Tensor, items: List[Item], specs: list, error) -> None:
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


def split(buf: torch.Tensor, n: int, rank: int) -> List[torch.Tensor]:
    """Rank ``rank``'s bytes cut into its ``n`` payloads, by the lengths in front of them."""
    head = 8 * n
    lengths = np.frombuffer(buf[:head].cpu().numpy().tobytes(), dtype="<i8") if buf.numel() >= head else None
    if lengths is None or (lengths < 0).any() or head + int(lengths.sum()) != buf.numel():
        raise ValueError(f"allreduce_fused: the bytes from rank {rank} do not hold {n} payloads as announced; "
                         f"ranks run different gradcomp versions or the data was corrupted")
    return list(buf[head:].split([int(x) for x in lengths]))


# ---- agreed layouts: payloads as raw tensors, no per-call header ---------------------------
# A caller that has made every rank agree on the set (keys, shapes, dtypes, compressors: the
# training runtime checks it when a bucket layout is first seen) passes a ``layouts`` dict.
# The first exchange of a layout runs the self-describing, validated path above; every rank
# then keeps each payload's structure (a :class:`Template`: its tensors' dtypes and shapes and
# its meta, which for a fixed-size compressor depend only on the tensor and configuration) and
# later exchanges of that layout send the payload tensors as they are, back to back in one
# flat device buffer behind an 8-byte status word: no header, no host copy, no host read.
# The receiver cuts each rank's buffer by its own templates; what only the data can show (a
# peer that failed locally, sparse indices out of range) is flagged on the device and read
# with the step's finiteness, when the transaction ends (``Transaction.flag``).
_ALIGN = 8  # each tensor starts at a multiple of 8 bytes, so it can be viewed where it lies
OK, FAILED, CHANGED = 0, 1, 2  # the status word


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
        offset = _ALIGN  # the status word
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
    buf[:_ALIGN].view(torch.int64).fill_(status)
    if status == OK:
        for p, t in zip(payloads, layout.templates):
            if t is not None:
                t.write(p, buf)
        if deferred is not None:
            _fail_where_refused(buf[:_ALIGN].view(torch.int64), deferred)
    return buf, status


def _fail_where_refused(word: torch.Tensor, deferred: Deferred) -> None:
    """This rank's one-element int64 status ``word`` set to FAILED where a refusal of
    ``deferred`` holds, decided on the word's device (nothing read)."""
    bad = deferred.bad()
    word.copy_(torch.where(bad if bad.device == word.device else bad.to(word.device), FAILED, word))


def statuses(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's status word (a device tensor, not read here)."""
    return rows[:, :_ALIGN].contiguous().view(torch.int64).reshape(-1)


def status_problem(values: List[int]) -> str:
    failed = [r for r, v in enumerate(values) if v == FAILED]
    changed = [r for r, v in enumerate(values) if v == CHANGED]
    parts = []
    if failed:
        parts.append(f"rank(s) {failed} failed to compress their gradients (the error is raised there)")
    if changed:
        parts.append(f"the payloads of rank(s) {changed} no longer fit the layout agreed at the bucket's first "
                     f"exchange (only a payload's sizes may change between steps, and only for a compressor "
                     f"that declares fixed_size=False)")
    return "; ".join(parts) or "an agreed exchange failed"


class Flags:
    """The device flags of one agreed exchange: handed to the open transaction, which reads
    them with the step's finiteness; with none open, to one of their own, read at
    :meth:`settle` (one host read)."""

    def __init__(self, txn: Any) -> None:
        self.own = txn is None
        self.txn = Transaction() if txn is None else txn

    def add(self, bad: torch.Tensor, problem) -> None:
        self.txn.flag(bad, problem)

    def settle(self) -> None:
        if self.own and self.txn.problems:
            raise ValueError("; ".join(self.txn.problems))


def checked(comp: Any, payload: Payload, key: str, rank: int, flags: Flags) -> Payload:
    """A payload read from an agreed layout, made safe by its compressor
    (``Compressor.check_on_device``); what only its values can show is noted in ``flags``."""
    payload, bad = comp.check_on_device(payload)
    if bad is not None:
        flags.add(bad, lambda _: f"the payload of {key!r} from rank {rank} is invalid")
    return payload


# ---- agreed layouts of variable-size payloads ------------------------------------------------
# A compressor whose payload sizes depend on the data (``fixed_size=False``: threshold's
# ``[values, indices]``) keeps everything of its payload's structure from one step to the next
# except each tensor's leading dimension. On an agreed layout those dimensions travel first, in
# one small all-gathered int64 vector per exchange, with each rank's status in front: its read
# is the exchange's one host read (the self-describing path reads a header, the lengths and every
# payload's checks). Every rank then knows every rank's sizes, checks them (the same values on
# every rank, so all raise alike) and cuts the payloads out of one all-gather padded to the
# largest rank's bytes, which NCCL needs (its all-gather takes equal sizes).


def int64_vector(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """A small int64 tensor of host ``values`` on ``device``, built without making the host
    wait for the device where that is a GPU (pinned memory, asynchronous copy)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=torch.int64, device=device)
    return copy_from_host(torch.empty(len(values), dtype=torch.int64, device=device),
                          torch.tensor(values, dtype=torch.int64))


class _Shape:
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
            t = Template(_Shape(s, mine), offset)
            templates.append(t)
            offset = t.end
        return templates, offset


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
        _fail_where_refused(head[:1], deferred)
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


def padded_buffer(templates: Sequence[Optional[Template]], payloads: Sequence[Any], nbytes: int, width: int,
                  device: torch.device) -> torch.Tensor:
    """``payloads`` at their templates' places in ``width`` bytes, the rest zeros."""
    buf = torch.empty(width, dtype=torch.uint8, device=device)
    for p, t in zip(payloads, templates):
        if t is not None:
            t.write(p, buf)
    buf[nbytes:].zero_()  # the same bits on the wire every time
    return buf


# ---- bounded payloads: variable sizes at an agreed capacity ----------------------------------
# A sized exchange shows every rank every rank's sizes. Where every variable-size payload of the
# set comes from a compressor that can bound its payloads (``Compressor.bounded_sizes``) under
# error feedback (which keeps whatever does not fit), the ranks derive from those sizes, alike,
# a capacity per payload (:func:`capacity`) and a fixed :class:`Layout` of payloads that size.
# The next ``REAGREE`` exchanges of the set compress to exactly that size
# (``compress.sparse.payload_bounds``) and travel as fixed-size payloads: no size vector, no
# host read. Then one sized exchange again measures the sizes and sets new capacities. Every
# rank counts the set's exchanges alike, so all take the same path each time.
REAGREE = 32  # bounded exchanges between two sized ones
SPARE = 0.5  # capacity above the largest size seen: this fraction of it ...
SPARE_MIN = 64  # ... and at least this many elements (never more than the tensor has)


def capacity(count: int, numel: int) -> int:
    """The capacity of a payload whose largest size at the last sized exchange was ``count``
    elements (of a tensor of ``numel``)."""
    return min(numel, count + max(int(count * SPARE), SPARE_MIN))


def bounded_set(specs: list) -> bool:
    """Whether a set's variable-size payloads may all be bounded: each from a compressor with
    ``bounded_sizes``, under error feedback."""
    return all(s.base.fixed_size or (s.base.bounded_sizes and s.feedback is not None) for s in specs)


class Bounds:
    """The agreed layout of a set of variable-size payloads (``sized``: a :class:`SizedLayout`,
    or the algorithm's structure of them) and, once a sized exchange has set them, the
    capacities per compressor key and the fixed layout(s) of payloads that size."""

    def __init__(self, sized: Any, bounded: bool) -> None:
        self.sized, self.bounded = sized, bounded
        self.caps: Optional[Dict[str, int]] = None
        self.fixed: Any = None
        self.left = 0  # bounded exchanges before the next sized one

    def local_caps(self) -> Optional[Dict[str, int]]:
        """The capacities the next exchange's local phase compresses to, or None (sized)."""
        return self.caps if self.left > 0 else None

    def begin(self) -> bool:
        """Whether this exchange is a bounded one (counted): what :meth:`local_caps` said."""
        if self.left > 0:
            self.left -= 1
            return True
        return False

    def set(self, caps: Optional[Dict[str, int]], fixed: Any) -> None:
        """After a sized exchange of a ``bounded`` set: the next ``REAGREE`` are bounded (None:
        the next stays sized)."""
        if caps is not None:
            self.caps, self.fixed, self.left = caps, fixed, REAGREE


def bounded_layout(layout: SizedLayout, rows: Sequence[Sequence[int]], bound: Sequence[bool]
                   ) -> Optional[Tuple[List[Optional[int]], Layout]]:
    """From every rank's announced leading dimensions (``rows``, one per rank, ``layout.count``
    each): a capacity per tensor (None for one not ``bound``) and the :class:`Layout` of
    payloads of those sizes (the others at their announced sizes). None when a tensor that is
    not bound announced different sizes on different ranks (it stays sized)."""
    caps: List[Optional[int]] = []
    shapes: List[Any] = []
    at = 0
    for s, n, b in zip(layout.structures, layout.counts, bound):
        if s is None:
            caps.append(None)
            shapes.append(None)
            continue
        dims = [list(row[at:at + n]) for row in rows]
        at += n
        if b and n and all(t == 0 for t in s.ties):  # one count: every leading dimension tied to the first
            c = capacity(max(d[0] for d in dims), s.numel)
            caps.append(c)
            shapes.append(_Shape(s, [c] * n))
        elif all(d == dims[0] for d in dims):
            caps.append(None)
            shapes.append(_Shape(s, dims[0]))
        else:
            return None
    return caps, Layout(shapes)


def local_bounds(layouts: Optional[dict], algorithm: str, size: int, items: List[Item], specs: list
                 ) -> Optional[Dict[str, int]]:
    """The capacities for a set's local phase (:func:`payload_bounds`), or None."""
    if layouts is None or not exact_sizes(specs):
        return None
    entry = layouts.get(signature(algorithm, size, items, specs))
    return entry.local_caps() if isinstance(entry, Bounds) else None

