"""Collectives over a tensor split into contiguous per-rank pieces: what sharded data
parallel (ZeRO) is made of.

- :func:`reduce_scatter`: rank ``j`` gets the mean over ranks of piece ``j`` of everyone's
  tensor — dense, or each piece compressed (with the compressor's error feedback, kept per
  ``"{key}/to{j}"`` on the sender: the worker side of scatter-reduce's first phase).
- :func:`all_gather`: every rank gets the concatenation of every rank's piece — dense, or
  each piece compressed by its owner (error feedback kept per ``key`` on the owner); the
  owner decodes its own payload too, so every rank ends with the same bits.

``splits[j]`` is the length of rank ``j``'s piece (zeros allowed; the same list on every rank).
The dense mean follows gradcomp's one rule (``Comm.mean_``): each piece is scaled by ``1/w``
before it is sent and the received pieces are summed in rank order, so the owner of a piece
holds exactly ``((g_0/w + g_1/w) + g_2/w) + ...``. A compressed piece is decoded and summed
in rank order, then scaled (16-bit pieces summed and scaled in fp32, rounded once at the end);
a rank's own piece is never compressed (it does not travel).
Bytes and time are counted in telemetry as ``reduce_scatter/<dense|compressed>`` and
``all_gather/<dense|compressed>``. Payloads are validated (``Payload.from_bytes`` and the
agreed number of elements) before anything decodes them.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from gradcomp.compress import transaction

from ._comm import Comm, scale_
from .wire.layouts import Template
from .wire.status import Flags, checked
from ._telemetry import Record, commit
from .wire.frame import decode, encode, gather_bytes

__all__ = ["reduce_scatter", "all_gather", "Gathering", "decode_gathered", "any_rank", "sum_row", "piece_key"]


def _begin(op: str, compressor: Any, key: str, group, splits: Sequence[int],
           tensor: torch.Tensor) -> Tuple[Record, Comm, List[int]]:
    """The call's telemetry record, its view of the group and the checked splits."""
    rec = Record(op, "dense" if compressor is None else "compressed", _label(compressor), key, 1)
    comm = Comm(group, rec, op)
    rec.world_size = comm.size
    sizes = [int(s) for s in splits]
    if len(sizes) != comm.size or any(s < 0 for s in sizes):
        raise ValueError(f"{op}: splits must hold one length >= 0 per rank ({comm.size}), got {list(splits)}")
    rec.dense_bytes = tensor.numel() * tensor.element_size()
    return rec, comm, sizes


def piece_key(key: str, j: int) -> str:
    """The key under which a compressed :func:`reduce_scatter` of ``key`` keeps (on the sender)
    the residual of the piece it sends to rank ``j``."""
    return f"{key}/to{j}"


def _label(compressor: Any) -> str:
    return "none" if compressor is None else str(getattr(compressor, "name", type(compressor).__name__))


def reduce_scatter(flat: torch.Tensor, splits: Sequence[int], *, compressor: Any = None, key: str = "rs",
                   group=None, layouts: Optional[dict] = None, out: Optional[torch.Tensor] = None,
                   consume: bool = False) -> torch.Tensor:
    """The mean over ranks of this rank's piece of ``flat`` (1-D, ``sum(splits)`` elements), a
    new tensor of ``splits[rank]`` elements in ``flat``'s dtype (or ``out``, written and
    returned: a tensor of that size and dtype, e.g. the buffer a caller's framework reduces
    into). ``flat`` is left unchanged unless ``consume`` (the caller drops it after the call: the
    dense exchange then scales it in place instead of copying it).

    ``layouts``: a dict the caller keeps across calls when every rank makes the same calls
    with the same splits and compressor (a sharded optimizer's buckets): after the first
    exchange of a ``(key, splits)`` the payloads of a fixed-size compressor travel as raw
    tensors, with no size exchange and no parsing (the same bits)."""
    rec, comm, sizes = _begin("reduce_scatter", compressor, key, group, splits, flat)
    if flat.dim() != 1 or flat.numel() != sum(sizes):
        raise ValueError(f"reduce_scatter: expected a 1-D tensor of {sum(sizes)} elements, got shape {tuple(flat.shape)}")
    if out is not None and (out.numel() != sizes[comm.rank] or out.dtype != flat.dtype or out.device != flat.device):
        raise ValueError(f"reduce_scatter: out must hold {sizes[comm.rank]} elements of {flat.dtype} on {flat.device}, "
                         f"got {out.numel()} of {out.dtype} on {out.device}")
    pieces = list(flat.split(sizes))
    if comm.size == 1:
        out = pieces[0].clone() if out is None else out.view(-1).copy_(pieces[0]).view_as(out)
    elif compressor is None:
        out = _dense_reduce(comm, flat, sizes, out, consume)
    else:
        out = _compressed_reduce(comm, pieces, sizes, compressor, key, rec, layouts, out)
    commit(rec)
    return out


