"""The DiLoCo benchmark: ``python -m gradcomp.bench diloco``.

The training benchmark's character-level transformer (``bench train --model transformer``: the
standard library's source, :mod:`gradcomp.bench.text`) trained longer, once per method, on
several gloo ranks (optionally on emulated links, ``--netem``). Every method starts from the
same weights, sees the same windows of text at each step and uses the same inner AdamW and
learning-rate schedule; they differ only in what crosses the wire and when:

- ``ddp``: gradients averaged every step (``CompressedOptimizer`` with compressor ``none``);
  ``ddp-NAME``: the same with gradcomp's per-step compressor NAME (``ddp-powersgd``: rank 4,
  error feedback, compressing from step 2, as in ``bench train``);
- ``diloco``: :class:`gradcomp.optim.DiLoCo`, H inner steps then the pseudo-gradient averaged
  uncompressed; ``diloco-NAME``: compressed with NAME (``topk``: ratio 0.02), error feedback
  where the compressor is biased;
- ``streaming-fF-tT[-NAME]``: Streaming DiLoCo, F fragments, each exchange started T inner
  steps before its sync (H rounded to the nearest multiple of F);
- ``sparseloco``: SparseLoCo's recipe on DiLoCo: top-k (``TOPK_RATIO``) with error feedback
  instead of outer momentum (outer SGD, lr 1, no momentum);
- ``local``: every rank trains alone (no exchange): the step time with nothing on the wire;
- ``torchft``: torchft's ``DiLoCo`` (H, one fragment) over the same gloo group, a fixed quorum
  standing in for its fault-tolerance manager (only when torchft is installed).

The methods run one after another, each alone on the machine, so that a method's exchange
overlaps only its own computation. Validation: every rank evaluates its own model on the same
held-out windows every ``--eval-every`` steps (a DiLoCo worker's local model between syncs);
the loss reported is the mean over ranks. Bytes: what each rank sent (gradcomp's telemetry; for
torchft, what its manager hands to ``all_reduce``, counted the same way), the largest of them
in one exchange (one step's gradients, one fragment's sync), and the run's training time on the
slowest rank (evaluation excluded).
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import cli
from . import env as envmod
from .collective import parse_entry
from .train import POWERSGD_RANK, POWERSGD_START, lm_options, lm_setup

SYNC_EVERY = 50  # H: inner steps between two outer steps of the whole model
TOPK_RATIO = 0.02  # diloco-topk: 2 % of the pseudo-gradient's elements (with error feedback)
HAVE_TORCHFT = importlib.util.find_spec("torchft") is not None
METHODS = ("ddp", "ddp-powersgd", "diloco", "diloco-int8", "diloco-int4", "diloco-fp4", "diloco-topk", "sparseloco",
           "streaming-f2-t1", "streaming-f4-t5", "local") + (("torchft",) if HAVE_TORCHFT else ())
REFERENCE = "ddp"
NO_EXCHANGE = "local"
WARMUP_STEPS = 5  # untimed ddp steps before the first method
QUICK = {"steps": 200, "eval_every": 25, "text_mb": 0.5, "val_windows": 128}  # --quick: a smoke run
_STREAMING = re.compile(r"streaming-f(\d+)-t(\d+)(?:-(.+))?")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gradcomp.bench diloco",
        description="DiLoCo and Streaming DiLoCo (gradcomp.optim.DiLoCo, dense and compressed) against "
                    "data-parallel AdamW on the character transformer of 'bench train --model transformer': "
                    "validation loss at equal tokens, bytes sent per worker, the largest exchange, wall time.")
    p.add_argument("--methods", default=",".join(METHODS), metavar="A,B",
                   help=f"methods to run (default: {','.join(METHODS)}); also ddp-NAME, diloco-NAME, "
                        f"streaming-fF-tT-NAME for any gradcomp compressor NAME[:opt=value]")
    p.add_argument("--ranks", dest="world_size", type=int, default=2, metavar="N",
                   help="workers, one rank each (2 or 4; the same as --world-size)")
    p.add_argument("--steps", type=int, default=None, metavar="N", help="inner steps per method (default 1000)")
    p.add_argument("--quick", action="store_true",
                   help=f"a short run: {QUICK['steps']} steps, validation every {QUICK['eval_every']}, "
                        f"{QUICK['text_mb']} MB of text, {QUICK['val_windows']} validation windows (each unless given)")
    p.add_argument("--sync-every", type=int, default=SYNC_EVERY, metavar="H",
                   help=f"DiLoCo: inner steps between syncs of each parameter (default {SYNC_EVERY}; streaming with "
                        f"F fragments: rounded to the nearest multiple of F)")
    p.add_argument("--outer-lr", type=float, default=0.7, metavar="LR",
                   help="DiLoCo's (and torchft's) outer SGD learning rate (default 0.7; sparseloco: 1)")
    p.add_argument("--outer-momentum", type=float, default=0.9, metavar="M",
                   help="its Nesterov momentum (default 0.9; 0: plain SGD; sparseloco: 0)")
    p.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help="steps between validation losses (default 50)")
    p.add_argument("--batch-size", type=int, default=16, metavar="N", help="sequences per rank per step (default 16)")
    p.add_argument("--lr", type=float, default=2e-3,
                   help="inner AdamW learning rate (default 0.002, warm-up then cosine decay to a tenth)")
    lm_options(p)
    p.set_defaults(text_mb=None)  # 2 MB, or --quick's
    p.add_argument("--val-windows", type=int, default=None, metavar="N",
                   help="validation sequences, every rank evaluating all of them (default 256)")
    cli.common_options(p)
    return p


# ---- methods -----------------------------------------------------------------------------------
def _compressor(entry: str, kind: str) -> Tuple[str, Dict[str, Any]]:
    """A compressor NAME[:opt=value] checked now, in the parent, with its defaults filled in."""
    from gradcomp.compress import get_compressor

    name, opts = parse_entry(entry)
    if name == "topk":
        opts.setdefault("ratio", TOPK_RATIO)
    if name == "powersgd":
        opts.setdefault("rank", POWERSGD_RANK)
    get_compressor(name, **opts)  # an unknown name or option: one clear error before any rank starts
    if name == "powersgd" and kind == "ddp":
        opts = {**opts, "start_iter": POWERSGD_START}  # a policy option of the per-step exchange
    return name, opts


def sync_every_for(sync_every: int, fragments: int) -> int:
    """H for ``fragments`` pieces: the multiple of ``fragments`` nearest ``sync_every`` (halves up)."""
    return fragments * max(1, int(sync_every / fragments + 0.5))


def parse_method(label: str, sync_every: int) -> Dict[str, Any]:
    """The spec of method ``label`` (see the module docstring); ``ValueError`` if unknown."""
    spec: Dict[str, Any] = {"label": label, "compressor": None, "options": {}, "fragments": 1, "delay": 0,
                            "sync_every": None}
    streaming = _STREAMING.fullmatch(label)
    if label in (NO_EXCHANGE, REFERENCE):
        spec["kind"] = "ddp" if label == REFERENCE else label
    elif label == "torchft":
        if not HAVE_TORCHFT:
            raise ValueError("method torchft needs torchft (pip install torchft-nightly); drop it from --methods")
        spec.update(kind="torchft", sync_every=sync_every)
    elif label.startswith("ddp-"):
        spec["kind"] = "ddp"
        spec["compressor"], spec["options"] = _compressor(label[4:], "ddp")
    elif label == "sparseloco":
        spec["compressor"], spec["options"] = _compressor("topk", "diloco")
        spec.update(kind="diloco", sync_every=sync_every, outer=(1.0, 0.0))
    elif label == "diloco" or label.startswith("diloco-") or streaming:
        frags, delay = (int(streaming.group(1)), int(streaming.group(2))) if streaming else (1, 0)
        rest = streaming.group(3) if streaming else label[7:]
        if rest:
            spec["compressor"], spec["options"] = _compressor(rest, "diloco")
        if frags < 1:
            raise ValueError(f"method {label}: the number of fragments must be >= 1")
        h = sync_every_for(sync_every, frags)
        if delay >= h // frags:
            raise ValueError(f"method {label}: the delay ({delay}) must be smaller than H / F = {h} / {frags}")
        spec.update(kind="diloco", fragments=frags, delay=delay, sync_every=h)
    else:
        raise ValueError(f"unknown method {label!r}: choose from {', '.join(METHODS)}, ddp-NAME, diloco-NAME or "
                         f"streaming-fF-tT[-NAME] (NAME a gradcomp compressor)")
    return spec


# ---- per rank ----------------------------------------------------------------------------------
class FixedQuorum:
    """What torchft's ``DiLoCo`` asks of its ``Manager``, over the fixed gloo group: every sync
    commits and a mean is the sum over the group divided by its size (torchft's AVG). It counts
    what it hands to ``all_reduce`` with the collectives' convention (``2 (w-1)/w`` of the bytes)."""

    _use_async_quorum = False

    def __init__(self, world: int) -> None:
        self.world, self.commits, self.sent = world, 0, 0.0

    def start_quorum(self) -> None:
        return None

    def current_step(self) -> int:
        return self.commits

    def should_commit(self, *args: Any, **kwargs: Any) -> bool:
        self.commits += 1
        return True

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, **kwargs: Any) -> Any:
        self.sent += tensor.numel() * tensor.element_size() * 2 * (self.world - 1) / self.world
        dist.all_reduce(tensor)
        tensor /= self.world
        done: torch.futures.Future = torch.futures.Future()
        done.set_result([tensor])
        return _Finished(done)

    def register_state_dict_fn(self, *args: Any) -> None:
        return None

    def disallow_state_dict_read(self) -> None:
        return None

    def allow_state_dict_read(self) -> None:
        return None


