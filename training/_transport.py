"""The exchange of one bucket: every gradient averaged over the group, each compressed on its own.

Each gradient comes with its route: dense (None), a *summable* codec (its payload may be
averaged element-wise as it is: native ones such as fp16, bf16, random-k, and multi-round
PowerSGD, whose factors are averaged), or any other codec. Everything summable travels in
lockstep: in each round, what every gradient needs averaged is concatenated per dtype into one
flat tensor and allreduced once. A bucket of dense gradients and PowerSGD matrices thus costs
one allreduce for the dense part and all P factors together and one for all Q factors, and no
header. The other codecs (payloads whose size or meaning differ between ranks) follow, all in
one ``allreduce_fused`` (``allgather`` on two ranks, ``scatter-reduce`` on more):
each exchange is made once for the bucket, each payload still its own parameter's.

A DDP bucket that is all dense, or all sent through one 16-bit cast, is averaged as a whole
instead, in place, as DDP's own allreduce and PyTorch's fp16/bf16 hooks do (the same bits).

Compression, error feedback and warm starts are per gradient, keyed by its parameter name,
so the result does not depend on how the bucket is laid out. Every rank makes the same
collectives in the same order: the rounds of a codec depend only on the tensor shapes.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Generator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gradcomp.collectives import allreduce, allreduce_fused
from gradcomp.collectives._comm import Comm, scale_
from gradcomp.collectives._telemetry import Record, commit, measure_error_default
from gradcomp.compress import Compressor, Payload
from gradcomp.compress.fp16 import CastCompressor

from .policy import base_of

Item = Tuple[str, torch.Tensor, Any]  # (key, gradient, codec or None for dense)


class Hierarchy(NamedTuple):
    """This rank's groups for the hierarchical exchange: its node, and one rank per node."""

    intra: Any  # the ranks of this node (consecutive global ranks)
    inter: Any  # the ranks with this rank's local index, one per node
    local_size: int
    local_rank: int
    nodes: int


def exchange(items: Sequence[Item], group, world: int, *, buffer: Optional[torch.Tensor] = None,
             label: str = "?") -> List[torch.Tensor]:
    """The mean over ``group`` of every gradient in ``items``, in order (new tensors, or views
    of ``buffer``).

    ``buffer``: a flat tensor whose consecutive views the gradients are (a DDP bucket); when
    every gradient is dense, or every one goes through the same 16-bit cast, the bucket is
    averaged as a whole (see :func:`_whole`).
    """
    codecs = {id(codec): codec for _, _, codec in items}
    if buffer is not None and items and len(codecs) == 1 and sum(g.numel() for _, g, _ in items) == buffer.numel():
        codec = next(iter(codecs.values()))
        if codec is None or isinstance(codec, CastCompressor):
            return _whole(items, buffer, codec, group, world)
    out: List[Optional[torch.Tensor]] = [None] * len(items)
    gens: Dict[int, Generator] = {}
    for i, (key, grad, codec) in enumerate(items):
        if codec is None:
            gens[i] = _dense(grad)
        elif base_of(codec).multi_round:
            # the result goes straight into the gradient, which the caller overwrites with it anyway
            gens[i] = codec.rounds(grad, key, out=grad if grad.is_contiguous() else None)
        elif base_of(codec).native:
            gens[i] = _native(codec, grad, key)
    if gens:
        rec = Record("allreduce", "bucket", label, "bucket", world,
                     dense_bytes=sum(_nbytes(items[i][1]) for i in gens))
        for i, value in _lockstep(gens, group, world, rec).items():
            out[i] = value
        commit(rec)
    rest = [i for i in range(len(items)) if out[i] is None]
    # the others share each exchange (allgather on two ranks, scatter-reduce on more), unless
    # errors are measured, which allreduce does per tensor
    if rest and not measure_error_default():
        for i, value in zip(rest, allreduce_fused([items[i] for i in rest], group=group)):
            out[i] = value
    for i in rest:
        if out[i] is None:
            key, grad, codec = items[i]
            out[i] = allreduce(grad, compressor=codec, key=key, group=group)
    return out  # type: ignore[return-value]


