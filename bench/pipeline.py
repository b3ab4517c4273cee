"""``python -m gradcomp.bench pipeline``: pipeline-parallel training, side by side.

On ``--world-size`` ranks (one pipeline stage each), loopback or ``--netem RATE``, in one run:

- throughput: samples/s of gradcomp's ``Pipeline`` under each schedule (``--schedules``) and
  pair of boundary compressors (``--codecs``, ``ACT+GRAD``), and of ``torch.distributed.pipelining``
  (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, and beside ``zb-h1`` and ``zb-h2``
  ``ScheduleInterleavedZeroBubble`` on one chunk per rank and ``ScheduleZBVZeroBubble``) on the same model, ranks,
  link and batch; median step time over ``--repeats`` steps after ``--warmup`` (each step
  starts at a barrier; a step's time is its slowest rank's); the measured bubble (the share
  of each rank's step spent outside its forward and backward passes, averaged over ranks)
  beside the textbook ``(p - 1) / (v m + p - 1)``; bytes sent per step as the
  pipeline counts them (``Pipeline.sent_bytes``: payloads);
- balance: an uneven model (four wide layers, then narrow ones) split into equal layer counts
  and by ``balance="auto"`` at this link, samples/s of each (1F1B, the last pair);
- accuracy (``--epochs`` > 0): the throughput model at ``--accuracy-width`` trained on the
  training benchmark's data (scikit-learn's digits) with each pair (and int8 activations
  in AQ-SGD's delta mode), test accuracy against the exact pipeline's;
- ``--plot PATH``: a PNG timeline of one step of each of gradcomp's schedules (stage x time:
  forward, backward, sends).

The model is activation-heavy on purpose: a stem ``Linear(64, W)``, bottleneck blocks
``W -> K -> W`` (little compute per byte of boundary), a head ``Linear(W, 10)``; every stage
boundary carries ``W`` floats per sample forward and back.
"""
from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from . import cli
from . import env as envmod
from .train import _data

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2")
# torch's nearest schedule to each of gradcomp's (zb-h2: torch has no ZB-H2 of its own; its zero-bubble
# schedule on one chunk per rank is the one compared with, measured once for both zero-bubble rows)
TORCH = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
         "zb-h1": "ScheduleInterleavedZeroBubble", "zb-h2": "ScheduleInterleavedZeroBubble"}
# torch's schedules without a gradcomp row of their own, measured beside the one named: ZBV
# (zero bubble on two model chunks per rank in a V: rank r holds stages r and 2p - 1 - r)
TORCH_BESIDE = {"zb-h1": "ScheduleZBVZeroBubble", "zb-h2": "ScheduleZBVZeroBubble"}
VIRTUAL = {"interleaved": 2, "ScheduleInterleaved1F1B": 2, "ScheduleZBVZeroBubble": 2}  # chunks per rank
BUSY = ("F", "B", "I", "W")  # the event kinds that are a rank's own passes
DEFAULT_CODECS = "none+none,int8+fp16"
ACCURACY_CODECS = ("none+none", "fp16+fp16", "bf16+bf16", "int8+fp16", "int8~delta+fp16", "qsgd+fp16",
                   "topk:ratio=0.1+fp16")
STAGE_LAYERS = 1  # layers per (virtual) stage of the models: little compute per boundary


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gradcomp.bench pipeline",
                                description="Pipeline-parallel training with compressed stage boundaries against "
                                            "torch.distributed.pipelining, on loopback or an emulated link.")
    p.add_argument("--schedules", default=",".join(SCHEDULES), metavar="A,B", help=",".join(SCHEDULES))
    p.add_argument("--codecs", default=DEFAULT_CODECS, metavar="ACT+GRAD,...",
                   help=f"pairs of boundary compressors, activation+gradient (default {DEFAULT_CODECS})")
    p.add_argument("--microbatches", "--chunks", type=int, default=8, metavar="M",
                   help="micro-batches per step (default 8)")
    p.add_argument("--batch-size", type=int, default=256, metavar="N", help="samples per step (default 256)")
    p.add_argument("--width", type=int, default=8192, metavar="W", help="boundary width (default 8192)")
    p.add_argument("--inner", type=int, default=16, metavar="K",
                   help="bottleneck width: compute per boundary byte (default 16)")
    p.add_argument("--repeats", type=int, default=5, metavar="N", help="timed steps per method (default 5)")
    p.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed steps first (default 2)")
    p.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    p.add_argument("--no-balance", action="store_true", help="skip the balance comparison")
    p.add_argument("--epochs", type=int, default=4, metavar="N", help="accuracy runs' epochs; 0 skips (default 4)")
    p.add_argument("--accuracy-width", type=int, default=1024, metavar="W", help="model width there (default 1024)")
    cli.common_options(p)
    return p


