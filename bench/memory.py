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
``torch.cuda.max_memory_allocated``), the median step time over ``--repeats`` steps after a
warm-up, and whether the gradients equal the plain model's. ``--accuracy`` also trains a
16-stage residual MLP on the training benchmark's data (scikit-learn's digits) with each
codec and a lossy plan, and reports test accuracy against the plain model's. The planner's solve time for a
100-stage chain is measured too. ``--plot`` draws the memory-time frontier.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from gradcomp.memory import BudgetTooSmall, MemoryMeter, compressed_activations, plan_memory
from gradcomp.memory import schedule as sch
from gradcomp.memory.planner import profile

from . import env as envmod

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
        w, n, b = 512, 24, int(256 * scale)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(w, w), nn.ReLU()) for _ in range(n)], nn.Linear(w, 10))
        x, desc = torch.randn(b, w), f"MLP: {n} x (Linear {w}-{w} + ReLU) + Linear {w}-10, batch {b}"
    elif name == "resnet-like":
        c, n, b, hw = 32, 16, int(32 * scale), 32
        model = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), *[_Residual(c) for _ in range(n)],
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))
        x, desc = torch.randn(b, 3, hw, hw), f"ResNet-like: stem + {n} residual blocks of {c} channels at {hw}x{hw}, batch {b}"
    elif name == "transformer-like":
        d, n, b, s = 256, 16, int(8 * scale), 128
        model = nn.Sequential(*[_Block(d, 4) for _ in range(n)], nn.Flatten(1), nn.Linear(s * d, 10))
        x, desc = torch.randn(b, s, d), f"transformer-like: {n} pre-norm blocks, d={d}, 4 heads, sequence {s}, batch {b}"
    else:
        raise ValueError(f"--model {name!r}: choose one of {', '.join(MODELS)}")
    y = torch.randint(0, 10, (x.shape[0],))
    return model.to(device), x.to(device), y.to(device), desc


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model: nn.Module, x: torch.Tensor, y: torch.Tensor, forward: Callable[[torch.Tensor], torch.Tensor],
            repeats: int, warmup: int = 1, context: Optional[Callable[[], Any]] = None) -> Dict[str, Any]:
    """Steps of forward and backward (gradients zeroed, no optimizer step, so every step is
    the same): peak saved bytes, CUDA peak, median seconds, the gradients of the last."""
    device = x.device
    times, peak, cuda_peak = [], 0, None
    for i in range(warmup + repeats):
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(1)
        _sync(device)
        t0 = time.perf_counter()
        with MemoryMeter(device if device.type == "cuda" else None) as meter:
            if context is None:
                loss = nn.functional.cross_entropy(forward(x), y)
                loss.backward()
            else:
                with context():
                    loss = nn.functional.cross_entropy(forward(x), y)
                loss.backward()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        peak = max(peak, meter.peak_saved_bytes)
        if meter.peak_cuda_bytes is not None:
            cuda_peak = max(cuda_peak or 0, meter.peak_cuda_bytes)
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    return {"peak_bytes": peak, "cuda_peak_bytes": cuda_peak, "step_s": statistics.median(times),
            "step_s_repeats": times, "grads": grads}


def _same(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b))