def _dense_reduce(comm: Comm, flat: torch.Tensor, sizes: List[int], out: Optional[torch.Tensor] = None,
                  consume: bool = False) -> torch.Tensor:
    scaled = scale_(flat.detach() if consume else flat.detach().clone(), comm.size)
    got = comm.all_to_all(scaled, sizes, [sizes[comm.rank]] * comm.size)
    blocks = got.split(sizes[comm.rank])
    if out is None:
        out = blocks[0].clone()
    else:
        out.view(-1).copy_(blocks[0])
    acc = out.view(-1)
    for b in blocks[1:]:
        acc += b
    return out


def _compressed_reduce(comm: Comm, pieces: List[torch.Tensor], sizes: List[int], compressor: Any, key: str,
                       rec: Record, layouts: Optional[dict] = None,
                       into: Optional[torch.Tensor] = None) -> torch.Tensor:
    me, device = comm.rank, pieces[0].device
    sig = ("reduce_scatter", key, tuple(sizes), repr(compressor), comm.size)
    agreed = layouts.get(sig) if layouts is not None and getattr(compressor.base, "fixed_size", False) else None
    with rec.timing("compress"):
        payloads: List[Optional[Any]] = []
        for j, piece in enumerate(pieces):
            payload = None if j == me or not sizes[j] else compressor.compress(piece, piece_key(key, j))
            if payload is not None:
                rec.payload_bytes += payload.nbytes
            payloads.append(payload)
    if agreed is not None:  # the pieces' layouts are known: raw tensors, nothing else
        sends, mine = agreed
        bufs = [raw(sends[j], payloads[j], device) for j in range(comm.size)]
        in_sizes = [0 if r == me or mine is None else mine.end for r in range(comm.size)]
        got = comm.all_to_all(torch.cat(bufs), [b.numel() for b in bufs], in_sizes)
        received = [None if r == me or not sizes[me] else _safe(compressor, mine.read(b), key, r)
                    for r, b in enumerate(got.split(in_sizes))]
    else:
        bufs = [torch.empty(0, dtype=torch.uint8, device=device) if p is None else encode(p, device) for p in payloads]
        out_sizes = [b.numel() for b in bufs]
        table = comm.exchange(out_sizes)  # (w, w): rank r's bytes for rank j
        in_sizes = table[:, me].tolist()
        got = comm.all_to_all(torch.cat(bufs), out_sizes, in_sizes)
        received = [None if r == me or not sizes[me] else decode(b, device, sizes[me], r)
                    for r, b in enumerate(got.split(in_sizes))]
        if layouts is not None and getattr(compressor.base, "fixed_size", False) and comm.size > 1:
            theirs = next((p for p in received if p is not None), None)
            layouts[sig] = ([None if p is None else Template(p, 0) for p in payloads],
                            None if theirs is None else Template(theirs, 0))
    with rec.timing("decompress"):
        out = torch.empty(sizes[me], dtype=pieces[me].dtype, device=device) if into is None else into.view(-1)
        if not sizes[me]:
            return out if into is None else into
        # a 16-bit piece is summed in fp32 and rounded once: a bf16 sum rounds at every add, and
        # its error grows with the number of ranks as a bf16 ring's does (tools/accumulation.py)
        acc = out.zero_() if out.element_size() >= 4 else torch.zeros(sizes[me], dtype=torch.float32, device=device)
        for r, p in enumerate(received):
            if r == me:
                acc += pieces[me]
            else:
                compressor.base.decompress_into(p, acc, accumulate=True)
        scale_(acc, comm.size)
        if acc is not out:
            out.copy_(acc)
    return out if into is None else into


def _safe(compressor: Any, payload: Any, key: str, rank: int) -> Any:
    """A payload read from an agreed layout, made safe by its compressor; what only its values
    can show is flagged to the open transaction (read when it ends) or, with none, read now."""
    flags = Flags(transaction.current())
    payload = checked(compressor.base, payload, key, rank, flags)
    flags.settle()
    return payload


