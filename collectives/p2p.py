"""Point-to-point ``send``/``recv`` of compressed tensors, and batches of raw point-to-point
operations (:func:`batch_send_recv`, what the pipeline's transport posts its messages with).

Two messages per tensor: the point-to-point header (``wire/message.py``: magic, code, payload
length, compressor hash, dtype; the pipeline's stage boundaries frame their messages with the
same), then the payload in the wire format, which carries shape and metadata, so the
receiver needs no prior knowledge of the tensor. With an error-feedback wrapper the sender
keeps the residual per key; the receiver finishes with ``combine`` (EF21's estimate).
Ranks are global ranks, as in ``torch.distributed.send``.

:func:`batch_send_recv` posts a list of sends and receives (:class:`P2P`: a tensor and a peer)
as one batch, in the list's order, and returns its works (:class:`Batch`). NCCL ignores tags
and matches a pair's operations in issue order, so each pair's two ends must list that pair's
operations in the same order (the pipeline derives one order on every rank: ``message_order``).
The tensors travel as they are: no header, no compression; the batch's bytes are counted in
telemetry (``"p2p/batch"``).
"""
from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from gradcomp.compress import transaction
from gradcomp.compress.payload import max_wire_bytes, memory_bytes

from . import _telemetry as telemetry
from ._comm import Comm, CommunicationError, group_timeout
from .wire.frame import decode, encode
from .wire.message import FIELDS, SEND, code_dtype, compressor_hash, dtype_code, header_tensor, read_header
from .reduction import check_input, label, make_spec

_KIND = SEND


def _comm(op: str, peer: Any, group, spec, key: str, device: Optional[torch.device]) -> Comm:
    rec = telemetry.Record(op, "p2p", label(spec), key, 1)
    comm = Comm(group, rec, op, device=device)
    rec.world_size = comm.size
    if comm.size < 2:
        raise ValueError(f"{op} needs an initialised process group of at least 2 ranks")
    world = dist.get_world_size()
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < world or peer == dist.get_rank():
        raise ValueError(f"{op}: peer rank {peer!r} must be another rank in [0, {world})")
    return comm


def send(tensor: torch.Tensor, dst: int, compressor: Any = "none", *, key: Optional[str] = None,
         group=None, tag: int = 0) -> None:
    """Compress ``tensor`` and send it to global rank ``dst`` (blocking)."""
    spec = make_spec(compressor, None, False, False)
    key = "" if key is None else str(key)
    check_input(tensor)
    comm = _comm("send", dst, group, spec, key, tensor.device)
    rec = comm.record
    with rec.timing("compress"), transaction.deferring() as refused:
        acc = tensor.detach()
        if spec.feedback is not None:
            acc = spec.feedback.accumulate(acc, key)
            payload, sent = spec.base.compress_decoded(acc.to(tensor.dtype), key)
        else:
            payload = spec.base.compress(acc, key)
    error = transaction.Deferred(refused).resolve() if refused else None
    if error is not None:  # a send is checked: a refused input raises here, before anything is sent or kept
        raise error
    if spec.feedback is not None:
        spec.feedback.update(key, acc, sent)
    with rec.timing("compress"):
        buf = encode(payload, comm.device)
    head = header_tensor(_KIND, buf.numel(), compressor_hash(spec.base), dtype_code(tensor.dtype), comm.device)
    comm.send(head, dst, tag)
    comm.send(buf, dst, tag)
    rec.dense_bytes = tensor.numel() * tensor.element_size()
    rec.payload_bytes = payload.nbytes
    telemetry.commit(rec)


def recv(src: int, compressor: Any = "none", *, key: Optional[str] = None, group=None, tag: int = 0,
         device: Optional[torch.device] = None, max_numel: Optional[int] = None) -> torch.Tensor:
    """Receive a tensor that global rank ``src`` sent with ``send`` and the same compressor
    configuration; returns it decompressed, with the sender's shape and dtype, on ``device``
    (default: the CPU, or under NCCL the CUDA device of ``device``/the calling thread).
    ``max_numel`` bounds the elements the sender may announce. A refused message (longer or
    describing more than ``max_numel`` allows, another compressor, another kind) is received
    in full and then raises ``ValueError``, so the channel stays in step (an NCCL send does
    not fail when its receiver gives up: it waits). Only a payload longer than this device's
    memory is refused unreceived; the error then says the channel is out of step."""
    spec = make_spec(compressor, None, False, False)
    key = "" if key is None else str(key)
    comm = _comm("recv", src, group, spec, key, None if device is None else torch.device(device))
    rec = comm.record
    head = read_header(comm.recv(torch.empty(len(FIELDS), dtype=torch.int64, device=comm.device), src, tag).tolist())
    if not head.ours or head.length < 0:
        raise ValueError(f"recv: the message from rank {src} is not a gradcomp send (header {list(head[:3])}): it "
                         f"announces "
                         f"no payload this rank could drain, so the channel between the two is out of step (an "
                         f"earlier message was not received as sent, or that rank sends something else)")
    # A refused message is still received in full before raising: an NCCL send does not fail
    # when the receiver gives up, it waits for the receive, and the next header would pair
    # with this payload. Only a length no receive could take is refused unreceived.
    too_long = _too_long(head.length, src, max_numel)
    _check_drainable(head.length, src, comm.device, too_long)
    buf = comm.recv(torch.empty(head.length, dtype=torch.uint8, device=comm.device), src, tag)
    if head.code != _KIND:
        raise ValueError(f"recv: the message from rank {src} is a gradcomp message of kind {head.code}, not a send "
                         f"(kind {_KIND}); its payload was received and dropped")
    if too_long is not None:
        raise ValueError(f"{too_long}; it was received and dropped, so the channel stays in step")
    if head.compressor != compressor_hash(spec.base):  # checked before decoding, after draining
        raise ValueError(f"recv: rank {src} sent with a different compressor or options than {spec.base!r}; its "
                         f"payload was received and dropped")
    with rec.timing("decompress"):
        payload = decode(buf, device or comm.device, max_numel=max_numel)
        out = spec.base.decompress(payload)
        if spec.feedback is not None:
            out = spec.feedback.combine(key, out)
        out = out.to(code_dtype(head.dtype))
    rec.dense_bytes = out.numel() * out.element_size()
    rec.payload_bytes = payload.nbytes
    telemetry.commit(rec)
    return out