def _rel_error(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    num = math.sqrt(sum(float((u - v).double().square().sum()) for u, v in zip(a, b)))
    den = math.sqrt(sum(float(v.double().square().sum()) for v in b))
    return num / den if den else 0.0


def run_model(name: str, args, device: torch.device) -> Dict[str, Any]:
    model, x, y, desc = build(name, device)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    n = len(model)
    records: List[Dict[str, Any]] = []
    print(f"model    {desc} ({n} stages)", flush=True)

    def add(method: str, kind: str, forward, context=None, **extra) -> Dict[str, Any]:
        model.load_state_dict(state)
        r = measure(model, x, y, forward, args.repeats, context=context)
        grads = r.pop("grads")
        r.update(method=method, kind=kind, model=name, **extra)
        r["bit_identical"] = _same(grads, base_grads) if records else True
        r["grad_rel_error"] = _rel_error(grads, base_grads) if records else 0.0
        r["time_ratio"] = r["step_s"] / records[0]["step_s"] if records else 1.0
        records.append(r)
        same = "bit-identical" if r["bit_identical"] else "grad err %.1e" % r["grad_rel_error"]
        print(f"  {method:<40} {r['peak_bytes'] / 2**20:9.2f} MiB  {r['step_s'] * 1e3:9.1f} ms  "
              f"{r['time_ratio']:5.2f}x  {same}", flush=True)
        return r

    model.load_state_dict(state)
    base = measure(model, x, y, model, args.repeats)
    base_grads = base.pop("grads")
    base.update(method="no saving", kind="none", model=name, bit_identical=True, grad_rel_error=0.0, time_ratio=1.0)
    records.append(base)
    print(f"  {'no saving':<40} {base['peak_bytes'] / 2**20:9.2f} MiB  {base['step_s'] * 1e3:9.1f} ms  1.00x", flush=True)
    base_peak = base["peak_bytes"]

    ckpt_peaks = []
    for segments in sorted({2, 4, max(1, round(math.sqrt(n)))}):
        # reentrant checkpointing needs an input that requires grad, or it leaves every gradient
        # None; "* 1" makes it an activation, which the meter counts where checkpoint stores it
        # (a leaf that requires grad would pass for a parameter)
        r = add(f"checkpoint_sequential({segments})", "checkpoint",
                lambda inp, s=segments: checkpoint_sequential(model, s, inp.detach().requires_grad_() * 1,
                                                              use_reentrant=True),
                segments=segments)
        ckpt_peaks.append((segments, r["peak_bytes"]))
    if device.type == "cuda":
        add("save_on_cpu", "offload", model, context=lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))
    for codec in args.codecs:
        add(f"compressed_activations({codec})", "codec", model,
            context=lambda c=codec: compressed_activations(c), codec=codec)

    budgets = [(f"{f:g} of no saving", int(base_peak * f)) for f in args.budgets]
    budgets += [(f"checkpoint_sequential({s})'s peak", p) for s, p in ckpt_peaks]
    allow_offload = ("offload",) if device.type == "cuda" else ()
    lossy = "+".join(args.plan_codecs)
    for variant, codecs in (("lossless", ("lossless",)), (lossy, tuple(["lossless"] + args.plan_codecs))):
        for label, budget in budgets:
            model.load_state_dict(state)
            t0 = time.perf_counter()
            try:
                plan = plan_memory(model, x, budget, allow=("recompute", "compress") + allow_offload, codecs=codecs,
                                   repeats=args.plan_repeats)
            except ValueError as exc:
                print(f"  plan {variant} at {label}: {exc}")
                continue
            planned = plan.apply(model)
            r = add(f"plan {variant} @ {label}", f"plan-{variant}", planned, budget_bytes=budget, budget_label=label,
                    plan_s=time.perf_counter() - t0, predicted_peak_bytes=plan.predicted_peak,
                    predicted_time_ratio=plan.predicted_time / max(plan.baseline_time, 1e-12),
                    decisions=[{k: d[k] for k in ("mode", "forward_runs")} for d in plan.decisions()])
            r["predicted_error"] = (r["peak_bytes"] - plan.predicted_peak) / max(plan.predicted_peak, 1)
    model.load_state_dict(state)
    return {"model": name, "description": desc, "stages": n, "records": records}


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
    for ax, res in zip(axes[0], results):
        recs = res["records"]
        for kind, (color, marker) in styles.items():
            pts = [r for r in recs if r["kind"] == kind]
            for r in pts:
                ax.scatter(r["peak_bytes"] / 2**20, r["time_ratio"], color=color, marker=marker, s=46, zorder=3)
                ax.annotate(r["method"].replace("compressed_activations", "").replace("checkpoint_sequential", "ckpt"),
                            (r["peak_bytes"] / 2**20, r["time_ratio"]), textcoords="offset points",
                            xytext=(5, -9 if kind == "checkpoint" else 4), fontsize=7, color=color)
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
        ax.set_ylabel("step time / no saving")
        ax.set_xlim(left=0)
        ax.set_title(res["model"], fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=min(0.95, ax.get_ylim()[0]))
        ax.margins(x=0.08)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ---- command line ------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gradcomp.bench memory",
                                description="Activation memory against step time: no saving, checkpoint_sequential, "
                                            "save_on_cpu (CUDA), plan_memory at several budgets, compressed "
                                            "activations per codec; one process.")
    p.add_argument("--model", default="all", choices=MODELS + ("all",), help="the chain (default: all three)")
    p.add_argument("--budgets", default="0.5,0.25", metavar="F,F",
                   help="planner budgets as fractions of the no-saving peak (default 0.5,0.25); the peak of each "
                        "checkpoint_sequential run is added")
    p.add_argument("--codecs", default="lossless,fp16,bf16,int8,int4,int2", metavar="A,B",
                   help="codecs for compressed_activations (default: all)")
    p.add_argument("--plan-codecs", default="bf16,int8", metavar="A,B",
                   help="the lossy codecs the second planner variant may use besides lossless (default bf16,int8)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per method (median; default 5)")
    p.add_argument("--plan-repeats", type=int, default=3, help="timed runs per stage when planning (default 3)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--accuracy", action="store_true", help="also train a 16-stage MLP on digits with each lossy method")
    p.add_argument("--accuracy-epochs", type=int, default=10)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE.png")
    return p


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    try:
        args.budgets = [float(f) for f in args.budgets.split(",") if f]
    except ValueError:
        raise ValueError(f"--budgets {args.budgets!r}: give fractions such as 0.5,0.25") from None
    if not all(0 < f for f in args.budgets):
        raise ValueError("--budgets: every fraction must be > 0")
    args.codecs = [c for c in args.codecs.split(",") if c]
    from gradcomp.memory import get_codec

    args.plan_codecs = [c for c in args.plan_codecs.split(",") if c]
    for c in args.codecs + args.plan_codecs:
        get_codec(c)
    if args.repeats < 1 or args.plan_repeats < 1:
        raise ValueError("--repeats and --plan-repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    env = envmod.environment(1, "none (one process)", torch.get_num_threads())
    print(envmod.header(env, [f"device {device}; {args.repeats} timed steps per method after 1 warm-up, median; "
                              f"peak saved activations from MemoryMeter"]), flush=True)
    models = MODELS if args.model == "all" else (args.model,)
    results = []
    for name in models:
        res = run_model(name, args, device)
        res["plan_codecs"] = args.plan_codecs
        results.append(res)
    st = solve_time(device)
    print(f"planner  100-stage chain, 2 modes, 500 slots: dynamic programme {1e3 * st['solve_s_max']:.0f} ms "
          f"(slowest of 3 budgets)", flush=True)
    acc = accuracy(args, device) if args.accuracy else None
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"env": env, "results": results, "solve": st, "accuracy": acc}, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        frontier_plot(results, args.plot, f"activation memory vs step time ({device}, {env['cpu']})")
        print(f"wrote {args.plot}")
    return 0
