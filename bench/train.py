"""The training benchmark: ``python -m gradcomp.bench train [--model mlp|transformer]``.

``--model mlp`` (the default): a small MLP learns scikit-learn's handwritten digits (1,797 8x8 images shipped with the
package, nothing downloaded) on several gloo ranks under ``DistributedDataParallel``, once
per method: gradcomp's DDP hook with each chosen compressor, with and without error feedback,
and PyTorch's own ``allreduce_hook``, ``fp16_compress_hook`` and ``powerSGD_hook``. Every run
starts from the same weights and sees the same batches. Reported: final test accuracy (and
its difference to PyTorch's allreduce), time per step (slowest rank, median), bytes sent per
rank per step (gradcomp's telemetry; for PyTorch's hooks, what they hand to ``all_reduce``,
counted the same way), and loss curves.

``--model transformer``: a small character-level transformer language model learns Python
source, the standard library's own files (:mod:`gradcomp.bench.text`; split by file), with
AdamW, a fixed number of steps and the same windows of text for every method; the methods
take turns step by step, so that load on a shared machine slows them alike. Reported:
final validation loss (nats per character, on held-out files; the unigram baseline beside
it), its difference to PyTorch's allreduce, time per step, bytes, and loss curves. Error
feedback by default where ``error_feedback="auto"`` puts it (the biased compressors but the
16-bit casts).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from . import cli, hooks
from .collective import parse_entry
from . import env as envmod

DEFAULT_COMPRESSORS = "topk,efsignsgd,onebit,qsgd,powersgd"
LM_COMPRESSORS = "fp16,powersgd,onebit,topk"  # --model transformer: EF as "auto" decides
# --model mlp / transformer: the defaults of the options that differ
MODEL_DEFAULTS = {"mlp": {"compressors": DEFAULT_COMPRESSORS, "error_feedback": "both", "lr": 0.05, "batch_size": 32},
                  "transformer": {"compressors": LM_COMPRESSORS, "error_feedback": "auto", "lr": 2e-3,
                                  "batch_size": 16}}
TORCH_METHODS = ("torch-allreduce", "torch-fp16", "torch-powersgd")
REFERENCE = "torch-allreduce"
POWERSGD_RANK = 4
# PyTorch's PowerSGD hook cannot compress before its 3rd step (start_powerSGD_iter >= 2 with
# error feedback); ours starts at the same step so that the two are compared like for like.
POWERSGD_START = 2
BUCKET_MB = 25


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gradcomp.bench train",
        description="Train a small real model on several ranks with each compressor and with PyTorch's own DDP "
                    "hooks; compare accuracy (or validation loss), step time and bytes. --model mlp: an MLP on "
                    "scikit-learn's digits; --model transformer: a character-level transformer language model on "
                    "the Python standard library's source files.")
    p.add_argument("--model", default="mlp", choices=tuple(MODEL_DEFAULTS),
                   help="mlp (digits, the default) or transformer (stdlib source, character level)")
    p.add_argument("--compressors", default=None, metavar="A,B,C",
                   help=f"gradcomp compressors, each NAME or NAME:opt=value (default {DEFAULT_COMPRESSORS}; "
                        f"transformer: {LM_COMPRESSORS})")
    p.add_argument("--error-feedback", default=None, choices=("both", "on", "off", "auto"),
                   help="run each compressor with error feedback, without, both (the mlp default) or as "
                        "error_feedback='auto' decides (the transformer default: on where biased, off for fp16)")
    p.add_argument("--no-torch", action="store_true", help=f"skip PyTorch's hooks ({', '.join(TORCH_METHODS)})")
    p.add_argument("--epochs", type=int, default=20, metavar="N", help="mlp: epochs per run (default 20)")
    p.add_argument("--steps", type=int, default=150, metavar="N", help="transformer: steps per run (default 150)")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="batch size per rank (default 32; transformer: 16 sequences)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (mlp: SGD, default 0.05, momentum 0.9; transformer: AdamW, default 0.002, "
                        "warm-up then cosine decay to a tenth)")
    p.add_argument("--hidden", type=int, default=512, metavar="N", help="mlp: hidden width of the 3-layer MLP (default 512)")
    lm_options(p, "transformer: ")
    p.add_argument("--eval-every", type=int, default=25, metavar="N",
                   help="transformer: steps between validation losses (default 25)")
    p.add_argument("--val-windows", type=int, default=256, metavar="N",
                   help="transformer: validation sequences, shared among the ranks (default 256)")
    cli.common_options(p)
    return p


def lm_options(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """The character transformer's size and text options (``bench train --model transformer``,
    ``bench diloco``); each help text starts with ``prefix``."""
    p.add_argument("--layers", type=int, default=2, metavar="N", help=f"{prefix}blocks (default 2)")
    p.add_argument("--d-model", type=int, default=128, metavar="N", help=f"{prefix}width (default 128)")
    p.add_argument("--heads", type=int, default=4, metavar="N", help=f"{prefix}attention heads (default 4)")
    p.add_argument("--context", type=int, default=64, metavar="N",
                   help=f"{prefix}characters per sequence (default 64)")
    p.add_argument("--text-mb", type=float, default=2.0, metavar="MB",
                   help=f"{prefix}MB of training text (default 2; validation: about a ninth of it, other files)")


def methods(args) -> List[Dict[str, Any]]:
    """Run specs in the order they are reported: PyTorch's first, then gradcomp's."""
    from gradcomp.compress import get_compressor

    out: List[Dict[str, Any]] = []
    if not args.no_torch:
        out += [{"label": k if k != "torch-powersgd" else f"{k}:rank={POWERSGD_RANK}", "kind": k, "source": "torch",
                 "options": {"rank": POWERSGD_RANK} if k == "torch-powersgd" else {},
                 "ef": k == "torch-powersgd"} for k in TORCH_METHODS]
    from gradcomp.compress import wants_feedback

    for entry in [e for e in args.compressors.split(",") if e.strip()]:
        name, opts = parse_entry(entry)
        if name == "powersgd":
            opts.setdefault("rank", POWERSGD_RANK)
        if name == "auto":  # per bucket, measured (gradcomp.training.auto): it decides error feedback itself
            out.append({"label": "auto" + "".join(f":{k}={v}" for k, v in opts.items()), "kind": "gradcomp",
                        "source": "gradcomp", "name": name, "options": opts, "ef": None})
            continue
        base = get_compressor(name, **opts)  # validate now, in the parent, with one clear error
        policy = {"start_iter": POWERSGD_START} if name == "powersgd" else {}
        efs = {"both": [False, True], "on": [True], "off": [False], "auto": [wants_feedback(base)]}[args.error_feedback]
        for ef in efs:
            label = name + "".join(f":{k}={v}" for k, v in opts.items()) + ("+ef" if ef else "")
            out.append({"label": label, "kind": "gradcomp", "source": "gradcomp", "name": name,
                        "options": {**opts, **policy}, "ef": ef})
    if not out:
        raise ValueError("nothing to run: give --compressors or drop --no-torch")
    return out


# ---- per rank ----------------------------------------------------------------------------------
def _data(seed: int):
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise ValueError("the training benchmark needs scikit-learn: pip install 'gradcomp[bench]'") from None
    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    mean, std = xtr.mean(0), xtr.std(0) + 1e-3  # a few border pixels are always 0
    conv = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return (conv((xtr - mean) / std), torch.tensor(ytr), conv((xte - mean) / std), torch.tensor(yte))


# the header line that names the training benchmark's data (train, optim and sharded print it)
DIGITS_LINE = "data     scikit-learn digits: 1,437 train / 360 test images, 8x8, 10 classes"


def model_line(hidden: int, rest: str) -> str:
    """The header line of the training benchmark's MLP of width ``hidden``, then ``rest``."""
    nparams = sum(p.numel() for p in _model(hidden, 0).parameters())
    return f"model    MLP 64-{hidden}-{hidden}-10 ({nparams:,} parameters), {rest}"


