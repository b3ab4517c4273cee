"""The optimizer benchmark: ``python -m gradcomp.bench optim``.

Two runs, each side by side in one launch (every method starts from the same weights and sees
the same batches):

- the default: the training benchmark's MLP and data (scikit-learn's digits, bench/train.py)
  on several gloo ranks under DDP with dense Adam (PyTorch's allreduce hook), Adam through
  gradcomp's 1-bit hook with error feedback (what error feedback on the gradient does to
  Adam), ``OneBitAdam`` at 20 % and 15 % warm-up, ``ZeroOneAdam``, dense ``Lamb`` and
  ``OneBitLamb``. Reported: bytes sent per rank per step averaged over the whole run (warm-up
  included; gradcomp's telemetry, PyTorch's hook counted the same way), median step time after
  the warm-up (slowest rank), final test accuracy, and the loss curves (``--plot``).
- ``--step-time``: dense Adam + DDP against ``OneBitAdam`` and ``ZeroOneAdam`` on a wide MLP of
  about 25 M parameters (synthetic batches: only time matters), a few steps after a short
  warm-up; the ratio of median step times.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any, Callable, Dict, List, Sequence

import torch
import torch.distributed as dist

from . import cli, hooks
from . import env as envmod
from .train import DIGITS_LINE, _data, _model, fit, model_line

METHODS = ("adam-ddp", "adam+onebit-hook", "onebit-adam@20%", "onebit-adam@15%", "zero-one-adam", "lamb-ddp",
           "onebit-lamb")
STEP_TIME_METHODS = ("adam-ddp", "onebit-adam", "zero-one-adam")
DENSE = {"adam-ddp", "lamb-ddp"}  # PyTorch's allreduce hook: counted as bytes handed to all_reduce
REFERENCE = "adam-ddp"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gradcomp.bench optim",
        description="Dense Adam + DDP against 1-bit Adam, 0/1 Adam, LAMB and 1-bit LAMB on scikit-learn's digits "
                    "(bytes per step over the whole run, step time, accuracy, loss curves); --step-time: step "
                    "time of a 25M-parameter model.")
    p.add_argument("--methods", default=",".join(METHODS), metavar="A,B",
                   help=f"methods to run (default all: {', '.join(METHODS).replace('%', '%%')})")
    p.add_argument("--epochs", type=int, default=20, metavar="N", help="epochs per run (default 20)")
    p.add_argument("--batch-size", type=int, default=32, metavar="N", help="batch size per rank (default 32)")
    p.add_argument("--hidden", type=int, default=512, metavar="N", help="hidden width of the MLP (default 512)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    p.add_argument("--lamb-lr", type=float, default=1e-2, help="LAMB learning rate (default 1e-2)")
    p.add_argument("--var-update-scaler", type=int, default=8, metavar="K",
                   help="0/1 Adam: variance updates per interval before it doubles (kappa; default 8)")
    p.add_argument("--local-step-scaler", type=int, default=16, metavar="N",
                   help="0/1 Adam: steps before the local-step interval doubles (default 16)")
    p.add_argument("--local-step-clipper", type=int, default=16, metavar="H",
                   help="0/1 Adam: the longest local-step interval (default 16)")
    p.add_argument("--step-time", action="store_true",
                   help="instead: step time of dense Adam + DDP, OneBitAdam and ZeroOneAdam on a ~25M-parameter MLP")
    p.add_argument("--steps", type=int, default=8, metavar="N", help="--step-time: timed steps per method (default 8)")
    cli.common_options(p)
    return p


# ---- per rank ----------------------------------------------------------------------------------
def _optimizer(kind: str, params, cfg: Dict[str, Any], total: int):
    """The optimizer of method ``kind`` and the step its warm-up ends at (0: none)."""
    from gradcomp.optim import Lamb, OneBitAdam, OneBitLamb, ZeroOneAdam

    lr, lamb_lr = cfg["lr"], cfg["lamb_lr"]
    freeze20 = max(1, round(0.2 * total))
    if kind in ("adam-ddp", "adam+onebit-hook"):
        return torch.optim.Adam(params, lr=lr), 0
    if kind.startswith("onebit-adam"):
        share = 0.15 if kind.endswith("15%") else 0.2
        freeze = max(1, round(share * total)) if "@" in kind else cfg["freeze"]
        return OneBitAdam(params, lr=lr, freeze_step=freeze), freeze
    if kind == "zero-one-adam":
        freeze = freeze20 if "freeze" not in cfg else cfg["freeze"]
        return ZeroOneAdam(params, lr=lr, var_freeze_step=freeze, var_update_scaler=cfg["var_update_scaler"],
                           local_step_scaler=cfg["local_step_scaler"],
                           local_step_clipper=cfg["local_step_clipper"]), freeze
    if kind == "lamb-ddp":
        return Lamb(params, lr=lamb_lr, weight_decay=0.01), 0
    if kind == "onebit-lamb":
        return OneBitLamb(params, lr=lamb_lr, weight_decay=0.01, freeze_step=freeze20), freeze20
    raise ValueError(f"unknown method {kind!r}; choose from {', '.join(METHODS)}")


def _wrap(kind: str, model: torch.nn.Module, cfg: Dict[str, Any], total: int):
    """``(ddp_model, optimizer, freeze_step)`` with the method's communication hook registered."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradcomp.training import ddp_comm_hook

    ddp = DDP(model, bucket_cap_mb=25)
    opt, freeze = _optimizer(kind, ddp.parameters(), cfg, total)
    if kind in DENSE:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif kind == "adam+onebit-hook":
        ddp.register_comm_hook(*ddp_comm_hook("onebit", error_feedback="ef"))
    else:
        ddp.register_comm_hook(*opt.comm_hook())
    return ddp, opt, freeze