# ---- models -------------------------------------------------------------------------------------
class _Bottleneck(nn.Module):
    def __init__(self, width: int, inner: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, inner), nn.ReLU(), nn.Linear(inner, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


def heavy_model(width: int, stages: int, seed: int, inner: int = 16) -> nn.Sequential:
    """Stem, bottleneck blocks, head: ``stages * STAGE_LAYERS`` layers."""
    torch.manual_seed(seed)
    n = stages * STAGE_LAYERS
    return nn.Sequential(nn.Sequential(nn.Linear(64, width), nn.ReLU()),
                         *[_Bottleneck(width, inner) for _ in range(n - 2)], nn.Linear(width, 10))


def uneven_model(seed: int) -> nn.Sequential:
    """Four wide layers (2048 x 2048) first, cheap narrow ones after: an equal layer count puts
    two wide layers on one stage and none on another."""
    torch.manual_seed(seed)
    wide = [nn.Sequential(nn.Linear(2048, 2048), nn.ReLU()) for _ in range(4)]
    narrow = [nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(2)]
    return nn.Sequential(nn.Sequential(nn.Linear(64, 2048), nn.ReLU()), *wide,
                         nn.Sequential(nn.Linear(2048, 64), nn.ReLU()), *narrow, nn.Linear(64, 10))


def _pair(text: str) -> Tuple[Any, Any, bool]:
    """``ACT+GRAD`` (``~delta`` after ACT: delta mode; ``NAME:opt=v``) as compressors."""
    from gradcomp.compress import get_compressor

    from .collective import parse_entry

    act, grad = text.split("+")
    delta = act.endswith("~delta")
    made = [get_compressor(n, **o) for n, o in (parse_entry(act.replace("~delta", "")), parse_entry(grad))]
    return made[0], made[1], delta


# ---- per rank -------------------------------------------------------------------------------------
class _Method:
    """One throughput method on this rank: ``step()`` runs a training step; ``measure()``
    notes what it measured after a timed one; ``result()`` is what the report needs."""

    def __init__(self, step: Callable[[], Any], vstages: int, pipe: Any = None, schedule: str = "1f1b") -> None:
        self.step, self.vstages, self.pipe = step, vstages, pipe  # vstages: virtual stages per rank
        self.schedule = schedule
        self.times: List[float] = []
        self.bubbles: List[float] = []
        self.sent: List[float] = []

    def measure(self, seconds: float, sent: float) -> None:
        self.times.append(seconds)
        if self.pipe is not None:  # the share of the step outside this rank's passes
            events = self.pipe.events
            busy = sum(e.end - e.start for e in events if e.kind in BUSY)
            self.bubbles.append(1 - busy / max(e.end for e in events))
            self.sent.append(sent)

    def result(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"times": self.times, "vstages": self.vstages, "bubble": None, "bytes": None,
                               "schedule": self.schedule, "peak_in_flight": None}
        if self.pipe is not None:
            self.step()  # one more, for the timeline
            out.update(bubble=statistics.median(self.bubbles), bytes=statistics.median(self.sent),
                       events=[list(e) for e in self.pipe.events], started_at=self.pipe.started_at,
                       balance=self.pipe.balance, peak_in_flight=self.pipe.peak_in_flight)
            self.pipe.close()
        return out


def _round_robin(methods: List[_Method], warmup: int, repeats: int, progress: Callable[[int], None]) -> None:
    """Every method's steps in turns — one step of each per round, each from a barrier — so
    that a change of the machine's load between rounds reaches every method alike."""
    from gradcomp.collectives import reset_telemetry, telemetry

    for i in range(warmup + repeats):
        for m in methods:
            reset_telemetry()
            dist.barrier()
            t0 = time.perf_counter()
            m.step()
            seconds = time.perf_counter() - t0
            if i >= warmup:  # the pipeline counts its own messages; torch's are not counted
                m.measure(seconds, m.pipe.sent_bytes if m.pipe is not None else telemetry()["total"]["bytes_sent"])
        progress(i)


def _ours(cfg: Dict[str, Any], schedule: str, codecs: str, world: int, make: Callable[[], nn.Sequential],
          balance: Optional[List[int]] = None) -> _Method:
    from gradcomp.pipeline import Pipeline

    act, grad, delta = _pair(codecs)
    model = make()
    v = VIRTUAL.get(schedule, 1)
    layers = len(model)
    balance = balance or [layers // (world * v)] * (world * v)
    balance[-1] += layers - sum(balance)
    pipe = Pipeline(model, balance=balance, schedule=schedule, microbatches=cfg["microbatches"], activation_codec=act,
                    grad_codec=grad, delta=delta, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))
    x, y = cfg["x"], cfg["y"]
    return _Method(lambda: pipe.step(x, y, nn.functional.cross_entropy), v, pipe, schedule)


def _torch(cfg: Dict[str, Any], name: str, rank: int, world: int, make: Callable[[], nn.Sequential]
           ) -> _Method:
    """torch.distributed.pipelining's schedule ``name`` (a class of it) on the same model."""
    from torch.distributed import pipelining

    model = make()
    v = VIRTUAL.get(name, 1)
    n = world * v
    per = len(model) // n
    pieces = [model[s * per:(s + 1) * per] if s < n - 1 else model[s * per:] for s in range(n)]
    mine = [rank, n - 1 - rank] if name == "ScheduleZBVZeroBubble" else [s for s in range(n) if s % world == rank]
    stages = [pipelining.PipelineStage(pieces[s], s, n, torch.device("cpu")) for s in mine]
    cls = getattr(pipelining, name)
    multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)
    sched = cls(stages if multi else stages[0], cfg["microbatches"], loss_fn=nn.functional.cross_entropy)
    opt = torch.optim.SGD([p for s in mine for p in pieces[s].parameters()], lr=1e-3)
    x, y = cfg["x"], cfg["y"]

    def step() -> None:
        opt.zero_grad()
        kwargs: Dict[str, Any] = {"target": y, "losses": []} if (n - 1) in mine else {}
        sched.step(x, **kwargs) if 0 in mine else sched.step(**kwargs)
        opt.step()

    return _Method(step, v, schedule=name)