def _model(hidden: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # every run and every rank starts from the same weights
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def epoch_batches(n: int, rank: int, world: int, batch: int, seed: int, epoch: int) -> List[torch.Tensor]:
    """This rank's batches (sample indices) of one epoch: one shuffle of the ``n`` training
    samples, the same on every rank and for every method (``seed``, ``epoch``), dealt round
    robin; every rank gets the same number of full batches."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
    mine = order[rank::world]
    return [mine[s * batch:(s + 1) * batch] for s in range(n // (world * batch))]


def timed_step(forward: Callable, opt, x: torch.Tensor, y: torch.Tensor) -> Tuple[float, float]:
    """One training step of ``forward`` and ``opt`` on ``(x, y)``: its loss and its milliseconds."""
    t0 = time.perf_counter()
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(forward(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach()), (time.perf_counter() - t0) * 1e3


def fit(forward: Callable, model: torch.nn.Module, opt, data, cfg: Dict[str, Any], rank: int, world: int,
        tick: Callable[[], None]) -> Tuple[List[float], List[float], List[float]]:
    """``cfg["epochs"]`` epochs of :func:`epoch_batches`; the losses and step times of every step
    and ``model``'s test accuracy after each epoch."""
    xtr, ytr, xte, yte = data
    losses, times, accuracy = [], [], []
    for epoch in range(cfg["epochs"]):
        for idx in epoch_batches(len(ytr), rank, world, cfg["batch_size"], cfg["seed"], epoch):
            loss, ms = timed_step(forward, opt, xtr[idx], ytr[idx])
            losses.append(loss)
            times.append(ms)
        with torch.no_grad():
            accuracy.append(float((model(xte).argmax(1) == yte).float().mean()))
        tick()
    return losses, times, accuracy


def _train_one(spec, rank, world, cfg, data, tick) -> Dict[str, Any]:
    from gradcomp.collectives import reset_telemetry, telemetry

    model = _model(cfg["hidden"], cfg["seed"])
    ddp = _register(spec, model, cfg)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"], momentum=0.9)
    counter = hooks.CountingAllReduce(world)
    reset_telemetry()
    # PyTorch's hooks keep no telemetry: count what they hand to all_reduce (ours report their own)
    with counter if spec["source"] == "torch" else contextlib.nullcontext():
        losses, times, accuracy = fit(ddp, model, opt, data, cfg, rank, world, tick)
    steps = len(times)
    sent = telemetry()["total"]["bytes_sent"] if spec["source"] == "gradcomp" else counter.nbytes
    # a weight checksum: the ranks' models must stay identical (every rank ends with the same mean)
    checksum = float(sum(p.double().sum() for p in model.parameters()))
    return {"losses": losses, "times_ms": times, "accuracy": accuracy, "bytes_per_step": sent / max(steps, 1),
            "checksum": checksum}


def _register(spec, model: torch.nn.Module, cfg: Dict[str, Any]):
    """``model`` in DDP with the spec's hook, and the counter of what PyTorch's hooks send."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    # one bucket (bucket_cap_mb also sets the first bucket): PyTorch's PowerSGD hook issues collectives
    # from future callbacks, which with several buckets in flight reach gloo in different orders
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    if spec["source"] == "torch":
        state, hook, _ = hooks.torch_hook(spec["kind"], {**spec["options"], "seed": cfg["seed"]})
    else:
        state, hook = hooks.gradcomp_hook(spec, model)
    ddp.register_comm_hook(state, hook)
    return ddp


class _LMRun:
    """One method's run of the transformer, a step at a time: AdamW for ``cfg["steps"]`` steps on
    the windows of :func:`text.train_starts`, the validation loss before the first step and every
    ``cfg["eval_every"]`` steps. The methods take turns step by step (:func:`_lm_rank`), so a
    load spike on a shared machine slows every method alike, not the one that happens to run."""

    def __init__(self, spec: Dict[str, Any], rank: int, world: int, cfg: Dict[str, Any], data) -> None:
        from . import text

        self.spec, self.rank, self.world, self.cfg = spec, rank, world, cfg
        self.train, self.xv, self.yv = data
        self.model = text.model(cfg)
        self.ddp = _register(spec, self.model, cfg)
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=cfg["lr"], weight_decay=0.01)
        steps, warmup = cfg["steps"], max(1, min(10, cfg["steps"] // 10))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: text.lr_at(s, steps, warmup))
        self.counter = hooks.CountingAllReduce(world)
        self.sent = 0.0
        self.losses: List[float] = []
        self.times: List[float] = []
        self.val_curve: List[Tuple[int, float]] = []
        self.validate(0)

    def validate(self, step: int) -> None:
        with torch.no_grad():  # this rank's equal share of the windows: the ranks' mean is the mean
            self.val_curve.append((step, float(torch.nn.functional.cross_entropy(self.model(self.xv), self.yv))))

    def step(self, step: int) -> bool:
        """Train step ``step``; whether a validation loss was taken after it."""
        from gradcomp.collectives import telemetry
        from gradcomp.training import wait_all

        from . import text

        cfg = self.cfg
        x, y = text.batch(self.train, text.train_starts(len(self.train), cfg["context"], self.rank, self.world,
                                                        cfg["batch_size"], cfg["seed"], step), cfg["context"])
        if self.spec["source"] == "torch":
            # PyTorch's hooks keep no telemetry: count what they hand to all_reduce (ours report their own)
            with self.counter:
                loss, ms = timed_step(self.ddp, self.opt, x, y)
        else:
            before = telemetry()["total"]["bytes_sent"]
            loss, ms = timed_step(self.ddp, self.opt, x, y)
            wait_all()  # this method's bytes are all counted before the next method's step
            self.sent += telemetry()["total"]["bytes_sent"] - before
        self.sched.step()
        self.losses.append(loss)
        self.times.append(ms)
        if (step + 1) % cfg["eval_every"] == 0 or step + 1 == cfg["steps"]:
            self.validate(step + 1)
            return True
        return False

    def result(self) -> Dict[str, Any]:
        sent = self.sent if self.spec["source"] == "gradcomp" else self.counter.nbytes
        checksum = float(sum(p.double().sum() for p in self.model.parameters()))
        return {"losses": self.losses, "times_ms": self.times, "val_curve": self.val_curve,
                "bytes_per_step": sent / max(len(self.times), 1), "checksum": checksum}


def _lm_rank(rank: int, world: int, cfg: Dict[str, Any], data, progress: Callable[..., None]) -> List[Dict[str, Any]]:
    """Every method's transformer run, the methods taking turns each step (in a rotating order)."""
    from gradcomp.collectives import reset_telemetry

    reset_telemetry()
    runs = [_LMRun(spec, rank, world, cfg, data) for spec in cfg["methods"]]
    total, done = len(runs) * _evals(cfg), 0
    for step in range(cfg["steps"]):
        k = step % len(runs)
        for run in runs[k:] + runs[:k]:
            if run.step(step):
                done += 1
                progress(done=done, total=total, label=run.spec["label"])
    return [run.result() for run in runs]


def lm_data(cfg: Dict[str, Any], rank: int, world: int):
    """The transformer's text: the training characters and this rank's validation windows."""
    from . import text

    info = text.corpus(int(cfg["text_mb"] * 1e6), cfg["seed"])
    xv, yv = text.batch(info["val"], text.val_starts(len(info["val"]), cfg["context"], cfg["val_windows"], rank,
                                                      world), cfg["context"])
    return info["train"], xv, yv


def _evals(cfg: Dict[str, Any]) -> int:
    return cfg["steps"] // cfg["eval_every"] + (cfg["steps"] % cfg["eval_every"] != 0)


def run_rank(rank: int, world: int, cfg: Dict[str, Any], progress: Callable[..., None]) -> Any:
    lm = cfg.get("model") == "transformer"
    specs = cfg["methods"]
    if lm:
        results = _lm_rank(rank, world, cfg, lm_data(cfg, rank, world), progress)
    else:
        data = _data(cfg["seed"])
        total, done = len(specs) * cfg["epochs"], [0]
        results = []
        for spec in specs:
            def tick(label=spec["label"]):
                done[0] += 1
                progress(done=done[0], total=total, label=label)
            results.append(_train_one(spec, rank, world, cfg, data, tick))
            dist.barrier()
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, results)
    if rank != 0:
        return None
    return (_lm_records if lm else _records)(specs, everyone, cfg, world)


