"""Hugging Face Accelerate with a gradcomp communication hook.

    torchrun --nproc_per_node=2 examples/train_accelerate.py --compressor powersgd      # CPU: gloo
    accelerate launch --num_processes 8 examples/train_accelerate.py --compressor topk   # GPUs

``accelerator.prepare`` wraps the model in DDP when it runs on several processes; register
gradcomp's hook on that prepared model. (Accelerate's own ``DistributedDataParallelKwargs
(comm_hook=...)`` takes only PyTorch's built-in hooks.) ``accelerator.accumulate`` and
``no_sync`` work as with any hook. The data is synthetic (a random linear teacher); rank 0
prints the test accuracy and the bytes each rank sent per step.
"""
from __future__ import annotations

import argparse

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

try:
    from accelerate import Accelerator
except ModuleNotFoundError as exc:  # say what to install, not a traceback
    raise SystemExit(f"train_accelerate.py needs Accelerate: pip install 'gradcomp[accelerate]' ({exc})") from None

from gradcomp.collectives import telemetry
from gradcomp.compress import available_compressors
from gradcomp.training import ddp_comm_hook, shutdown


def synthetic(n: int, seed: int):
    teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 64, generator=torch.Generator().manual_seed(seed))
    return x, (x @ teacher).argmax(1)


def main() -> None:
    p = argparse.ArgumentParser(description="gradcomp with Hugging Face Accelerate")
    p.add_argument("--compressor", default="powersgd", choices=available_compressors())
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = DataLoader(TensorDataset(*synthetic(4096, seed=1)), batch_size=32, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    if isinstance(model, DistributedDataParallel):  # several processes: the hook goes on the prepared model
        state, hook = ddp_comm_hook(args.compressor, model=model)
        model.register_comm_hook(state, hook)

    step = 0
    while step < args.steps:
        for x, y in loader:
            opt.zero_grad()
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step()
            step += 1
            if step == args.steps:
                break

    x, y = synthetic(2048, seed=2)
    with torch.no_grad():
        acc = (model(x.to(accelerator.device)).argmax(1).cpu() == y).float().mean().item()
    if accelerator.is_main_process:
        sent = telemetry()["total"]["bytes_sent"]
        print(f"accelerate {args.compressor}: test accuracy {acc:.3f}, {sent / args.steps:.0f} bytes sent per step "
              f"per rank, world size {accelerator.num_processes}")
    shutdown()  # gradcomp's worker threads and twin groups, before the process group goes
    accelerator.end_training()


if __name__ == "__main__":
    main()