def _train_one(kind: str, rank: int, world: int, cfg: Dict[str, Any], data, tick) -> Dict[str, Any]:
    from gradcomp.collectives import reset_telemetry, telemetry

    xtr, ytr, xte, yte = data
    model = _model(cfg["hidden"], cfg["seed"])
    per_epoch = len(ytr) // (world * cfg["batch_size"])
    ddp, opt, freeze = _wrap(kind, model, cfg, per_epoch * cfg["epochs"])
    counter = hooks.CountingAllReduce(world)
    reset_telemetry()
    with counter if kind in DENSE else contextlib.nullcontext():
        losses, times, accuracy = fit(ddp, model, opt, data, cfg, rank, world, tick)
    if hasattr(opt, "synchronize"):  # 0/1 Adam: the replicas meet after their last local steps
        opt.synchronize()
        with torch.no_grad():
            accuracy[-1] = float((model(xte).argmax(1) == yte).float().mean())
    sent = counter.nbytes if kind in DENSE else telemetry()["total"]["bytes_sent"]
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return {"losses": losses, "times_ms": times, "accuracy": accuracy, "bytes": sent, "freeze": freeze,
            "checksum": checksum}


def _wide_model(seed: int) -> torch.nn.Module:
    """A 64-5000-5000-10 MLP: 25.4 M parameters, most of them in one 5000 x 5000 layer."""
    return _model(5000, seed)


def _time_one(kind: str, rank: int, world: int, cfg: Dict[str, Any], tick) -> Dict[str, Any]:
    from gradcomp.collectives import reset_telemetry, telemetry

    model = _wide_model(cfg["seed"])
    warm = 2
    cfg = dict(cfg, freeze=warm, var_update_scaler=1, local_step_scaler=1 << 30)
    ddp, opt, _ = _wrap(kind, model, cfg, warm + cfg["steps"])
    g = torch.Generator().manual_seed(cfg["seed"] + rank)
    x, y = torch.randn(cfg["batch_size"], 64, generator=g), torch.randint(0, 10, (cfg["batch_size"],), generator=g)
    counter = hooks.CountingAllReduce(world)
    times, cpu = [], []
    with counter if kind in DENSE else contextlib.nullcontext():
        for s in range(warm + cfg["steps"]):
            if s == warm:
                reset_telemetry()
                counter.nbytes = 0
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()  # CPU time: every thread of this rank
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            times.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
            tick()
    total = telemetry()["total"]
    sent = counter.nbytes if kind in DENSE else total["bytes_sent"]
    codec_ms = 1e3 * (total["compress_s"] + total["decompress_s"]) / cfg["steps"]  # gradcomp's collectives only
    return {"times_ms": times[warm:], "cpu_ms": cpu[warm:], "codec_ms": codec_ms, "bytes": sent / cfg["steps"],
            "params": sum(p.numel() for p in model.parameters())}