@dataclass
class _Finished:
    """A finished torchft ``Work``."""

    future: torch.futures.Future

    def wait(self, *args: Any) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future


@dataclass
class _Method:
    """One method's optimizer on this rank: ``sent()`` its bytes so far, ``syncs()`` its
    exchanges so far (a change: one ended), ``blocking``: one exchange every step, ended within
    the step (waited for in the step's time); ``close()`` after the last step."""

    opt: Any
    sent: Callable[[], float]
    syncs: Callable[[], int]
    blocking: bool = False
    close: Callable[[], None] = lambda: None


def _method(spec: Dict[str, Any], model: torch.nn.Module, inner: torch.optim.Optimizer, world: int,
            cfg_outer: Dict[str, float]) -> _Method:
    from gradcomp.collectives import telemetry
    from gradcomp.optim import DiLoCo
    from gradcomp.training import CompressedOptimizer

    def telemetry_sent() -> float:
        return float(telemetry()["total"]["bytes_sent"])

    kind = spec["kind"]
    if kind == NO_EXCHANGE:
        return _Method(inner, lambda: 0.0, lambda: 0)
    if kind == "ddp":
        dp = CompressedOptimizer(inner, spec["compressor"] or "none", model=model, **spec["options"])
        return _Method(dp, telemetry_sent, lambda: 0, blocking=True)
    if kind == "diloco":
        lr, momentum = spec.get("outer") or (cfg_outer["lr"], cfg_outer["momentum"])
        opt = DiLoCo(model, inner, spec["sync_every"], compressor=spec["compressor"],
                     compressor_options=spec["options"] or None, fragments=spec["fragments"], delay=spec["delay"],
                     outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum, nesterov=momentum > 0))
        return _Method(opt, telemetry_sent, lambda: len(opt.history))
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo  # type: ignore[import-untyped]

    quorum = FixedQuorum(world)
    params = list(model.parameters())
    outer = torch.optim.SGD(params, lr=cfg_outer["lr"], momentum=cfg_outer["momentum"],
                            nesterov=cfg_outer["momentum"] > 0)
    ft = TorchftDiLoCo(quorum, [model], inner, outer,
                       sync_every=spec["sync_every"])
    ft.__enter__()  # its hooks on the inner optimizer's step do the rest
    return _Method(inner, lambda: quorum.sent, lambda: quorum.commits, close=lambda: ft.__exit__(None, None, None))


