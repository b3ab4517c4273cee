"""The 2-D rank grid of pipeline x data parallelism.

The ``n`` ranks of the pipeline's process group form ``replicas`` pipelines of
``stages = n / replicas`` ranks each. Group rank ``g`` is stage ``g % stages`` of replica
``g // stages``: a pipeline's ranks are consecutive (on a multi-GPU node its stage-to-stage
traffic stays inside the node), and the replicas of one stage, which average gradients, are
``stages`` apart. Ranks in messages are global ranks, as ``torch.distributed.send`` takes.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch.distributed as dist

from gradcomp.collectives import rank_of, world_of


class Grid:
    """Where this rank sits: its stage and replica, its neighbours, its stage's replica group."""

    def __init__(self, group: Any, replicas: int) -> None:
        self.group = group
        self.world = world_of(group)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1 or self.world % replicas:
            raise ValueError(f"replicas={replicas!r} is not allowed; it must be an int >= 1 that divides the "
                             f"{self.world} ranks of the pipeline's process group")
        self.replicas = replicas
        self.stages = self.world // replicas
        if self.stages < 2:
            raise ValueError(f"a pipeline needs at least 2 stages; {self.world} rank(s) with replicas={replicas} "
                             f"leave {self.stages}")
        self.rank = rank_of(group)
        self.stage = self.rank % self.stages
        self.replica = self.rank // self.stages
        self.dp_group: Optional[Any] = None

    def global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def peer(self, stage: int) -> int:
        """The global rank holding pipeline stage ``stage`` (mod ``stages``) in this replica."""
        return self.global_rank(self.replica * self.stages + stage % self.stages)

    def replica_ranks(self, stage: int) -> List[int]:
        return [self.global_rank(r * self.stages + stage) for r in range(self.replicas)]

    def make_dp_groups(self, timeout: Any) -> None:
        """One group per stage over its replicas (every rank creates all of them, in order)."""
        if self.replicas == 1:
            return
        for s in range(self.stages):
            g = dist.new_group(self.replica_ranks(s), timeout=timeout)
            if s == self.stage:
                self.dp_group = g
