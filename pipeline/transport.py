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
  (it may announce a tail). Each post is one ``batch_isend_irecv`` from the calling thread;
  operations are waited in issue order.
- **One message per tensor.** A uint8 device tensor: a 64-byte header (magic, message code,
  payload length, the boundary compressor's hash, dtype), then the payload in the wire format
  (self-describing, so shapes may change at any step), built in one buffer on the device and
  parsed where it arrived. Both ends know each channel's capacity (the previous message's
  length, kept across steps; the header alone for its first message); a longer payload sends
  its rest right after, posted by the receiver once it has read the header.
- **Buffers kept.** A message's buffer (sent or received) comes from its channel's
  :class:`_Pool`: one nothing else holds any more (its step's slots and works are gone, and
  no tensor of a caller views it: the storage's use count says so), reused from step to step,
  so a CPU message does not pay a fresh buffer's page faults (a fresh 1 MB buffer filled: 0.21
  ms, a kept one 0.06 ms); a received payload that a caller still holds (a stage input saved for
  backward, a cached activation) keeps its buffer out of reuse.

**Raw steps.** Every message of a step whose layouts are agreed travels raw: its payload's
tensors and nothing else (one tensor: that tensor itself, no copy; several: copied once into one
buffer at offsets both ends derive), received into a buffer of the agreed size, with no header
to read, so posting never stops at a receive. A channel's layout (the payload's compressor,
shape, dtype, meta and tensors' dtypes and shapes, and the stage output's dtype) is learned at
both ends from the self-describing messages of a framed step in which every message on that
channel had the same one; :class:`~gradcomp.pipeline.Pipeline` decides, in the batch agreement
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

import math
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gradcomp.collectives import CommunicationError, fingerprint
from gradcomp.compress import Compressor, Payload
from gradcomp.compress.payload import memory_bytes
from gradcomp.compress import transaction
from gradcomp.kernels import memory

from .schedule import Action, timeline

MESSAGES = ("act", "grad")  # the message kinds of schedule.PASSES' sends

MAGIC = 0x67706970650001  # "gpipe" + version 1
HEADER = 8  # int64 fields: magic, message code, payload length, compressor hash, dtype, 3 spare
HEADER_BYTES = HEADER * 8
HEAD_GUESS = 512  # payload bytes read with the header: a payload's own JSON header is a few hundred
# What a message costs in the timeline that orders a step's messages, in forwards; a link from
# one rank to another carries one message at a time there. Free messages (0) tie a message
# produced right after another one's arrival with one produced without a wait, and break the
# tie by kind: in 1F1B's steady state stage 0's next activation then came before the gradient
# the last stage had already sent, and stage 0 posted that gradient's receive only once its
# forward was done, while gloo (whose sends move once the receive is posted) held the
# gradient. Measured, 2 stages at 1 Gbit/s, three alternating runs each against torch's same
# schedule (bench/RESULTS.md 26a, 26f): 1F1B 0.92-0.94x at 0 against 1.06-1.13x at 1 and 3;
# interleaved 0.77-0.78x at 0, 0.92-0.94x at 1 with links that carry any number at once,
# 0.80-0.82x at 3 likewise, 1.01-1.02x at 3 with one message at a time per link (a 1 MB
# message is 8 ms there, a forward 2-3 ms). 1F1B's, GPipe's and ZB-H1's orders on 2 ranks are
# the same at 1 and at 3.
MESSAGE_COST = 3.0
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
FLOAT_DTYPES = frozenset(_DTYPES)


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


def h63(text: str) -> int:
    """A non-negative 63-bit hash of ``text``, the same on every rank and run."""
    return int.from_bytes(bytes.fromhex(fingerprint(text)), "little") >> 1


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


