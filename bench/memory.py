"""``python -m gradcomp.bench memory``: activation memory against step time, side by side.

For one chain (``--model``: an MLP, a ResNet-like conv chain or a transformer-like stack,
16+ stages) and one process, every method trains the same steps from the same weights:

- ``no saving``: the plain model;
- ``checkpoint_sequential`` with 2, 4 and sqrt(n) segments (``torch.utils.checkpoint``,
  reentrant: its stored inputs go through autograd's saved-tensor hooks, where the meter sees
  them; the batch then requires grad, as reentrant checkpointing needs);
- ``save_on_cpu`` (``torch.autograd.graph``; CUDA only);
- ``plan_memory`` at each budget (``--budgets``, fractions of the no-saving peak, plus the peak
  of every ``checkpoint_sequential`` run, so each is compared at its own memory), lossless
  (recompute and the lossless codec: gradients bit-identical) and with the lossy codecs of
  ``--plan-codecs`` (bf16 and int8 by default) allowed too;
- ``compressed_activations`` with each codec of ``--codecs``.

Per method: peak saved-activation bytes (``MemoryMeter``; on CUDA also
``torch.cuda.max_memory_allocated``), the step time, and whether the gradients equal the plain
model's. After one warm-up step of each, the methods are timed in ``--repeats`` rounds of one
step each (the order rotating), so a change of the machine's load reaches them alike; a
method's ``x no saving`` is its median step over no saving's median step (the two figures the
table prints), and ``same round`` the median over rounds of its step over no saving's step in
the same round, with the middle half of those ratios. The results so far are written after
every round. The planner measures the chain once per variant and solves that measurement at
every budget. ``--accuracy`` also trains a
16-stage residual MLP on the training benchmark's data (scikit-learn's digits) with each
codec and a lossy plan, and reports test accuracy against the plain model's. The planner's solve time for a
100-stage chain is measured too. ``--plot`` draws the memory-time frontier.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import textwrap
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from gradcomp.memory import BudgetTooSmall, MemoryMeter, compressed_activations, plan_memory
from gradcomp.memory import schedule as sch
from gradcomp.memory.planner import Plan, profile

from . import env as envmod
from . import spread

MODELS = ("mlp", "resnet-like", "transformer-like")


class _Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                                  nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


class _ResidualMLP(nn.Module):
    """x + MLP(LayerNorm(x)): a stage deep stacks of which still train."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln(x))


