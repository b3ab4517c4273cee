"""Train a small classifier on several processes with compressed gradients.

    torchrun --nproc_per_node=2 examples/train_ddp.py --compressor powersgd --mode hook
    torchrun --nproc_per_node=2 examples/train_ddp.py --compressor topk --mode optimizer

``--mode hook`` wraps the model in DDP and registers gradcomp's communication hook;
``--mode optimizer`` uses no DDP: ``CompressedOptimizer`` broadcasts the parameters and
averages the gradients itself. The data is synthetic (a random linear teacher), so nothing
is downloaded. Runs on gloo (CPU) or NCCL (one GPU per process); without torchrun it runs
as one process. Rank 0 prints the loss, the test accuracy and the bytes each rank sent.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from gradcomp.collectives import telemetry
from gradcomp.compress import available_compressors
from gradcomp.training import CompressedOptimizer, ddp_comm_hook, shutdown


def synthetic(n: int, seed: int, device: torch.device):
    """Inputs and labels of one fixed teacher; ``seed`` picks the samples."""
    teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 64, generator=torch.Generator().manual_seed(seed))
    return x.to(device), (x @ teacher).argmax(1).to(device)


def main() -> None:
    p = argparse.ArgumentParser(description="gradcomp data-parallel training example")
    p.add_argument("--compressor", default="powersgd", choices=available_compressors())
    p.add_argument("--mode", default="hook", choices=["hook", "optimizer"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--start-iter", type=int, default=10, help="dense steps before compression starts")
    args = p.parse_args()

    distributed = "RANK" in os.environ
    cuda = torch.cuda.is_available()
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if distributed else 0
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(rank)  # replicas start different on purpose: DDP / the wrapper broadcast rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10)).to(device)
    options = {"start_iter": args.start_iter}
    if args.compressor == "powersgd":
        options["rank"] = 2
    if args.mode == "hook":
        net = DDP(model) if distributed else model
        if distributed:
            state, hook = ddp_comm_hook(args.compressor, model=model, **options)
            net.register_comm_hook(state, hook)
        opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    else:
        net = model
        opt = CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                  args.compressor, model=model, **options)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps)

    x, y = synthetic(8192, 1 + rank, device)  # each rank has its own shard
    x_test, y_test = synthetic(4096, 999, device)
    g = torch.Generator().manual_seed(rank)
    warm = 0  # bytes sent during the dense warm-up (start_iter), reported apart
    for step in range(args.steps):
        if step == args.start_iter:
            warm = telemetry()["total"]["bytes_sent"]
        idx = torch.randint(0, x.shape[0], (64,), generator=g).to(device)
        loss = torch.nn.functional.cross_entropy(net(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if rank == 0 and (step + 1) % 100 == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}")
    with torch.no_grad():
        acc = (model(x_test).argmax(1) == y_test).float().mean().item()
    sent = telemetry()["total"]["bytes_sent"] - warm
    compressed = max(args.steps - args.start_iter, 1)
    if rank == 0:
        print(f"{args.mode} {args.compressor}: test accuracy {acc:.3f}, {sent / compressed:.0f} bytes sent per "
              f"compressed step ({warm / max(min(args.start_iter, args.steps), 1):.0f} per dense warm-up step)")
    if distributed:
        shutdown()  # gradcomp's worker threads and twin groups, before the process group goes
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
