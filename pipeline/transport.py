"""The pipeline's transport: every boundary message of a step from one thread, in one agreed order.

Invariants (why, and what was measured: docs/pipeline.md, "No deadlock" and "Shapes that change"):

- **One order.** :func:`message_order` sorts the step's messages by when they arrive in
  :func:`gradcomp.pipeline.schedule.timeline` with messages that take time, one at a time per
  link (:data:`MESSAGE_COST`; ties by kind, boundary, micro-batch), the same list on every
  rank; each rank issues its own messages' operations in it, whoever the peer, so the two ends
  of a link agree (NCCL ignores tags and runs a pair's operations in issue order) and the
  earliest unfinished message always has its send and its receive posted: no deadlock, with a
  stream per pair or one for all of a rank's peers.
- **The frontier.** A send is posted once produced, a receive as soon as everything before it
  is posted; posting stops at a send not yet produced and at a receive whose header is not read
  (it may announce a tail). Each post is one batch of gradcomp's point-to-point operations
  (:func:`gradcomp.collectives.p2p.batch_send_recv`, its operations in the agreed order) from
  the calling thread; operations are waited in issue order.
- **One message per stage output.** A uint8 device tensor: gradcomp's 64-byte point-to-point
  header (``collectives/wire/message.py``, as ``collectives.send``'s: magic, message code,
  payload length, the boundary compressor's hash, dtype, parts table length), then the
  payload in the wire format (self-describing, so shapes may change at any step), built in one
  buffer on the device and parsed where it arrived. An output that is not one floating-point
  tensor (a tuple or list of tensors, None among them, or a tensor of another dtype: masks,
  token ids) is a message of parts (:class:`Parts`): a parts table (JSON: the form and, per
  value, its kind, dtype, shape, whether the sending stage's output required a gradient and
  its bytes), then each value 8-byte aligned (the alignment bytes zero, in a raw message too:
  the same bits on the wire every time): a floating-point tensor through the boundary
  compressor under its own key (``key.i``), any other as its exact bytes, None as nothing.
  Both ends know each channel's capacity (the previous message's length, kept across steps;
  the header alone for its first message); a longer payload sends its rest right after,
  posted by the receiver once it has read the header.
- **Buffers kept.** A message's buffer (sent or received) comes from its channel's
  :class:`_Pool`: one nothing else holds any more (its step's slots and works are gone, and
  no tensor of a caller views it: the storage's use count says so), reused from step to step,
  so a CPU message does not pay a fresh buffer's page faults (a fresh 1 MB buffer filled: 0.21
  ms, a kept one 0.06 ms); a received payload that a caller still holds (a stage input saved for
  backward, a cached activation) keeps its buffer out of reuse.

**Raw steps.** Every message of a step whose layouts are agreed travels raw: its payload's
tensors and nothing else (one tensor: that tensor itself, no copy; several: copied once into one
buffer at offsets both ends derive), received into a buffer of the agreed size, with no header
to read, so posting never stops at a receive. A channel's layout (the message's form and, per
value, the payload's compressor, shape, dtype, meta and tensors' dtypes and shapes, and the stage
output's dtype and gradient flag, or a value's exact dtype and shape) is learned at
both ends from the self-describing messages of a framed step in which every message on that
channel had the same one (the wire's :class:`~gradcomp.collectives.wire.layouts.LayoutCache`,
a channel being a direction and a boundary); :class:`~gradcomp.pipeline.Pipeline` decides, in the batch agreement
every step begins with, whether a step is raw (every rank's layouts known, its inputs shaped as
in the step they were learned in). A payload that does not fit its channel's layout in a raw
step (a shape that depends on the data) cannot tell the receiver so: its rank sends the agreed
bytes of zeros instead and notes :attr:`Transport.mismatched`, and the pipeline undoes the step
and runs it again framed. A raw payload is made safe to decode on the device
(``Compressor.check_on_device``); what only its values show is a flag of the step's
transaction.

A failed or timed-out operation is a ``CommunicationError`` and leaves the transport broken: its
ranks are out of step (``Pipeline`` then refuses further steps).
"""
from __future__ import annotations

import json
import math
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from gradcomp.collectives import CommunicationError
from gradcomp.collectives.p2p import P2P, batch_send_recv
from gradcomp.collectives.wire.layouts import LayoutCache
from gradcomp.collectives.wire.message import (HEADER_BYTES, MAGIC, code_dtype, compressor_hash, dtype_code,
                                               header_bytes)
from gradcomp.compress import Compressor, Payload
from gradcomp.compress.payload import DTYPES, dtype_name, memory_bytes
from gradcomp.compress import transaction
from gradcomp.kernels import memory
from gradcomp.kernels.memory import copy_from_host

from .schedule import Action, timeline

MESSAGES = ("act", "grad")  # the message kinds of schedule.PASSES' sends