class _Block(nn.Module):
    """Pre-norm transformer block: self-attention and a 4x MLP, each with a residual."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


def build(name: str, device: torch.device, scale: float = 1.0):
    """The chain and a batch for it: (model, x, y, description)."""
    torch.manual_seed(0)
    if name == "mlp":
        w, n, b = 512, 24, max(1, round(256 * scale))
        model = nn.Sequential(*[nn.Sequential(nn.Linear(w, w), nn.ReLU()) for _ in range(n)], nn.Linear(w, 10))
        x, desc = torch.randn(b, w), f"MLP: {n} x (Linear {w}-{w} + ReLU) + Linear {w}-10, batch {b}"
    elif name == "resnet-like":
        c, n, b, hw = 32, 16, max(1, round(32 * scale)), 32
        model = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), *[_Residual(c) for _ in range(n)],
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))
        x, desc = torch.randn(b, 3, hw, hw), f"ResNet-like: stem + {n} residual blocks of {c} channels at {hw}x{hw}, batch {b}"
    elif name == "transformer-like":
        d, n, b, s = 256, 16, max(1, round(8 * scale)), 128
        model = nn.Sequential(*[_Block(d, 4) for _ in range(n)], nn.Flatten(1), nn.Linear(s * d, 10))
        x, desc = torch.randn(b, s, d), f"transformer-like: {n} pre-norm blocks, d={d}, 4 heads, sequence {s}, batch {b}"
    else:
        raise ValueError(f"--model {name!r}: choose one of {', '.join(MODELS)}")
    y = torch.randint(0, 10, (x.shape[0],))
    return model.to(device), x.to(device), y.to(device), desc


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Method:
    """One way to train the chain: its label, kind, forward and context, what it measured."""

    def __init__(self, label: str, kind: str, forward: Callable[[torch.Tensor], torch.Tensor],
                 context: Optional[Callable[[], Any]] = None, **extra: Any) -> None:
        self.label, self.kind, self.forward, self.context, self.extra = label, kind, forward, context, extra
        self.times: List[float] = []
        self.ratios: List[float] = []  # step time / no saving's in the same round
        self.peak: int = 0
        self.cuda_peak: Optional[int] = None
        self.bit_identical, self.grad_rel_error = True, 0.0


def step(model: nn.Module, state: Dict[str, torch.Tensor], m: Method, x: torch.Tensor,
         y: torch.Tensor) -> float:
    """One forward and backward of ``m`` from the saved weights (gradients zeroed, no optimizer
    step, so every step is the same); records the peak bytes, returns the seconds."""
    device = x.device
    model.load_state_dict(state)  # untimed: batch norm's running statistics as at the start
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    _sync(device)
    t0 = time.perf_counter()
    with MemoryMeter(device if device.type == "cuda" else None) as meter:
        if m.context is None:
            loss = nn.functional.cross_entropy(m.forward(x), y)
        else:
            with m.context():
                loss = nn.functional.cross_entropy(m.forward(x), y)
        loss.backward()
    _sync(device)
    seconds = time.perf_counter() - t0
    m.peak = max(m.peak, meter.peak_saved_bytes)
    if meter.peak_cuda_bytes is not None:
        m.cuda_peak = max(m.cuda_peak or 0, meter.peak_cuda_bytes)
    return seconds


def _grads(model: nn.Module) -> List[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _same(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def _rel_error(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    num = math.sqrt(sum(float((u - v).double().square().sum()) for u, v in zip(a, b)))
    den = math.sqrt(sum(float(v.double().square().sum()) for v in b))
    return num / den if den else 0.0


def warm_up(model: nn.Module, state: Dict[str, torch.Tensor], methods: Sequence[Method], x: torch.Tensor,
            y: torch.Tensor, base_grads: List[torch.Tensor]) -> None:
    """One untimed step of each method: its peak, and its gradients against the plain model's."""
    for m in methods:
        step(model, state, m, x, y)
        grads = _grads(model)
        m.bit_identical, m.grad_rel_error = _same(grads, base_grads), _rel_error(grads, base_grads)


def rounds(model: nn.Module, state: Dict[str, torch.Tensor], methods: Sequence[Method], x: torch.Tensor,
           y: torch.Tensor, repeats: int, after_round: Callable[[int], None]) -> None:
    """``repeats`` timed rounds, one step of every method per round (the first method,
    no saving, is each round's reference): a change of the machine's load between rounds
    reaches every method alike, and each ratio compares steps of the same round. The order
    inside a round rotates, so no method always follows the same one. ``after_round(i)`` runs
    after round ``i`` (the caller writes what is measured so far)."""
    for i in range(repeats):
        order = [methods[(j + i) % len(methods)] for j in range(len(methods))]
        took = {id(m): step(model, state, m, x, y) for m in order}
        for m in methods:
            m.times.append(took[id(m)])
            m.ratios.append(took[id(m)] / took[id(methods[0])])
        after_round(i)