def exchange_hierarchical(items: Sequence[Item], hier: Any, owners: Sequence[int], *,
                          label: str = "?") -> List[torch.Tensor]:
    """The mean of every gradient over all ranks, dense inside a node, compressed across nodes
    (``hier``: :class:`Hierarchy`). Each gradient has an owner, one
    local rank (``owners``, one per item: whole gradients, the same on every node and every
    step). Per dtype, in order:

    1. for each local rank, the gradients it owns, concatenated and scaled by ``1/L``, are
       summed onto it (``reduce`` over the node: the fast links carry the dense bytes, each
       byte once);
    2. the owners of a gradient, one per node, average their node means with :func:`exchange`
       over the inter-node group, so the codec, its error feedback and its state per
       parameter name live on the owners, and each gradient crosses the slow links once per
       node, compressed;
    3. each owner broadcasts its results over the node. Every rank of every node ends with
       the same bits.

    Returns views of new flat tensors (one per owner and dtype).
    """
    out: List[Optional[torch.Tensor]] = [None] * len(items)
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, (_, g, _) in enumerate(items):
        by_dtype.setdefault(g.dtype, []).append(i)
    L = hier.local_size
    for idx in by_dtype.values():
        rec = Record("allreduce", "intra-node", label, "bucket", L)
        parts = []  # (owner, item indices, flat): the same list on every rank of the node
        for o in range(L):
            mine = [i for i in idx if owners[i] == o]
            if not mine:
                continue
            flat = torch.cat([items[i][1].detach().reshape(-1) for i in mine])
            rec.dense_bytes += _nbytes(flat)
            scale_(flat, L)
            _backend(hier.intra, rec, f"reduce onto local rank {o}", lambda: dist.reduce(flat, group=hier.intra, group_dst=o))
            if o != hier.local_rank:
                rec.bytes_sent += _nbytes(flat)
            else:
                rec.bytes_recv += _nbytes(flat) * (L - 1)
            parts.append((o, mine, flat))
        error = None
        for o, mine, flat in parts:
            views = [v.view(items[i][1].shape) for v, i in zip(flat.split([items[i][1].numel() for i in mine]), mine)]
            if o == hier.local_rank:
                try:  # a failure must reach the node before its broadcasts, not leave it waiting
                    results = exchange([(items[i][0], v, items[i][2]) for i, v in zip(mine, views)], hier.inter,
                                       hier.nodes, label=label)
                    for v, value in zip(views, results):
                        if value.data_ptr() != v.data_ptr():
                            v.copy_(value)
                except Exception as exc:
                    error = exc
            for i, v in zip(mine, views):
                out[i] = v
        failed = torch.zeros(L, dtype=torch.int32, device=parts[0][2].device)
        failed[hier.local_rank] = int(error is not None)
        _backend(hier.intra, rec, "status exchange", lambda: dist.all_reduce(failed, group=hier.intra))
        if error is not None:
            raise error
        if bool(failed.any()):
            raise ValueError(f"the hierarchical exchange failed on local rank(s) {failed.nonzero().flatten().tolist()} "
                             f"of this node (the error is raised there)")
        for o, _, flat in parts:
            _backend(hier.intra, rec, f"broadcast from local rank {o}",
                     lambda: dist.broadcast(flat, group=hier.intra, group_src=o))
            if o == hier.local_rank:
                rec.bytes_sent += _nbytes(flat) * (L - 1)
            else:
                rec.bytes_recv += _nbytes(flat)
        commit(rec)
    return out  # type: ignore[return-value]