def raw(template: Optional[Template], payload: Optional[Any], device: torch.device) -> torch.Tensor:
    """``payload``'s tensors at ``template``'s places (empty for no piece); ``ValueError`` if
    it no longer fits the agreed layout."""
    if template is None or payload is None:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if not template.matches(payload):
        raise ValueError(f"the payload of {payload.compressor} no longer fits the layout agreed at its first exchange "
                         f"(a compressor whose payload structure changes between steps must declare fixed_size=False)")
    buf = torch.empty(template.end, dtype=torch.uint8, device=device)
    template.write(payload, buf)
    return buf


def all_gather(shard: torch.Tensor, splits: Sequence[int], *, compressor: Any = None, key: str = "ag",
               group=None, layouts: Optional[dict] = None, out: Optional[torch.Tensor] = None,
               async_op: bool = False, keep: Optional[List[Any]] = None) -> Any:
    """Every rank's piece (this rank's is ``shard``, 1-D of ``splits[rank]`` elements), in rank
    order: a 1-D tensor of ``sum(splits)`` elements in ``shard``'s dtype (``out`` when given,
    written in place). Compressed, this rank's part of the result is its own payload decoded
    (as on every other rank). ``layouts``: as in :func:`reduce_scatter`.

    ``async_op=True`` returns a :class:`Gathering` instead: this rank's piece is encoded and the
    wire started now; ``wait()`` finishes it (decodes every piece) and returns the result. Only
    the wire runs in between (a compressed exchange whose layout is not agreed yet, the first of
    its ``layouts`` key, finishes before it returns). ``keep``: a list that receives, when it
    finishes, every rank's payload (compressed only; None for an empty piece), checked, so the
    same result can be decoded again (:func:`decode_gathered`) without the wire."""
    rec, comm, sizes = _begin("all_gather", compressor, key, group, splits, shard)
    if shard.dim() != 1 or shard.numel() != sizes[comm.rank]:
        raise ValueError(f"all_gather: this rank's piece must be 1-D with {sizes[comm.rank]} elements, "
                         f"got shape {tuple(shard.shape)}")
    if out is not None and (out.dim() != 1 or out.numel() != sum(sizes) or out.dtype != shard.dtype):
        raise ValueError(f"all_gather: out must be 1-D with {sum(sizes)} elements of {shard.dtype}, got "
                         f"{tuple(out.shape)} of {out.dtype}")
    if out is None:
        out = torch.empty(sum(sizes), dtype=shard.dtype, device=shard.device)
    if compressor is None:
        finish = _dense_gather(comm, shard, sizes, out)
    else:
        finish = _compressed_gather(comm, shard, sizes, compressor, key, rec, layouts, out, keep)
    pending = Gathering(finish, rec)
    return pending if async_op else pending.wait()


class Gathering:
    """An :func:`all_gather` on the wire: ``wait()`` finishes it once (decoding every piece into
    the result) and returns the result; ``get_future()`` completes when the wire is done (before the
    decode), or is None when nothing is in flight."""

    def __init__(self, finish: Tuple[Callable[[], torch.Tensor], Optional[Any]], rec: Record) -> None:
        self._finish, self._started = finish
        self._rec = rec
        self._out: Optional[torch.Tensor] = None

    def get_future(self) -> Optional[Any]:
        return None if self._started is None else self._started[0].get_future()

    def is_completed(self) -> bool:
        return self._out is not None

    def wait(self) -> torch.Tensor:
        if self._out is None:
            self._out = self._finish()
            commit(self._rec)
        return self._out


def _dense_gather(comm: Comm, shard: torch.Tensor, sizes: List[int],
                  out: torch.Tensor) -> Tuple[Callable[[], torch.Tensor], Optional[Any]]:
    if comm.size == 1:
        out.copy_(shard)
        return (lambda: out), None
    width = max(sizes)
    even = all(s == width for s in sizes)
    if even:  # the pieces are the rows of out: straight in
        rows, started = comm.all_gather_start(shard.detach(), out.view(comm.size, width))
        return (lambda: comm.finish(rows, started).view(-1)), started
    padded = shard.new_zeros(width)
    padded[:shard.numel()] = shard
    rows, started = comm.all_gather_start(padded)

    def finish() -> torch.Tensor:
        comm.finish(rows, started)
        torch.cat([rows[r, :sizes[r]] for r in range(comm.size)], out=out)
        return out
    return finish, started


