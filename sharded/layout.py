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


class GatherPiece(NamedTuple):
    """One all-gather of a group's weights: ``slices[r]`` is the ``(start, stop)`` of rank ``r``'s
    shard (shard coordinates) that it sends; every rank's slice is about ``1/count`` of its shard,
    so no rank pads its piece to a larger one's size."""
    group: int
    slices: Tuple[Tuple[int, int], ...]


def gather_pieces(layout: GroupLayout, group: int, count: int) -> List[GatherPiece]:
    """Group ``group``'s weight all-gather cut into ``count`` balanced pieces: piece ``c`` takes
    the ``c``-th of ``count`` equal parts of every rank's shard. Piece 0 holds the start of
    every shard, so the forward pass's first parameters (the start of rank 0's shard) arrive
    with the first piece."""
    sizes = [hi - lo for lo, hi in zip(layout.bounds[:-1], layout.bounds[1:])]
    return [GatherPiece(group, tuple((c * s // count, (c + 1) * s // count) for s in sizes)) for c in range(count)]


def weight_key(group: int, piece: Optional[Tuple[int, int]] = None) -> str:
    """The error-feedback key of a weight all-gather: the whole shard of parameter group
    ``group`` (``"w{group}"``), or its slice ``piece = (start, stop)`` (``"w{group}/{start}:{stop}"``,
    shard coordinates): a checkpoint's keys say where each residual lies, whatever pieces the
    run that saved it gathered."""
    return f"w{group}" if piece is None else f"w{group}/{piece[0]}:{piece[1]}"


def parse_weight_key(key: str) -> Optional[Tuple[int, Optional[Tuple[int, int]]]]:
    """``(group, (start, stop) or None for the whole shard)`` of a :func:`weight_key`, or None."""
    head, _, tail = key.partition("/")
    if not (head.startswith("w") and head[1:].isdigit()):
        return None
    if not tail:
        return int(head[1:]), None
    a, _, z = tail.partition(":")
    if not (a.isdigit() and z.isdigit()):
        return None
    return int(head[1:]), (int(a), int(z))


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
