"""Point-to-point ``send``/``recv`` of compressed tensors (for pipeline-parallel training).

Two messages per tensor: the point-to-point header (``wire/message.py``: magic, code, payload
length, compressor hash, dtype; the pipeline's stage boundaries frame their messages with the
same), then the payload in the wire format, which carries shape and metadata, so the
receiver needs no prior knowledge of the tensor. With an error-feedback wrapper the sender
keeps the residual per key; the receiver finishes with ``combine`` (EF21's estimate).
Ranks are global ranks, as in ``torch.distributed.send``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from gradcomp.compress import transaction
from gradcomp.compress.payload import max_wire_bytes, memory_bytes

from . import _telemetry as telemetry
from ._comm import Comm
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