# a message's header: gradcomp's point-to-point header (collectives/wire/message.py), 64 bytes
HEAD_GUESS = 512  # payload bytes read with the header: a payload's own JSON header is a few hundred
# What a message costs in the timeline that orders a step's messages, in forwards; a link from
# one rank to another carries one message at a time there. Free messages (0) tie a message
# produced right after another one's arrival with one produced without a wait, and break the
# tie by kind: in 1F1B's steady state stage 0's next activation then came before the gradient
# the last stage had already sent, and stage 0 posted that gradient's receive only once its
# forward was done, while gloo (whose sends move once the receive is posted) held the
# gradient. Measured with the cost as a switch, 2 stages at 1 Gbit/s, three alternating runs each
# against torch's same schedule (the kept order's figures: bench/results/pipeline.md,
# "Every schedule against torch's, 1 Gbit/s"): 1F1B 0.92-0.94x at 0 against 1.06-1.13x at 1 and 3;
# interleaved 0.77-0.78x at 0, 0.92-0.94x at 1 with links that carry any number at once,
# 0.80-0.82x at 3 likewise, 1.01-1.02x at 3 with one message at a time per link (a 1 MB
# message is 8 ms there, a forward 2-3 ms). 1F1B's, GPipe's and ZB-H1's orders on 2 ranks are
# the same at 1 and at 3.
MESSAGE_COST = 3.0
# a plain message carries one of the first four (its header's dtype code); a value of another
# dtype travels as its exact bytes in a message of parts (a mask, token ids)
WIRE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
               torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
FLOAT_DTYPES = frozenset(WIRE_DTYPES[:4])
_PLAIN_CODES = frozenset(dtype_code(d) for d in FLOAT_DTYPES)
MAX_PARTS = 64  # values in one message
MAX_STRUCTURE = 1 << 16  # bytes of a message's parts table (JSON); a few dozen per value


class Message(NamedTuple):
    """One boundary message: ``kind`` "act" (stage ``boundary`` to ``boundary + 1``) or
    "grad" (back), of micro-batch ``mb``."""

    kind: str
    boundary: int
    mb: int

    @property
    def src(self) -> int:
        """The virtual stage that sends it."""
        return self.boundary if self.kind == "act" else self.boundary + 1

    @property
    def dst(self) -> int:
        return self.boundary + 1 if self.kind == "act" else self.boundary

    @property
    def key(self) -> str:
        """The boundary compressor's key (per-key counters and feedback), as the channels always used."""
        return f"{self.kind}{self.boundary}:{self.mb}"

    @property
    def code(self) -> int:
        return (self.boundary * 2 + (self.kind == "grad")) * (1 << 32) + self.mb


def message_order(plans: Sequence[Sequence[Action]], p: int) -> List[Message]:
    """Every message of one step of ``plans`` (each rank's actions), in the order every rank
    issues its operations (see the module docstring): by arrival in :func:`timeline` with
    :data:`MESSAGE_COST`."""
    done = timeline(plans, p, message=MESSAGE_COST)
    out = [(t, kind == "grad", b, mb, Message(kind, b, mb)) for (kind, b, mb), t in done.items() if kind in MESSAGES]
    return [m for *_, m in sorted(out)]


class _Slot:
    """One message of this rank's step: what was posted for it and what came back."""

    __slots__ = ("msg", "out", "peer", "buf", "tail", "works", "length", "read", "hdr", "head")

    def __init__(self, msg: Message, out: bool, peer: int) -> None:
        self.msg, self.out, self.peer = msg, out, peer
        self.buf: Optional[torch.Tensor] = None  # the first part (sent, or posted for receiving)
        self.tail: Optional[torch.Tensor] = None  # the rest of a payload longer than the capacity
        self.works: List[int] = []  # positions of its operations' works in the transport's issue order
        self.length = -1  # payload bytes
        self.read = False  # receive: header read and the tail (if any) posted
        self.hdr: List[int] = []
        self.head: Optional[bytes] = None  # receive: the payload's first bytes, read with the header


class Parts(NamedTuple):
    """A boundary value other than one floating-point tensor, as its message carries it:
    ``values`` (tensors of any dtype the wire carries, or None: a gradient that does not exist)
    delivered as ``form`` (``"tuple"``, ``"list"``, or ``"tensor"``: the one value alone), and
    per value whether the sending stage's output required a gradient (the receiving stage asks
    for the gradients of those only)."""

    form: str
    values: Tuple[Optional[torch.Tensor], ...]
    grad: Tuple[bool, ...]


class Part(NamedTuple):
    """The structure of one value of a message: ``kind`` "t" (a floating-point tensor through
    the boundary compressor: its payload's structure), "x" (a tensor of another dtype, its
    exact bytes) or "n" (None)."""

    kind: str
    compressor: str  # "t": the payload's compressor
    shape: Tuple[int, ...]  # "t": the payload's shape; "x": the tensor's
    dtype: torch.dtype  # "t": the payload's (decoded) dtype; "x": the tensor's
    meta: Any  # "t": the payload's meta, compared whole
    tensors: Tuple[Tuple[torch.dtype, Tuple[int, ...]], ...]  # what travels: each tensor's dtype and shape
    wire_dtype: torch.dtype  # "t": the stage output's dtype, restored on receipt
    grad: bool  # the sending stage's output required a gradient