def run_rank(rank: int, world: int, cfg: Dict[str, Any], progress: Callable[..., None]) -> Any:
    kinds = cfg["methods"]
    step_time = cfg["step_time"]
    total = len(kinds) * (cfg["steps"] + 2 if step_time else cfg["epochs"])
    done = [0]
    data = None if step_time else _data(cfg["seed"])
    results = []
    for kind in kinds:
        def tick(label=kind):
            done[0] += 1
            progress(done=done[0], total=total, label=label)
        results.append(_time_one(kind, rank, world, cfg, tick) if step_time
                       else _train_one(kind, rank, world, cfg, data, tick))
        dist.barrier()
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, results)
    if rank != 0:
        return None
    return _timing_records(kinds, everyone, world) if step_time else _records(kinds, everyone, cfg, world)


def _records(kinds, everyone, cfg, world) -> List[Dict[str, Any]]:
    runs_of = [[r[m] for r in everyone] for m in range(len(kinds))]
    steps = len(runs_of[0][0]["times_ms"])
    after = max(max(r[0]["freeze"] for r in runs_of), 5)  # the same steps for every method: after every warm-up
    records = []
    for kind, runs in zip(kinds, runs_of):
        step_ms = statistics.median(max(r["times_ms"][i] for r in runs) for i in range(min(after, steps - 1), steps))
        sums = [r["checksum"] for r in runs]
        records.append({
            "method": kind, "source": "torch" if kind in DENSE else "gradcomp", "error_feedback": True,
            "world_size": world, "epochs": cfg["epochs"], "steps": steps, "warmup_steps": runs[0]["freeze"],
            "test_accuracy": runs[0]["accuracy"][-1], "accuracy_curve": runs[0]["accuracy"],
            "step_ms": step_ms, "bytes_per_step": max(r["bytes"] for r in runs) / steps,
            "loss_curve": [sum(r["losses"][i] for r in runs) / world for i in range(steps)],
            "ranks_agree": max(sums) - min(sums) <= 1e-6 * max(1.0, abs(sums[0])),
        })
    ref = next((r for r in records if r["method"] == REFERENCE), None)
    for r in records:
        r["accuracy_vs_dense_pp"] = None if ref is None else 100 * (r["test_accuracy"] - ref["test_accuracy"])
        r["volume_ratio"] = None if ref is None or not r["bytes_per_step"] else ref["bytes_per_step"] / r["bytes_per_step"]
    return records


def _timing_records(kinds, everyone, world) -> List[Dict[str, Any]]:
    records = []
    for m, kind in enumerate(kinds):
        runs = [r[m] for r in everyone]
        n = len(runs[0]["times_ms"])
        records.append({"method": kind, "world_size": world, "params": runs[0]["params"], "timed_steps": n,
                        "step_ms": statistics.median(max(r["times_ms"][i] for r in runs) for i in range(n)),
                        "cpu_ms": statistics.median(max(r["cpu_ms"][i] for r in runs) for i in range(n)),
                        "codec_ms": max(r["codec_ms"] for r in runs),
                        "bytes_per_step": max(r["bytes"] for r in runs)})
    ref = next((r for r in records if r["method"] == REFERENCE), None)
    for r in records:
        r["speedup"] = None if ref is None else ref["step_ms"] / r["step_ms"]
    return records


# ---- entry point -------------------------------------------------------------------------------
def table(records: List[Dict[str, Any]]) -> str:
    head = ("method", "warm-up", "test acc", "vs dense", "step ms", "bytes/step", "less than dense", "")
    rows = [(r["method"], str(r["warmup_steps"]), f"{100 * r['test_accuracy']:.2f}%",
             cli.fmt(r["accuracy_vs_dense_pp"], "+.2f") + " pp", f"{r['step_ms']:.2f}",
             cli.fmt_bytes(r["bytes_per_step"]), cli.fmt(r["volume_ratio"], ".2f") + "x",
             "" if r["ranks_agree"] else "RANKS DIFFER") for r in records]
    return _columns(head, rows)