def _compressed_gather(comm: Comm, shard: torch.Tensor, sizes: List[int], compressor: Any, key: str,
                       rec: Record, layouts: Optional[dict], out: torch.Tensor, keep: Optional[List[Any]] = None
                       ) -> Tuple[Callable[[], torch.Tensor], Optional[Any]]:
    device = shard.device
    mine: Optional[Any] = None
    sig = ("all_gather", key, tuple(sizes), repr(compressor), comm.size)
    fixed = layouts is not None and getattr(compressor.base, "fixed_size", False) and comm.size > 1
    agreed = layouts.get(sig) if fixed and layouts is not None else None
    with rec.timing("compress"):
        if sizes[comm.rank]:
            mine = compressor.compress(shard, key)
            rec.payload_bytes += mine.nbytes

    def decode_into(payloads: List[Any]) -> torch.Tensor:
        if keep is not None:
            keep[:] = payloads
        with rec.timing("decompress"):
            return decode_gathered(compressor, payloads, out)

    if agreed is not None:  # every rank's layout is known: one all-gather of raw tensors, started now
        buf = raw(agreed[comm.rank], mine, device)
        width = max(0 if t is None else t.end for t in agreed)
        padded = buf.new_zeros(width)
        padded[:buf.numel()] = buf
        rows, started = comm.all_gather_start(padded)

        def finish() -> torch.Tensor:
            comm.finish(rows, started)
            return decode_into([None if t is None else mine if r == comm.rank else
                                _safe(compressor, t.read(rows[r]), key, r) for r, t in enumerate(agreed)])
        return finish, started
    buf = torch.empty(0, dtype=torch.uint8, device=device) if mine is None else encode(mine, device)
    lengths = comm.exchange([buf.numel()])[:, 0].tolist()
    parts = gather_bytes(comm, buf, lengths, exact=not getattr(compressor, "fixed_size", False))
    payloads = [None if not sizes[r] else mine if r == comm.rank else decode(b, device, sizes[r], r)
                for r, b in enumerate(parts)]
    if fixed and layouts is not None:
        layouts[sig] = [None if p is None else Template(p, 0) for p in payloads]
    return (lambda: decode_into(payloads)), None


def decode_gathered(compressor: Any, payloads: Sequence[Any], out: torch.Tensor) -> torch.Tensor:
    """Every rank's payload of a compressed :func:`all_gather` (its ``keep``) decoded into ``out``
    again, in rank order: the bits that all-gather gave, with no communication."""
    sizes = [0 if p is None else p.numel for p in payloads]
    if sum(sizes) != out.numel():
        raise ValueError(f"decode_gathered: the payloads hold {sum(sizes)} elements, out has {out.numel()}")
    for payload, piece in zip(payloads, out.view(-1).split(sizes)):
        if payload is not None:
            for t in payload.tensors if out.is_cuda else ():  # read here, on this stream, before they are freed
                t.record_stream(torch.cuda.current_stream(out.device))
            compressor.base.decompress_into(payload, piece, accumulate=False)
    return out


def any_rank(flags: Sequence[Any], group=None) -> List[bool]:
    """For each flag (a bool, or a 0-d tensor that is non-zero for true, left on its device
    until the one read), whether it is true on any rank of ``group``: one small all-reduce
    (counted in telemetry as ``all_reduce/flags``); the flags themselves without a group."""
    return [bool(v > 0) for v in sum_row(flags, group, op="any_rank").tolist()]  # the one read


def sum_row(values: Sequence[Any], group=None, owner: str = "flags", device: Optional[torch.device] = None,
            op: str = "sum_row") -> torch.Tensor:
    """Each value (a bool, None for 0, a number or a 0-d tensor, left on its device) summed
    over the ranks of ``group`` in float64: one all-reduce of one row on the group's device
    (``device``: the values' device, by default the first tensor's), counted in telemetry as
    ``all_reduce/flags`` under ``owner``; the values themselves without a group (nothing
    counted). Nothing is read: the caller reads the row once. ``op`` names the caller in a
    :class:`CommunicationError`."""
    if device is None:
        device = next((v.device for v in values if isinstance(v, torch.Tensor)), None)
    rec = Record("all_reduce", "flags", "none", owner, 1)
    comm = Comm(group, rec, op, device)
    rec.world_size = comm.size
    if not values:
        return torch.zeros(0, dtype=torch.float64, device=comm.device)
    row = torch.stack([_on(v.detach().reshape(()).to(torch.float64), comm.device) if isinstance(v, torch.Tensor)
                       else torch.tensor(0.0 if v is None else float(v), dtype=torch.float64, device=comm.device)
                       for v in values])
    if comm.size > 1:
        comm.all_reduce_(row)
        commit(rec)
    return row


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)
