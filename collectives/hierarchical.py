"""Hierarchical allreduce: dense inside a node, compressed across nodes, split two ways.

**By shards** (``allreduce(..., intra_group=, inter_group=)``, one tensor): with ``L`` ranks
per node, each rank owns one ``1/L`` shard of the tensor:

1. inside the node, an all-to-all of dense shards; each rank averages its shard in rank order
   (a reduce-scatter: fast links carry the dense bytes);
2. across nodes, a compressed allreduce of that shard among the ranks with the same local
   index (key ``"{key}/shard{i}of{L}"``, so error feedback is kept per shard);
3. inside the node, an all-gather of the shards.

So the slow links carry ``1/L`` of a compressed tensor per rank, and every rank ends with the
same bits: each shard comes from one inter-node allreduce, identical on all its members.

**By owners** (:func:`exchange_bucket_by_owners`, a bucket of whole tensors: what the DDP hook
and ``CompressedOptimizer`` do with ``local_size``): each tensor has one owner per node, is
reduced densely onto it, exchanged compressed among the owners with
:func:`~gradcomp.collectives.bucket.exchange_bucket`, and broadcast back, so a tensor's
error feedback and warm start live on one rank per node whatever the bucket layout.

``make_node_groups(local_size)`` builds the groups (and their twins for the workers); on one
machine, 4 ranks as 2 "nodes" of 2 exercise both paths.
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gradcomp.compress import transaction

from . import _telemetry as telemetry
from . import worker
from ._algorithm import chunk_sizes, mean_in_order, wdtype
from ._comm import Comm, group_timeout, initialized, scale_
from .reduction import check_input, choose_algorithm, label, measure, reduce
from .wire.header import build, verify
from ._telemetry import Record, commit
from .bucket import Item, exchange_bucket


class NodeGroups(NamedTuple):
    """This rank's groups for a hierarchical allreduce."""

    intra: object  # the ranks of this node
    inter: object  # the ranks with this rank's local index, one per node
    local_rank: int
    node: int