def timing_table(records: List[Dict[str, Any]]) -> str:
    head = ("method", "parameters", "step ms", "CPU ms/rank", "codec ms", "bytes/step",
            "faster than dense")
    rows = [(r["method"], f"{r['params']:,}", f"{r['step_ms']:.1f}", f"{r['cpu_ms']:.1f}", f"{r['codec_ms']:.1f}",
             cli.fmt_bytes(r["bytes_per_step"]), cli.fmt(r["speedup"], ".2f") + "x") for r in records]
    return _columns(head, rows)


def _columns(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in [head, *rows])


def _check(args) -> List[str]:
    cli.check_sizes(args)
    for name in ("epochs", "batch_size", "hidden", "steps", "var_update_scaler", "local_step_scaler",
                 "local_step_clipper"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, not {getattr(args, name)}")
    for name in ("lr", "lamb_lr"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, not {getattr(args, name)}")
    allowed = STEP_TIME_METHODS if args.step_time else METHODS
    chosen = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods != ",".join(METHODS) \
        else list(allowed)
    bad = [m for m in chosen if m not in allowed]
    if bad or not chosen:
        raise ValueError(f"--methods: {', '.join(bad) or 'none given'} not allowed; choose from {', '.join(allowed)}")
    return chosen


def _launch(cfg: Dict[str, Any], args, link, env, show) -> List[Dict[str, Any]]:
    """Run the ranks through the benchmarks' launcher (bench/launch.py) and report."""
    return cli.run_and_report("optim", cfg, args, link, env, show)


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    kinds = _check(args)
    link = cli.resolve_link(args)
    cfg = {"methods": kinds, "step_time": args.step_time, "epochs": args.epochs, "batch_size": args.batch_size,
           "hidden": args.hidden, "lr": args.lr, "lamb_lr": args.lamb_lr, "seed": args.seed, "steps": args.steps,
           "var_update_scaler": args.var_update_scaler, "local_step_scaler": args.local_step_scaler,
           "local_step_clipper": args.local_step_clipper}
    env = envmod.environment(args.world_size, cli.link_text(link), args.threads)
    if args.step_time:
        nparams = sum(p.numel() for p in _wide_model(0).parameters())
        print(envmod.header(env, [
            f"model    MLP 64-5000-5000-10 ({nparams:,} parameters), synthetic batches of {args.batch_size} per rank",
            f"timing   median over {args.steps} steps after 2 warm-up steps (OneBitAdam/ZeroOneAdam freeze at "
            f"step 2; ZeroOneAdam synchronising every step), slowest rank per step; CPU ms: the rank's CPU time "
            f"(all its threads) in the step; codec ms: wall time gradcomp's collectives spent in the "
            f"codec per step",
        ]), flush=True)
        _launch(cfg, args, link, env, timing_table)
        return 0
    _data(args.seed)  # fail early, in the parent, if scikit-learn is missing
    print(envmod.header(env, [
        DIGITS_LINE,
        model_line(args.hidden, f"batch {args.batch_size} per rank, "
                   f"{args.epochs} epochs, seed {args.seed}; Adam lr {args.lr}, LAMB lr {args.lamb_lr} (weight decay 0.01)"),
        f"methods  {', '.join(kinds)}; warm-up 20 % of the steps unless marked; 0/1 Adam kappa "
        f"{args.var_update_scaler}, local steps x2 every {args.local_step_scaler} up to {args.local_step_clipper}",
    ]), flush=True)
    records = _launch(cfg, args, link, env, table)
    if args.plot:
        from . import plot

        plot.training_plot(records, args.plot, title=f"digits MLP, {env['world_size']} ranks, {env['link']}: "
                                                     f"bytes per step and accuracy in the table")
        print(f"wrote {args.plot}")
    return 0