class Layout(NamedTuple):
    """What both ends of a channel know of its messages in a raw step: the payload's structure,
    each tensor's offset in the message (8-byte aligned) and the message's bytes."""

    compressor: str
    shape: Tuple[int, ...]
    dtype: torch.dtype  # the payload's (decoded) dtype
    meta: Any  # the payload's meta, compared whole
    tensors: Tuple[Tuple[torch.dtype, Tuple[int, ...]], ...]
    wire_dtype: torch.dtype  # the stage output's dtype, restored on receipt
    offsets: Tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, payload: Payload, wire_dtype: torch.dtype) -> "Layout":
        specs = tuple((t.dtype, tuple(t.shape)) for t in payload.tensors)
        offsets, pos = [], 0
        for dtype, shape in specs:
            offsets.append(pos)
            pos += -(-math.prod(shape) * dtype.itemsize // 8) * 8
        return cls(payload.compressor, tuple(payload.shape), payload.dtype, payload.meta, specs, wire_dtype,
                   tuple(offsets), pos)

    def fits(self, payload: Payload, wire_dtype: torch.dtype) -> bool:
        return (payload.compressor == self.compressor and tuple(payload.shape) == self.shape
                and payload.dtype == self.dtype and wire_dtype == self.wire_dtype
                and len(payload.tensors) == len(self.tensors)
                and all(t.dtype == d and tuple(t.shape) == sh for t, (d, sh) in zip(payload.tensors, self.tensors))
                and payload.meta == self.meta)

    def views(self, buf: torch.Tensor) -> List[torch.Tensor]:
        """The payload's tensors, viewed where they lie in the received ``buf``."""
        return [buf[o:o + math.prod(sh) * d.itemsize].view(d).reshape(sh)
                for o, (d, sh) in zip(self.offsets, self.tensors)]


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
        self._layouts: Dict[Tuple[str, int], Layout] = {}  # each channel's, learned in a framed step
        self._seen: Dict[Tuple[str, int], Optional[Layout]] = {}  # this framed step's (None: not one layout)
        self._learn = False
        self._works: List[Any] = []  # every work of the step, in issue order
        self._waited = 0  # the works before this position have been waited

    # ---- a step -------------------------------------------------------------------------
    def ready(self, order: Sequence[Message]) -> bool:
        """Whether a step of ``order`` could travel raw: every channel of this rank's messages
        in it has a layout."""
        return all((m.kind, m.boundary) in self._layouts for m in order if m.src in self.mine or m.dst in self.mine)

    def begin(self, order: Sequence[Message], *, raw: bool = False, learn: bool = False) -> None:
        """Start a step whose messages are ``order`` (the same list on every rank): ``raw`` (every
        rank alike, and only when :meth:`ready`) sends them on the channels' layouts; ``learn``
        (a framed training step) notes each channel's layout for later raw steps."""
        self._check()
        if raw and not self.ready(order):
            raise RuntimeError("pipeline: a raw step needs every channel's layout, learned in a framed step")
        self.raw, self.mismatched, self._learn = raw, False, learn and not raw
        self._seen = {}
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

    def send(self, msg: Message, tensor: torch.Tensor, compressor: Any) -> None:
        """Compress ``tensor`` with the boundary ``compressor`` (a Compressor or a feedback
        wrapper of one; its state under ``msg.key``) and post it as soon as the agreed order
        allows."""
        self._check()
        slot = self._slot[msg]
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(f"pipeline: a stage output of dtype {tensor.dtype} cannot cross a boundary; "
                             f"use float16, bfloat16, float32 or float64")
        base, payload = _encode(msg, tensor, compressor)
        if self.raw:
            self._raw_frame(slot, payload, tensor.dtype)
        else:
            self._frame(slot, base, payload, tensor.dtype)
            self._note(msg, Layout.of(payload, tensor.dtype) if self._learn else None)
        self.payload_bytes += payload.nbytes
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

    def _frame(self, slot: _Slot, base: Compressor, payload: Payload, dtype: torch.dtype) -> None:
        """Header + payload into the slot, built in one buffer on the transport's device (the
        headers copied from the host, each payload tensor copied once into place): padded to
        the channel's capacity, or cut into the first ``capacity`` bytes and a tail."""
        msg = slot.msg
        head = payload.wire_head()
        length = len(head) + payload.nbytes
        ours = torch.tensor([MAGIC, msg.code, length, h63(repr(base)), _DTYPES.index(dtype), 0, 0, 0],
                            dtype=torch.int64).view(torch.uint8).numpy().tobytes()
        cap = self._capacity(msg)
        whole = HEADER_BYTES + length
        buf = self._pool(msg, True).take(max(whole, cap))
        payload.write_wire(buf, head=ours + head)  # both headers in one copy from the host, then the tensors
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

    def _raw_frame(self, slot: _Slot, payload: Payload, dtype: torch.dtype) -> None:
        """The payload's tensors as the channel's layout places them: the one tensor itself
        where it is a contiguous, 8-byte aligned block of the agreed bytes (no copy; it does
        not change before the step's end), else one buffer; zeros when it does not fit."""
        lay = self._layout(slot.msg)
        if not lay.fits(payload, dtype):
            self.mismatched = True
            slot.buf = self._void(slot.msg, lay)
        elif len(payload.tensors) == 1 and payload.tensors[0].is_contiguous() and lay.nbytes == payload.nbytes \
                and payload.tensors[0].data_ptr() % 8 == 0:
            slot.buf = payload.tensors[0].detach().reshape(-1).view(torch.uint8)
        else:
            buf = self._pool(slot.msg, True).take(lay.nbytes)
            for t, o in zip(payload.tensors, lay.offsets):
                size = t.numel() * t.element_size()
                if size:
                    buf[o:o + size].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
            slot.buf = buf
        slot.length = lay.nbytes
        self.sent_bytes += lay.nbytes

    def _note(self, msg: Message, layout: Optional[Layout]) -> None:
        """A framed training step's message on its channel: the channel's layout once every one
        of the step's messages on it had the same (learned at :meth:`finish`)."""
        if not self._learn:
            return
        ch = (msg.kind, msg.boundary)
        if ch not in self._seen:
            self._seen[ch] = layout
        elif self._seen[ch] != layout:
            self._seen[ch] = None

    def take(self, msg: Message, compressor: Any) -> torch.Tensor:
        """The decoded tensor of ``msg`` (waits for it), through ``compressor`` as :meth:`send`."""
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
        if slot.hdr[3] != h63(repr(base)):
            raise ValueError(f"pipeline: {msg.key} from rank {slot.peer} was sent with another boundary compressor "
                             f"than {base!r}; every rank must be built with the same activation_codec and "
                             f"grad_codec")
        try:  # the bytes are this rank's own: the payload may view them where they lie, on the device
            payload = Payload.from_tensor(data, head=slot.head)
        except ValueError as exc:
            raise ValueError(f"pipeline: the payload of {msg.key} from rank {slot.peer} is invalid: {exc}") from None
        self._note(msg, Layout.of(payload, _DTYPES[slot.hdr[4]]) if self._learn else None)
        return _decoded(msg, base, feedback, payload, _DTYPES[slot.hdr[4]])

    def _take_raw(self, slot: _Slot, compressor: Any) -> torch.Tensor:
        """A raw message decoded on its channel's layout: its tensors viewed in the buffer, made
        safe by the compressor on the device, its flag (if any) noted in the step's transaction."""
        lay = self._layout(slot.msg)
        base, feedback = _split(compressor)
        assert slot.buf is not None
        payload = Payload(lay.compressor, lay.shape, lay.dtype, lay.views(slot.buf),
                          dict(lay.meta) if isinstance(lay.meta, dict) else lay.meta)
        payload, bad = base.check_on_device(payload)
        if bad is not None:
            transaction.refuse(bad, f"pipeline: the payload of {slot.msg.key} from rank {slot.peer} is invalid")
        return _decoded(slot.msg, base, feedback, payload, lay.wire_dtype)

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
        if self._learn:  # what this framed step showed replaces what earlier ones did
            for ch, lay in self._seen.items():
                if lay is None:
                    self._layouts.pop(ch, None)
                else:
                    self._layouts[ch] = lay

    def forget(self) -> None:
        """Drop every channel's layout (the next steps are framed until they learn again)."""
        self._layouts.clear()

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
        ops: List[Tuple[Any, _Slot]] = []
        try:
            while self._pos < len(self._seq):
                slot = self._seq[self._pos]
                if slot.out:
                    if slot.buf is None:
                        break  # not produced yet; nothing after it may go first
                    ops.append((dist.P2POp(dist.isend, slot.buf, slot.peer, self.group), slot))
                    if slot.tail is not None:
                        ops.append((dist.P2POp(dist.isend, slot.tail, slot.peer, self.group), slot))
                    self._pos += 1
                    continue
                if self.raw:  # the agreed bytes: nothing to read before what follows is posted
                    slot.buf = self._pool(slot.msg, False).take(self._layout(slot.msg).nbytes)
                    ops.append((dist.P2POp(dist.irecv, slot.buf, slot.peer, self.group), slot))
                    slot.read = True
                    self._pos += 1
                    continue
                if slot.buf is None:
                    slot.buf = self._pool(slot.msg, False).take(self._capacity(slot.msg))
                    ops.append((dist.P2POp(dist.irecv, slot.buf, slot.peer, self.group), slot))
                    self._post(ops)
                    ops = []
                if (until is None or self._pos > until) and not self._completed(slot):
                    break  # its header may announce a tail, which must be posted before anything after it
                self._wait(slot)
                self._read(slot)
                if slot.tail is not None:
                    ops.append((dist.P2POp(dist.irecv, slot.tail, slot.peer, self.group), slot))
                self._pos += 1
        except RuntimeError as exc:
            raise self._lost(self._seq[min(self._pos, len(self._seq) - 1)], exc) from exc
        except ValueError as exc:  # a header out of step: so are the ranks
            self.broken = exc
            raise
        finally:
            if ops and self.broken is None:
                self._post(ops)

    def _post(self, ops: List[Tuple[Any, _Slot]]) -> None:
        works = list(dist.batch_isend_irecv([op for op, _ in ops]))
        self.messages += len(ops)
        first = len(self._works)
        self._works.extend(works)
        for i, (_, slot) in enumerate(ops):
            # one work per operation, or one for the whole batch (a coalesced backend): the op completes with it
            slot.works.append(first + (i if len(works) == len(ops) else len(works) - 1))

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
        length, dtype = hdr[2], hdr[4]
        limit = memory_bytes()
        if length < 0 or not 0 <= dtype < len(_DTYPES) or (limit is not None and length > limit):
            raise ValueError(f"pipeline: the header of {slot.msg.key} from rank {slot.peer} is invalid ({hdr[:5]})")
        whole = HEADER_BYTES + length
        cap = slot.buf.numel()
        if whole > cap:
            slot.tail = torch.empty(whole - cap, dtype=torch.uint8, device=self.device)
        slot.length = length
        slot.read = True
        self._cap[(slot.msg.kind, slot.msg.boundary)] = whole

    def _lost(self, slot: _Slot, exc: BaseException) -> BaseException:
        err = CommunicationError(f"pipeline: {slot.msg.key} {'to' if slot.out else 'from'} rank {slot.peer} failed: "
                                 f"a peer died or did not answer within the group timeout ({exc})")
        self.broken = err
        return err

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken


def _encode(msg: Message, tensor: torch.Tensor, compressor: Any) -> Tuple[Compressor, Payload]:
    """``tensor`` compressed under ``msg.key``, through the feedback wrapper if there is one."""
    base, feedback = _split(compressor)
    acc = tensor.detach()
    if feedback is None:  # framed at once: the payload may view the tensor (the identity's does)
        return base, base.compress_view(acc, msg.key)
    acc = feedback.accumulate(acc, msg.key)
    payload, sent = base.compress_decoded(acc.to(tensor.dtype), msg.key)
    feedback.update(msg.key, acc, sent)
    return base, payload


def _decoded(msg: Message, base: Compressor, feedback: Optional[Any], payload: Payload,
             dtype: torch.dtype) -> torch.Tensor:
    """``payload`` decoded, through the feedback wrapper under ``msg.key`` if there is one, in
    the stage output's ``dtype``."""
    out = base.decompress(payload)
    if feedback is not None:
        out = feedback.combine(msg.key, out)
    return out.to(dtype)


def _split(compressor: Any) -> Tuple[Compressor, Optional[Any]]:
    """``(the Compressor that encodes, the feedback wrapper around it or None)``."""
    if isinstance(compressor, Compressor):
        return compressor, None
    inner = getattr(compressor, "base", None)
    if isinstance(inner, Compressor) and all(hasattr(compressor, f) for f in ("accumulate", "update", "combine")):
        return inner, compressor
    raise ValueError(f"a pipeline boundary compressor must be a Compressor or a feedback wrapper of one, "
                     f"got {type(compressor).__name__}")

