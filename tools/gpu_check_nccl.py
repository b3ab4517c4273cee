"""The NCCL smoke test of ``tools/gpu_check.sh``, where there are two GPUs: two ranks, one GPU each,
under torchrun, as a user runs gradcomp. One ``PASS`` or ``FAIL`` line per check (rank 0 prints):

- the DDP communication hook (PowerSGD) for a few steps: parameters identical on both ranks;
- ``CompressedOptimizer`` (top-k, error feedback): parameters identical on both ranks;
- a ``Pipeline`` step (1F1B, 2 stages, int8 activations, fp16 gradients): the same finite loss
  on both ranks;
- ``ShardedOptimizer`` steps (AdamW, int8 gradients, bf16 weights, 8-bit state): parameters
  identical on both ranks, and the same bits with ``prefetch=True`` (the weights' all-gather
  running into the next forward pass).

``torchrun --standalone --nproc_per_node=2 tools/gpu_check_nccl.py`` (NCCL and the
GPU of ``LOCAL_RANK``); ``--backend gloo --device cpu`` runs the same checks on CPU ranks.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from datetime import timedelta
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn


def _mlp(device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)  # every rank builds the same model
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)


def _batch(device: torch.device, rank: int, step: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)  # each rank its own data
    return [torch.randn(16, 32, generator=g).to(device), torch.randint(0, 4, (16,), generator=g).to(device)]


def _same_on_every_rank(t: torch.Tensor) -> bool:
    """Whether ``t`` holds the same bits on every rank (decided by all, on ``t``'s device)."""
    ref = t.detach().clone()
    dist.broadcast(ref, 0)
    flag = torch.tensor([1.0 if torch.equal(ref, t) and bool(torch.isfinite(t).all()) else 0.0], device=t.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() == 1.0)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def check_hook(device: torch.device, rank: int) -> str:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradcomp.training import ddp_comm_hook

    model = _mlp(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    ddp.register_comm_hook(*ddp_comm_hook("powersgd", model=model, rank=2, start_iter=0))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(4):
        x, y = _batch(device, rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    assert _same_on_every_rank(_flat(model)), "the ranks' parameters differ after 4 hook steps"
    return "4 steps of DDP + the powersgd hook, parameters identical on both ranks"


def check_compressed_optimizer(device: torch.device, rank: int) -> str:
    from gradcomp.training import CompressedOptimizer

    model = _mlp(device)
    opt = CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), compressor="topk", ratio=0.1,
                              model=model)
    for step in range(4):
        x, y = _batch(device, rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert _same_on_every_rank(_flat(model)), "the ranks' parameters differ after 4 CompressedOptimizer steps"
    return "4 steps of CompressedOptimizer(topk 10 %), parameters identical on both ranks"


def check_pipeline(device: torch.device, rank: int) -> str:
    from gradcomp.pipeline import Pipeline

    model = _mlp(device)
    pipe = Pipeline(model, balance=[3, 2], schedule="1f1b", microbatches=4, activation_codec="int8", grad_codec="fp16",
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.05))
    try:
        x, y = _batch(device, 0, 0)  # every rank passes the same batch
        losses = [pipe.step(x, y, nn.functional.cross_entropy) for _ in range(2)]
    finally:
        pipe.close()
    loss = losses[-1].detach().reshape(1).to(device)
    assert _same_on_every_rank(loss), f"the pipeline's loss differs between ranks or is not finite ({loss})"
    return f"2 steps of a 2-stage 1F1B pipeline (int8 activations, fp16 gradients), loss {float(loss):.4f} on both"


def check_sharded(device: torch.device, rank: int) -> str:
    from gradcomp.sharded import ShardedOptimizer

    flats = []
    for prefetch in (False, True):  # with prefetch the weights' gathers run into the next forward pass
        model = _mlp(device)
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, model=model, compressor="int8",
                               weight_compressor="bf16", state_bits=8, bucket_mb=0.01, prefetch=prefetch)
        for step in range(3):
            x, y = _batch(device, rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        opt.synchronize()
        assert _same_on_every_rank(_flat(model)), f"the ranks' parameters differ after 3 ShardedOptimizer steps " \
                                                  f"(prefetch={prefetch})"
        flats.append(_flat(model))
    assert torch.equal(flats[0], flats[1]), "prefetch=True changed the parameters of 3 ShardedOptimizer steps"
    return ("3 steps of ShardedOptimizer(AdamW, int8 gradients, bf16 weights, 8-bit state), identical parameters, "
            "the same bits with prefetch=True")


CHECKS: List[Callable[[torch.device, int], str]] = [check_hook, check_compressed_optimizer, check_pipeline,
                                                    check_sharded]


def _missing_gpus(device: str, backend: str, local: int) -> Optional[str]:
    """Why this machine cannot run the checks as asked (None: it can)."""
    fallback = ("; --backend gloo --device cpu runs the same checks on CPU ranks "
                "(torchrun --standalone --nproc_per_node=2 tools/gpu_check_nccl.py --backend gloo --device cpu)")
    if device == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if local >= count:
            return (f"it needs one CUDA GPU per rank, and this machine has {count} visible to this rank "
                    f"(LOCAL_RANK {local}); run it under torchrun on a machine with 2 GPUs{fallback}")
    if backend == "nccl" and not dist.is_nccl_available():
        return f"this torch build has no NCCL (a CPU build?){fallback}"
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--device", default="cuda", help="cuda: the GPU of LOCAL_RANK; cpu: with --backend gloo")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before a stuck collective fails")
    ap.add_argument("--checks", default="", help="comma-separated names of the checks to run (default: all)")
    args = ap.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    problem = _missing_gpus(args.device, args.backend, local)
    if problem:
        print(f"tools/gpu_check_nccl.py: {problem}", file=sys.stderr, flush=True)
        return 2
    if args.device == "cuda":
        torch.cuda.set_device(local)  # before the group: object collectives and allocations use it
        device = torch.device("cuda", local)
    else:
        device = torch.device(args.device)
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    from gradcomp.training import shutdown

    rank = dist.get_rank()
    failed = 0
    try:
        for check in CHECKS:
            name = check.__name__.replace("check_", "")
            if args.checks and name not in args.checks.split(","):
                continue
            try:
                detail = check(device, rank)
                if rank == 0:
                    print(f"PASS {name}: {detail}", flush=True)
            except Exception as exc:  # noqa: BLE001 - every check is tried and reported
                failed += 1
                if rank == 0:
                    print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
                print(f"rank {rank}, {name}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            finally:
                shutdown()  # each check as its own program would run: no worker or twin group left over
    finally:
        shutdown()
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
