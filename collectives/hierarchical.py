"""Hierarchical allreduce: dense inside a node, compressed across nodes.

With ``L`` ranks per node, each rank owns one ``1/L`` shard of the tensor:

1. inside the node, an all-to-all of dense shards; each rank averages its shard in rank order
   (a reduce-scatter: fast links carry the dense bytes);
2. across nodes, a compressed allreduce of that shard among the ranks with the same local
   index (key ``"{key}/shard{i}of{L}"``, so error feedback is kept per shard);
3. inside the node, an all-gather of the shards.

So the slow links carry ``1/L`` of a compressed tensor per rank, and every rank ends with the
same bits: each shard comes from one inter-node allreduce, identical on all its members.
``make_node_groups(local_size)`` builds the groups (and their async twins); on one machine,
4 ranks as 2 "nodes" of 2 exercise the whole path.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from gradcomp.compress import transaction

from . import _telemetry as telemetry, worker
from ._algorithm import chunk_sizes, mean_in_order, wdtype
from ._comm import Comm, group_timeout, initialized
from ._core import check_input, choose_algorithm, label, measure, reduce
from ._header import build, verify


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
    intra = Comm(intra_group, rec, "allreduce")
    inter = Comm(inter_group, rec, "allreduce")
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
