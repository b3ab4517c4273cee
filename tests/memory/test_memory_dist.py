"""A memory plan under data parallelism, on 2 real gloo ranks: the planned model trains under
DDP with a gradcomp hook and under ``CompressedOptimizer``, and ends where the unplanned model
ends, bit for bit (lossless plans), with the replicas identical.

One spawn of ranks runs every case; the tests assert on its results."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "training"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _training_helpers import batch, teacher_data  # noqa: E402
from ranks import run_ranks  # noqa: E402

STEPS = 4


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 32), nn.Tanh())
                           for _ in range(6)], nn.Linear(32, 4))


def _train(rank, how, planned):
    from gradcomp.memory import MemoryMeter, plan_memory
    from gradcomp.training import CompressedOptimizer, ddp_comm_hook

    x, y = teacher_data(512, 32, 4)
    model = _model()
    peak = None
    if planned:
        # the same plan on every rank: measured on rank 0's batch, then shared
        sample = batch(x, y, 64, 0, 0)[0]
        plan = plan_memory(model, sample, 120_000, allow=("recompute", "compress"), repeats=1)
        text = [plan.to_json()]
        torch.distributed.broadcast_object_list(text, src=0)
        from gradcomp.memory import Plan

        model = Plan.from_json(text[0]).apply(model)
    if how == "ddp":
        net = DDP(model)
        state, hook = ddp_comm_hook("topk", model=model, min_numel=0, ratio=0.2)
        net.register_comm_hook(state, hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    else:
        net = model
        opt = CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), "topk", model=model,
                                  ratio=0.2, min_numel=0)
    torch.manual_seed(100 + rank)  # dropout masks differ between ranks, as in real training
    for step in range(STEPS):
        xb, yb = batch(x, y, 64, rank, step)
        with MemoryMeter() as meter:
            loss = nn.functional.cross_entropy(net(xb), yb)
            opt.zero_grad()
            loss.backward()
        opt.step()
        peak = meter.peak_saved_bytes if peak is None else max(peak, meter.peak_saved_bytes)
    return [p.detach().clone() for p in model.parameters()], peak


def _rank(rank, world):
    out = {}
    for how in ("ddp", "optimizer"):
        for planned in (False, True):
            out[(how, planned)] = _train(rank, how, planned)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_rank, 2, tmp_path_factory.mktemp("memory"), timeout_s=120)


@pytest.mark.parametrize("how", ["ddp", "optimizer"])
def test_a_planned_model_trains_like_the_plain_one(results, how):
    plain = [r[(how, False)] for r in results]
    planned = [r[(how, True)] for r in results]
    for params, _ in plain + planned:  # every replica identical
        assert all(torch.equal(a, b) for a, b in zip(params, plain[0][0]))
    for (_, base_peak), (_, peak) in zip(plain, planned):  # and the plan saved memory
        assert peak < base_peak
