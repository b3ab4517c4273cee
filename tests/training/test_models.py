"""The training layer on other kinds of model (issue 21): a conv net with BatchNorm, a
transformer block and a model of many small tensors (``tests/models.py``), each trained on 2
real gloo ranks through the DDP hook and through ``CompressedOptimizer`` with ``none``,
``powersgd``, ``topk`` with error feedback and ``onebit``, for a few steps, in one spawn.

For every run: the replicas' parameters are bit-identical, every loss is finite, and the
evaluation loss falls by a good part of what the dense run (plain DDP) gains; ``none`` gives
exactly plain DDP's parameters, through either wrapper."""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ranks import run_ranks

KINDS = ("conv_bn", "transformer", "many_small")
CODECS = {"none": {}, "powersgd": {"rank": 2}, "topk+ef": {"ratio": 0.1, "error_feedback": "ef"}, "onebit": {}}
STEPS, BATCH, LR = 12, 32, 3e-3


def _loss(model, x, y):
    with torch.no_grad():  # on a copy in train mode: BatchNorm's batch statistics, no side effects
        return F.cross_entropy(copy.deepcopy(model).train()(x), y).item()


def _train(kind, wrapper, codec, rank):
    import models

    from gradcomp.training import CompressedOptimizer, ddp_comm_hook

    torch.manual_seed(0)
    model = models.model(kind)
    x, y = models.data(kind, BATCH * 2 * STEPS, seed=1)
    ex, ey = models.data(kind, 256, seed=2)
    start = _loss(model, ex, ey)
    options = dict(CODECS.get(codec, {}))
    name = codec.split("+")[0]
    if wrapper == "optimizer":
        net = model
        opt = CompressedOptimizer(torch.optim.Adam(model.parameters(), lr=LR), name, model=model, min_numel=0,
                                  bucket_mb=0.05, **options)
    else:
        net = DDP(model, bucket_cap_mb=0.05)
        if wrapper == "hook":
            net.register_comm_hook(*ddp_comm_hook(name, model=model, min_numel=0, **options))
        opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        lo = (step * 2 + rank) * BATCH
        loss = F.cross_entropy(net(x[lo:lo + BATCH]), y[lo:lo + BATCH])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return params, losses, start, _loss(model, ex, ey)


def _runs(rank, w):
    out = {}
    for kind in KINDS:
        out[(kind, "dense", "ddp")] = _train(kind, "ddp", "none", rank)
        for wrapper in ("hook", "optimizer"):
            for codec in CODECS:
                out[(kind, wrapper, codec)] = _train(kind, wrapper, codec, rank)
    return out


def test_hook_and_optimizer_on_other_models(tmp_path):
    r0, r1 = run_ranks(_runs, 2, tmp_path, timeout_s=120)
    for run, (params, losses, start, end) in r0.items():
        kind = run[0]
        assert torch.equal(params, r1[run][0]), f"{run}: the replicas differ"
        assert all(math.isfinite(v) for v in losses + r1[run][1]) and math.isfinite(end), f"{run}: {losses}"
        _, _, dense_start, dense_end = r0[(kind, "dense", "ddp")]
        gain = dense_start - dense_end
        assert gain > 0.1, f"{kind}: the dense run did not learn ({dense_start:.3f} -> {dense_end:.3f})"
        assert start - end > 0.4 * gain, (f"{run}: eval loss {start:.3f} -> {end:.3f}, the dense run "
                                          f"{dense_start:.3f} -> {dense_end:.3f}")
        if run[2] == "none":
            assert torch.equal(params, r0[(kind, "dense", "ddp")][0]), f"{run}: not plain DDP's parameters"
