"""Where every element of a sharded optimizer lives: the flat layout of parameter groups,
their shards and the buckets their gradients travel in. Pure arithmetic, no communication.

Each parameter group's trainable parameters are laid end to end (in the order given) into
one flat vector of ``numel`` elements. That vector is cut into ``world`` contiguous shards
on :data:`ALIGN`-element (256) boundaries, as evenly as whole blocks allow (``tensor_split`` of the
blocks: the first ranks get one block more), so a shard starts where a block of the group's
vector starts whatever the world size — the blocks of 8-bit state are the same blocks on any
number of ranks, and resharding only re-cuts them. A group smaller than ``world`` blocks
leaves the last ranks without a shard of it (an empty tensor).

Buckets: each group's parameters, last first (the order backward produces them), are packed
by gradcomp's one bucket plan (:func:`gradcomp.collectives.plan_buckets`, every element counted
as 4 bytes) into buckets of at most ``bucket_mb`` (a larger parameter is a bucket alone); a
bucket is a contiguous range of the group's vector, and its piece for rank ``j`` is the part
of that range inside rank ``j``'s shard.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from gradcomp.collectives import plan_buckets

from .lowbit import BLOCK, LEGACY_BLOCK

# shards start on multiples of every low-bit block size (128, and the 256 of saved state of
# format version 1), so a shard's blocks are the whole vector's blocks at any world size
ALIGN = max(BLOCK, LEGACY_BLOCK)


class Bucket(NamedTuple):
    group: int
    members: Tuple[int, ...]  # positions in the group's trainable parameters, ascending
    start: int  # the bucket's range in the group's flat vector
    stop: int


class GroupLayout(NamedTuple):
    offsets: Tuple[int, ...]  # start of each trainable parameter in the flat vector
    numels: Tuple[int, ...]
    numel: int
    bounds: Tuple[int, ...]  # world + 1 shard boundaries

    def shard(self, rank: int) -> Tuple[int, int]:
        return self.bounds[rank], self.bounds[rank + 1]

    def splits(self, start: int, stop: int) -> List[int]:
        """Per rank, how many elements of ``[start, stop)`` lie in its shard."""
        return [max(0, min(stop, b) - max(start, a)) for a, b in zip(self.bounds[:-1], self.bounds[1:])]


def shard_bounds(numel: int, world: int) -> Tuple[int, ...]:
    """``world + 1`` boundaries of ``numel`` elements cut on :data:`ALIGN` boundaries."""
    blocks = -(-numel // ALIGN)
    base, extra = divmod(blocks, world)
    bounds, at = [0], 0
    for r in range(world):
        at += base + (1 if r < extra else 0)
        bounds.append(min(at * ALIGN, numel))
    return tuple(bounds)


def group_layout(numels: Sequence[int], world: int) -> GroupLayout:
    offsets, at = [], 0
    for n in numels:
        offsets.append(at)
        at += int(n)
    return GroupLayout(tuple(offsets), tuple(int(n) for n in numels), at, shard_bounds(at, world))


def group_buckets(layout: GroupLayout, group: int, params: Sequence[torch.Tensor], bucket_mb: float) -> List[Bucket]:
    """The buckets of parameter group ``group`` (its trainable ``params``, laid out as
    ``layout``) in launch order: the last parameters first, at most ``bucket_mb`` of fp32."""
    last_first = list(reversed(range(len(params))))
    cap = max(bucket_mb, 4 / 2 ** 20)  # at least one element
    plan = plan_buckets([(str(i), params[i]) for i in last_first], cap, bytes_per_element=4)
    return [_bucket(layout, group, [last_first[j] for j in members]) for members in plan]


def _bucket(layout: GroupLayout, group: int, members: List[int]) -> Bucket:
    ordered = tuple(sorted(members))
    start = layout.offsets[ordered[0]]
    stop = layout.offsets[ordered[-1]] + layout.numels[ordered[-1]]
    return Bucket(group, ordered, start, stop)


def bucket_key(group: int, k: int) -> str:
    """The error-feedback key of bucket ``k``'s reduce-scatter (``k``: its index over all
    groups' buckets, in launch order; ``group``: its parameter group)."""
    return f"g{group}/b{k}"


def weight_key(group: int, k: Optional[int] = None) -> str:
    """The error-feedback key of bucket ``k``'s weight all-gather (``group``: its parameter
    group). Without ``k``: the key of the whole group's all-gather, which checkpoints saved
    before the weights were gathered bucket by bucket hold."""
    return f"w{group}" if k is None else f"w{group}/b{k}"


def bucket_piece(layout: GroupLayout, rank: int, start: int, stop: int) -> Tuple[int, int]:
    """The part of ``[start, stop)`` inside ``rank``'s shard, in shard coordinates (empty:
    equal ends)."""
    lo, hi = layout.shard(rank)
    a, z = max(lo, start), min(hi, stop)
    return (a - lo, z - lo) if a < z else (0, 0)


def layer_slices(layout: GroupLayout, rank: int, layers: Sequence[int]) -> List[Tuple[int, int, int]]:
    """``(layer, start, stop)`` for every parameter with elements in this rank's shard, in
    shard coordinates; ``layers[i]`` is the layer number of the group's parameter ``i``."""
    lo, hi = layout.shard(rank)
    out = []
    for i, (off, n) in enumerate(zip(layout.offsets, layout.numels)):
        a, b = max(lo, off), min(hi, off + n)
        if a < b:
            out.append((int(layers[i]), a - lo, b - lo))
    return out


def flat_of(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The tensors end to end as one new 1-D tensor of ``dtype``."""
    if not tensors:
        return torch.empty(0, dtype=dtype)
    return torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])