NONE_PART = Part("n", "", (), torch.float32, None, (), torch.float32, False)


class _Enc(NamedTuple):
    """One value encoded for sending: its structure, its payload ("t") and the tensors that travel."""

    part: Part
    payload: Optional[Payload]
    tensors: List[torch.Tensor]


class Layout(NamedTuple):
    """What both ends of a channel know of its messages in a raw step: the message's form
    (``"plain"``: one floating-point tensor; else a :class:`Parts` form), each value's
    structure, each tensor's offset in the message (8-byte aligned, all values' tensors in
    order) and the message's bytes."""

    form: str
    parts: Tuple[Part, ...]
    offsets: Tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, form: str, parts: Sequence[Part]) -> "Layout":
        offsets, pos = [], 0
        for part in parts:
            for dtype, shape in part.tensors:
                offsets.append(pos)
                pos += _up8(math.prod(shape) * dtype.itemsize)
        # a message of no bytes (every gradient of a tuple None) still sends 8: no 0-byte operation
        return cls(form, tuple(parts), tuple(offsets), pos if form == "plain" else max(pos, 8))

    def fits(self, form: str, parts: Sequence[Part]) -> bool:
        return form == self.form and tuple(parts) == self.parts

    def views(self, buf: torch.Tensor) -> List[List[torch.Tensor]]:
        """Each value's tensors, viewed where they lie in the received ``buf``."""
        flat = iter(zip(self.offsets, [spec for part in self.parts for spec in part.tensors]))
        return [[buf[o:o + math.prod(sh) * d.itemsize].view(d).reshape(sh) for o, (d, sh) in
                 (next(flat) for _ in part.tensors)] for part in self.parts]


