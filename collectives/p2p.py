"""Point-to-point ``send``/``recv`` of compressed tensors (for pipeline-parallel training).

Two messages per tensor: a 5-number header (magic, kind, payload length, compressor hash,
dtype), then the payload in the wire format, which carries shape and metadata, so the
receiver needs no prior knowledge of the tensor. With an error-feedback wrapper the sender
keeps the residual per key; the receiver finishes with ``combine`` (EF21's estimate).
Ranks are global ranks, as in ``torch.distributed.send``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from gradcomp.compress.payload import max_wire_bytes, memory_bytes

from . import _telemetry as telemetry
from ._comm import Comm
from ._header import MAGIC, code_dtype, dtype_code, h64
from ._wire import decode, encode
from .reduction import check_input, label, make_spec

_KIND = 3


def _comm(op: str, peer: Any, group, spec, key: str) -> Comm:
    rec = telemetry.Record(op, "p2p", label(spec), key, 1)
    comm = Comm(group, rec, op)
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
    comm = _comm("send", dst, group, spec, key)
    check_input(tensor)
    rec = comm.record
    with rec.timing("compress"):
        acc = tensor.detach()
        if spec.feedback is not None:
            acc = spec.feedback.accumulate(acc, key)
            payload, sent = spec.base.compress_decoded(acc.to(tensor.dtype), key)
            spec.feedback.update(key, acc, sent)
        else:
            payload = spec.base.compress(acc, key)
        buf = encode(payload, comm.device)
    head = torch.tensor([MAGIC, _KIND, buf.numel(), h64(repr(spec.base)), dtype_code(tensor.dtype)],
                        dtype=torch.int64, device=comm.device)
    comm.send(head, dst, tag)
    comm.send(buf, dst, tag)
    rec.dense_bytes = tensor.numel() * tensor.element_size()
    rec.payload_bytes = payload.nbytes
    telemetry.commit(rec)


def recv(src: int, compressor: Any = "none", *, key: Optional[str] = None, group=None, tag: int = 0,
         device: Optional[torch.device] = None, max_numel: Optional[int] = None) -> torch.Tensor:
    """Receive a tensor that global rank ``src`` sent with ``send`` and the same compressor
    configuration; returns it decompressed, with the sender's shape and dtype, on ``device``
    (default: the CPU, or the current CUDA device under NCCL). ``max_numel`` bounds the
    elements the sender may announce: a payload that describes more raises ``ValueError``
    once received (the channel stays in step), and one announced as longer than any payload
    of ``max_numel`` elements can be (``max_wire_bytes``) raises ``ValueError`` before
    anything is allocated for it, unreceived. Without ``max_numel``, a payload announced as
    longer than this machine's memory is refused the same way."""
    spec = make_spec(compressor, None, False, False)
    key = "" if key is None else str(key)
    comm = _comm("recv", src, group, spec, key)
    rec = comm.record
    head = comm.recv(torch.empty(5, dtype=torch.int64, device=comm.device), src, tag).tolist()
    if head[0] != MAGIC or head[1] != _KIND or head[2] < 0:
        raise ValueError(f"recv: the message from rank {src} is not a gradcomp send (header {head[:3]})")
    _check_length(head[2], src, max_numel)
    buf = comm.recv(torch.empty(head[2], dtype=torch.uint8, device=comm.device), src, tag)
    if head[3] != h64(repr(spec.base)):  # raised only now, so the channel stays in step
        raise ValueError(f"recv: rank {src} sent with a different compressor or options than {spec.base!r}")
    with rec.timing("decompress"):
        payload = decode(buf, device or comm.device, max_numel=max_numel)
        out = spec.base.decompress(payload)
        if spec.feedback is not None:
            out = spec.feedback.combine(key, out)
        out = out.to(code_dtype(head[4]))
    rec.dense_bytes = out.numel() * out.element_size()
    rec.payload_bytes = payload.nbytes
    telemetry.commit(rec)
    return out


def _check_length(length: int, src: int, max_numel: Optional[int]) -> None:
    """Refuse, before allocating, a payload longer than one of ``max_numel`` elements can be
    (longer than this machine's memory without ``max_numel``)."""
    if max_numel is not None:
        limit, what = max_wire_bytes(max_numel), f"a payload of at most max_numel={max_numel} elements"
    else:
        limit, what = memory_bytes(), "this machine's memory"
    if limit is not None and length > limit:
        raise ValueError(f"recv: rank {src} announced a payload of {length} bytes, more than {what} can take "
                         f"({limit} bytes); it was not received, so that rank's send fails and later messages "
                         f"between the two are out of step")