def _whole(items: Sequence[Item], buffer: torch.Tensor, cast: Optional[CastCompressor], group, world: int
           ) -> List[torch.Tensor]:
    """The whole bucket in one allreduce, in place: dense (as DDP's own allreduce does), or
    cast to 16 bits (as PyTorch's fp16/bf16 hooks do). A cast is element-wise and keeps no
    state, so casting the bucket equals casting each gradient, with a pass less each way."""
    rec = Record("allreduce", "bucket", "none" if cast is None else cast.name, "bucket", world,
                 dense_bytes=_nbytes(buffer))
    flat = buffer if cast is None else buffer.to(cast.wire_dtype)
    rec.payload_bytes = _nbytes(flat)
    _mean_(flat, group, world, rec)
    if flat is not buffer:
        buffer.copy_(flat)
    commit(rec)
    offsets = [0]
    for _, g, _ in items:
        offsets.append(offsets[-1] + g.numel())
    return [buffer[a:b].view(g.shape) for (_, g, _), a, b in zip(items, offsets, offsets[1:])]


def _lockstep(gens: Dict[int, Generator], group, world: int, rec: Record) -> Dict[int, torch.Tensor]:
    """Drive round generators together: one allreduce per dtype and round for all of them."""
    results: Dict[int, torch.Tensor] = {}
    pending: Dict[int, torch.Tensor] = {}
    for i, gen in gens.items():
        _advance(i, gen, None, pending, results, rec)
    while pending:
        sent, pending = pending, {}
        kinds: Dict[Tuple[torch.dtype, torch.device], List[int]] = {}
        for i in sorted(sent):
            kinds.setdefault((sent[i].dtype, sent[i].device), []).append(i)
        for idx in kinds.values():
            flat = torch.cat([sent[i].reshape(-1) for i in idx])
            rec.payload_bytes += _nbytes(flat)
            _mean_(flat, group, world, rec)
            for i, avg in zip(idx, flat.split([sent[i].numel() for i in idx])):
                _advance(i, gens[i], avg.view(sent[i].shape), pending, results, rec)
    return results


def _advance(i: int, gen: Generator, value: Optional[torch.Tensor], pending: Dict[int, torch.Tensor],
             results: Dict[int, torch.Tensor], rec: Record) -> None:
    """One step of a round generator; its time counts as compression, except the last step
    (the decoding, e.g. PowerSGD's ``P Q^T`` and the residual update), which counts as
    decompression."""
    start = time.perf_counter()
    try:
        pending[i] = next(gen) if value is None else gen.send(value)
    except StopIteration as stop:
        results[i] = stop.value
        rec.decompress_s += time.perf_counter() - start
    else:
        rec.compress_s += time.perf_counter() - start


def _mean_(flat: torch.Tensor, group, world: int, rec: Record) -> torch.Tensor:
    """Average ``flat`` over the group in place by the collectives' one rule (``Comm.mean_``),
    so the ``none`` and 16-bit cast hooks give the bits of DDP and of PyTorch's hooks."""
    return flat if world == 1 else Comm(group, rec, "training exchange").mean_(flat)


def _backend(group, rec: Record, what: str, call) -> Any:
    """Run one ``torch.distributed`` call: a backend failure (a dead peer, a timeout) becomes the
    collectives' ``CommunicationError`` naming this rank and the call; time counts as comm."""
    return Comm(group, rec, "training exchange")._run(what, call)


def _dense(grad: torch.Tensor) -> Generator:
    avg = yield grad.detach()
    return avg


def _native(codec: Any, grad: torch.Tensor, key: str) -> Generator:
    """A native codec as one round: its first payload tensor is averaged as it is."""
    base = base_of(codec)
    feedback = None if isinstance(codec, Compressor) else codec
    if feedback is None:
        acc, (payload, sent) = grad.detach(), (base.compress(grad, key), None)
    else:
        acc = feedback.accumulate(grad.detach(), key)
        payload, sent = base.compress_decoded(acc, key)
    avg = yield payload.tensors[0]
    p = payload
    avg = base.decompress(Payload(p.compressor, p.shape, p.dtype, [avg, *p.tensors[1:]], p.meta))
    if feedback is not None:
        feedback.update(key, acc, sent.reshape(acc.shape))
        avg = feedback.combine(key, avg.reshape(acc.shape))
    return avg.reshape(grad.shape).to(grad.dtype)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