def _too_long(length: int, src: int, max_numel: Optional[int]) -> Optional[str]:
    """Why a payload of ``length`` bytes is refused under ``max_numel`` (None: it is not)."""
    if max_numel is None or length <= max_wire_bytes(max_numel):
        return None
    return (f"recv: rank {src} announced a payload of {length} bytes, more than a payload of at most "
            f"max_numel={max_numel} elements can take ({max_wire_bytes(max_numel)} bytes)")


def _drain_limit(device: torch.device) -> Optional[int]:
    if device.type == "cuda":
        try:
            return torch.cuda.mem_get_info(device)[0]
        except Exception:  # no driver query on this build
            return None
    return memory_bytes()


def _check_drainable(length: int, src: int, device: torch.device, too_long: Optional[str]) -> None:
    """Refuse, unreceived, a payload longer than this device's memory: nothing can take it, so
    the channel is out of step from here on (say so)."""
    limit = _drain_limit(device)
    if limit is not None and length > limit:
        said = f"{too_long}, and" if too_long else f"recv: rank {src} announced a payload of {length} bytes,"
        raise ValueError(f"{said} more than this machine's memory can take ({limit} bytes on {device}); it was not "
                         f"received, so that rank's send fails or waits and later messages between the two are out "
                         f"of step")


# ---- batches of raw point-to-point operations ------------------------------------------------
class P2P(NamedTuple):
    """One operation of a batch: ``kind`` "send" (``tensor`` to global rank ``peer``) or
    "recv" (into ``tensor``, from ``peer``)."""

    kind: str
    tensor: torch.Tensor
    peer: int


class Batch:
    """The works of one posted batch, in its operations' order: one per operation, or one for
    the whole batch (a backend that coalesces it, as NCCL's); :meth:`index` says which work
    completes operation ``i``."""

    __slots__ = ("works", "count", "group")

    def __init__(self, works: List[Any], count: int, group=None) -> None:
        self.works, self.count, self.group = works, count, group

    def index(self, i: int) -> int:
        """The position in :attr:`works` of the work that completes operation ``i``."""
        return i if len(self.works) == self.count else len(self.works) - 1

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        """Wait for every operation, in issue order; a backend failure is a ``CommunicationError``."""
        for w in self.works:
            try:
                w.wait()
            except RuntimeError as exc:
                raise CommunicationError(_failed("p2p batch: waiting", exc, self.group)) from exc


def batch_send_recv(ops: Sequence[P2P], *, group=None, key: Optional[str] = None) -> Batch:
    """Post ``ops`` (sends and receives of tensors, each with a global rank as peer) as one
    batch, in the list's order, and return its works (:class:`Batch`) to wait on. The two
    ends of each pair must list that pair's operations in the same order (NCCL matches them in
    issue order, tags ignored). Telemetry counts the sends' bytes as sent and the receives' as
    received (op ``"p2p/batch"``; the time is that of posting). A backend that refuses the post
    raises ``CommunicationError``."""
    ops = list(ops)
    rec = telemetry.Record("p2p", "batch", "none", "" if key is None else str(key), 0)
    if not ops:
        return Batch([], 0)
    world, me = dist.get_world_size(), dist.get_rank()
    rec.world_size = dist.get_world_size(group)
    posted = []
    for op in ops:
        if op.kind not in ("send", "recv"):
            raise ValueError(f"batch_send_recv: an operation is a 'send' or a 'recv', got {op.kind!r}")
        if isinstance(op.peer, bool) or not isinstance(op.peer, int) or not 0 <= op.peer < world \
                or op.peer == me:
            raise ValueError(f"batch_send_recv: peer rank {op.peer!r} must be another rank in [0, {world})")
        posted.append(dist.P2POp(dist.isend if op.kind == "send" else dist.irecv, op.tensor, op.peer, group))
        if op.kind == "send":
            rec.bytes_sent += op.tensor.numel() * op.tensor.element_size()
        else:
            rec.bytes_recv += op.tensor.numel() * op.tensor.element_size()
    with rec.timing("comm"):
        try:
            works = list(dist.batch_isend_irecv(posted))
        except RuntimeError as exc:
            raise CommunicationError(_failed(f"p2p batch: posting {len(ops)} operations", exc, group)) from exc
    telemetry.commit(rec)
    return Batch(works, len(ops), group)


def _failed(what: str, exc: BaseException, group=None) -> str:
    timeout = group_timeout(group)
    within = f"within the group timeout of {timeout.total_seconds():g} s" if timeout else "in time"
    return f"{what} failed on rank {dist.get_rank()}: a peer died or did not answer {within} (backend: {exc})"
