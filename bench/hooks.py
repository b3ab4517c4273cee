"""DDP communication hooks as the benchmarks run them: gradcomp's and PyTorch's own.

The training benchmark registers them on a real ``DistributedDataParallel`` model; the
collective benchmark calls them on :class:`Bucket`, a stand-in for ``dist.GradBucket`` (which
Python cannot construct) with the methods the hooks use, over parameters of the model's shapes.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

Hook = Callable[[Any, Any], torch.futures.Future]


class Bucket:
    """What hooks read from a ``dist.GradBucket``: a flat buffer and per-parameter views."""

    def __init__(self, index: int, buffer: torch.Tensor, params: List[torch.Tensor], last: bool) -> None:
        self._index, self._buffer, self._params, self._last = index, buffer, params, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> List[torch.Tensor]:
        return self._params

    def gradients(self) -> List[torch.Tensor]:
        out, pos = [], 0
        for p in self._params:
            out.append(self._buffer[pos:pos + p.numel()].view(p.shape))
            pos += p.numel()
        return out


class CountingAllReduce:
    """Counts what PyTorch's hooks hand to ``all_reduce`` (they keep no telemetry), with the
    collectives' convention: a ring allreduce of ``n`` bytes sends ``2 (w-1)/w * n`` per rank."""

    def __init__(self, world: int) -> None:
        self.nbytes = 0
        self.world = world
        self._orig = dist.all_reduce

    def __enter__(self) -> "CountingAllReduce":
        orig = self._orig

        def counted(tensor, *args, **kwargs):
            self.nbytes += tensor.numel() * tensor.element_size() * 2 * (self.world - 1) // self.world
            return orig(tensor, *args, **kwargs)

        dist.all_reduce = counted  # the hooks call dist.all_reduce through the module
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._orig


def gradcomp_hook(spec: Dict[str, Any], model: Optional[torch.nn.Module] = None,
                  local_size: Optional[int] = None) -> Tuple[Any, Hook]:
    """``(state, hook)`` of gradcomp's DDP hook for a method spec (compressor, options, EF);
    ``local_size``: ranks per node for the hierarchical exchange."""
    from gradcomp.training import ddp_comm_hook

    if spec["name"] == "auto":  # chooses per bucket, error feedback with the biased methods
        return ddp_comm_hook("auto", model=model, local_size=local_size, **spec["options"])
    return ddp_comm_hook(spec["name"], model=model, error_feedback="ef" if spec["ef"] else "none",
                         local_size=local_size, **spec["options"])


def torch_hook(kind: str, options: Dict[str, Any]) -> Tuple[Any, Hook, int]:
    """``(state, hook, setup_steps)`` of PyTorch's own hook ``kind``: ``torch-allreduce``,
    ``torch-fp16`` or ``torch-powersgd``. ``setup_steps``: steps the hook runs uncompressed first."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    if kind == "torch-allreduce":
        return None, default_hooks.allreduce_hook, 0
    if kind == "torch-fp16":
        return None, default_hooks.fp16_compress_hook, 0
    if kind == "torch-powersgd":
        # start_powerSGD_iter=2 is the earliest PyTorch allows with error feedback and warm start
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=options["rank"],
                                 start_powerSGD_iter=2, use_error_feedback=True, warm_start=True,
                                 random_seed=options.get("seed", 0))
        return state, ps.powerSGD_hook, 2
    raise ValueError(f"unknown PyTorch hook {kind!r}; allowed: torch-allreduce, torch-fp16, torch-powersgd")
