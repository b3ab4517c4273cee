"""The sharded-optimizer benchmark: ``python -m gradcomp.bench sharded``.

The training benchmark's MLP learns scikit-learn's digits (``bench/train.py``'s data and
model) on several gloo ranks with AdamW, once per method, side by side in one run:

- ``ddp-adamw``: DDP (PyTorch's allreduce hook) + AdamW, every rank holding all the state;
- ``zero``: DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)`` (ZeRO-1);
- ``ours-dense``: :class:`~gradcomp.memory.ShardedOptimizer` (ZeRO-2, no DDP), exact;
- ``ours-int8g``: int8 gradients (reduce-scatter with error feedback);
- ``ours-int8w``: int8 weights (all-gather with error feedback on the weights);
- ``ours-8bit``: 8-bit optimizer state;
- ``ours-int8g-bf16w``: int8 gradients + bf16 weights (the issue's target configuration);
- ``ours-int8g-bf16w-prefetch``: the same, the weights' all-gather running into the next
  forward pass (``prefetch=True``);
- ``ours-int8g-bf16w-8bit``: the same with 8-bit state.

Every run starts from the same weights and sees the same batches; the methods take turns epoch
by epoch, so a change in the machine's load slows them alike. Measured per rank:
optimizer-state bytes (every tensor the optimizer keeps, ``state_nbytes``), parameter +
gradient + master bytes (the tensors alive just before ``step()``: parameters, ``.grad``
tensors, master shards), bytes sent per step (gradcomp's telemetry; for PyTorch's methods
what they hand to ``all_reduce`` and ``broadcast``, counted by the same convention), step
time (median over steps after warm-up of the slowest rank) and the final test accuracy.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import cli, hooks
from . import env as envmod
from .train import DIGITS_LINE, _data, _model, epoch_batches, model_line

METHODS: Dict[str, Dict[str, Any]] = {
    "ddp-adamw": {"kind": "ddp"},
    "zero": {"kind": "zero"},
    "ours-dense": {"kind": "ours"},
    "ours-int8g": {"kind": "ours", "compressor": "int8"},
    "ours-int8w": {"kind": "ours", "weight_compressor": "int8"},
    "ours-8bit": {"kind": "ours", "state_bits": 8},
    "ours-int8g-bf16w": {"kind": "ours", "compressor": "int8", "weight_compressor": "bf16"},
    "ours-int8g-bf16w-prefetch": {"kind": "ours", "compressor": "int8", "weight_compressor": "bf16", "prefetch": True},
    "ours-int8g-bf16w-8bit": {"kind": "ours", "compressor": "int8", "weight_compressor": "bf16", "state_bits": 8},
}
REFERENCE = "ddp-adamw"
SPEED_REFERENCE = "zero"
BUCKET_MB = 4.0  # a few buckets on the default model, so that the exchange overlaps backward
WARMUP = 5  # steps not timed: buckets, workers and optimizer state are built in the first ones


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gradcomp.bench sharded",
        description="Train the digits MLP with AdamW under DDP, ZeroRedundancyOptimizer and gradcomp's "
                    "ShardedOptimizer (dense, int8 gradients, int8/bf16 weights, 8-bit state); compare memory per "
                    "rank, bytes and time per step, and accuracy.")
    p.add_argument("--methods", default=",".join(METHODS), metavar="A,B",
                   help=f"methods to run (default all: {', '.join(METHODS)})")
    p.add_argument("--epochs", type=int, default=10, metavar="N", help="epochs per run (default 10)")
    p.add_argument("--batch-size", type=int, default=32, metavar="N", help="batch size per rank (default 32)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--hidden", type=int, default=1024, metavar="N",
                   help="hidden width of the 3-layer MLP (default 1024: 1.1M parameters)")
    p.add_argument("--bucket-mb", type=float, default=BUCKET_MB, metavar="MB",
                   help=f"gradient bucket size of DDP and of ours (default {BUCKET_MB})")
    cli.common_options(p)
    return p


# ---- PyTorch's methods: bytes counted by the collectives' convention -------------------------------
class CountingBroadcast:
    """Counts what ``ZeroRedundancyOptimizer`` hands to ``broadcast``: the source sends its
    tensor to the ``w-1`` others (``collectives/_comm.py``'s convention)."""

    def __init__(self, world: int) -> None:
        self.nbytes, self.world, self._orig = 0, world, dist.broadcast

    def __enter__(self) -> "CountingBroadcast":
        orig = self._orig

        def counted(tensor, src=None, *args, **kwargs):
            if src == dist.get_rank():
                self.nbytes += tensor.numel() * tensor.element_size() * (self.world - 1)
            return orig(tensor, src, *args, **kwargs)

        dist.broadcast = counted  # ZeroRedundancyOptimizer calls dist.broadcast through the module
        return self

    def __exit__(self, *exc) -> None:
        dist.broadcast = self._orig


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _build(spec: Dict[str, Any], model: torch.nn.Module, lr: float,
           bucket_mb: float) -> Tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    """``(forward module, optimizer, optimizer holding the state)`` for one method."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradcomp.sharded import ShardedOptimizer

    if spec["kind"] == "ours":
        ours = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=lr, model=model, bucket_mb=bucket_mb,
                                **{k: v for k, v in spec.items() if k != "kind"})
        return model, ours, ours.optimizer
    ddp = DDP(model, bucket_cap_mb=bucket_mb)
    _, hook, _ = hooks.torch_hook("torch-allreduce", {})
    ddp.register_comm_hook(None, hook)
    if spec["kind"] == "zero":
        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=lr)
        return ddp, zero, zero.optim
    plain = torch.optim.AdamW(ddp.parameters(), lr=lr)
    return ddp, plain, plain


class _Run:
    """One method's model, optimizer and measurements, trained an epoch at a time: the methods
    take turns epoch by epoch, so a machine whose load changes slows every method alike."""

    def __init__(self, spec: Dict[str, Any], rank: int, world: int, cfg: Dict[str, Any]) -> None:
        self.spec, self.rank, self.world, self.cfg = spec, rank, world, cfg
        self.model = _model(cfg["hidden"], cfg["seed"])
        self.fwd, self.opt, self.holder = _build(spec, self.model, cfg["lr"], cfg["bucket_mb"])
        self.times: List[float] = []
        self.held, self.sent = 0, 0
        self.phases: Dict[str, Dict[str, float]] = {}  # collective -> seconds in compress / comm / decompress

    def epoch(self, epoch: int, xtr: torch.Tensor, ytr: torch.Tensor) -> None:
        from gradcomp.collectives import reset_telemetry, telemetry

        cfg, world, batch = self.cfg, self.world, self.cfg["batch_size"]
        allreduce, broadcast = hooks.CountingAllReduce(world), CountingBroadcast(world)
        reset_telemetry()
        with allreduce, broadcast:
            for idx in epoch_batches(len(ytr), self.rank, world, batch, cfg["seed"], epoch):
                t0 = time.perf_counter()
                self.opt.zero_grad()
                torch.nn.functional.cross_entropy(self.fwd(xtr[idx]), ytr[idx]).backward()
                if not self.held:  # the tensors alive just before the first step
                    self.held = _nbytes(list(self.model.parameters()) + [p.grad for p in self.model.parameters()]
                                        + list(getattr(self.opt, "masters", [])))
                self.opt.step()
                self.times.append((time.perf_counter() - t0) * 1e3)
        if hasattr(self.opt, "synchronize"):  # prefetched weights in flight: done before the next barrier
            self.opt.synchronize()
        tel = telemetry()
        if self.spec["kind"] == "ours":
            self.sent += tel["total"]["bytes_sent"]
            for op, v in tel["by_op"].items():
                mine_s = self.phases.setdefault(op, {"compress": 0.0, "comm": 0.0, "decompress": 0.0})
                for k in mine_s:
                    mine_s[k] += v[f"{k}_s"]
        else:
            self.sent += allreduce.nbytes + broadcast.nbytes

    def result(self, xte: torch.Tensor, yte: torch.Tensor) -> Dict[str, Any]:
        from gradcomp.sharded import state_nbytes

        steps = max(len(self.times), 1)
        with torch.no_grad():
            accuracy = float((self.model(xte).argmax(1) == yte).float().mean())
        # where our step's time goes: per collective, ms per step in compress / communicate / decompress
        phases = {op: {k: 1e3 * v / steps for k, v in ph.items()} for op, ph in self.phases.items()}
        return {"times_ms": self.times, "accuracy": accuracy, "bytes_per_step": self.sent / steps,
                "state_bytes": state_nbytes(self.holder), "held_bytes": self.held, "phases": phases,
                "checksum": float(sum(p.double().sum() for p in self.model.parameters()))}


def take_turns(names: Sequence[str], runs: Sequence[Any], epochs: int, data: Tuple[torch.Tensor, ...],
               progress: Callable[..., None], world: int) -> List[Any]:
    """The methods' runs taking turns epoch by epoch (so load changes hit them alike), each
    epoch started together on every rank; every rank's ``run.result(xte, yte)`` list."""
    xtr, ytr, xte, yte = data
    total = len(names) * epochs
    for epoch in range(epochs):
        for m, (name, run) in enumerate(zip(names, runs)):
            dist.barrier()  # every rank starts the method's epoch together
            run.epoch(epoch, xtr, ytr)
            progress(done=epoch * len(names) + m + 1, total=total, label=name)
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, [run.result(xte, yte) for run in runs])
    return everyone


