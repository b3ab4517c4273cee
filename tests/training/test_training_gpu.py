"""The hook and the wrapper on CUDA tensors (skipped without a GPU).

Two gloo ranks share one GPU (NCCL needs a GPU per rank): the worker's side stream, the
event that orders it after backward, and the CUDA future DDP waits on are all exercised,
for every compressor, as a hook and in the wrapper.
"""
from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _training_helpers import batch, flat_params, mlp, teacher_data
from ranks import run_ranks
from gradcomp.compress import available_compressors

pytestmark = pytest.mark.gpu


def _cuda_rank(rank, world):
    from gradcomp.training import CompressedOptimizer, ddp_comm_hook

    dev = torch.device("cuda", 0)
    x, y = teacher_data(512, 20, 4)
    x, y = x.to(dev), y.to(dev)
    out = {}
    for name in available_compressors():
        for mode in ("hook", "optimizer"):
            model = mlp(20, 64, 4).to(dev)
            options = {"min_numel": 0, **({"rank": 1} if name == "powersgd" else {})}
            if mode == "hook":
                net = DDP(model, device_ids=[0])
                state, hook = ddp_comm_hook(name, model=model, **options)
                net.register_comm_hook(state, hook)
                opt = torch.optim.SGD(net.parameters(), lr=0.1)
            else:
                net = model
                opt = CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), name, **options)
            losses = []
            for step in range(4):
                xb, yb = batch(x, y, 16, rank, step)
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(net(xb), yb)
                loss.backward()
                opt.step()
                losses.append(float(loss))
            out[(name, mode)] = (flat_params(model).cpu(), losses)
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_on_two_ranks(tmp_path):
    r0, r1 = run_ranks(_cuda_rank, 2, tmp_path, timeout_s=240)
    for key in r0:
        assert torch.equal(r0[key][0], r1[key][0]), f"replicas differ: {key}"
        assert all(torch.isfinite(torch.tensor(r0[key][1]))), key
