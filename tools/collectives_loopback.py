"""Bytes per rank and time per call of each allreduce algorithm, on local gloo ranks (loopback).

    python tools/collectives_loopback.py [--numel 25000000] [--world-sizes 2 4] [--repeats 3]

For every world size it spawns that many ranks (one thread each) and times, after one warm-up
call, ``--repeats`` calls of each (algorithm, compressor) pair on an fp32 tensor viewed as a
square-ish matrix (so PowerSGD has a matrix to work on); a barrier precedes every call and
rank 0's wall time is reported (median). Bytes are gradcomp's own per-rank telemetry: the
tensors handed to ``torch.distributed`` (headers, framing and padding included). The dense
``torch.distributed.all_reduce`` row is counted with the same ring convention (2(w-1)/w n).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CASES = [  # (algorithm, compressor); "dense" is torch.distributed.all_reduce itself
    ("dense", "none"),
    ("native", "fp16"),
    ("allgather", "int8"),
    ("allgather", "onebit"),
    ("scatter-reduce", "int8"),
    ("scatter-reduce", "onebit"),
    ("rounds", "powersgd"),
]


def _rank(rank: int, world: int, store_path: str, numel: int, repeats: int, out_path: str) -> None:
    torch.set_num_threads(1)
    from gradcomp.collectives import allreduce, reset_telemetry, telemetry
    from gradcomp.compress import ErrorFeedback, get_compressor

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    rows = math.isqrt(numel)
    while numel % rows:
        rows -= 1
    g = torch.Generator().manual_seed(rank)
    t = torch.randn(rows, numel // rows, generator=g)
    results = []
    for algo, name in CASES:
        ef = ErrorFeedback(get_compressor(name))
        times, records = [], []
        for i in range(repeats + 1):
            dist.barrier()
            reset_telemetry()
            start = time.perf_counter()
            if algo == "dense":
                buf = t.clone()
                dist.all_reduce(buf)
                buf /= world
            else:
                allreduce(t, ef, key="bench", algorithm=algo)
            elapsed = time.perf_counter() - start
            if i:  # the first call warms up (allocations, twin buffers, warm start)
                times.append(elapsed)
                records.append(telemetry()["last"])
        row = {"algorithm": algo, "compressor": name, "time_s": statistics.median(times)}
        if algo == "dense":
            moved = t.numel() * t.element_size() * 2 * (world - 1) // world
            row.update(bytes_sent=moved, bytes_recv=moved, compress_s=0.0, comm_s=row["time_s"], decompress_s=0.0)
        else:
            for k in ("bytes_sent", "bytes_recv", "compress_s", "comm_s", "decompress_s"):
                row[k] = statistics.median(r[k] for r in records)
        results.append(row)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(results, f)


def run(world: int, numel: int, repeats: int) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.start_processes(_rank, args=(world, os.path.join(tmp, "store"), numel, repeats, out),
                           nprocs=world, start_method="spawn")
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    print(f"# gradcomp collectives, loopback gloo | torch {torch.__version__} | python {platform.python_version()} | "
          f"{os.cpu_count()} CPUs | 1 thread per rank | fp32 tensor of {args.numel} elements "
          f"({args.numel * 4 / 2**20:.0f} MiB) | median of {args.repeats} after 1 warm-up")
    header = f"{'ranks':>5} {'algorithm':<15} {'compressor':<10} {'MB sent/rank':>12} {'MB recv/rank':>12} " \
             f"{'s/call':>8} {'compress':>9} {'comm':>8} {'decomp':>8}"
    print(header)
    rows = []
    for world in args.world_sizes:
        for r in run(world, args.numel, args.repeats):
            r["world_size"] = world
            rows.append(r)
            print(f"{world:>5} {r['algorithm']:<15} {r['compressor']:<10} {r['bytes_sent'] / 1e6:>12.2f} "
                  f"{r['bytes_recv'] / 1e6:>12.2f} {r['time_s']:>8.3f} {r['compress_s']:>9.3f} "
                  f"{r['comm_s']:>8.3f} {r['decompress_s']:>8.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
