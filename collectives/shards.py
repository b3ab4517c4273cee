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
in rank order, then scaled; a rank's own piece is never compressed (it does not travel).
Bytes and time are counted in telemetry as ``reduce_scatter/<dense|compressed>`` and
``all_gather/<dense|compressed>``. Payloads are validated (``Payload.from_bytes`` and the
agreed number of elements) before anything decodes them.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from ._comm import Comm, scale_
from ._telemetry import Record, commit
from ._wire import decode, encode, gather_bytes

__all__ = ["reduce_scatter", "all_gather", "any_rank", "piece_key"]


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
                   group=None) -> torch.Tensor:
    """The mean over ranks of this rank's piece of ``flat`` (1-D, ``sum(splits)`` elements), a
    new tensor of ``splits[rank]`` elements in ``flat``'s dtype. ``flat`` is left unchanged."""
    rec, comm, sizes = _begin("reduce_scatter", compressor, key, group, splits, flat)
    if flat.dim() != 1 or flat.numel() != sum(sizes):
        raise ValueError(f"reduce_scatter: expected a 1-D tensor of {sum(sizes)} elements, got shape {tuple(flat.shape)}")
    pieces = list(flat.split(sizes))
    if comm.size == 1:
        out = pieces[0].clone()
    elif compressor is None:
        out = _dense_reduce(comm, flat, sizes)
    else:
        out = _compressed_reduce(comm, pieces, sizes, compressor, key, rec)
    commit(rec)
    return out


def _dense_reduce(comm: Comm, flat: torch.Tensor, sizes: List[int]) -> torch.Tensor:
    scaled = scale_(flat.detach().clone(), comm.size)
    got = comm.all_to_all(scaled, sizes, [sizes[comm.rank]] * comm.size)
    blocks = got.split(sizes[comm.rank])
    out = blocks[0].clone()
    for b in blocks[1:]:
        out += b
    return out


def _compressed_reduce(comm: Comm, pieces: List[torch.Tensor], sizes: List[int], compressor: Any, key: str,
                       rec: Record) -> torch.Tensor:
    me, device = comm.rank, pieces[0].device
    with rec.timing("compress"):
        bufs = []
        for j, piece in enumerate(pieces):
            if j == me or not sizes[j]:
                bufs.append(torch.empty(0, dtype=torch.uint8, device=device))
                continue
            payload = compressor.compress(piece, piece_key(key, j))
            rec.payload_bytes += payload.nbytes
            bufs.append(encode(payload, device))
    out_sizes = [b.numel() for b in bufs]
    table = comm.exchange(out_sizes)  # (w, w): rank r's bytes for rank j
    in_sizes = table[:, me].tolist()
    got = comm.all_to_all(torch.cat(bufs), out_sizes, in_sizes)
    with rec.timing("decompress"):
        out = torch.zeros(sizes[me], dtype=pieces[me].dtype, device=device)
        if not sizes[me]:
            return out
        for r, b in enumerate(got.split(in_sizes)):
            if r == me:
                out += pieces[me]
            else:
                compressor.base.decompress_into(decode(b, device, sizes[me], r), out, accumulate=True)
        scale_(out, comm.size)
    return out


def all_gather(shard: torch.Tensor, splits: Sequence[int], *, compressor: Any = None, key: str = "ag",
               group=None) -> torch.Tensor:
    """Every rank's piece (this rank's is ``shard``, 1-D of ``splits[rank]`` elements), in rank
    order: a new 1-D tensor of ``sum(splits)`` elements in ``shard``'s dtype. Compressed, this
    rank's part of the result is its own payload decoded (as on every other rank)."""
    rec, comm, sizes = _begin("all_gather", compressor, key, group, splits, shard)
    if shard.dim() != 1 or shard.numel() != sizes[comm.rank]:
        raise ValueError(f"all_gather: this rank's piece must be 1-D with {sizes[comm.rank]} elements, "
                         f"got shape {tuple(shard.shape)}")
    if compressor is None:
        out = _dense_gather(comm, shard, sizes)
    else:
        out = _compressed_gather(comm, shard, sizes, compressor, key, rec)
    commit(rec)
    return out


def _dense_gather(comm: Comm, shard: torch.Tensor, sizes: List[int]) -> torch.Tensor:
    if comm.size == 1:
        return shard.detach().clone()
    padded = shard.new_zeros(max(sizes))
    padded[:shard.numel()] = shard
    rows = comm.all_gather(padded)
    return torch.cat([rows[r, :sizes[r]] for r in range(comm.size)])


def _compressed_gather(comm: Comm, shard: torch.Tensor, sizes: List[int], compressor: Any, key: str,
                       rec: Record) -> torch.Tensor:
    device = shard.device
    mine: Optional[Any] = None
    with rec.timing("compress"):
        if sizes[comm.rank]:
            mine = compressor.compress(shard, key)
            rec.payload_bytes += mine.nbytes
            buf = encode(mine, device)
        else:
            buf = torch.empty(0, dtype=torch.uint8, device=device)
    lengths = comm.exchange([buf.numel()])[:, 0].tolist()
    parts = gather_bytes(comm, buf, lengths, exact=not getattr(compressor, "fixed_size", False))
    with rec.timing("decompress"):
        out = torch.empty(sum(sizes), dtype=shard.dtype, device=device)
        for r, (b, piece) in enumerate(zip(parts, out.split(sizes))):
            if sizes[r]:
                payload = mine if r == comm.rank else decode(b, device, sizes[r], r)
                compressor.base.decompress_into(payload, piece, accumulate=False)
    return out


def any_rank(flags: Sequence[bool], group=None) -> List[bool]:
    """For each flag, whether it is true on any rank of ``group``: one small all-reduce
    (counted in telemetry as ``all_reduce/flags``); the flags themselves without a group."""
    rec = Record("all_reduce", "flags", "none", "flags", 1)
    comm = Comm(group, rec, "any_rank")
    rec.world_size = comm.size
    t = torch.tensor([1.0 if f else 0.0 for f in flags], dtype=torch.float64, device=comm.device)
    comm.all_reduce_(t)
    commit(rec)
    return [bool(v > 0) for v in t.tolist()]