def _validate(model: torch.nn.Module, xv: torch.Tensor, yv: torch.Tensor) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(xv), yv))


def _train(spec: Dict[str, Any], rank: int, world: int, cfg: Dict[str, Any], data,
           tick: Callable[[], None]) -> Dict[str, Any]:
    """One method's run on this rank: the validation curve (step, training seconds, loss), the
    bytes sent, each exchange's bytes and the training time."""
    from gradcomp.training import wait_all

    from . import text

    train, xv, yv = data
    model = text.model(cfg)
    inner = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    steps, warmup = cfg["steps"], max(1, min(10, cfg["steps"] // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: text.lr_at(s, steps, warmup))
    method = _method(spec, model, inner, world, cfg["outer"])
    start, syncs = method.sent(), method.syncs()
    last, exchanges, clock = start, [], 0.0
    curve: List[Tuple[int, float, float]] = [(0, 0.0, _validate(model, xv, yv))]
    for step in range(steps):
        x, y = text.batch(train, text.train_starts(len(train), cfg["context"], rank, world, cfg["batch_size"],
                                                   cfg["seed"], step), cfg["context"])
        t0 = time.perf_counter()
        method.opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        method.opt.step()
        if method.blocking:
            wait_all()
        clock += time.perf_counter() - t0
        sched.step()
        if method.blocking or method.syncs() != syncs:  # an exchange ended in this step: its bytes are counted
            syncs, now = method.syncs(), method.sent()
            exchanges.append(now - last)
            last = now
        if (step + 1) % cfg["eval_every"] == 0 or step + 1 == steps:
            curve.append((step + 1, clock, _validate(model, xv, yv)))
            tick()
    wait_all()  # an exchange still in flight (a last fragment's) ends before the next method starts
    method.close()
    return {"curve": curve, "sent": method.sent() - start, "exchanges": exchanges, "clock_s": clock,
            "skipped": int(getattr(method.opt, "skipped", 0))}


def run_rank(rank: int, world: int, cfg: Dict[str, Any], progress: Callable[..., None]) -> Any:
    from . import text

    info = text.corpus(int(cfg["text_mb"] * 1e6), cfg["seed"])
    starts = text.val_starts(len(info["val"]), cfg["context"], cfg["val_windows"], 0, 1)  # all of them
    data = (info["train"], *text.batch(info["val"], starts, cfg["context"]))
    evals = cfg["steps"] // cfg["eval_every"] + (cfg["steps"] % cfg["eval_every"] != 0)
    total, done = len(cfg["methods"]) * evals, [0]
    # untimed: the first method would otherwise pay for the threads, allocations and first calls of all
    warm: Dict[str, Any] = {"label": "warm-up", "kind": "ddp", "compressor": None, "options": {}, "fragments": 1,
                            "delay": 0}
    _train(warm, rank, world, {**cfg, "steps": WARMUP_STEPS, "eval_every": WARMUP_STEPS}, data, lambda: None)
    results = []
    for spec in cfg["methods"]:
        def tick(label=spec["label"]) -> None:
            done[0] += 1
            progress(done=done[0], total=total, label=label)
        dist.barrier()
        results.append(_train(spec, rank, world, cfg, data, tick))
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, results)
    return records(cfg, everyone, world) if rank == 0 else None


# ---- records and table ---------------------------------------------------------------------------
def records(cfg: Dict[str, Any], everyone: List[List[Dict[str, Any]]], world: int) -> List[Dict[str, Any]]:
    """One record per method from every rank's runs, with its comparisons to ``ddp`` (bytes, loss,
    time to ddp's final loss), to ``diloco`` (loss) and to ``local`` (time per step)."""
    tokens = world * cfg["batch_size"] * cfg["context"]  # per step, all workers together
    out = []
    for m, spec in enumerate(cfg["methods"]):
        runs = [r[m] for r in everyone]
        curve = [{"step": s, "tokens": s * tokens, "seconds": max(r["curve"][i][1] for r in runs),
                  "val_loss": sum(r["curve"][i][2] for r in runs) / world}
                 for i, (s, _, _) in enumerate(runs[0]["curve"])]
        finals = [r["curve"][-1][2] for r in runs]
        wall = max(r["clock_s"] for r in runs)
        out.append({"method": spec["label"], "kind": spec["kind"], "compressor": spec["compressor"] or "none",
                    "options": spec["options"], "sync_every": spec["sync_every"], "fragments": spec["fragments"],
                    "delay": spec["delay"], "world_size": world, "steps": cfg["steps"], "tokens": cfg["steps"] * tokens,
                    "val_loss": curve[-1]["val_loss"], "val_spread": max(finals) - min(finals), "val_curve": curve,
                    "bytes_sent": max(r["sent"] for r in runs),
                    "largest_exchange": max((b for r in runs for b in r["exchanges"]), default=0.0),
                    # the typical one (ddp-powersgd's first steps are dense: its largest is ddp's)
                    "median_exchange": statistics.median(runs[0]["exchanges"]) if runs[0]["exchanges"] else 0.0,
                    "exchanges": len(runs[0]["exchanges"]), "wall_s": wall, "step_ms": 1e3 * wall / cfg["steps"],
                    "skipped": max(r["skipped"] for r in runs)})
    ref = next((r for r in out if r["method"] == REFERENCE), None)
    alone = next((r for r in out if r["method"] == NO_EXCHANGE), None)
    dense_diloco = next((r for r in out if r["method"] == "diloco"), None)  # what compressing DiLoCo costs
    for r in out:
        r["bytes_vs_ddp"] = ref["bytes_sent"] / r["bytes_sent"] if ref and r["bytes_sent"] else None
        r["val_vs_ddp_pct"] = 100 * (r["val_loss"] / ref["val_loss"] - 1) if ref else None
        r["val_vs_diloco_pct"] = 100 * (r["val_loss"] / dense_diloco["val_loss"] - 1) if dense_diloco else None
        r["time_to_ddp_loss_s"] = None if ref is None else next(
            (c["seconds"] for c in r["val_curve"] if c["val_loss"] <= ref["val_loss"]), None)
        r["step_vs_local_pct"] = 100 * (r["step_ms"] / alone["step_ms"] - 1) if alone else None
    return out


def _h(r: Dict[str, Any]) -> str:
    if r["kind"] == "ddp":
        return "1"
    if r["kind"] == NO_EXCHANGE:
        return "-"
    frag = f" F{r['fragments']} t{r['delay']}" if r["fragments"] > 1 or r["delay"] else ""
    return f"{r['sync_every']}{frag}"


def _pct(v: Optional[float], spec: str) -> str:
    return cli.fmt(v, spec) + ("" if v is None else "%")


def table(recs: List[Dict[str, Any]]) -> str:
    """The records, one line per method, then what the columns mean."""
    head = ("method", "H", "val loss", "vs ddp", "sent/worker", "fewer", "largest exch.", "wall s", "ms/step",
            "vs local", "to ddp loss")
    rows = [(r["method"], _h(r), f"{r['val_loss']:.4f}", _pct(r["val_vs_ddp_pct"], "+.2f"),
             cli.fmt_bytes(r["bytes_sent"]), cli.fmt(r["bytes_vs_ddp"], ".1f") + ("x" if r["bytes_vs_ddp"] else ""),
             cli.fmt_bytes(r["largest_exchange"]), f"{r['wall_s']:.1f}", f"{r['step_ms']:.1f}",
             _pct(r["step_vs_local_pct"], "+.1f"),
             cli.fmt(r["time_to_ddp_loss_s"], ".1f", "never") + ("" if r["time_to_ddp_loss_s"] is None else " s"))
            for r in recs]
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]

    def line(cells: Sequence[str]) -> str:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(cells) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ("-" if i == 0 else ":") for i, w in enumerate(widths)) + "|"
    r0 = recs[0]
    note = (f"val loss: nats per character on held-out files after {r0['steps']} steps ({r0['tokens']:,} tokens; "
            f"the mean over the {r0['world_size']} workers' models); vs ddp: relative to {REFERENCE}'s; sent/worker: "
            f"bytes each rank sent over the run (the most of any rank); fewer: {REFERENCE}'s bytes / these; largest "
            f"exch.: the most bytes one exchange sent (one step's gradients, one fragment's sync); wall s: training "
            f"time of the slowest rank (validation excluded); vs local: time per step relative to {NO_EXCHANGE} "
            f"(no exchange); to ddp loss: training seconds until the validation loss first reached {REFERENCE}'s "
            f"final one (at the evaluations)")
    skipped = [f"{r['method']} skipped {r['skipped']} outer step(s)" for r in recs if r["skipped"]]
    return "\n".join([line(head), rule, *(line(r) for r in rows), "", note] + (["; ".join(skipped)] if skipped else []))