def _up8(n: int) -> int:
    return -(-n // 8) * 8


def _use_count(t: torch.Tensor) -> int:
    """How many tensors (and storage handles) share ``t``'s memory: the storage's use count."""
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


class _Pool:
    """One channel's buffers at one end, kept across steps (see the module docstring): a
    buffer is handed out again only when ``t``'s storage has no user but the pool (its count
    equals the one noted when it was made). At most ``KEEP`` buffers per channel are kept;
    more in use at once are made and dropped as before."""

    KEEP = 64
    __slots__ = ("device", "kept")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kept: List[Tuple[torch.Tensor, int]] = []  # (buffer, its use count when only the pool holds it)

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` that nothing else uses, its first ``nbytes``
        returned (a view: the pool's own tensor keeps the memory)."""
        for i, (buf, alone) in enumerate(self.kept):
            if _use_count(buf) == alone:
                if buf.numel() < nbytes:  # grown: the old one goes, a larger one takes its place
                    buf = memory.empty(nbytes, torch.uint8, self.device)
                    self.kept[i] = (buf, _use_count(buf))
                return buf[:nbytes]
        buf = memory.empty(nbytes, torch.uint8, self.device)
        if len(self.kept) < self.KEEP:
            self.kept.append((buf, _use_count(buf)))
        return buf[:nbytes]


class Transport:
    """One rank's boundary messages, step by step (:meth:`begin`, :meth:`send`, :meth:`take`,
    :meth:`finish`); only the thread that drives the pipeline calls it."""

    def __init__(self, group: Any, rank_of_stage: Callable[[int], int], my_stages: Sequence[int],
                 device: torch.device) -> None:
        self.group, self.rank_of_stage, self.device = group, rank_of_stage, device
        self.mine = set(my_stages)
        self.broken: Optional[BaseException] = None
        self.idle = True  # no step open: every operation of the last one is done
        self.sent_bytes = 0  # wire bytes this rank sent in the current (or last) step (framing included)
        self.payload_bytes = 0  # of which the payloads' tensors (what telemetry calls payload bytes)
        self.messages = 0  # point-to-point operations this rank posted in the current step
        self._seq: List[_Slot] = []
        self._slot: Dict[Message, _Slot] = {}
        self._pos = 0
        self._cap: Dict[Tuple[str, int], int] = {}
        self._pools: Dict[Tuple[str, int, bool], _Pool] = {}  # (kind, boundary, outgoing): its buffers
        self.raw = False  # this step's messages travel raw (see the module docstring)
        self.mismatched = False  # a payload of this raw step did not fit its channel's layout
        self._layouts = LayoutCache()  # each channel's Layout, learned in a framed step
        self._works: List[Any] = []  # every work of the step, in issue order
        self._waited = 0  # the works before this position have been waited

    # ---- a step -------------------------------------------------------------------------
    def ready(self, order: Sequence[Message]) -> bool:
        """Whether a step of ``order`` could travel raw: every channel of this rank's messages
        in it has a layout."""
        return self._layouts.knows((m.kind, m.boundary) for m in order if m.src in self.mine or m.dst in self.mine)

    def begin(self, order: Sequence[Message], *, raw: bool = False, learn: bool = False) -> None:
        """Start a step whose messages are ``order`` (the same list on every rank): ``raw`` (every
        rank alike, and only when :meth:`ready`) sends them on the channels' layouts; ``learn``
        (a framed training step) notes each channel's layout for later raw steps."""
        self._check()
        if raw and not self.ready(order):
            raise RuntimeError("pipeline: a raw step needs every channel's layout, learned in a framed step")
        self.raw, self.mismatched = raw, False
        self._layouts.begin(learn and not raw)
        self._seq = []
        for m in order:
            if m.src in self.mine or m.dst in self.mine:
                out = m.src in self.mine
                self._seq.append(_Slot(m, out, self.rank_of_stage(m.dst if out else m.src)))
        self._slot = {s.msg: s for s in self._seq}
        self.idle = not self._seq
        # the channels' capacities carry over from the last step (both ends saw its last message),
        # so a step's first message on a channel is not cut into the header and a tail
        self._pos, self.sent_bytes, self.payload_bytes, self.messages = 0, 0, 0, 0
        self._works, self._waited = [], 0

    def send(self, msg: Message, value: Union[torch.Tensor, Parts], compressor: Any) -> None:
        """Compress ``value`` (a floating-point tensor, or :class:`Parts`: each floating-point
        value through the compressor, others exact) with the boundary ``compressor`` (a
        Compressor or a feedback wrapper of one; its state under ``msg.key``, a value of parts
        under ``msg.key`` + ``.i``) and post it as soon as the agreed order allows."""
        self._check()
        slot = self._slot[msg]
        form, encs = _encode(msg, value, compressor)
        if self.raw:
            self._raw_frame(slot, form, encs)
        else:
            self._frame(slot, _split(compressor)[0], form, encs)
            self._note(msg, form, [e.part for e in encs])
        self.payload_bytes += sum(t.numel() * t.element_size() for e in encs for t in e.tensors)
        self._leave(slot)

    def send_void(self, msg: Message) -> None:
        """In a raw step already void on this rank (:attr:`mismatched`): ``msg``'s agreed bytes,
        as zeros, so that its peer's receive is matched; the step is run again."""
        self._check()
        if not (self.raw and self.mismatched):
            raise RuntimeError("pipeline: send_void is for a raw step a payload has left its layout")
        slot = self._slot[msg]
        lay = self._layout(msg)
        slot.buf, slot.length = self._void(msg, lay), lay.nbytes
        self.sent_bytes += lay.nbytes
        self._leave(slot)

    def _layout(self, msg: Message) -> Layout:
        return self._layouts[(msg.kind, msg.boundary)]

    def _void(self, msg: Message, lay: Layout) -> torch.Tensor:
        """The agreed bytes of ``msg``'s channel as zeros (a void raw message)."""
        return self._pool(msg, True).take(lay.nbytes).zero_()

    def _leave(self, slot: _Slot) -> None:
        """Post ``slot`` (produced) as soon as the agreed order allows."""
        before = len(self._works)
        # The message leaves now: the receives ahead of it in the agreed order are waited for
        # (else it would stay queued until the next take), and so is what was issued before it
        # (torch's pipelining waits a micro-batch's sends at the next one too; on gloo an unwaited
        # send may not move). Both waits are safe in the agreed order. Measured on 2 gloo
        # ranks, 8192-wide boundaries, 8 micro-batches, each against the step without it: the
        # second GPipe 351 -> 235 ms and 1F1B 300 -> 262 ms, the first 1F1B 138 -> 121 ms and
        # interleaved 240 -> 232 ms.
        self._advance(self._seq.index(slot))
        if slot.works and self._waited < before:
            self._wait_index(before)

    def _frame(self, slot: _Slot, base: Compressor, form: str, encs: List[_Enc]) -> None:
        """Header + payload into the slot, built in one buffer on the transport's device (the
        headers copied from the host, each payload tensor copied once into place): padded to
        the channel's capacity, or cut into the first ``capacity`` bytes and a tail. A message
        of parts has its parts table (JSON) after the header, then each value (a payload's wire
        bytes, or a tensor's exact bytes) at an 8-byte aligned offset."""
        msg = slot.msg
        heads = [e.payload.wire_head() if e.payload is not None else b"" for e in encs]
        sizes = [len(h) + sum(t.numel() * t.element_size() for t in e.tensors) for h, e in zip(heads, encs)]
        if form == "plain":
            table, code, length = b"", dtype_code(encs[0].part.wire_dtype), sizes[0]
        else:
            table, code = _parts_table(form, encs, sizes), 0
            length = len(table) + sum(_up8(n) for n in sizes)
        ours = header_bytes(msg.code, length, compressor_hash(base), code, len(table))
        cap = self._capacity(msg)
        whole = HEADER_BYTES + length
        buf = self._pool(msg, True).take(max(whole, cap))
        if form == "plain":
            assert encs[0].payload is not None
            encs[0].payload.write_wire(buf, head=ours + heads[0])  # both headers in one copy from the host
        else:
            pos = HEADER_BYTES + len(table)
            copy_from_host(buf[:pos], torch.frombuffer(bytearray(ours + table), dtype=torch.uint8))
            for head, enc, size in zip(heads, encs, sizes):
                if enc.payload is not None:
                    enc.payload.write_wire(buf[pos:pos + size], head=head)
                elif size:
                    buf[pos:pos + size].copy_(enc.tensors[0].reshape(-1).view(torch.uint8))
                if size % 8:  # the alignment bytes zeroed: the same bits on the wire every time
                    buf[pos + size:pos + _up8(size)].zero_()
                pos += _up8(size)
        if whole < cap:
            buf[whole:].zero_()
            slot.buf = buf
        elif whole == cap:
            slot.buf = buf
        else:
            slot.buf, slot.tail = buf[:cap], buf[cap:]
        self._cap[(msg.kind, msg.boundary)] = whole
        slot.length = length
        self.sent_bytes += whole

    def _raw_frame(self, slot: _Slot, form: str, encs: List[_Enc]) -> None:
        """The values' tensors as the channel's layout places them: the one tensor itself
        where it is a contiguous, 8-byte aligned block of the agreed bytes (no copy; it does
        not change before the step's end), else one buffer; zeros when they do not fit."""
        lay = self._layout(slot.msg)
        tensors = [t for e in encs for t in e.tensors]
        if not lay.fits(form, [e.part for e in encs]):
            self.mismatched = True
            slot.buf = self._void(slot.msg, lay)
        elif len(tensors) == 1 and tensors[0].is_contiguous() and tensors[0].data_ptr() % 8 == 0 \
                and lay.nbytes == tensors[0].numel() * tensors[0].element_size():
            slot.buf = tensors[0].detach().reshape(-1).view(torch.uint8)
        else:
            buf = self._pool(slot.msg, True).take(lay.nbytes)
            end = 0
            for t, o in zip(tensors, lay.offsets):
                size = t.numel() * t.element_size()
                if o > end:  # alignment bytes zeroed, as in a framed message
                    buf[end:o].zero_()
                if size:
                    buf[o:o + size].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
                end = o + size
            if lay.nbytes > end:
                buf[end:].zero_()
            slot.buf = buf
        slot.length = lay.nbytes
        self.sent_bytes += lay.nbytes

    def _note(self, msg: Message, form: str, parts: Sequence[Part]) -> None:
        """A framed training step's message on its channel: the channel's layout once every one
        of the step's messages on it had the same (learned at :meth:`finish`)."""
        if self._layouts.learning:
            self._layouts.note((msg.kind, msg.boundary), Layout.of(form, parts))

    def take(self, msg: Message, compressor: Any) -> Union[torch.Tensor, Parts]:
        """The decoded value of ``msg`` (waits for it), through ``compressor`` as :meth:`send`:
        a tensor, or :class:`Parts`."""
        self._check()
        slot = self._slot[msg]
        at = self._seq.index(slot)
        self._advance(at)
        if self._pos <= at:
            raise RuntimeError(f"pipeline: {msg.key} is needed before this rank produced "
                               f"{self._seq[self._pos].msg.key}, which comes first in the agreed order: the "
                               f"schedule and the message order disagree")
        self._wait(slot)
        assert slot.buf is not None
        if self.raw:
            return self._take_raw(slot, compressor)
        data = slot.buf[HEADER_BYTES:] if slot.tail is None else torch.cat([slot.buf[HEADER_BYTES:], slot.tail])
        data = data[:slot.length]
        base, feedback = _split(compressor)
        if slot.hdr[3] != compressor_hash(base):
            raise ValueError(f"pipeline: {msg.key} from rank {slot.peer} was sent with another boundary compressor "
                             f"than {base!r}; every rank must be built with the same activation_codec and "
                             f"grad_codec")
        try:  # the bytes are this rank's own: the payload may view them where they lie, on the device
            entries: List[_Entry]
            if slot.hdr[5] == 0:
                form, entries = "plain", [("t", code_dtype(slot.hdr[4]), (), True, slot.length)]
            else:
                form, entries = _read_table(self._table_bytes(slot, data))
                if sum(_up8(e[4]) for e in entries) != slot.length - slot.hdr[5]:
                    raise ValueError("its parts do not fill the message")
            parts: List[Part] = []
            values: List[Optional[torch.Tensor]] = []
            pos = slot.hdr[5]
            for i, (kind, dtype, shape, grad, size) in enumerate(entries):
                piece = data[pos:pos + size]
                pos += _up8(size)
                if kind == "n":
                    parts.append(NONE_PART)
                    values.append(None)
                elif kind == "x":
                    parts.append(Part("x", "", shape, dtype, None, ((dtype, shape),), dtype, False))
                    values.append(_exact(piece, dtype, shape))
                else:
                    payload = Payload.from_tensor(piece, head=slot.head if form == "plain" else None)
                    parts.append(_part_of(payload, dtype, grad))
                    values.append(_decoded(_key(msg, form, i), base, feedback, payload, dtype))
        except ValueError as exc:
            raise ValueError(f"pipeline: the payload of {msg.key} from rank {slot.peer} is invalid: {exc}") from None
        self._note(msg, form, parts)
        return _delivered(form, values, parts)

    def _table_bytes(self, slot: _Slot, data: torch.Tensor) -> bytes:
        """A message's parts table: read with the header where it fits (off the CPU), else now."""
        n = slot.hdr[5]
        if slot.head is not None and len(slot.head) >= n:
            return slot.head[:n]
        return data[:n].cpu().numpy().tobytes()

    def _take_raw(self, slot: _Slot, compressor: Any) -> Union[torch.Tensor, Parts]:
        """A raw message decoded on its channel's layout: its tensors viewed in the buffer, made
        safe by the compressor on the device, its flag (if any) noted in the step's transaction."""
        lay = self._layout(slot.msg)
        base, feedback = _split(compressor)
        assert slot.buf is not None
        values: List[Optional[torch.Tensor]] = []
        for i, (part, tensors) in enumerate(zip(lay.parts, lay.views(slot.buf))):
            if part.kind != "t":
                values.append(tensors[0] if part.kind == "x" else None)
                continue
            payload = Payload(part.compressor, part.shape, part.dtype, tensors,
                              dict(part.meta) if isinstance(part.meta, dict) else part.meta)
            payload, bad = base.check_on_device(payload)
            if bad is not None:
                transaction.refuse(bad, f"pipeline: the payload of {slot.msg.key} from rank {slot.peer} is invalid")
            values.append(_decoded(_key(slot.msg, lay.form, i), base, feedback, payload, part.wire_dtype))
        return _delivered(lay.form, values, lay.parts)

    def finish(self) -> None:
        """Post what is left and wait until every operation of the step is done."""
        self._check()
        self._advance(len(self._seq) - 1)
        for slot in self._seq:
            self._wait(slot)
        if self._pos != len(self._seq):
            missing = [s.msg.key for s in self._seq[self._pos:]]
            raise RuntimeError(f"pipeline: the step ended with messages never produced: {missing}")
        self.idle = True
        self._layouts.end()  # what a framed training step showed replaces what earlier ones did

    def forget(self) -> None:
        """Drop every channel's layout (the next steps are framed until they learn again)."""
        self._layouts.forget()

    # ---- the frontier -------------------------------------------------------------------
    def _capacity(self, msg: Message) -> int:
        return self._cap.get((msg.kind, msg.boundary), HEADER_BYTES)

    def _pool(self, msg: Message, out: bool) -> _Pool:
        key = (msg.kind, msg.boundary, out)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool(self.device)
        return pool

    def _advance(self, until: Optional[int]) -> None:
        """Post this rank's operations in the agreed order as far as possible; wait (only) for
        receives at positions up to ``until``, which must be posted when this returns."""
        ops: List[Tuple[P2P, _Slot]] = []
        try:
            while self._pos < len(self._seq):
                slot = self._seq[self._pos]
                if slot.out:
                    if slot.buf is None:
                        break  # not produced yet; nothing after it may go first
                    ops.append((P2P("send", slot.buf, slot.peer), slot))
                    if slot.tail is not None:
                        ops.append((P2P("send", slot.tail, slot.peer), slot))
                    self._pos += 1
                    continue
                if self.raw:  # the agreed bytes: nothing to read before what follows is posted
                    slot.buf = self._pool(slot.msg, False).take(self._layout(slot.msg).nbytes)
                    ops.append((P2P("recv", slot.buf, slot.peer), slot))
                    slot.read = True
                    self._pos += 1
                    continue
                if slot.buf is None:
                    slot.buf = self._pool(slot.msg, False).take(self._capacity(slot.msg))
                    ops.append((P2P("recv", slot.buf, slot.peer), slot))
                    self._post(ops)
                    ops = []
                if (until is None or self._pos > until) and not self._completed(slot):
                    break  # its header may announce a tail, which must be posted before anything after it
                self._wait(slot)
                self._read(slot)
                if slot.tail is not None:
                    ops.append((P2P("recv", slot.tail, slot.peer), slot))
                self._pos += 1
        except RuntimeError as exc:
            raise self._lost(self._seq[min(self._pos, len(self._seq) - 1)], exc) from exc
        except ValueError as exc:  # a header out of step: so are the ranks
            self.broken = exc
            raise
        finally:
            if ops and self.broken is None:
                self._post(ops)

    def _post(self, ops: List[Tuple[P2P, _Slot]]) -> None:
        """One batch of the agreed order's next operations (gradcomp's point-to-point batch)."""
        batch = batch_send_recv([op for op, _ in ops], group=self.group, key="pipeline")
        self.messages += len(ops)
        first = len(self._works)
        self._works.extend(batch.works)
        for i, (_, slot) in enumerate(ops):
            slot.works.append(first + batch.index(i))  # the work its operation completes with

    def _completed(self, slot: _Slot) -> bool:
        """Whether the slot's operations are known done without waiting (gloo tells only once waited)."""
        return all(i < self._waited or self._works[i].is_completed() for i in slot.works)

    def _wait(self, slot: _Slot) -> None:
        """Wait for the slot's operations and, first, for every operation issued before them:
        NCCL completes a stream's operations in issue order anyway, and on gloo a receive
        waited before the sends issued ahead of it can hang (their data does not move until
        they are waited)."""
        if slot.works:
            self._wait_index(max(slot.works) + 1, slot)

    def _wait_index(self, end: int, slot: Optional[_Slot] = None) -> None:
        """Wait for the works issued before position ``end``, in issue order."""
        try:
            while self._waited < end:
                self._works[self._waited].wait()
                self._waited += 1
        except RuntimeError as exc:
            raise self._lost(slot or self._seq[min(self._pos, len(self._seq) - 1)], exc) from exc

    def _read(self, slot: _Slot) -> None:
        """The received header: checked, the capacity of the channel's next message noted, the
        tail of a longer payload allocated (posted by the caller, next in order)."""
        assert slot.buf is not None
        # one host read per message: this header and, off the CPU, where the buffer holds them, the
        # payload's first bytes (its own header, which Payload.from_tensor then need not read again;
        # on CPU it parses the bytes where they lie)
        on_host = self.device.type == "cpu"
        first = slot.buf[:HEADER_BYTES if on_host else HEADER_BYTES + HEAD_GUESS].cpu()
        hdr = first[:HEADER_BYTES].view(torch.int64).tolist()
        slot.hdr = hdr
        slot.head = None if on_host else first[HEADER_BYTES:].numpy().tobytes()
        if hdr[0] != MAGIC:
            raise ValueError(f"pipeline: the message from rank {slot.peer} expected as {slot.msg.key} is not a "
                             f"pipeline message (header {hdr[:3]}): the ranks are out of step")
        if hdr[1] != slot.msg.code:
            raise ValueError(f"pipeline: rank {slot.peer} sent another message ({hdr[1]:#x}) where this rank "
                             f"expected {slot.msg.key} ({slot.msg.code:#x}): the ranks run different schedules")
        length, dtype, table = hdr[2], hdr[4], hdr[5]
        limit = memory_bytes()
        if length < 0 or not (dtype in _PLAIN_CODES if table == 0 else dtype == 0) \
                or (limit is not None and length > limit) or not 0 <= table <= min(length, MAX_STRUCTURE) or table % 8:
            raise ValueError(f"pipeline: the header of {slot.msg.key} from rank {slot.peer} is invalid ({hdr[:6]})")
        whole = HEADER_BYTES + length
        cap = slot.buf.numel()
        if whole > cap:
            slot.tail = torch.empty(whole - cap, dtype=torch.uint8, device=self.device)
        slot.length = length
        slot.read = True
        self._cap[(slot.msg.kind, slot.msg.boundary)] = whole

    def _lost(self, slot: _Slot, exc: BaseException) -> BaseException:
        if isinstance(exc, CommunicationError) and exc.__cause__ is not None:
            exc = exc.__cause__  # a refused post: what the backend said
        err = CommunicationError(f"pipeline: {slot.msg.key} {'to' if slot.out else 'from'} rank {slot.peer} failed: "
                                 f"a peer died or did not answer within the group timeout ({exc})")
        self.broken = err
        return err

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken


def _key(msg: Message, form: str, i: int) -> str:
    """The boundary compressor's key of value ``i`` of ``msg`` (a plain message: the message's)."""
    return msg.key if form == "plain" else f"{msg.key}.{i}"


def _part_of(payload: Payload, wire_dtype: torch.dtype, grad: bool) -> Part:
    return Part("t", payload.compressor, tuple(payload.shape), payload.dtype, payload.meta,
                tuple((t.dtype, tuple(t.shape)) for t in payload.tensors), wire_dtype, grad)


def _encode(msg: Message, value: Union[torch.Tensor, Parts], compressor: Any) -> Tuple[str, List[_Enc]]:
    """``value`` as its message's form and encoded values: each floating-point tensor compressed
    under its key, through the feedback wrapper if there is one; any other exact."""
    if isinstance(value, torch.Tensor) and value.dtype in FLOAT_DTYPES:
        payload = _compressed(msg.key, value, compressor)
        return "plain", [_Enc(_part_of(payload, value.dtype, True), payload, payload.tensors)]
    if isinstance(value, torch.Tensor):
        value = Parts("tensor", (value,), (False,))
    if len(value.values) > MAX_PARTS:
        raise ValueError(f"pipeline: a stage output of {len(value.values)} values cannot cross a boundary; at most "
                         f"{MAX_PARTS}")
    encs = []
    for i, (v, grad) in enumerate(zip(value.values, value.grad)):
        if v is None:
            encs.append(_Enc(NONE_PART, None, []))
        elif v.dtype in FLOAT_DTYPES:
            payload = _compressed(_key(msg, value.form, i), v, compressor)
            encs.append(_Enc(_part_of(payload, v.dtype, grad), payload, payload.tensors))
        elif v.dtype in WIRE_DTYPES:
            shape = tuple(v.shape)
            encs.append(_Enc(Part("x", "", shape, v.dtype, None, ((v.dtype, shape),), v.dtype, False), None,
                             [v.detach().contiguous()]))
        else:
            raise ValueError(f"pipeline: a stage output of dtype {v.dtype} cannot cross a boundary; use one of "
                             f"{', '.join(dtype_name(d) for d in WIRE_DTYPES)}")
    return value.form, encs


def _compressed(key: str, tensor: torch.Tensor, compressor: Any) -> Payload:
    """``tensor`` compressed under ``key``, through the feedback wrapper if there is one."""
    base, feedback = _split(compressor)
    acc = tensor.detach()
    if feedback is None:  # framed at once: the payload may view the tensor (the identity's does)
        return base.compress_view(acc, key)
    acc = feedback.accumulate(acc, key)
    payload, sent = base.compress_decoded(acc.to(tensor.dtype), key)
    feedback.update(key, acc, sent)
    return payload


def _decoded(key: str, base: Compressor, feedback: Optional[Any], payload: Payload,
             dtype: torch.dtype) -> torch.Tensor:
    """``payload`` decoded, through the feedback wrapper under ``key`` if there is one, in
    the stage output's ``dtype``."""
    out = base.decompress(payload)
    if feedback is not None:
        out = feedback.combine(key, out)
    return out.to(dtype)


def _delivered(form: str, values: List[Optional[torch.Tensor]], parts: Sequence[Part]
               ) -> Union[torch.Tensor, Parts]:
    if form == "plain":
        assert values[0] is not None
        return values[0]
    return Parts(form, tuple(values), tuple(p.grad for p in parts))


def _exact(raw: torch.Tensor, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
    """A value sent as its exact bytes, viewed where the 1-D uint8 ``raw`` holds them (a copy
    where they are not aligned for ``dtype``; none for no bytes)."""
    if not raw.numel():
        return torch.empty(shape, dtype=dtype, device=raw.device)
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).reshape(shape)


_FORMS = ("tuple", "list", "tensor")


def _parts_table(form: str, encs: List[_Enc], sizes: List[int]) -> bytes:
    """A message's parts table: its form and, per value, ``[kind, dtype, shape, grad, bytes]``
    (JSON, padded with spaces to a multiple of 8 bytes)."""
    rows = [[e.part.kind, dtype_name(e.part.wire_dtype), list(e.part.shape) if e.part.kind == "x" else [],
             e.part.grad, n] for e, n in zip(encs, sizes)]
    raw = json.dumps({"f": form, "p": rows}, separators=(",", ":")).encode()
    if len(raw) > MAX_STRUCTURE:
        raise ValueError(f"pipeline: a stage output's parts table of {len(raw)} bytes exceeds {MAX_STRUCTURE}")
    return raw + b" " * (-len(raw) % 8)


_Entry = Tuple[str, torch.dtype, Tuple[int, ...], bool, int]  # a parts table's row: kind, dtype, shape, grad, bytes


def _read_table(raw: bytes) -> Tuple[str, List[_Entry]]:
    """A received parts table, checked: ``(form, [(kind, dtype, shape, grad, bytes), ...])``;
    ``ValueError`` for anything :func:`_parts_table` does not make."""
    if raw.count(b"[") + raw.count(b"{") > 2 + 2 * MAX_PARTS:  # bounds nesting before parsing
        raise ValueError("its parts table is nested too deep")
    try:
        table = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        raise ValueError("its parts table is not valid JSON") from None
    if not isinstance(table, dict) or set(table) != {"f", "p"} or table["f"] not in _FORMS \
            or not isinstance(table["p"], list) or len(table["p"]) > MAX_PARTS \
            or (table["f"] == "tensor" and len(table["p"]) != 1):
        raise ValueError("its parts table is malformed")
    out: List[_Entry] = []
    for row in table["p"]:
        if not (isinstance(row, list) and len(row) == 5 and row[0] in ("t", "x", "n") and row[1] in DTYPES
                and isinstance(row[2], list) and len(row[2]) <= 16 and isinstance(row[3], bool)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in row[2])
                and isinstance(row[4], int) and not isinstance(row[4], bool) and row[4] >= 0):
            raise ValueError(f"its parts table holds an invalid entry {row!r:.80}")
        kind, dtype, shape, grad, size = row[0], DTYPES[row[1]], tuple(row[2]), row[3], row[4]
        if (kind == "t") != (dtype in FLOAT_DTYPES) and kind != "n" or (kind != "t" and grad) \
                or (kind == "x" and size != math.prod(shape) * dtype.itemsize) or (kind == "n" and size):
            raise ValueError(f"its parts table holds an invalid entry {row!r:.80}")
        out.append((kind, dtype, shape, grad, size))
    return table["f"], out


def _split(compressor: Any) -> Tuple[Compressor, Optional[Any]]:
    """``(the Compressor that encodes, the feedback wrapper around it or None)``."""
    if isinstance(compressor, Compressor):
        return compressor, None
    inner = getattr(compressor, "base", None)
    if isinstance(inner, Compressor) and all(hasattr(compressor, f) for f in ("accumulate", "update", "combine")):
        return inner, compressor
    raise ValueError(f"a pipeline boundary compressor must be a Compressor or a feedback wrapper of one, "
                     f"got {type(compressor).__name__}")