def record(m: Method, model_name: str, base: Optional[Method] = None) -> Dict[str, Any]:
    """The JSON record of a method with the rounds measured so far. ``time_ratio`` is its median
    step over ``base``'s (no saving's) median step: the ratio of the two figures the table
    prints, which a reader can check; ``round_ratio`` is the median of the ratios of steps
    timed in the same round (a load change between rounds cancels in it), with the middle half
    of those ratios in ``round_ratio_span``."""
    base = m if base is None else base
    step_s = statistics.median(m.times) if m.times else None
    base_s = statistics.median(base.times) if base.times else None
    r: Dict[str, Any] = {"method": m.label, "kind": m.kind, "model": model_name, "peak_bytes": m.peak,
                         "cuda_peak_bytes": m.cuda_peak, "step_s": step_s,
                         "step_s_repeats": list(m.times), "rounds": len(m.times),
                         "time_ratio": step_s / base_s if step_s is not None and base_s else None,
                         "round_ratio": statistics.median(m.ratios) if m.ratios else None,
                         "round_ratio_span": list(spread.middle_half(m.ratios)) if m.ratios else None,
                         "bit_identical": m.bit_identical, "grad_rel_error": m.grad_rel_error}
    r.update(m.extra)
    return r


def table(records: Sequence[Dict[str, Any]]) -> str:
    """The records as an aligned table (column widths from the longest label), then what the
    two ratio columns mean."""
    head = ("method", "peak saved", "step", "x no saving", "same round", "gradients")

    def same_round(r: Dict[str, Any]) -> str:
        if r.get("round_ratio") is None:
            return "-"
        span = r.get("round_ratio_span")
        return f"{r['round_ratio']:.2f}x" + (f" ({spread.fmt_span(span, '.2f')})" if span else "")

    rows = [(r["method"], f"{r['peak_bytes'] / 2**20:.2f} MiB",
             "-" if r["step_s"] is None else f"{r['step_s'] * 1e3:.1f} ms",
             "-" if r["time_ratio"] is None else f"{r['time_ratio']:.2f}x", same_round(r),
             "bit-identical" if r["bit_identical"] else f"grad err {r['grad_rel_error']:.1e}") for r in records]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i in (0, 5) else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    legend = textwrap.wrap(
        "step: the median over the rounds; x no saving: that median over no saving's (step / no saving's step); "
        "same round: the median of each round's step over no saving's step in the same round (a load change "
        "between rounds cancels in it), in brackets the middle half of those ratios.", 98)
    return "\n".join(["  " + line(head)] + ["  " + line(row) for row in rows] + [""] + ["  " + t for t in legend])