def make_node_groups(local_size: int) -> NodeGroups:
    """Split the world into nodes of ``local_size`` consecutive ranks. A collective: every rank
    must call it, in the same order relative to its other ``new_group`` calls."""
    if not initialized():
        raise ValueError("make_node_groups needs an initialised process group (torch.distributed.init_process_group)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1 or world % local_size:
        raise ValueError(f"make_node_groups: local_size={local_size!r} must be an int >= 1 that divides the world size {world}")
    timeout = group_timeout(dist.group.WORLD)
    nodes = world // local_size
    mine = {}
    for kind, members in ([("intra", list(range(n * local_size, (n + 1) * local_size))) for n in range(nodes)]
                          + [("inter", list(range(i, world, local_size))) for i in range(local_size)]):
        group = dist.new_group(members, timeout=timeout)
        twin = dist.new_group(members, timeout=timeout)  # for workers; see worker.py
        if rank in members:
            worker.register_twin(group, twin)
            mine[kind] = group
    return NodeGroups(mine["intra"], mine["inter"], rank % local_size, rank // local_size)


def hierarchical_job(tensor, spec, key: str, intra_group, inter_group) -> torch.Tensor:
    """One hierarchical allreduce on this rank (see the module docstring)."""
    rec = telemetry.Record("allreduce", "?", label(spec), key, 1)
    device = tensor.device if isinstance(tensor, torch.Tensor) else None  # the group's device under NCCL
    intra = Comm(intra_group, rec, "allreduce", device)
    inter = Comm(inter_group, rec, "allreduce", device)
    rec.world_size = intra.size * inter.size
    rec.algorithm = f"hierarchical+{choose_algorithm(spec.base, inter.size, spec.algorithm)}"
    n_local, i = intra.size, intra.rank
    error = None
    try:
        check_input(tensor)
        rec.dense_bytes = tensor.numel() * tensor.element_size()
    except Exception as exc:
        error = exc
    for comm in (intra, inter):  # both, so that a rank on another node with another shape is caught too
        table = comm.exchange(build(comm.size, op="hierarchical", algorithm="dense", tensor=tensor,
                                    compressor=spec.desc, key=key, measure=spec.measure, error=error is not None))
        verify(table, op="allreduce", error=error, local={"compressor": spec.desc, "key": key})
    if tensor.numel() == 0:
        return torch.empty_like(tensor)
    sizes = chunk_sizes(tensor.numel(), n_local)
    got = intra.all_to_all(tensor.detach().reshape(-1), sizes, [sizes[i]] * n_local)
    with rec.timing("decompress"):  # the dense reduction of the shard
        shard = mean_in_order(got.split(sizes[i]), n_local, wdtype(tensor)).to(tensor.dtype)
    with transaction.step() as txn:  # state kept only if the exchange completes with a finite mean
        result = reduce(shard, spec, inter, key=f"{key}/shard{i}of{n_local}", feedback=spec.feedback,
                        part=i, parts=n_local)
        padded = result.new_zeros(sizes[0])
        padded[:sizes[i]] = result
        rows = intra.all_gather(padded)
        out = torch.cat([rows[j, :sizes[j]] for j in range(n_local)]).reshape(tensor.shape)
        txn.observe(out)  # the whole tensor: every rank of every node decides alike
    if spec.measure:
        measure(rec, out, tensor, [intra, inter])
    telemetry.commit(rec)
    return out


# ---- by owners: whole tensors, one owner per node (the training runtime's buckets) ---------
class Hierarchy(NamedTuple):
    """This rank's groups for :func:`exchange_bucket_by_owners`: its node, and one rank per node."""

    intra: Any  # the ranks of this node (consecutive global ranks)
    inter: Any  # the ranks with this rank's local index, one per node
    local_size: int
    local_rank: int
    nodes: int


def exchange_bucket_by_owners(items: Sequence[Item], hier: Any, owners: Sequence[int], *,
                          label: str = "?") -> List[torch.Tensor]:
    """The mean of every gradient over all ranks, dense inside a node, compressed across nodes
    (``hier``: :class:`Hierarchy`). Each gradient has an owner, one
    local rank (``owners``, one per item: whole gradients, the same on every node and every
    step). Per dtype, in order:

    1. for each local rank, the gradients it owns, concatenated and scaled by ``1/L``, are
       summed onto it (``reduce`` over the node: the fast links carry the dense bytes, each
       byte once);
    2. the owners of a gradient, one per node, average their node means with :func:`~gradcomp.collectives.bucket.exchange_bucket`
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
    for idx in by_dtype.values():
        rec = Record("allreduce", "intra-node", label, "bucket", hier.local_size)
        node = Comm(hier.intra, rec, "allreduce", items[idx[0]][1].device)
        parts = _reduce_onto_owners(items, idx, owners, node, rec, hier.local_size)
        error = _exchange_owned(items, parts, hier, label, out)
        _raise_if_any_failed(node, error)
        for o, _, flat in parts:
            node.broadcast_(flat, o)
        commit(rec)
    txn = transaction.current()
    if txn is not None:  # the same results on every rank: every rank keeps or undoes alike
        txn.observe(out)
    return out  # type: ignore[return-value]


_Part = Tuple[int, List[int], torch.Tensor]  # (owner, item indices, flat node sum)


def _reduce_onto_owners(items: Sequence[Item], idx: Sequence[int], owners: Sequence[int], node: Comm,
                        rec: Record, local_size: int) -> List[_Part]:
    """Step 1: each owner's gradients, concatenated and scaled by ``1/L``, summed onto it over
    the node; the same list on every rank of the node (non-owners hold their own input sum)."""
    parts = []
    for o in range(local_size):
        mine = [i for i in idx if owners[i] == o]
        if not mine:
            continue
        flat = torch.cat([items[i][1].detach().reshape(-1) for i in mine])
        rec.dense_bytes += flat.numel() * flat.element_size()
        node.reduce_(scale_(flat, local_size), o)
        parts.append((o, mine, flat))
    return parts


def _exchange_owned(items: Sequence[Item], parts: Sequence[_Part], hier: Any, label: str,
                    out: List[Optional[torch.Tensor]]) -> Optional[Exception]:
    """Step 2: this rank's own part averaged across nodes (compressed), written into its flat;
    every item's result view goes into ``out``. The exchange's error is returned, not raised:
    it must reach the node before the broadcasts, or the other ranks would wait for them."""
    error = None
    for o, mine, flat in parts:
        views = [v.view(items[i][1].shape) for v, i in zip(flat.split([items[i][1].numel() for i in mine]), mine)]
        if o == hier.local_rank:
            try:  # observed by the caller, on the results every rank of every node holds
                results = exchange_bucket([(items[i][0], v, items[i][2]) for i, v in zip(mine, views)], hier.inter,
                                          hier.nodes, label=label, observe=False)
                for v, value in zip(views, results):
                    if value.data_ptr() != v.data_ptr():
                        v.copy_(value)
            except Exception as exc:
                error = exc
        for i, v in zip(mine, views):
            out[i] = v
    return error


def _raise_if_any_failed(node: Comm, error: Optional[Exception]) -> None:
    """Every rank of the node learns whether an owner's exchange failed (a status exchange,
    counted) and raises: the owner its own error, the others a ValueError naming the owners."""
    failed = node.exchange([int(error is not None)])[:, 0]
    if error is not None:
        raise error
    if bool(failed.any()):
        raise ValueError(f"the hierarchical exchange failed on local rank(s) {failed.nonzero().flatten().tolist()} "
                         f"of this node (the error is raised there)")