def run_rank(rank: int, world: int, cfg: Dict[str, Any], progress: Callable[..., None]) -> Any:
    names = cfg["methods"]
    runs = [_Run(METHODS[name], rank, world, cfg) for name in names]
    everyone = take_turns(names, runs, cfg["epochs"], _data(cfg["seed"]), progress, world)
    return _records(names, everyone, cfg, world) if rank == 0 else None


def _records(names, everyone, cfg, world) -> List[Dict[str, Any]]:
    records = []
    for m, name in enumerate(names):
        runs = [r[m] for r in everyone]
        steps = len(runs[0]["times_ms"])
        skip = min(WARMUP, steps - 1)
        sums = [r["checksum"] for r in runs]
        records.append({
            "method": name, "world_size": world, "epochs": cfg["epochs"], "steps": steps,
            "test_accuracy": runs[0]["accuracy"],
            "step_ms": statistics.median(max(r["times_ms"][i] for r in runs) for i in range(skip, steps)),
            "bytes_per_step": max(r["bytes_per_step"] for r in runs),
            "state_bytes": max(r["state_bytes"] for r in runs), "held_bytes": max(r["held_bytes"] for r in runs),
            "ranks_agree": max(sums) - min(sums) <= 1e-6 * max(1.0, abs(sums[0])),
            "phases_ms_rank0": runs[0]["phases"],
        })
    ref = next((r for r in records if r["method"] == REFERENCE), None)
    speed = next((r for r in records if r["method"] == SPEED_REFERENCE), None)
    for r in records:
        r["accuracy_vs_dense_pp"] = None if ref is None else 100 * (r["test_accuracy"] - ref["test_accuracy"])
        r["state_vs_ddp"] = None if ref is None else r["state_bytes"] / ref["state_bytes"]
        r["bytes_vs_zero"] = None if speed is None or not speed["bytes_per_step"] else (
            r["bytes_per_step"] / speed["bytes_per_step"])
        r["speedup_vs_zero"] = None if speed is None else speed["step_ms"] / r["step_ms"]
    return records


