"""The base of gradcomp's optimizers that wrap another one (``CompressedOptimizer``,
``memory.LowBitState``, ``memory.ShardedOptimizer``): a ``torch.optim.Optimizer`` whose
``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's, so LR schedulers,
gradient clipping and hooks work on it as on any optimizer; and the broadcast that gives every
rank the first rank's parameters at the start (``gradcomp.optim``'s optimizers use it too).
The gradient hooks of those that exchange gradients as backward produces them are
:mod:`gradcomp.training.buckets`'."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Sequence

import torch
import torch.distributed as dist

from gradcomp.collectives import worker

_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
          "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
          "_optimizer_load_state_dict_post_hooks")


class Wrapper(torch.optim.Optimizer):
    """Set ``self.optimizer`` (the wrapped one) before reading the properties."""

    optimizer: torch.optim.Optimizer

    def __init__(self) -> None:  # what Optimizer.__init__ sets up, without copying any param groups
        for name in _HOOKS:
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> Dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def __getstate__(self) -> Dict[str, Any]:
        raise ValueError(f"a {type(self).__name__} cannot be pickled; save state_dict() instead")


def broadcast_params(params: Sequence[torch.Tensor], group=None) -> None:
    """Every rank of ``group`` starts from the parameters of the group's first rank; nothing
    without a process group or with one rank."""
    if not params or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return
    src = 0 if group is None else dist.get_global_rank(group, 0)

    def job(twin):
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.data, src=src, group=twin(group))

    # after the gradcomp jobs in flight, under the parameters' device (see collectives.worker)
    worker.submit(job, (group,), False, device=worker.device_of(list(params)))