def _checkpointed(model: nn.Sequential, segments: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(inp: torch.Tensor) -> torch.Tensor:
        # reentrant checkpointing needs an input that requires grad, or it leaves every gradient
        # None; "* 1" makes it an activation, which the meter counts where checkpoint stores it
        # (a leaf that requires grad would pass for a parameter)
        return checkpoint_sequential(model, segments, inp.detach().requires_grad_() * 1, use_reentrant=True)
    return forward


def _codec_context(codec: str) -> Callable[[], Any]:
    return lambda: compressed_activations(codec)


def _replan(plan: Any, budget: int) -> Optional[Any]:
    """The measured plan solved again at another budget (no second measurement); None when no
    schedule fits."""
    blocks = sch.solve(plan.costs, int(budget), recompute=True)
    if blocks is None:
        least, blocks = sch.min_peak(plan.costs, recompute=True)
        if least > budget:
            return None
    return Plan(plan.costs, blocks, int(budget), plan.names, plan.fingerprint, plan.device, plan.notes)


def run_model(name: str, args, device: torch.device,
              write: Callable[[Dict[str, Any]], None] = lambda res: None) -> Dict[str, Any]:
    """Every method on chain ``name``; ``write(result)`` is called with the results so far
    after the warm-up and after every timed round."""
    model, x, y, desc = build(name, device, args.scale)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    n = len(model)
    print(f"model    {desc} ({n} stages)", flush=True)
    base = Method("no saving", "none", model)
    methods = [base]
    for segments in sorted({2, 4, max(1, round(math.sqrt(n)))}):
        methods.append(Method(f"checkpoint_sequential({segments})", "checkpoint", _checkpointed(model, segments),
                              segments=segments))
    if device.type == "cuda":
        methods.append(Method("save_on_cpu", "offload", model,
                              context=lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)))
    for codec in args.codecs:
        methods.append(Method(f"compressed_activations({codec})", "codec", model,
                              context=_codec_context(codec), codec=codec))
    step(model, state, base, x, y)
    base_grads = _grads(model)
    warm_up(model, state, methods[1:], x, y, base_grads)
    base_peak = base.peak
    result = {"model": name, "description": desc, "stages": n, "records": [], "complete": False}

    def publish() -> None:
        result["records"] = [record(m, name, base) for m in methods]
        write(result)

    # the planner: each variant measured once (at a budget every schedule meets), then solved
    # at each budget
    budgets = [(f"{f:g} of no saving", int(base_peak * f)) for f in args.budgets]
    budgets += [(f"checkpoint_sequential({m.extra['segments']})'s peak", m.peak) for m in methods
                if m.kind == "checkpoint"]
    allow = ("recompute", "compress") + (("offload",) if device.type == "cuda" else ())
    lossy = "+".join(args.plan_codecs)
    planned: List[Method] = []
    for variant, codecs in (("lossless", ("lossless",)), (lossy, tuple(["lossless"] + args.plan_codecs))):
        model.load_state_dict(state)
        t0 = time.perf_counter()
        try:
            measured = plan_memory(model, x, base_peak, allow=allow, codecs=codecs, repeats=args.plan_repeats)
        except ValueError as exc:  # this chain or codec cannot be planned: the other methods still run
            print(f"  plan {variant}: {exc}", flush=True)
            continue
        measure_s = time.perf_counter() - t0  # plan_s: measuring the chain, shared by the variant's budgets
        for label, budget in budgets:
            plan = _replan(measured, budget)
            if plan is None:
                print(f"  plan {variant} at {label}: no schedule fits {budget} bytes", flush=True)
                continue
            planned.append(Method(f"plan {variant} @ {label}", f"plan-{variant}", plan.apply(model),
                                  budget_bytes=budget, budget_label=label, plan_s=measure_s,
                                  predicted_peak_bytes=plan.predicted_peak,
                                  predicted_time_ratio=plan.predicted_time / max(plan.baseline_time, 1e-12),
                                  decisions=[{k: d[k] for k in ("mode", "forward_runs")} for d in plan.decisions()]))
    warm_up(model, state, planned, x, y, base_grads)
    for m in planned:
        m.extra["predicted_error"] = (m.peak - m.extra["predicted_peak_bytes"]) / max(m.extra["predicted_peak_bytes"], 1)
    methods += planned
    publish()
    t_start = time.perf_counter()

    def after_round(i: int) -> None:
        publish()
        print(f"  round {i + 1}/{args.repeats}: one step of each of {len(methods)} methods "
              f"({time.perf_counter() - t_start:.0f} s so far)", flush=True)

    rounds(model, state, methods, x, y, args.repeats, after_round)
    result["complete"] = True
    publish()
    model.load_state_dict(state)
    print(table(result["records"]), flush=True)
    return result


