"""Train a classifier split into pipeline stages, with compressed stage boundaries.

    torchrun --nproc_per_node=2 examples/train_pipeline.py
    torchrun --nproc_per_node=4 examples/train_pipeline.py --schedule interleaved
    torchrun --nproc_per_node=4 examples/train_pipeline.py --replicas 2 --dp-compressor fp16

Each rank holds one stage of an ``nn.Sequential`` (``--schedule interleaved``: two virtual
stages); activations go forward through the boundary compressor ``--act`` and their gradients
back through ``--grad`` (``none`` for exact), ``--delta`` sends each sample's activation
change (AQ-SGD). With
``--replicas R`` the ranks form R pipelines side by side and each stage's replicas average
gradients with ``--dp-compressor``. ``--balance auto`` cuts the model where measured compute
is even and compressed boundaries are cheap. The data is synthetic (a random linear teacher),
so nothing is downloaded; gloo on CPU. Rank 0 prints every line (the loss, the test accuracy
the last stage measured, what each rank sent), so lines of several ranks never interleave.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

from gradcomp.collectives import telemetry
from gradcomp.pipeline import SCHEDULES, Pipeline
from gradcomp.training import shutdown


def synthetic(n: int, seed: int):
    """Inputs and labels of one fixed teacher; ``seed`` picks the samples."""
    teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(0))
    x = torch.randn(n, 64, generator=torch.Generator().manual_seed(seed))
    return x, (x @ teacher).argmax(1)


class Residual(nn.Module):
    """x + ReLU(Linear(LayerNorm(x))): a block deep stacks of which still train."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def model(width: int) -> nn.Sequential:
    torch.manual_seed(0)  # every rank builds the same model and keeps its own stage of it
    return nn.Sequential(nn.Sequential(nn.Linear(64, width), nn.ReLU()), *[Residual(width) for _ in range(6)],
                         nn.Linear(width, 10))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schedule", default="1f1b", choices=tuple(SCHEDULES))
    p.add_argument("--microbatches", "--chunks", type=int, default=4, help="micro-batches per step")
    p.add_argument("--act", default="int8", help="the activations' boundary compressor (a gradcomp compressor "
                                                 "name, or none)")
    p.add_argument("--grad", default="fp16", help="the activation gradients' boundary compressor")
    p.add_argument("--delta", action="store_true", help="AQ-SGD: send each sample's activation change")
    p.add_argument("--replicas", type=int, default=1, help="pipelines side by side (data parallel)")
    p.add_argument("--dp-compressor", default="none", help="how stage replicas average gradients")
    p.add_argument("--balance", default="equal", choices=("equal", "auto"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--width", type=int, default=256)
    args = p.parse_args()

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    stages = (world // args.replicas) * (2 if args.schedule == "interleaved" else 1)
    net = model(args.width)
    x, y = synthetic(8192, seed=1)
    batch = 64
    if args.balance == "auto":
        balance: object = "auto"
    else:
        per = len(net) // stages
        balance = [per] * (stages - 1) + [len(net) - per * (stages - 1)]
    pipe = Pipeline(net, balance=balance, sample=x[:batch // args.microbatches], schedule=args.schedule,
                    microbatches=args.microbatches, activation_codec=args.act, grad_codec=args.grad,
                    delta=args.delta, replicas=args.replicas, dp_compressor=args.dp_compressor,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9))
    replica = pipe.grid.replica
    boundary = 0  # bytes this rank put on the wire across stage boundaries
    for step in range(args.steps):
        # each replica its own samples; every rank of a pipeline the same ones
        idx = torch.randint(0, len(y), (batch,), generator=torch.Generator().manual_seed(step * 131 + replica))
        loss = pipe.step(x[idx], y[idx], nn.functional.cross_entropy, sample_ids=idx)
        boundary += pipe.wire_bytes
        if rank == 0 and step % 50 == 0:
            print(f"step {step:4d}  loss {float(loss):.4f}", flush=True)
    xt, yt = synthetic(1024, seed=2)
    out, loss = pipe.eval_step(xt, yt, nn.functional.cross_entropy)
    # the accuracy is known on the last stages, the bytes on each rank: rank 0 prints them all
    accuracy = float((out.argmax(1) == yt).float().mean()) if out is not None else None
    # telemetry counts every byte gradcomp sent: the boundaries' ("p2p/batch", which the pipeline
    # counts too) and the data-parallel exchange's (the rest)
    counted = telemetry()
    dp = counted["total"]["bytes_sent"] - counted["by_op"].get("p2p/batch", {}).get("bytes_sent", 0)
    mine = (accuracy, boundary, dp)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        found = [a for a, _, _ in everyone if a is not None]
        print(f"balance {pipe.balance}, test loss {float(loss):.4f}, test accuracy {found[0]:.3f}", flush=True)
        for r, (_, wire, dp) in enumerate(everyone):
            dp_text = f", {dp / 1e6:.1f} MB of data-parallel gradients" if args.replicas > 1 else ""
            print(f"rank {r} sent {wire / 1e6:.1f} MB across stage boundaries{dp_text}", flush=True)
    pipe.close()
    shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
