"""Three gloo ranks (not a power of two, so the order of scaling and summing shows):

- the ``none`` hook equals plain DDP and ``fp16`` on every tensor equals PyTorch's
  ``fp16_compress_hook``, bit for bit;
- scatter-reduce (top-k with its second, server-side error feedback) and the lockstep PowerSGD
  exchange keep replicas bit-identical, and a hook resumes bit-identically with the server
  residuals in its state.
"""
from __future__ import annotations

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from _training_helpers import batch, flat_params, mlp, restore, snapshot, teacher_data
from ranks import run_ranks


def _run(me, compressor, steps, *, start=0, checkpoint=None, save_at=None, seed=0, torch_hook=None, **options):
    from gradcomp.training import ddp_comm_hook

    x, y = teacher_data(256, 20, 4)
    model = mlp(20, 64, 4, seed=seed)
    ddp = DDP(model)
    state = None
    if torch_hook is not None:
        ddp.register_comm_hook(None, torch_hook)
    elif compressor is not None:
        state, hook = ddp_comm_hook(compressor, model=model, min_numel=0, **options)
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    restore(model, state, checkpoint)
    saved = None
    for step in range(start, start + steps):
        xb, yb = batch(x, y, 8, me, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(xb), yb).backward()
        opt.step()
        if save_at == step + 1:
            saved = snapshot(model, state)
    return model, state, saved


def _three(rank, world):
    same = {label: flat_params(_run(rank, name, 4, **options)[0]) for label, name, options in (
        ("plain", None, {}), ("none", "none", {}), ("fp16", "fp16", {"compress_1d": True}),
        ("torch fp16", None, {"torch_hook": default_hooks.fp16_compress_hook}))}
    straight, state, saved = _run(rank, "topk", 6, save_at=3, ratio=0.05)
    # the codecs whose error feedback holds scatter-reduce server residuals (inside its state)
    servers = [p for p, c in state.state_dict()["codecs"].items() if (c.get("server") or {}).get("state")]
    resumed, *_ = _run(rank, "topk", 3, start=3, checkpoint=saved, seed=7, ratio=0.05)
    psgd, *_ = _run(rank, "powersgd", 4, rank=1)
    # variable-size payloads through scatter-reduce on their agreed layout (each phase's sizes read once)
    thr, *_ = _run(rank, "threshold", 4, tau=0.01)
    return {"straight": flat_params(straight), "resumed": flat_params(resumed), "servers": sorted(servers),
            "powersgd": flat_params(psgd), "threshold": flat_params(thr), **same}


def test_three_ranks(tmp_path):
    results = run_ranks(_three, 3, tmp_path, timeout_s=120)
    for r in results:
        assert torch.equal(r["none"], r["plain"])
        assert torch.equal(r["fp16"], r["torch fp16"])
        assert r["servers"] == ["*"]
        assert torch.equal(r["straight"], r["resumed"])
        assert torch.equal(r["straight"], results[0]["straight"])
        assert torch.equal(r["powersgd"], results[0]["powersgd"])
        assert torch.equal(r["threshold"], results[0]["threshold"])
    assert not torch.equal(results[0]["threshold"], results[0]["plain"])  # it trained, and not densely