# ---- entry point -----------------------------------------------------------------------------------
def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    defaults = dict(QUICK) if args.quick else {"steps": 1000, "eval_every": 50, "text_mb": 2.0, "val_windows": 256}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    cli.check_sizes(args)
    if args.world_size < 2:
        raise ValueError(f"--ranks must be at least 2 (the workers exchange with each other), not {args.world_size}")
    for name in ("steps", "batch_size", "layers", "d_model", "heads", "context", "eval_every", "val_windows",
                 "sync_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, not {getattr(args, name)}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0, not {args.lr}")
    labels = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not labels or len(set(labels)) != len(labels):
        raise ValueError(f"--methods must name each method once, got {args.methods!r}")
    specs = [parse_method(m, args.sync_every) for m in labels]
    link = cli.resolve_link(args)
    base, lines = lm_setup(args, optimizer="inner AdamW", per="worker")
    if not args.outer_lr > 0 or not 0 <= args.outer_momentum < 1:
        raise ValueError(f"--outer-lr must be > 0 and --outer-momentum in [0, 1), not {args.outer_lr} and "
                         f"{args.outer_momentum}")
    cfg = {"methods": specs, **base, "outer": {"lr": args.outer_lr, "momentum": args.outer_momentum}}
    env = envmod.environment(args.world_size, cli.link_text(link), args.threads)
    print(envmod.header(env, [
        *lines,
        f"methods  {len(specs)}, one after another; DiLoCo H={args.sync_every}, outer SGD lr {args.outer_lr}"
        f"{f' Nesterov {args.outer_momentum}' if args.outer_momentum else ''}; "
        f"validation on {args.val_windows} windows every {args.eval_every} steps",
    ]), flush=True)
    recs = cli.run_and_report("diloco", cfg, args, link, env, table)
    if args.plot:
        from . import plot

        plot.loss_plot(recs, args.plot, title=f"character transformer on stdlib source, {env['world_size']} "
                                              f"workers, {env['link']}")
        print(f"wrote {args.plot}")
    return 0