def _run_fields(spec, runs, world: int, dense_bytes: int) -> Dict[str, Any]:
    """What every method's record holds, from its runs on each rank: step time (median over the
    steps after the first few, slowest rank per step), bytes, the mean loss curve, agreement."""
    steps = len(runs[0]["times_ms"])
    skip = min(5, steps - 1)  # the first steps build DDP's buckets and the hooks' state
    sums = [r["checksum"] for r in runs]
    return {"method": spec["label"], "source": spec["source"], "error_feedback": spec["ef"], "world_size": world,
            "steps": steps,
            "step_ms": statistics.median(max(r["times_ms"][i] for r in runs) for i in range(skip, steps)),
            "bytes_per_step": max(r["bytes_per_step"] for r in runs), "dense_bytes_per_step": dense_bytes,
            "loss_curve": [sum(r["losses"][i] for r in runs) / world for i in range(steps)],
            "ranks_agree": max(sums) - min(sums) <= 1e-6 * max(1.0, abs(sums[0]))}


def _lm_records(specs, everyone, cfg, world) -> List[Dict[str, Any]]:
    from . import text

    info = text.corpus(int(cfg["text_mb"] * 1e6), cfg["seed"])
    unigram = text.unigram_loss(info["train"], info["val"])
    dense_bytes = 4 * sum(p.numel() for p in text.model(cfg).parameters()) * 2 * (world - 1) // world
    records = []
    for m, spec in enumerate(specs):
        runs = [r[m] for r in everyone]
        rec = _run_fields(spec, runs, world, dense_bytes)
        val_curve = [(s, sum(r["val_curve"][i][1] for r in runs) / world)
                     for i, (s, _) in enumerate(runs[0]["val_curve"])]
        tail = rec["loss_curve"][-max(1, rec["steps"] // 10):]
        records.append({**rec, "model": "transformer", "val_loss": val_curve[-1][1], "val_curve": val_curve,
                        "unigram_loss": unigram, "final_loss": sum(tail) / len(tail)})
    ref = next((r for r in records if r["method"] == REFERENCE), None)
    for r in records:
        r["val_vs_dense"] = None if ref is None else r["val_loss"] - ref["val_loss"]
        r["ratio"] = r["dense_bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else None
    return records


def _records(specs, everyone, cfg, world) -> List[Dict[str, Any]]:
    dense_bytes = 4 * sum(p.numel() for p in _model(cfg["hidden"], 0).parameters()) * 2 * (world - 1) // world
    records = []
    for m, spec in enumerate(specs):
        runs = [r[m] for r in everyone]
        rec = _run_fields(spec, runs, world, dense_bytes)
        tail = rec["loss_curve"][-10:]
        records.append({**rec, "epochs": cfg["epochs"], "test_accuracy": runs[0]["accuracy"][-1],
                        "accuracy_curve": runs[0]["accuracy"], "final_loss": sum(tail) / len(tail)})
    ref = next((r for r in records if r["method"] == REFERENCE), None)
    for r in records:
        r["accuracy_vs_dense_pp"] = None if ref is None else 100 * (r["test_accuracy"] - ref["test_accuracy"])
        r["ratio"] = r["dense_bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else None
    return records


# ---- entry point -------------------------------------------------------------------------------
def table(records: List[Dict[str, Any]]) -> str:
    head = ("method", "test acc", "vs dense", "step ms", "bytes/step", "ratio", "final loss", "")
    rows = []
    for r in records:
        rows.append((r["method"], f"{100 * r['test_accuracy']:.2f}%",
                     cli.fmt(r["accuracy_vs_dense_pp"], "+.2f") + " pp",
                     f"{r['step_ms']:.2f}", cli.fmt_bytes(r["bytes_per_step"]), cli.fmt(r["ratio"], ".1f") + "x",
                     f"{r['final_loss']:.4f}", "" if r["ranks_agree"] else "RANKS DIFFER"))
    w0 = max(len(x[0]) for x in [head, *rows])
    widths = [w0, 9, 10, 8, 11, 7, 11, 0]
    def line(cells) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join(line(r) for r in [head, *rows])


def lm_table(records: List[Dict[str, Any]]) -> str:
    """The transformer's records, one line per method; the unigram baseline below."""
    head = ("method", "val loss", "vs dense", "step ms", "bytes/step", "ratio", "train loss", "")
    rows = [(r["method"], f"{r['val_loss']:.4f}", cli.fmt(r["val_vs_dense"], "+.4f"), f"{r['step_ms']:.2f}",
             cli.fmt_bytes(r["bytes_per_step"]), cli.fmt(r["ratio"], ".1f") + "x", f"{r['final_loss']:.4f}",
             "" if r["ranks_agree"] else "RANKS DIFFER") for r in records]
    widths = [max(len(x[0]) for x in [head, *rows]), 9, 9, 8, 11, 7, 11, 0]

    def line(cells) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    note = (f"val loss: nats per character on held-out files, after the last step (lower is better; the "
            f"unigram baseline, character frequencies alone, is {records[0]['unigram_loss']:.4f}); vs dense: "
            f"minus {REFERENCE}'s; train loss: mean of the last tenth of the steps")
    return "\n".join([*(line(r) for r in [head, *rows]), "", note])


def main(argv: Sequence[str]) -> int:
    args = parser().parse_args(argv)
    for key, value in MODEL_DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    cli.check_sizes(args)
    sizes = ("epochs", "batch_size", "hidden") if args.model == "mlp" else \
        ("steps", "batch_size", "layers", "d_model", "heads", "context", "eval_every", "val_windows")
    for name in sizes:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, not {getattr(args, name)}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0, not {args.lr}")
    specs = methods(args)
    link = cli.resolve_link(args)
    if args.model == "transformer":
        return _lm_main(args, specs, link)
    _data(args.seed)  # fail early, in the parent, if scikit-learn is missing
    cfg = {"methods": specs, "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
           "hidden": args.hidden, "seed": args.seed}
    env = envmod.environment(args.world_size, cli.link_text(link), args.threads)
    print(envmod.header(env, [
        DIGITS_LINE,
        model_line(args.hidden, f"SGD lr {args.lr} momentum 0.9, "
                   f"batch {args.batch_size} per rank, {args.epochs} epochs, seed {args.seed}"),
        f"methods  {len(specs)} runs; PowerSGD (ours and PyTorch's) rank {POWERSGD_RANK}, compressing from step "
        f"{POWERSGD_START}",
    ]), flush=True)
    records = cli.run_and_report("train", cfg, args, link, env, table)
    if args.plot:
        from . import plot

        plot.training_plot(records, args.plot, title=f"digits MLP, {env['world_size']} ranks, {env['link']}")
        print(f"wrote {args.plot}")
    return 0


def lm_setup(args, optimizer: str = "AdamW", per: str = "rank") -> Tuple[Dict[str, Any], List[str]]:
    """The transformer's run settings from ``args`` (checked in the parent: the text is there,
    ``--d-model`` fits ``--heads``) and the header's data and model lines."""
    from . import text

    cfg = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "layers": args.layers,
           "d_model": args.d_model, "heads": args.heads, "context": args.context, "text_mb": args.text_mb,
           "eval_every": args.eval_every, "val_windows": args.val_windows, "seed": args.seed}
    info = text.corpus(int(args.text_mb * 1e6), args.seed)  # fail early, in the parent, with a clear error
    nparams = sum(p.numel() for p in text.model(cfg).parameters())  # also checks --d-model against --heads
    return cfg, [
        text.data_line(info),
        f"model    character transformer, {args.layers} blocks, width {args.d_model}, {args.heads} heads, context "
        f"{args.context} ({nparams:,} parameters); {optimizer} lr {args.lr:g} (warm-up, cosine decay), batch "
        f"{args.batch_size} x {args.context} characters per {per}, {args.steps} steps, seed {args.seed}"]


def _lm_main(args, specs, link) -> int:
    from . import text

    if args.val_windows < args.world_size:
        raise ValueError(f"--val-windows ({args.val_windows}) must be at least --world-size ({args.world_size})")
    base, lines = lm_setup(args)
    cfg = {"model": "transformer", "methods": specs, **base}
    env = envmod.environment(args.world_size, cli.link_text(link), args.threads)
    print(envmod.header(env, [
        *lines,
        f"methods  {len(specs)} runs; PowerSGD (ours and PyTorch's) rank {POWERSGD_RANK}, compressing from step "
        f"{POWERSGD_START}; validation on {args.val_windows - args.val_windows % args.world_size} windows every "
        f"{args.eval_every} steps",
    ]), flush=True)
    records = cli.run_and_report("train", cfg, args, link, env, lm_table)
    if args.plot:
        text.plot(records, args.plot, title=f"character transformer on stdlib source, {env['world_size']} ranks, "
                                            f"{env['link']}")
        print(f"wrote {args.plot}")
    return 0
