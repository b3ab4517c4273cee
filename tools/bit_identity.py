"""Fingerprints of what each training layer computes, to check a refactor changes no bit.

``python tools/bit_identity.py [--out FILE]`` trains small models on 2 gloo ranks through
every layer that steps (the DDP hook with several compressors and ``auto``,
``CompressedOptimizer`` with the allgather and scatter-reduce paths, ``ShardedOptimizer``,
``compress_fsdp``, ``OneBitAdam``, ``Pipeline``, a standalone ``allreduce`` with error
feedback; on 4 ranks too, where scatter-reduce and its server residuals run) and prints one sha256 per workload over the parameters, the losses and the
residuals each rank ends with. Run it before and after a change and compare the lines (or
``--compare BEFORE.json``): a behaviour-preserving change prints the same digests.
Every workload is deterministic (seeded data, single-threaded ranks).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STEPS = 6


def _digest(tensors: List[torch.Tensor], losses: List[float]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    h.update(repr([float(x) for x in losses]).encode())
    return h.hexdigest()[:24]


def _data(rank: int, step: int, n: int = 32, d: int = 32, classes: int = 8):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def _train(rank: int, forward: Callable, opt: Any, step: Optional[Callable[[], None]] = None) -> List[float]:
    """STEPS steps of cross-entropy on this rank's data: gradients cleared, backward, then
    ``step()`` (default ``opt.step()``); the losses."""
    losses = []
    for i in range(STEPS):
        x, y = _data(rank, i)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        (step or opt.step)()
        losses.append(loss.item())
    return losses


def _hook(r: int, spec: str, **options: Any) -> str:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from gradcomp.training import ddp_comm_hook
    model = _mlp()
    ddp = DDP(model, bucket_cap_mb=0.01)
    state, hook = ddp_comm_hook(spec, model=model, **options)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses = _train(r, ddp, opt)
    return _digest(list(model.parameters()), losses)


def _wrapper(rank: int, spec: str, **options: Any) -> str:
    from gradcomp.training import CompressedOptimizer
    model = _mlp()
    opt = CompressedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True), spec, model=model,
                              **options)
    losses = _train(rank, model, opt)
    return _digest(list(model.parameters()), losses)


def _sharded(rank: int) -> str:
    from gradcomp.memory import ShardedOptimizer
    model = _mlp()
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, model=model, compressor="int8",
                           weight_compressor="bf16", state_bits=8)
    losses = _train(rank, model, opt)
    return _digest(list(model.parameters()), losses)


def _fsdp(rank: int) -> str:
    from torch.distributed.fsdp import fully_shard
    from gradcomp.training import compress_fsdp
    model = _mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    fsdp = compress_fsdp(model, "int8", all_gather="bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = _train(rank, model, opt, lambda: fsdp.step(opt))
    return _digest([p.to_local() for p in model.parameters()], losses)


def _onebit(rank: int) -> str:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from gradcomp.optim import OneBitAdam
    model = _mlp()
    ddp = DDP(model)
    opt = OneBitAdam(ddp.parameters(), lr=1e-2, freeze_step=2)
    ddp.register_comm_hook(*opt.comm_hook())
    losses = _train(rank, ddp, opt)
    return _digest(list(model.parameters()), losses)


def _pipeline(rank: int) -> str:
    from gradcomp.pipeline import Pipeline
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)], nn.Linear(32, 8))
    pipe = Pipeline(model, balance=[3, 2], schedule="1f1b", microbatches=4, activation_codec="int8",
                    grad_codec="fp16", optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    losses = []
    for step in range(STEPS):
        x, y = _data(0, step)  # the same batch on every rank
        losses.append(float(pipe.step(x, y, nn.functional.cross_entropy)))
    params = list(model.parameters())
    pipe.close()
    return _digest(params, losses)


def _allreduce(rank: int) -> str:
    from gradcomp.collectives import allreduce
    from gradcomp.compress import ErrorFeedback, get_compressor
    out = []
    for name, options in (("topk", {"ratio": 0.05}), ("int8", {}), ("powersgd", {"rank": 2}), ("onebit", {})):
        ef = ErrorFeedback(get_compressor(name, **options))
        for step in range(3):
            g = torch.Generator().manual_seed(7 * rank + step)
            t = torch.randn(64, 48, generator=g)
            out.append(allreduce(t, compressor=ef, key="w"))
        out.append(ef.residual("w"))
    for algorithm in ("allgather", "scatter-reduce"):
        ef = ErrorFeedback(get_compressor("topk", ratio=0.05))
        for step in range(3):
            t = torch.randn(5000, generator=torch.Generator().manual_seed(11 * rank + step))
            out.append(allreduce(t, compressor=ef, key="v", algorithm=algorithm))
    return _digest(out, [])


def _auto() -> Dict[str, Any]:
    """auto's options for a decision no measurement can change: two candidates and a given link
    so slow (1 Mbit/s) that the compressed one wins however long its codec takes here."""
    from gradcomp.training.auto import Link
    return {"candidates": ("dense", "topk"), "link": Link.of(0.01, 0.001), "trial_steps": 1, "verify_steps": 1}


WORKLOADS: Dict[str, Callable[[int], str]] = {
    "hook fp16": lambda r: _hook(r, "fp16"),
    "hook topk": lambda r: _hook(r, "topk", ratio=0.05),
    "hook int8": lambda r: _hook(r, "int8"),
    "hook powersgd": lambda r: _hook(r, "powersgd", rank=2),
    "hook signsgd": lambda r: _hook(r, "signsgd"),
    "hook threshold": lambda r: _hook(r, "threshold", tau=0.01),
    "hook auto": lambda r: _hook(r, "auto", **_auto()),
    "optimizer topk": lambda r: _wrapper(r, "topk", ratio=0.05),
    "optimizer auto": lambda r: _wrapper(r, "auto", **_auto()),
    "sharded int8+bf16, 8-bit state": _sharded,
    "fsdp int8+bf16": _fsdp,
    "onebit adam": _onebit,
    "pipeline 1f1b int8/fp16": _pipeline,
    "allreduce with error feedback": _allreduce,
}


# on 4 ranks: scatter-reduce (chosen for a compressor with error feedback from three ranks on)
# and its server residuals
WORKLOADS4: Dict[str, Callable[[int], str]] = {
    "4 ranks: hook topk": lambda r: _hook(r, "topk", ratio=0.05),
    "4 ranks: hook int8": lambda r: _hook(r, "int8"),
    "4 ranks: optimizer topk": lambda r: _wrapper(r, "topk", ratio=0.05),
    "4 ranks: optimizer auto": lambda r: _wrapper(r, "auto", **_auto()),
    "4 ranks: allreduce with error feedback": _allreduce,
}


def _run(rank: int, world: int) -> Dict[str, str]:
    out = {}
    for name, fn in (WORKLOADS if world == 2 else WORKLOADS4).items():
        try:
            out[name] = fn(rank)
        except Exception as exc:  # a workload the code cannot run is reported, not fatal
            out[name] = f"error: {type(exc).__name__}: {str(exc)[:160]}"
        dist.barrier()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the digests here (JSON)")
    ap.add_argument("--compare", help="a JSON file of an earlier run: exit 1 on any difference")
    args = ap.parse_args(argv)
    from tests.ranks import run_ranks
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_run, 2, tmp, timeout_s=120.0, deadline_s=1200.0)
        results4 = run_ranks(_run, 4, tmp, timeout_s=120.0, deadline_s=1200.0)
    table = {name: [r[name] for r in results] for name in WORKLOADS}
    table.update({name: [r[name] for r in results4] for name in WORKLOADS4})
    for name, digests in table.items():
        print(f"{name:34s} " + " ".join(digests))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        diff = [n for n in table if before.get(n) != table[n]]
        print("identical" if not diff else "DIFFERENT: " + ", ".join(diff))
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