def _accuracy(cfg: Dict[str, Any], codecs: str, world: int, data: Any) -> Dict[str, Any]:
    from gradcomp.pipeline import Pipeline

    act, grad, delta = _pair(codecs)
    xtr, ytr, xte, yte = data
    model = heavy_model(cfg["accuracy_width"], world * 2, cfg["seed"], cfg["inner"])
    per = len(model) // world
    pipe = Pipeline(model, balance=[per] * (world - 1) + [len(model) - per * (world - 1)], schedule="1f1b",
                    microbatches=4, activation_codec=act, grad_codec=grad, delta=delta,
                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    batch = 64
    for epoch in range(cfg["epochs"]):
        order = torch.randperm(len(ytr), generator=torch.Generator().manual_seed(cfg["seed"] * 7919 + epoch))
        for s in range(len(ytr) // batch):
            idx = order[s * batch:(s + 1) * batch]
            pipe.step(xtr[idx], ytr[idx], nn.functional.cross_entropy, sample_ids=idx)
    out, _ = pipe.eval_step(xte)
    acc = [float((out.argmax(1) == yte).float().mean()) if out is not None else -1.0]
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, (acc[0], pipe.delta_cache_bytes()))
    pipe.close()
    return {"accuracy": max(a for a, _ in everyone), "delta_cache_bytes": sum(b for _, b in everyone)}


def run_rank(rank: int, world: int, cfg: Dict[str, Any], progress: Callable[..., None]) -> Any:
    g = torch.Generator().manual_seed(cfg["seed"])
    cfg = dict(cfg, x=torch.randn(cfg["batch_size"], 64, generator=g),
               y=torch.randint(0, 10, (cfg["batch_size"],), generator=g))

    def model() -> nn.Sequential:  # enough layers for two virtual stages per rank
        return heavy_model(cfg["width"], world * 2, cfg["seed"], cfg["inner"])

    labels: List[str] = []
    methods: List[_Method] = []
    for schedule in cfg["schedules"]:
        for codecs in cfg["codecs"]:
            labels.append(f"gradcomp {schedule} {codecs}")
            methods.append(_ours(cfg, schedule, codecs, world, model))
        if cfg["torch"]:
            for name in [TORCH[schedule]] + ([TORCH_BESIDE[schedule]] if schedule in TORCH_BESIDE else []):
                if f"torch {name}" in labels:  # zb-h1 and zb-h2 share torch's
                    continue
                labels.append(f"torch {name}")
                methods.append(_torch(cfg, name, rank, world, model))
    if cfg["balance"]:
        for label, method in _balance_methods(cfg, world):
            labels.append(label)
            methods.append(method)
    accuracy = list(cfg["accuracy_codecs"]) if cfg["epochs"] else []
    total = cfg["warmup"] + cfg["repeats"] + len(accuracy)
    _round_robin(methods, cfg["warmup"], cfg["repeats"], lambda i: progress(done=i + 1, total=total, label="steps"))
    out = [dict(m.result(), label=label) for label, m in zip(labels, methods)]
    data = _data(cfg["seed"]) if accuracy else None
    for i, codecs in enumerate(accuracy):
        progress(done=cfg["warmup"] + cfg["repeats"] + i, total=total, label=f"accuracy {codecs}")
        out.append(dict(_accuracy(cfg, codecs, world, data), label=f"accuracy {codecs}"))
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, out)
    return _records(everyone, cfg, world) if rank == 0 else None


