"""The DDP communication hook of the compressed-momentum optimizers (``opt.comm_hook()``).

DDP reduces every bucket every step; 1-bit Adam, 0/1 Adam and 1-bit LAMB need the dense mean
only on some steps (warm-up, variance updates) and this rank's own gradient on the others,
where they exchange compressed momentum themselves. This hook asks the optimizer which step is
coming: a dense step averages the bucket as DDP's own reduction does (scaled by ``1/w``, then
summed: the same bits), any other step hands the bucket back untouched, without communicating.
"""
# no ``from __future__ import annotations``: DDP checks the hook's annotations at registration
from typing import Any

import torch
import torch.distributed as dist

from gradcomp.collectives import allreduce


def dense_or_local_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` densely when ``state`` (the optimizer) wants it, else return it as is."""
    buffer = bucket.buffer()
    if not state.wants_dense():
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done
    fut = allreduce(buffer, "none", key=f"{state.display_name}/ddp/{bucket.index()}", group=state.process_group,
                    async_op=True)

    def write(f: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(f.value())
        return buffer

    return fut.then(write)
