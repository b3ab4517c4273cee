"""gradcomp's ``powersgd`` and ``fp16`` DDP hooks side by side with PyTorch's ``powerSGD_hook``
and ``fp16_compress_hook``: time per training step and bytes per step, medians.

Every hook trains its own copy of one MLP on the same synthetic data, in one run on local
gloo ranks (loopback); the hooks take turns in short blocks, so a busy machine slows them
alike. Bytes are what each rank hands to ``torch.distributed.all_reduce`` (counted the same
way for PyTorch's hooks and ours, as a ring allreduce moves them: ``2 (w-1)/w`` of the
tensor), per step; DDP's own allreduce (no hook) runs in C++ and is computed instead. Steps
before ``--warmup`` (and PowerSGD's dense warm-up) are discarded.

Every model gets one DDP bucket: with several, PyTorch's ``powerSGD_hook`` launches the
collectives of one bucket from callbacks while the next bucket starts its own, and on gloo
the ranks can then pair different collectives (a size-mismatch error or a hang).
gradcomp's hooks run buckets one after the other on a worker and work with any layout.

    python examples/compare_hooks.py --world 2 --width 1024 --steps 30
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from gradcomp.collectives import reset_telemetry, telemetry
from gradcomp.training import ddp_comm_hook


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 10))


def _hooks(rank_r: int):
    """name -> factory(model) returning (state, hook), or None for DDP's own allreduce."""
    return {
        "dense (no hook)": None,
        "torch fp16_compress_hook": lambda m: (None, default_hooks.fp16_compress_hook),
        "gradcomp fp16": lambda m: ddp_comm_hook("fp16", model=m, compress_1d=True, min_numel=0),
        "torch powerSGD_hook": lambda m: (torch_psgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank_r, start_powerSGD_iter=2), torch_psgd.powerSGD_hook),
        "gradcomp powersgd": lambda m: ddp_comm_hook("powersgd", model=m, rank=rank_r, min_numel=0),
    }


class _Counter:
    """Bytes handed to ``dist.all_reduce`` (as a ring moves them), while installed."""

    def __init__(self, world: int) -> None:
        self.world, self.bytes, self._real = world, 0, dist.all_reduce

    def install(self) -> None:
        def counting(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size() * 2 * (self.world - 1) // self.world
            return self._real(tensor, *args, **kwargs)

        dist.all_reduce = counting


def _rank(rank: int, world: int, store_path: str, args, out_path: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    counter = _Counter(world)
    counter.install()
    runs = {}
    for name, factory in _hooks(args.rank).items():
        model = _model(args.width)
        ddp = DDP(model, bucket_cap_mb=1024)  # one bucket; see the module docstring
        if factory is not None:
            ddp.register_comm_hook(*factory(model))
        runs[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9), [], [])
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, 256, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    ours_bytes = []
    blocks = (args.warmup + args.steps + args.block - 1) // args.block
    for _ in range(blocks):
        for name, (ddp, opt, times, sent) in runs.items():
            for _ in range(args.block):
                counter.bytes = 0
                reset_telemetry()
                dist.barrier()
                start = time.perf_counter()
                opt.zero_grad()
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
                times.append(time.perf_counter() - start)
                sent.append(counter.bytes)
                if name == "gradcomp powersgd":
                    ours_bytes.append(telemetry()["total"]["bytes_sent"])
    if rank == 0:
        rows = []
        for name, (ddp, opt, times, sent) in runs.items():
            t, b = times[args.warmup:args.warmup + args.steps], sent[args.warmup:args.warmup + args.steps]
            rows.append((name, statistics.median(t) * 1e3, statistics.median(b)))
        params = sum(p.numel() for p in _model(args.width).parameters())
        rows[0] = (rows[0][0], rows[0][1], params * 4 * 2 * (world - 1) // world)  # computed, see above
        with open(out_path, "w") as f:
            f.write(f"# torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}, "
                    f"{os.cpu_count()} CPUs, {args.threads} thread(s) per rank, gloo on loopback, world {world}\n")
            f.write(f"# MLP 256-{args.width}-{args.width}-{args.width}-10: {params} parameters "
                    f"({params * 4 / 2**20:.1f} MiB of fp32 gradients); batch {args.batch} per rank; "
                    f"PowerSGD rank {args.rank}; medians of {args.steps} steps after {args.warmup}\n")
            f.write(f"{'hook':28s} {'ms/step':>9s} {'bytes/step':>12s}\n")
            for name, ms, b in rows:
                f.write(f"{name:28s} {ms:9.1f} {int(b):12d}\n")
            f.write(f"# gradcomp telemetry, powersgd bytes sent per step (median): "
                    f"{int(statistics.median(ours_bytes[args.warmup:]))}\n")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rank", type=int, default=4, help="PowerSGD rank (both hooks)")
    p.add_argument("--steps", type=int, default=30, help="measured steps per hook")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--block", type=int, default=5, help="steps per turn of each hook")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.txt")
        mp.start_processes(_rank, args=(args.world, os.path.join(tmp, "store"), args, out),
                           nprocs=args.world, start_method="spawn")
        print(open(out).read(), end="")


if __name__ == "__main__":
    main()