def _balance_methods(cfg: Dict[str, Any], world: int) -> List[Tuple[str, _Method]]:
    """The uneven model split into equal layer counts and by ``balance="auto"`` at this link."""
    from gradcomp.pipeline import auto_balance

    codecs = cfg["codecs"][-1]
    act, grad, _ = _pair(codecs)
    model = uneven_model(cfg["seed"])
    chosen: List[Any] = [None]
    if dist.get_rank() == 0:
        chosen[0] = auto_balance(model, cfg["x"][: cfg["batch_size"] // cfg["microbatches"]], world,
                                 activation_codec=act,
                                 grad_codec=grad, link_bps=cfg["link_bps"]).balance
    dist.broadcast_object_list(chosen, src=0)
    n = len(model)
    equal = [n // world] * world
    equal[-1] += n - sum(equal)
    uneven = partial(uneven_model, cfg["seed"])
    return [(f"balance {how} {split} {codecs}", _ours(cfg, "1f1b", codecs, world, uneven, list(split)))
            for how, split in (("equal", equal), ("auto", chosen[0]))]


def _records(everyone: List[Any], cfg: Dict[str, Any], world: int) -> List[Dict[str, Any]]:
    from gradcomp.pipeline import ideal_bubble

    records = []
    for j, mine in enumerate(everyone[0]):
        runs = [e[j] for e in everyone]
        r: Dict[str, Any] = {"method": mine["label"], "world_size": world}
        if "times" in mine:
            step = statistics.median(max(x["times"][i] for x in runs) for i in range(len(mine["times"])))
            bubbles = [x["bubble"] for x in runs if x["bubble"] is not None]
            r.update(step_ms=1e3 * step, samples_per_s=cfg["batch_size"] / step,
                     bubble=statistics.mean(bubbles) if bubbles else None,
                     ideal_bubble=ideal_bubble(world, cfg["microbatches"], mine["vstages"],
                                               "zb-h1" if "Zero" in mine["schedule"] else mine["schedule"]),
                     peak_in_flight=[x["peak_in_flight"] for x in runs] if mine["peak_in_flight"] is not None else None,
                     bytes_per_step=max(x["bytes"] for x in runs) if mine["bytes"] is not None else None)
            if "events" in mine:
                r["timeline"] = [[(e[0], e[1], e[2], e[3] + x["started_at"], e[4] + x["started_at"])
                                  for e in x["events"]] for x in runs]
        else:
            r.update(test_accuracy=mine["accuracy"], delta_cache_bytes=mine["delta_cache_bytes"])
        records.append(r)
    _ratios(records)
    return records


def _ratios(records: List[Dict[str, Any]]) -> None:
    """Each throughput row against the uncompressed gradcomp row of its schedule and against
    torch's; accuracy rows against the exact run."""
    by = {r["method"]: r for r in records}
    exact = by.get("accuracy none+none")
    for r in records:
        parts = r["method"].split()
        if parts[0] == "gradcomp":
            base, theirs = by.get(f"gradcomp {parts[1]} none+none"), by.get(f"torch {TORCH[parts[1]]}")
            r["vs_uncompressed"] = r["samples_per_s"] / base["samples_per_s"] if base else None
            r["vs_torch"] = r["samples_per_s"] / theirs["samples_per_s"] if theirs else None
        if parts[0] == "accuracy" and exact is not None:
            r["vs_exact_pp"] = 100 * (r["test_accuracy"] - exact["test_accuracy"])
    eq = next((r for r in records if r["method"].startswith("balance equal")), None)
    for r in records:
        if r["method"].startswith("balance auto") and eq is not None:
            r["vs_equal_split"] = r["samples_per_s"] / eq["samples_per_s"]


# ---- report ------------------------------------------------------------------------------------------
def table(records: List[Dict[str, Any]]) -> str:
    fmt = cli.fmt
    lines = ["| method | samples/s | step ms | vs uncompressed | vs torch | bubble (ideal) | bytes/step/rank | "
             "held per rank |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        if "samples_per_s" not in r:
            continue
        if "vs_equal_split" in r:
            extra = fmt(r["vs_equal_split"], ".2f") + "x vs equal split"
        else:
            extra = fmt(r.get("vs_uncompressed"), ".2f") + ("x" if r.get("vs_uncompressed") else "")
        bubble = f"{fmt(r['bubble'], '.2f')} ({r['ideal_bubble']:.2f})" if r["bubble"] is not None else \
            f"- ({r['ideal_bubble']:.2f})"
        lines.append(f"| {r['method']} | {r['samples_per_s']:.0f} | {r['step_ms']:.1f} | {extra} | "
                     f"{fmt(r.get('vs_torch'), '.2f')}{'x' if r.get('vs_torch') else ''} | {bubble} | "
                     f"{cli.fmt_bytes(r['bytes_per_step'])} | {_held(r.get('peak_in_flight'))} |")
    acc = [r for r in records if "test_accuracy" in r]
    if acc:
        lines += ["", "| codecs (activation+gradient) | test accuracy | vs exact | delta cache |",
                  "|---|---:|---:|---:|"]
        for r in acc:
            lines.append(f"| {r['method'].split(' ', 1)[1]} | {100 * r['test_accuracy']:.2f}% | "
                         f"{fmt(r.get('vs_exact_pp'), '+.2f')} pp | "
                         f"{cli.fmt_bytes(r['delta_cache_bytes']) if r['delta_cache_bytes'] else '-'} |")
    return "\n".join(lines)


def _held(peaks: Optional[List[int]]) -> str:
    """Micro-batches each rank held at once (``Pipeline.peak_in_flight``), or "-"."""
    return "-" if not peaks else "/".join(map(str, peaks))


def timeline_plot(records: List[Dict[str, Any]], path: str, title: str) -> None:
    """One panel per gradcomp schedule (its first pair of boundary compressors): stages down, time across;
    forward, backward and send intervals, micro-batch numbers on the passes."""
    from .plot import _pyplot

    plt = _pyplot()
    rows = [r for r in records if r.get("timeline") and r["method"].startswith("gradcomp")]
    seen, panels = set(), []
    for r in rows:
        schedule = r["method"].split()[1]
        if schedule not in seen:
            seen.add(schedule)
            panels.append(r)
    colors = {"F": "#4c72b0", "B": "#55a868", "I": "#8fd19e", "W": "#2d6a3e", "send": "#dd8452"}
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 1.0 + 0.75 * len(panels) * len(panels[0]["timeline"])),
                             squeeze=False)
    for ax, r in zip(axes[:, 0], panels):
        t0 = min(e[3] for rank in r["timeline"] for e in rank)
        for rank, events in enumerate(r["timeline"]):
            for kind, stage, mb, start, end in events:
                if kind not in colors:
                    continue
                y, h = (rank, 0.6) if kind != "send" else (rank + 0.38, 0.16)
                ax.broken_barh([(1e3 * (start - t0), 1e3 * (end - start))], (y - 0.3, h), color=colors[kind],
                               edgecolor="white", linewidth=0.4)
                if kind != "send" and (end - start) * 1e3 > 0.02 * _span(r):
                    ax.text(1e3 * ((start + end) / 2 - t0), rank, str(mb), ha="center", va="center", fontsize=7,
                            color="white")
        ax.set_yticks(range(len(r["timeline"])), [f"rank {i}" for i in range(len(r["timeline"]))])
        ax.invert_yaxis()
        ax.set_xlim(0, _span(r) * 1.01)
        ax.set_title(f"{r['method']}: median step {r['step_ms']:.0f} ms, bubble {r['bubble']:.2f} (ideal "
                     f"{r['ideal_bubble']:.2f}); drawn: one more step, {_span(r):.0f} ms", fontsize=9, loc="left")
        ax.set_xlabel("ms since the step began (wall clock, one step)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, ["forward", "backward", "input gradient (I)", "weight gradient (W)",
                         "send (its wait for earlier messages included)"], loc="upper left", ncol=5, fontsize=8,
               frameon=False, bbox_to_anchor=(0.005, 1.0 - 0.28 / fig.get_figheight()))  # a line below the title
    fig.suptitle(title, fontsize=10, x=0.01, y=1.0 - 0.08 / fig.get_figheight(), ha="left", va="top")
    fig.tight_layout(rect=(0, 0, 1, 1.0 - 0.6 / fig.get_figheight()))
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _span(r: Dict[str, Any]) -> float:
    starts = [e[3] for rank in r["timeline"] for e in rank]
    ends = [e[4] for rank in r["timeline"] for e in rank]
    return 1e3 * (max(ends) - min(starts))


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    cli.check_sizes(args)
    if args.world_size < 2:
        raise ValueError(f"--world-size must be >= 2 (one pipeline stage per rank), not {args.world_size}")
    schedules = [s for s in args.schedules.split(",") if s]
    bad = [s for s in schedules if s not in SCHEDULES]
    if bad or not schedules:
        raise ValueError(f"--schedules {args.schedules!r}: choose from {', '.join(SCHEDULES)}")
    codecs = [c for c in args.codecs.split(",") if c]
    for c in codecs + list(ACCURACY_CODECS):
        if c.count("+") != 1:
            raise ValueError(f"--codecs {c!r}: give ACT+GRAD, e.g. int8+fp16")
        _pair(c)
    for name in ("microbatches", "batch_size", "width", "inner", "repeats", "warmup", "accuracy_width"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, not {getattr(args, name)}")
    if args.batch_size % args.microbatches or args.microbatches % args.world_size:
        raise ValueError(f"--batch-size ({args.batch_size}) must split into --microbatches ({args.microbatches}), "
                         f"and --microbatches be a multiple of --world-size ({args.world_size}) for the interleaved "
                         f"schedule")
    link = cli.resolve_link(args)
    if args.epochs:
        _data(args.seed)  # fail early, in the parent, if scikit-learn is missing
    cfg = {"schedules": schedules, "codecs": codecs, "microbatches": args.microbatches, "batch_size": args.batch_size,
           "width": args.width, "inner": args.inner, "repeats": args.repeats, "warmup": args.warmup,
           "torch": not args.no_torch,
           "balance": not args.no_balance, "epochs": args.epochs, "accuracy_width": args.accuracy_width,
           "accuracy_codecs": list(ACCURACY_CODECS), "seed": args.seed,
           "link_bps": link.rate_bit if link is not None else None}
    env = envmod.environment(args.world_size, cli.link_text(link), args.threads)
    print(envmod.header(env, [
        f"model    stem Linear(64,{args.width}), {2 * args.world_size * STAGE_LAYERS - 2} bottleneck blocks "
        f"{args.width}-{args.inner}-{args.width}, head Linear({args.width},10); {2 * STAGE_LAYERS} layers per stage, "
        f"{STAGE_LAYERS} per virtual stage when interleaved; batch {args.batch_size} in {args.microbatches} "
        f"micro-batches",
        f"timing   median over {args.repeats} steps after {args.warmup} warm-up, each from a barrier, slowest rank",
        f"accuracy digits, width {args.accuracy_width}, 1F1B, 4 micro-batches of 16, {args.epochs} epochs, "
        f"SGD lr 0.05 momentum 0.9",
    ]), flush=True)
    records = cli.run_and_report("pipeline", cfg, args, link, env, table)
    if args.plot:
        timeline_plot(records, args.plot, f"one training step per schedule, {args.world_size} stages, "
                                          f"{env['link']}")
        print(f"wrote {args.plot}")
    return 0