def table(records: List[Dict[str, Any]]) -> str:
    head = ("method", "state/rank", "vs DDP", "param+grad+master", "bytes/step", "vs ZeRO", "step ms",
            "speed-up", "test acc", "vs DDP", "replicas")
    rows = [(r["method"], cli.fmt_bytes(r["state_bytes"]), cli.fmt(r["state_vs_ddp"], ".3f") + "x",
             cli.fmt_bytes(r["held_bytes"]), cli.fmt_bytes(r["bytes_per_step"]), cli.fmt(r["bytes_vs_zero"], ".3f") + "x",
             f"{r['step_ms']:.2f}", cli.fmt(r["speedup_vs_zero"], ".2f") + "x", f"{100 * r['test_accuracy']:.2f}%",
             cli.fmt(r["accuracy_vs_dense_pp"], "+.2f") + " pp", "same" if r["ranks_agree"] else "DIFFER")
            for r in records]
    out = _markdown([head, *rows])
    phases = [(r["method"], op, *(f"{ms[k]:.2f}" for k in ("compress", "comm", "decompress")))
              for r in records for op, ms in sorted(r["phases_ms_rank0"].items())]
    if phases:
        out += "\n\nwhere our time goes (rank 0, ms per step):\n\n" + _markdown(
            [("method", "collective", "compress", "communicate", "decompress"), *phases])
    return out


def _markdown(rows: Sequence[Sequence[str]]) -> str:
    """A markdown table (the first row is the header), ready to paste."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"
             for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _check(args) -> List[str]:
    cli.check_sizes(args)
    for name in ("epochs", "batch_size", "hidden"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, not {getattr(args, name)}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0, not {args.lr}")
    if not args.bucket_mb > 0:
        raise ValueError(f"--bucket-mb must be > 0, not {args.bucket_mb}")
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        raise ValueError(f"--methods: unknown {unknown or 'none given'}; allowed: {', '.join(METHODS)}")
    return names


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(list(argv or []))
    names = _check(args)
    link = cli.resolve_link(args)
    _data(args.seed)  # fail early, in the parent, if scikit-learn is missing
    if args.plot:  # and if matplotlib is, before the run rather than after it
        from . import plot

        plot._pyplot()
    cfg = {"methods": names, "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
           "hidden": args.hidden, "seed": args.seed, "bucket_mb": args.bucket_mb}
    env = envmod.environment(args.world_size, cli.link_text(link), args.threads)
    print(envmod.header(env, [
        DIGITS_LINE,
        model_line(args.hidden, f"AdamW lr {args.lr}, "
                   f"batch {args.batch_size} per rank, {args.epochs} epochs, seed {args.seed}, buckets of {args.bucket_mb:g} MB"),
        f"methods  {', '.join(names)}, taking turns epoch by epoch; step time: median over the steps after "
        f"the first {WARMUP} of the slowest rank",
    ]), flush=True)
    records = cli.run_and_report("sharded", cfg, args, link, env, table)
    if args.plot:
        from . import plot

        plot.sharded_plot(records, args.plot, title=f"ShardedOptimizer and PyTorch's methods, digits MLP, "
                                                    f"{args.world_size} ranks, {env['link']}")
        print(f"wrote {args.plot}")
    return 0