def solve_time(device: torch.device) -> Dict[str, Any]:
    """Seconds to plan a 100-stage chain: measuring it, and the dynamic programme alone."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(100)]).to(device)
    x = torch.randn(32, 64, device=device)
    costs, _ = profile(model, x, ["keep", "compress:int8"], repeats=1)
    peak = sch.total_peak([sch.Plain(i) for i in range(100)], costs)
    runs = []
    for frac in (0.5, 0.25, 0.1):
        t0 = time.perf_counter()
        sch.solve(costs, int(peak * frac))
        runs.append(time.perf_counter() - t0)
    return {"stages": 100, "modes": 2, "slots": 500, "solve_s": runs, "solve_s_max": max(runs)}


# ---- accuracy with lossy codecs on the training benchmark's data -----------------------------
def accuracy(args, device: torch.device) -> List[Dict[str, Any]]:
    from .train import _data

    xtr, ytr, xte, yte = (t.to(device) for t in _data(0))
    out = []

    def chain() -> nn.Sequential:  # 16 stages: a stem, 14 residual blocks, a head
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 256), *[_ResidualMLP(256) for _ in range(14)],
                             nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 10))).to(device)

    def train(model: nn.Module, context: Optional[Callable[[], Any]]) -> float:
        opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
        g = torch.Generator().manual_seed(0)
        for _ in range(args.accuracy_epochs):
            order = torch.randperm(xtr.shape[0], generator=g).to(device)
            for i in range(0, xtr.shape[0], 64):
                idx = order[i:i + 64]
                opt.zero_grad()
                if context is None:
                    loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
                else:
                    with context():
                        loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
                loss.backward()
                opt.step()
        with torch.no_grad():
            return float((model(xte).argmax(1) == yte).float().mean())

    base = train(chain(), None)
    out.append({"method": "no saving", "test_accuracy": base})
    print(f"  {'no saving':<34} test accuracy {100 * base:.2f} %", flush=True)
    def codec_context(c: str) -> Callable[[], Any]:
        return lambda: compressed_activations(c, min_numel=1024)

    for codec in args.codecs:
        acc = train(chain(), codec_context(codec))
        out.append({"method": f"compressed_activations({codec})", "test_accuracy": acc})
        print(f"  {'compressed_activations(' + codec + ')':<34} test accuracy {100 * acc:.2f} % "
              f"({100 * (acc - base):+.2f} pp)", flush=True)
    model = chain()
    xb = xtr[:64]
    with MemoryMeter() as meter:
        nn.functional.cross_entropy(model(xb), ytr[:64]).backward()
    for p in model.parameters():
        p.grad = None
    lossy = "+".join(args.plan_codecs)
    codecs = tuple(["lossless"] + args.plan_codecs)
    try:
        plan = plan_memory(model, xb, meter.peak_saved_bytes // 4, allow=("recompute", "compress"), codecs=codecs,
                           repeats=1)
        at = "0.25 of no saving"
    except BudgetTooSmall as exc:  # a quarter is out of reach: the least memory any plan needs
        plan = plan_memory(model, xb, exc.smallest_budget, allow=("recompute", "compress"), codecs=codecs, repeats=1)
        at = f"its smallest budget, {exc.smallest_budget / meter.peak_saved_bytes:.2f} of no saving"
    acc = train(plan.apply(model), None)
    label = f"plan {lossy} @ {at}"
    modes = sorted({d["mode"] for d in plan.decisions()})
    out.append({"method": label, "test_accuracy": acc, "modes": modes})
    print(f"  {label:<34} test accuracy {100 * acc:.2f} % ({100 * (acc - base):+.2f} pp; stages: {', '.join(modes)})",
          flush=True)
    return out


# ---- the plot ------------------------------------------------------------------------------------
def frontier_plot(results: List[Dict[str, Any]], path: str, title: str) -> None:
    from .plot import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6.2 * len(results), 5.6), squeeze=False)
    styles = {"none": ("black", "o"), "checkpoint": ("tab:red", "s"), "offload": ("tab:purple", "D"),
              "codec": ("tab:orange", "^")}
    labels: List[Any] = []
    for ax, res in zip(axes[0], results):
        recs = [r for r in res["records"] if r.get("time_ratio") is not None]
        for kind, (color, marker) in styles.items():
            pts = [r for r in recs if r["kind"] == kind]
            for r in pts:
                ax.scatter(r["peak_bytes"] / 2**20, r["time_ratio"], color=color, marker=marker, s=46, zorder=3)
                labels.append(ax.annotate(
                    r["method"].replace("compressed_activations", "").replace("checkpoint_sequential", "ckpt"),
                    (r["peak_bytes"] / 2**20, r["time_ratio"]), textcoords="offset points", xytext=(5, 4),
                    fontsize=7, color=color))
        lossy = "+".join(res.get("plan_codecs", ["int8"]))
        for kind, color in (("plan-lossless", "tab:blue"), (f"plan-{lossy}", "tab:green")):
            pts = sorted((r for r in recs if r["kind"] == kind), key=lambda r: r["peak_bytes"])
            if pts:
                ax.plot([r["peak_bytes"] / 2**20 for r in pts], [r["time_ratio"] for r in pts], "-o", color=color,
                        ms=5, lw=1.5, zorder=2, label=kind.replace("plan-", "plan_memory, "))
        for kind, (color, marker) in styles.items():
            if any(r["kind"] == kind for r in recs):
                ax.scatter([], [], color=color, marker=marker, label={"none": "no saving", "checkpoint":
                           "checkpoint_sequential", "offload": "save_on_cpu", "codec": "compressed_activations"}[kind])
        ax.set_xlabel("peak saved activations (MiB)")
        ax.set_ylabel("median step time / no saving's")
        ax.set_xlim(left=0)
        ax.set_title(res["model"], fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=min(0.95, ax.get_ylim()[0]))
        ax.margins(x=0.08)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    place_labels(fig, labels)  # after the layout: it fixes where the points are drawn
    fig.savefig(path, dpi=130)
    plt.close(fig)


# where a point's label may go, in points from the point, tried in turn
_OFFSETS = ((5, 4), (5, -10), (-5, 4), (-5, -10), (5, 14), (5, -20), (-5, 14), (-5, -20), (5, 24), (5, -30))


def place_labels(fig: Any, labels: Sequence[Any]) -> None:
    """Move each point label to the first offset where it overlaps no label placed before it
    (two methods with nearly the same peak and time, such as two checkpoint_sequential
    segmentations, no longer print on top of each other); the last offset when none is free."""
    fig.draw_without_rendering()  # settles the axes' limits, which place the points
    renderer = fig.canvas.get_renderer()
    placed: List[Any] = []
    for text in labels:
        for dx, dy in _OFFSETS:
            text.set_position((dx, dy))
            text.set_horizontalalignment("left" if dx > 0 else "right")
            box = text.get_window_extent(renderer).expanded(1.05, 1.15)
            if not any(box.overlaps(other) for other in placed):
                break
        placed.append(text.get_window_extent(renderer))


# ---- command line ------------------------------------------------------------------------------
DEFAULT_JSON, DEFAULT_PLOT = "gradcomp-bench-memory.json", "gradcomp-bench-memory.png"
DEFAULT_SCALE = 0.25  # batch scale: the default run stays under 2 minutes on 2 cores; 1: bench/results/memory.md


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gradcomp.bench memory",
                                description="Activation memory against step time: no saving, checkpoint_sequential, "
                                            "save_on_cpu (CUDA), plan_memory at several budgets, compressed "
                                            "activations per codec; one process. The methods are timed in rounds, "
                                            "one step of each per round, and the results are written after every "
                                            f"round (with neither --json nor --plot: {DEFAULT_JSON} and "
                                            f"{DEFAULT_PLOT} in the current directory).")
    p.add_argument("--model", default="all", choices=MODELS + ("all",), help="the chain (default: all three)")
    p.add_argument("--scale", type=float, default=DEFAULT_SCALE, metavar="F",
                   help=f"batch size as a multiple of the chain's full batch (default {DEFAULT_SCALE:g}: MLP 64, "
                        "ResNet-like 8, transformer-like 2; 1 for the sizes of bench/results/memory.md)")
    p.add_argument("--budgets", default="0.5,0.25", metavar="F,F",
                   help="planner budgets as fractions of the no-saving peak (default 0.5,0.25); the peak of each "
                        "checkpoint_sequential run is added")
    p.add_argument("--codecs", default="lossless,bf16,int8", metavar="A,B",
                   help="codecs for compressed_activations (default lossless,bf16,int8; all: "
                        "lossless,fp16,bf16,int8,int4,int2)")
    p.add_argument("--plan-codecs", default="bf16,int8", metavar="A,B",
                   help="the lossy codecs the second planner variant may use besides lossless (default bf16,int8)")
    p.add_argument("--repeats", type=int, default=3, metavar="N",
                   help="timed rounds, one step of every method each (median; default 3), after one warm-up step")
    p.add_argument("--plan-repeats", type=int, default=1, metavar="N",
                   help="timed runs per stage and mode when the planner measures the chain, once per variant "
                        "(default 1)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the chain runs (default: cuda when available, else cpu)")
    p.add_argument("--threads", type=int, default=0, metavar="N", help="torch threads (default: torch's choice)")
    p.add_argument("--accuracy", action="store_true",
                   help="also train a 16-stage MLP on digits with each codec and a lossy plan (test accuracy)")
    p.add_argument("--accuracy-epochs", type=int, default=10, metavar="N",
                   help="epochs of each --accuracy training run (default 10)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON, after every round")
    p.add_argument("--plot", metavar="FILE.png", help="draw the memory-time frontier (needs matplotlib)")
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    if args.json is None and args.plot is None:  # nothing named: write both beside the caller, as the main job does
        args.json = DEFAULT_JSON
        args.plot = DEFAULT_PLOT if importlib.util.find_spec("matplotlib") else None
    try:
        args.budgets = [float(f) for f in args.budgets.split(",") if f]
    except ValueError:
        raise ValueError(f"--budgets {args.budgets!r}: give fractions such as 0.5,0.25") from None
    if not all(0 < f for f in args.budgets):
        raise ValueError("--budgets: every fraction must be > 0")
    if not args.scale > 0:
        raise ValueError(f"--scale must be > 0, not {args.scale}")
    args.codecs = [c for c in args.codecs.split(",") if c]
    from gradcomp.memory import get_codec

    args.plan_codecs = [c for c in args.plan_codecs.split(",") if c]
    for c in args.codecs + args.plan_codecs:
        get_codec(c)
    if args.repeats < 1 or args.plan_repeats < 1:
        raise ValueError("--repeats and --plan-repeats must be >= 1")
    if args.plot:
        from .plot import _pyplot

        _pyplot()  # no matplotlib: say so before the run, not after it
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a device torch knows (cpu, cuda, cuda:1 ...)") from None
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        raise ValueError(f"--device {args.device}: this machine has no such CUDA device (torch {torch.__version__}, "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} GPUs visible); leave "
                         f"--device out to run on the CPU")
    env = envmod.environment(1, "none (one process)", torch.get_num_threads())
    print(envmod.header(env, [f"device {device}; {args.repeats} timed rounds (one step of every method each, "
                              f"after a warm-up step), median; peak saved activations from MemoryMeter"]), flush=True)
    models = MODELS if args.model == "all" else (args.model,)
    results: List[Dict[str, Any]] = []
    out: Dict[str, Any] = {"env": env, "results": results, "solve": None, "accuracy": None, "complete": False}

    def write(current: Optional[Dict[str, Any]] = None) -> None:
        if args.json:  # the whole file each time, through a temporary one: a stop leaves the last round's
            out["results"] = results + ([current] if current is not None else [])
            tmp = args.json + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(out, f, indent=1)
            os.replace(tmp, args.json)

    try:
        for name in models:
            res = run_model(name, args, device, write=lambda r: write(dict(r, plan_codecs=args.plan_codecs)))
            res["plan_codecs"] = args.plan_codecs
            results.append(res)
            write()
        st = solve_time(device)
        out["solve"] = st
        print(f"planner  100-stage chain, 2 modes, 500 slots: dynamic programme {1e3 * st['solve_s_max']:.0f} ms "
              f"(slowest of 3 budgets)", flush=True)
        out["accuracy"] = accuracy(args, device) if args.accuracy else None
        out["complete"] = True
        write()
    except KeyboardInterrupt:
        if args.json:
            print(f"\ninterrupted: {args.json} holds the rounds measured so far", file=sys.stderr)
        raise
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        frontier_plot(results, args.plot, f"activation memory vs step time ({device}, {env['cpu']})")
        print(f"wrote {args.plot}")
    return 0
