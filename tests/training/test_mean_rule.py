"""One averaging rule: the ``none`` hook, ``allreduce(t, "none")`` and plain DDP give the same bits.

Invariant protected, on 2 and 3 real gloo ranks (3: where scaling by 1/3 before the sum and
dividing by 3 after it round differently): the gradients DDP averages itself, those the
``none`` hook averages, and ``allreduce`` of each rank's local gradient with ``"none"`` are
equal bit for bit — and so are ``fp16`` and PyTorch's ``fp16_compress_hook``.
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from _training_helpers import batch, mlp, teacher_data
from ranks import run_ranks


def _grads(rank, hook=None, state=None, no_ddp=False):
    x, y = teacher_data(128, 20, 4)
    model = mlp(20, 48, 4, seed=0)
    net = model if no_ddp else DDP(model)
    if hook is not None:
        net.register_comm_hook(state, hook)
    xb, yb = batch(x, y, 16, rank, 0)
    torch.nn.functional.cross_entropy(net(xb), yb).backward()
    return [p.grad.clone() for p in model.parameters()]


def _all(rank, world):
    from gradcomp.collectives import allreduce
    from gradcomp.training import ddp_comm_hook

    dense = _grads(rank)
    state, hook = ddp_comm_hook("none", model=None)
    ours = _grads(rank, hook, state)
    # one flat tensor laid out as DDP's one bucket of this model (its parameters in order):
    # gloo's ring sums each chunk of a buffer in an order that depends on the chunk's place,
    # so only the same layout can give the same bits on 3 ranks
    local = _grads(rank, no_ddp=True)
    flat = allreduce(torch.cat([g.reshape(-1) for g in local]), "none", key="bucket")
    collective = [v.view(g.shape) for v, g in zip(flat.split([g.numel() for g in local]), local)]
    fp16_state, fp16_hook = ddp_comm_hook("fp16", min_numel=0, compress_1d=True)
    fp16 = _grads(rank, fp16_hook, fp16_state)
    torch_fp16 = _grads(rank, default_hooks.fp16_compress_hook, None)
    return dense, ours, collective, fp16, torch_fp16


@pytest.mark.parametrize("world", [2, 3])
def test_none_hook_allreduce_and_ddp_agree_bit_for_bit(tmp_path, world):
    for rank, (dense, ours, collective, fp16, torch_fp16) in enumerate(run_ranks(_all, world, tmp_path)):
        for i, (d, o, c) in enumerate(zip(dense, ours, collective)):
            assert torch.equal(d, o), f"rank {rank}, parameter {i}: the none hook differs from DDP"
            assert torch.equal(d, c), f"rank {rank}, parameter {i}: allreduce(t, 'none') differs from DDP"
        for i, (a, b) in enumerate(zip(fp16, torch_fp16)):
            assert torch.equal(a, b), f"rank {rank}, parameter {i}: fp16 differs from PyTorch's fp16 hook"
