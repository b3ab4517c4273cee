"""The FSDP2 benchmark: ``python -m gradcomp.bench fsdp``.

A small transformer encoder reads scikit-learn's digits as sequences (each 8x8 image cut into
``--tokens`` tokens of ``64 / tokens`` pixels: few tokens per step keep the step communication-bound
on a CPU, as a large model's step is on GPUs) under ``fully_shard`` (each block, the embedding and head,
then the root) on several gloo ranks, trained with AdamW, once per method, side by side in
one run:

- ``fsdp-fp32``: FSDP2 as it comes (fp32 reduce-scatter and all-gather);
- ``fsdp-bf16rs``: FSDP2 with ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``;
- ``gc-dense``: :func:`gradcomp.training.compress_fsdp` with ``compressor=None`` (gradcomp's
  dense reduce-scatter, FSDP's all-gather): the cost of the custom comm itself;
- ``gc-int8``, ``gc-onebit``, ``gc-topk``: gradcomp's compressed reduce-scatter (error
  feedback per piece), FSDP's exact all-gather;
- ``gc-int8-bf16ag``, ``gc-onebit-bf16ag``, ``gc-topk-bf16ag``, ``gc-int8-int8ag``,
  ``gc-int4-bf16ag``, ``gc-fp4-bf16ag``: the same with the compressed parameter all-gather (error
  feedback on the weights); the last two reduce-scatter in 4 bits (block-scaled int4, e2m1);
- ``gc-int8-bf16ag-local``, ``gc-int8-int8ag-local``, ``gc-int4-bf16ag-local``: the same with
  ``regather="local"`` (backward's re-gathers decode the forward's payloads: no wire).

Every run starts from the same weights and sees the same batches; the methods take turns epoch
by epoch, so a change in the machine's load slows them alike. Measured: step time (median over
the steps after warm-up of the slowest rank, forward to optimizer step), bytes sent per step
and rank (gradcomp's telemetry; FSDP's own collectives counted as they are handed to
``reduce_scatter_single`` / ``all_gather_single`` by the same convention) and the test accuracy;
the compute-only step (the unsharded model on one rank's batch, no communication); where each
step's time goes (:class:`StepTrace`: forward, its compute, the gathers' issue and flight,
backward, reduce-scatters, all-reduces, the step); and with ``--plot`` a timeline of one step per
method. ``--overlap on`` (the default) calls :func:`gradcomp.sharded.overlap_gathers` for every
method, FSDP's own too: asynchronous, prefetched gathers.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import textwrap
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import cli
from . import env as envmod
from .sharded import _markdown, take_turns
from .train import DIGITS_LINE, _data, epoch_batches

METHODS: Dict[str, Dict[str, Any]] = {
    "fsdp-fp32": {"kind": "fsdp"},
    "fsdp-bf16rs": {"kind": "fsdp", "reduce_dtype": "bfloat16"},
    "gc-dense": {"kind": "ours", "compressor": None},
    "gc-int8": {"kind": "ours", "compressor": "int8"},
    "gc-onebit": {"kind": "ours", "compressor": "onebit"},
    "gc-topk": {"kind": "ours", "compressor": "topk"},
    "gc-int8-bf16ag": {"kind": "ours", "compressor": "int8", "all_gather": "bf16"},
    "gc-onebit-bf16ag": {"kind": "ours", "compressor": "onebit", "all_gather": "bf16"},
    "gc-topk-bf16ag": {"kind": "ours", "compressor": "topk", "all_gather": "bf16"},
    "gc-int8-int8ag": {"kind": "ours", "compressor": "int8", "all_gather": "int8"},
    "gc-int4-bf16ag": {"kind": "ours", "compressor": "int4", "all_gather": "bf16"},
    "gc-fp4-bf16ag": {"kind": "ours", "compressor": "fp4", "all_gather": "bf16"},
    # regather="local": backward's re-gathers decode the forward's payloads, kept compressed
    "gc-int8-bf16ag-local": {"kind": "ours", "compressor": "int8", "all_gather": "bf16", "regather": "local"},
    "gc-int8-int8ag-local": {"kind": "ours", "compressor": "int8", "all_gather": "int8", "regather": "local"},
    "gc-int4-bf16ag-local": {"kind": "ours", "compressor": "int4", "all_gather": "bf16", "regather": "local"},
}
# HSDP (--hsdp R: R replicas, one per emulated node, each sharded over its node's ranks): FSDP2's
# own HSDP (a 2-D mesh; its all-reduce between replicas dense) against compress_fsdp(replicate=...)
HSDP_METHODS: Dict[str, Dict[str, Any]] = {
    "hsdp-fp32": {"kind": "fsdp", "hsdp": True},
    "hsdp-bf16rs": {"kind": "fsdp", "reduce_dtype": "bfloat16", "hsdp": True},
    "gc-hsdp-dense": {"kind": "ours", "compressor": None, "replicate": None, "hsdp": True},
    "gc-hsdp-int8": {"kind": "ours", "compressor": None, "replicate": "int8", "hsdp": True},
    "gc-hsdp-int4": {"kind": "ours", "compressor": None, "replicate": "int4", "hsdp": True},
    "gc-hsdp-int8-bf16ag": {"kind": "ours", "compressor": None, "replicate": "int8", "all_gather": "bf16",
                            "hsdp": True},
    "gc-hsdp-int8-bf16ag-local": {"kind": "ours", "compressor": None, "replicate": "int8", "all_gather": "bf16",
                                  "regather": "local", "hsdp": True},
}
METHODS.update(HSDP_METHODS)
HSDP_DEFAULT = ("hsdp-fp32", "hsdp-bf16rs", "gc-hsdp-dense", "gc-hsdp-int8", "gc-hsdp-int4", "gc-hsdp-int8-bf16ag-local")
DEFAULT_METHODS = ("fsdp-fp32", "fsdp-bf16rs", "gc-dense", "gc-int8-bf16ag", "gc-int8-int8ag", "gc-int4-bf16ag",
                   "gc-int8-bf16ag-local", "gc-int4-bf16ag-local")
REFERENCE = "fsdp-fp32"
SPEED_REFERENCES = ("fsdp-fp32", "fsdp-bf16rs", "hsdp-fp32", "hsdp-bf16rs")
WARMUP = 3  # steps not timed: FSDP's lazy init and gradcomp's first exchanges
# the breakdown's columns (StepTrace kinds): wall time of the phases, then what runs inside them
BREAKDOWN = {"FW": "forward", "F": "forward compute", "AGi": "gather issue (encode)", "AG": "gather in flight",
             "B": "backward", "RS": "reduce-scatter", "AR": "all-reduce", "S": "step"}


class Encoder(torch.nn.Module):
    """An 8x8 digit as ``tokens`` tokens of ``64 / tokens`` pixels: a linear embedding, learned
    positions, ``layers`` pre-norm encoder blocks, mean pooling, a linear head."""

    def __init__(self, width: int, layers: int, tokens: int = 8) -> None:
        super().__init__()
        self.tokens = tokens
        self.embed = torch.nn.Linear(64 // tokens, width)
        self.pos = torch.nn.Parameter(torch.randn(tokens, width) * 0.02)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.reshape(-1, self.tokens, 64 // self.tokens)) + self.pos
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=1))


def build(width: int, layers: int, tokens: int, seed: int, reshard: bool,
          reduce_dtype: Optional[torch.dtype] = None, mesh: Any = None) -> Encoder:
    """The model, the same weights on every rank and for every method, under ``fully_shard``
    (on ``mesh`` when given: a 2-D mesh is FSDP2's own HSDP)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)
    model = Encoder(width, layers, tokens)
    kw: Dict[str, Any] = {"reshard_after_forward": reshard, **({"mesh": mesh} if mesh is not None else {})}
    if reduce_dtype is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for part in (model.embed, *model.blocks, model.head):
        fully_shard(part, **kw)
    fully_shard(model, **kw)
    return model


class CountingFSDP:
    """Counts what FSDP2's own comms hand to ``reduce_scatter_single`` / ``all_gather_single``
    (FSDP keeps no telemetry) with the collectives' convention: a reduce-scatter of ``n`` bytes
    sends the ``w-1`` pieces of the others, an all-gather sends this rank's block to ``w-1``."""

    NAMES = ("reduce_scatter_single", "all_gather_single", "all_reduce")

    def __init__(self, world: int, all_reduce: bool = False, trace: Optional["StepTrace"] = None) -> None:
        self.nbytes, self.world, self.all_reduce, self.trace = 0, world, all_reduce, trace
        self._orig = {n: getattr(dist, n) for n in self.NAMES}

    def __enter__(self) -> "CountingFSDP":
        rs, ag, ar = (self._orig[n] for n in self.NAMES)
        trace = self.trace if self.trace is not None else StepTrace()

        def fsdps(depth: int = 2) -> bool:  # FSDP's own call, not gradcomp's (its telemetry counts those)
            return not sys._getframe(depth).f_globals.get("__name__", "").startswith("gradcomp.")

        def counted_rs(output, input, *args, **kwargs):
            if not fsdps():
                return rs(output, input, *args, **kwargs)
            w = _size(kwargs.get("group"), self.world)
            self.nbytes += input.numel() * input.element_size() * (w - 1) // w
            return trace.timed("RS", "", rs, output, input, *args, **kwargs)

        def counted_ag(output, input, *args, **kwargs):
            if not fsdps():
                return ag(output, input, *args, **kwargs)
            self.nbytes += input.numel() * input.element_size() * (_size(kwargs.get("group"), self.world) - 1)
            return trace.gather("", lambda: ag(output, input, *args, **kwargs))

        def counted_ar(tensor, *args, **kwargs):  # FSDP2's HSDP: the replicas' all-reduce (a ring's bytes)
            if not fsdps():
                return ar(tensor, *args, **kwargs)
            w = _size(kwargs.get("group"), self.world)
            self.nbytes += tensor.numel() * tensor.element_size() * 2 * (w - 1) // w
            return trace.timed("AR", "", ar, tensor, *args, **kwargs)

        # FSDP calls them through the module
        setattr(dist, "reduce_scatter_single", counted_rs)
        setattr(dist, "all_gather_single", counted_ag)
        if self.all_reduce:  # FSDP's own runs only: gradcomp counts its all-reduces in its telemetry
            setattr(dist, "all_reduce", counted_ar)
        return self

    def __exit__(self, *exc) -> None:
        for n, f in self._orig.items():
            setattr(dist, n, f)


class StepTrace:
    """What one rank does in a step, as intervals (kind, name, start, end) of ``time.perf_counter``:
    ``F`` a module's forward compute, ``B`` the backward (its reduce-scatters inside), ``RS`` a
    reduce-scatter, ``AR`` an all-reduce, ``AG`` a parameter all-gather from its issue to its
    wire being done (``AGi``: its issue, the encode of a compressed one), ``S`` the step (the
    decision and the optimizer). ``on`` while the traced step runs; ``sums`` adds every traced
    step's time per kind (the breakdown), ``events`` keeps the last one (the timeline)."""

    def __init__(self) -> None:
        self.on = False
        self.events: List[List[Any]] = []
        self.sums: Dict[str, float] = {}
        self.steps = 0

    def begin(self) -> None:
        self.on, self.events = True, []

    def end(self) -> None:
        self.on = False
        self.steps += 1
        for kind, _, start, end in self.events:
            if end is not None:
                self.sums[kind] = self.sums.get(kind, 0.0) + (end - start)

    def span(self, kind: str, name: str, start: float, end: Optional[float]) -> List[Any]:
        event = [kind, name, start, end]
        if self.on:
            self.events.append(event)
        return event

    def timed(self, kind: str, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.span(kind, name, start, time.perf_counter())

    def gather(self, name: str, issue: Callable[[], Any]) -> Any:
        """An all-gather issued by ``issue()``: synchronous (None back) or a Work whose future
        completes when its wire is done."""
        start = time.perf_counter()
        work = issue()
        issued = time.perf_counter()
        self.span("AGi", name, start, issued)
        future = None if work is None else work.get_future()
        event = self.span("AG", name, start, issued if future is None else None)
        if future is not None and self.on:
            future.add_done_callback(lambda _f, e=event: e.__setitem__(3, time.perf_counter()))
        return work


def _size(group: Any, world: int) -> int:
    return world if group is None else dist.get_world_size(group)


_MESHES: Dict[Any, Any] = {}


def hsdp_mesh(replicas: int, world: int) -> Any:
    """The 2-D mesh (replicate x shard) of ``replicas`` replicas, made once per process."""
    from torch.distributed.device_mesh import init_device_mesh

    if (replicas, world) not in _MESHES:
        _MESHES[(replicas, world)] = init_device_mesh("cpu", (replicas, world // replicas),
                                                      mesh_dim_names=("replicate", "shard"))
    return _MESHES[(replicas, world)]


class _Run:
    """One method's model, optimizer and measurements, trained an epoch at a time."""

    def __init__(self, spec: Dict[str, Any], rank: int, world: int, cfg: Dict[str, Any]) -> None:
        from gradcomp.sharded import compress_fsdp, overlap_gathers

        self.spec, self.rank, self.world, self.cfg = spec, rank, world, cfg
        reduce = getattr(torch, spec["reduce_dtype"]) if spec.get("reduce_dtype") else None
        mesh = hsdp_mesh(cfg["hsdp"], world) if spec.get("hsdp") else None
        on = None if mesh is None else mesh if spec["kind"] == "fsdp" else mesh["shard"]
        self.model = build(cfg["width"], cfg["layers"], cfg["tokens"], cfg["seed"], cfg["reshard"], reduce, on)
        hsdp = {} if mesh is None or spec["kind"] == "fsdp" else {"replicate": mesh,
                                                                   "replicate_compressor": spec["replicate"]}
        self.handle = None if spec["kind"] == "fsdp" else compress_fsdp(
            self.model, spec["compressor"], all_gather=spec.get("all_gather"), regather=spec.get("regather", "wire"),
            **hsdp)
        parts = [self.model.embed, *self.model.blocks, self.model.head]
        if cfg["overlap"]:  # every method alike: FSDP's own gathers and gradcomp's run beside compute
            overlap_gathers(self.model, parts)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg["lr"])
        self.times: List[float] = []
        self.sent = 0
        self.phases: Dict[str, Dict[str, float]] = {}
        self.trace = StepTrace()
        self.timeline: List[List[Any]] = []
        self._instrument(parts)

    def _instrument(self, parts: List[torch.nn.Module]) -> None:
        """The trace's hooks: each part's forward compute (after FSDP's pre-forward, which waits
        for its gather) and, for gradcomp's runs, its collectives (FSDP's own are traced by
        CountingFSDP)."""
        trace = self.trace
        names = {id(m): n for n, m in self.model.named_modules()}
        def began(mod: torch.nn.Module, args: Any) -> None:
            setattr(mod, "_traced_at", time.perf_counter())

        def ended(mod: torch.nn.Module, args: Any, out: Any) -> None:
            trace.span("F", names[id(mod)], getattr(mod, "_traced_at"), time.perf_counter())

        for m in parts:
            m.register_forward_pre_hook(began)
            m.register_forward_hook(ended)
        if self.handle is not None:
            rs, ag = self.handle._reduce_scatter, self.handle._all_gather
            setattr(self.handle, "_reduce_scatter", lambda key, *a: trace.timed("RS", key, rs, key, *a))
            setattr(self.handle, "_all_gather", lambda key, *a: trace.gather(key, lambda: ag(key, *a)))

    def epoch(self, epoch: int, xtr: torch.Tensor, ytr: torch.Tensor) -> None:
        from gradcomp.collectives import reset_telemetry, telemetry

        counting = CountingFSDP(self.world, all_reduce=self.handle is None, trace=self.trace)
        reset_telemetry()
        trace = self.trace
        with counting:
            for idx in epoch_batches(len(ytr), self.rank, self.world, self.cfg["batch_size"], self.cfg["seed"], epoch):
                if len(self.times) >= WARMUP:
                    trace.begin()
                t0 = time.perf_counter()
                loss = torch.nn.functional.cross_entropy(self.model(xtr[idx]), ytr[idx])
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                if self.handle is not None:
                    self.handle.step(self.opt)
                else:
                    self.opt.step()
                self.opt.zero_grad()
                t3 = time.perf_counter()
                self.times.append((t3 - t0) * 1e3)
                if trace.on:
                    trace.span("FW", "", t0, t1)
                    trace.span("B", "", t1, t2)
                    trace.span("S", "", t2, t3)
                    trace.end()
                    if len(self.times) == self.cfg["trace_step"]:
                        self.timeline = [list(e) for e in trace.events]
        tel = telemetry()
        self.sent += counting.nbytes + tel["total"]["bytes_sent"]
        for op, v in tel["by_op"].items():
            mine = self.phases.setdefault(op, {"compress": 0.0, "comm": 0.0, "decompress": 0.0})
            for k in mine:
                mine[k] += v[f"{k}_s"]

    def result(self, xte: torch.Tensor, yte: torch.Tensor) -> Dict[str, Any]:
        steps = max(len(self.times), 1)
        with torch.no_grad():
            accuracy = float((self.model(xte).argmax(1) == yte).float().mean())
        traced = max(self.trace.steps, 1)
        return {"times_ms": self.times, "accuracy": accuracy, "bytes_per_step": self.sent / steps,
                "phases": {op: {k: 1e3 * v / steps for k, v in ph.items()} for op, ph in self.phases.items()},
                "breakdown_ms": {k: 1e3 * v / traced for k, v in self.trace.sums.items()},
                "timeline": self.timeline,
                "skipped": 0 if self.handle is None else self.handle.skipped}


def compute_only(cfg: Dict[str, Any], xtr: torch.Tensor, ytr: torch.Tensor, rank: int, world: int) -> float:
    """The step without communication: the whole model, unsharded, on this rank's batch (the
    same batches, AdamW), median ms over the steps after warm-up (at most 30 steps)."""
    torch.manual_seed(cfg["seed"])
    model = Encoder(cfg["width"], cfg["layers"], cfg["tokens"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    times = []
    for idx in list(epoch_batches(len(ytr), rank, world, cfg["batch_size"], cfg["seed"], 0))[:WARMUP + 30]:
        t0 = time.perf_counter()
        torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
        opt.zero_grad()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[WARMUP:] or times)


def run_rank(rank: int, world: int, cfg: Dict[str, Any], progress: Callable[..., None]) -> Any:
    names = cfg["methods"]
    data = _data(cfg["seed"])
    alone = compute_only(cfg, data[0], data[1], rank, world)
    runs = [_Run(METHODS[name], rank, world, cfg) for name in names]
    everyone = take_turns(names, runs, cfg["epochs"], data, progress, world)
    slowest: List[Any] = [None] * world
    dist.all_gather_object(slowest, alone)
    if rank:
        return None
    records = _records(names, everyone, cfg, world)
    for r in records:
        r["compute_only_ms"] = max(slowest)
    return records


def _records(names: List[str], everyone: List[Any], cfg: Dict[str, Any], world: int) -> List[Dict[str, Any]]:
    records = []
    for m, name in enumerate(names):
        runs = [r[m] for r in everyone]
        steps = len(runs[0]["times_ms"])
        skip = min(WARMUP, steps - 1)
        records.append({
            "method": name, "world_size": world, "epochs": cfg["epochs"], "steps": steps,
            "test_accuracy": runs[0]["accuracy"],
            "step_ms": statistics.median(max(r["times_ms"][i] for r in runs) for i in range(skip, steps)),
            "bytes_per_step": max(r["bytes_per_step"] for r in runs), "skipped": runs[0]["skipped"],
            "phases_ms_rank0": runs[0]["phases"], "breakdown_ms_rank0": runs[0]["breakdown_ms"],
            "timeline_rank0": runs[0]["timeline"], "overlap": cfg["overlap"],
        })
    by_name = {r["method"]: r for r in records}
    ref = by_name.get(REFERENCE, by_name.get("hsdp-fp32"))
    for r in records:
        r["accuracy_vs_dense_pp"] = None if ref is None else 100 * (r["test_accuracy"] - ref["test_accuracy"])
        r["bytes_vs_dense"] = None if ref is None or not ref["bytes_per_step"] else (
            r["bytes_per_step"] / ref["bytes_per_step"])
        for base in SPEED_REFERENCES:
            r[f"speedup_vs_{base}"] = by_name[base]["step_ms"] / r["step_ms"] if base in by_name else None
    return records


def table(records: List[Dict[str, Any]]) -> str:
    hsdp = any(r["method"] in HSDP_METHODS for r in records)
    bases = ("hsdp-fp32", "hsdp-bf16rs") if hsdp else ("fsdp-fp32", "fsdp-bf16rs")
    head = ("method", "step ms", f"vs {bases[0]}", f"vs {bases[1]}", "bytes/step", "vs fp32", "test acc",
            "vs fp32 ", "skipped")
    rows = [(r["method"], f"{r['step_ms']:.1f}", cli.fmt(r[f"speedup_vs_{bases[0]}"], ".2f") + "x",
             cli.fmt(r[f"speedup_vs_{bases[1]}"], ".2f") + "x", cli.fmt_bytes(r["bytes_per_step"]),
             cli.fmt(r["bytes_vs_dense"], ".3f") + "x", f"{100 * r['test_accuracy']:.2f}%",
             cli.fmt(r["accuracy_vs_dense_pp"], "+.2f") + " pp", str(r["skipped"])) for r in records]
    out = _markdown([head, *rows])
    alone = records[0].get("compute_only_ms")
    if alone:
        ref = next((r for r in records if r["method"] in (REFERENCE, "hsdp-fp32")), None)
        out += (f"\n\ncompute only (the unsharded model on one rank's batch, no communication): {alone:.1f} ms per step"
                + (f"; {ref['method']}'s step is {ref['step_ms'] / alone:.1f}x that" if ref else ""))
    parts = [(r["method"], *(f"{r['breakdown_ms_rank0'].get(k, 0.0):.1f}" for k in BREAKDOWN))
             for r in records if r.get("breakdown_ms_rank0")]
    if parts:
        out += ("\n\nwhere a step's time goes (rank 0, ms per step after warm-up; gathers "
                + ("asynchronous, beside compute" if records[0].get("overlap") else "synchronous") + "):\n\n"
                + _markdown([("method", *BREAKDOWN.values()), *parts]))
    phases = [(r["method"], op, *(f"{ms[k]:.2f}" for k in ("compress", "comm", "decompress")))
              for r in records for op, ms in sorted(r["phases_ms_rank0"].items())]
    if phases:
        out += "\n\nwhere gradcomp's time goes (rank 0, ms per step):\n\n" + _markdown(
            [("method", "collective", "compress", "communicate", "decompress"), *phases])
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gradcomp.bench fsdp",
        description="Train a small transformer encoder on the digits under FSDP2 (fully_shard): FSDP's own fp32 and "
                    "bf16 reductions against gradcomp's compressed reduce-scatter and all-gather (compress_fsdp); "
                    "compare step time, bytes per step and accuracy.")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), metavar="A,B",
                   help=f"methods to run (default {', '.join(DEFAULT_METHODS)}; all: {', '.join(METHODS)})")
    p.add_argument("--epochs", type=int, default=2, metavar="N", help="epochs per run (default 2)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="batch size per rank (default 8)")
    p.add_argument("--tokens", type=int, default=4, choices=(1, 2, 4, 8, 16),
                   help="tokens per image (default 4, of 16 pixels each)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--width", type=int, default=192, metavar="D", help="model width (default 192)")
    p.add_argument("--layers", type=int, default=4, metavar="N", help="encoder blocks (default 4: 1.8M parameters)")
    p.add_argument("--hsdp", type=int, default=0, metavar="R",
                   help="HSDP: R replicas, one per node of world-size/R ranks (with --netem the link between the "
                        f"nodes), each sharded inside its node; default methods then {', '.join(HSDP_DEFAULT)}")
    p.add_argument("--reshard-after-forward", choices=("true", "false"), default="true",
                   help="fully_shard's reshard_after_forward for every module (default true, FSDP2's)")
    p.add_argument("--overlap", choices=("on", "off"), default="on",
                   help="overlap_gathers for every method (default on): FSDP unshards asynchronously and each module "
                        "prefetches the next one's gather, so gathers run beside compute; off: every gather blocks")
    cli.common_options(p)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(list(argv or []))
    cli.check_sizes(args)
    for name in ("epochs", "batch_size", "width", "layers"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, not {getattr(args, name)}")
    if args.width % 4:
        raise ValueError(f"--width must be a multiple of 4 (the heads), not {args.width}")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0, not {args.lr}")
    if args.hsdp < 0 or (args.hsdp and (args.hsdp < 2 or args.world_size % args.hsdp)):
        raise ValueError(f"--hsdp must be >= 2 and divide --world-size ({args.world_size}), not {args.hsdp}")
    if args.hsdp and args.methods == ",".join(DEFAULT_METHODS):
        args.methods = ",".join(HSDP_DEFAULT)
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    mixed = [n for n in names if bool(METHODS.get(n, {}).get("hsdp")) != bool(args.hsdp)]
    if mixed and not [n for n in names if n not in METHODS]:
        raise ValueError(f"--methods: {', '.join(mixed)} {'need' if not args.hsdp else 'are not'} HSDP methods "
                         f"({'pass --hsdp R' if not args.hsdp else 'HSDP methods start with hsdp- or gc-hsdp-'})")
    unknown = [n for n in names if n not in METHODS]
    if unknown or not names:
        raise ValueError(f"--methods: unknown {unknown or 'none given'}; allowed: {', '.join(METHODS)}")
    link = cli.resolve_link(args)
    _data(args.seed)  # fail early, in the parent, if scikit-learn is missing
    reshard = args.reshard_after_forward == "true"
    cfg = {"methods": names, "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
           "width": args.width, "layers": args.layers, "tokens": args.tokens, "seed": args.seed, "reshard": reshard,
           "hsdp": args.hsdp, "local_size": args.world_size // args.hsdp if args.hsdp else 1,
           "overlap": args.overlap == "on", "trace_step": WARMUP + 3}
    nparams = sum(p.numel() for p in Encoder(args.width, args.layers, args.tokens).parameters())
    env = envmod.environment(args.world_size, cli.link_text(link, cfg["local_size"]), args.threads)
    print(envmod.header(env, [
        DIGITS_LINE,
        f"model    transformer encoder, {args.tokens} tokens of {64 // args.tokens} pixels, width {args.width}, {args.layers} blocks "
        f"({nparams:,} parameters), fully_shard per block (reshard_after_forward={reshard}), AdamW lr {args.lr}, "
        f"batch {args.batch_size} per rank, {args.epochs} epochs, seed {args.seed}",
        f"methods  {', '.join(names)}, taking turns epoch by epoch; step time: median over the steps after "
        f"the first {WARMUP} of the slowest rank",
    ]), flush=True)
    records = cli.run_and_report("fsdp", cfg, args, link, env, table)
    if args.plot:
        timeline_plot(records, args.plot, f"one FSDP2 step per method (rank 0, step {WARMUP + 3}), {args.world_size} "
                                          f"ranks, {env['link']}, gathers "
                                          f"{'overlapped' if cfg['overlap'] else 'synchronous'}")
        print(f"wrote {args.plot}")
    return 0


LANES = ("compute", "all-gather", "reduce-scatter / all-reduce")


def timeline_plot(records: List[Dict[str, Any]], path: str, title: str) -> None:
    """One panel per method: its compute (each module's forward, the backward, the step) on one
    lane, its parameter all-gathers from issue to wire done (the issue, a compressed one's
    encode, darker) on the next, its reduce-scatters (and HSDP all-reduces) on the third."""
    from .plot import _pyplot

    plt = _pyplot()
    rows = [r for r in records if r.get("timeline_rank0")]
    colors = {"F": "#4c72b0", "B": "#55a868", "S": "#8c8c8c", "AG": "#f2b47e", "AGi": "#c4661f", "RS": "#c44e52",
              "AR": "#8172b2"}
    lane = {"F": 0, "B": 0, "S": 0, "AG": 1, "AGi": 1, "RS": 2, "AR": 2}
    fig, axes = plt.subplots(len(rows), 1, figsize=(14, 0.6 + 1.25 * len(rows)), squeeze=False)
    span = max(max(e[3] for e in r["timeline_rank0"] if e[3] is not None) -
               min(e[2] for e in r["timeline_rank0"]) for r in rows) * 1e3
    for ax, r in zip(axes[:, 0], rows):
        events = [e for e in r["timeline_rank0"] if e[3] is not None and e[0] in colors]
        t0 = min(e[2] for e in r["timeline_rank0"])
        for kind, name, start, end in sorted(events, key=lambda e: e[0] == "AGi"):  # the issue over its flight
            y = lane[kind]
            ax.broken_barh([(1e3 * (start - t0), max(1e3 * (end - start), 0.05))], (y - 0.32, 0.64),
                           color=colors[kind], edgecolor="white", linewidth=0.3)
            if kind == "F" and (end - start) * 1e3 > 0.025 * span:
                label = name.replace("blocks.", "b")
                ax.text(1e3 * ((start + end) / 2 - t0), y, label, ha="center", va="center", fontsize=6, color="white")
        ax.set_yticks(range(len(LANES)), LANES, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, span * 1.01)
        ax.set_title(f"{r['method']}: median step {r['step_ms']:.1f} ms, {cli.fmt_bytes(r['bytes_per_step'])} per step",
                     fontsize=8, loc="left")
    axes[-1, 0].set_xlabel("ms since the step began (wall clock, rank 0)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in ("F", "B", "S", "AGi", "AG", "RS", "AR")]
    lines = textwrap.wrap(title, 170)
    fig.legend(handles, ["forward of a module", "backward (its exchanges inside)", "step (decision, optimizer)",
                         "gather issued (encode)", "gather in flight", "reduce-scatter (HSDP: with the replicas' "
                         "all-reduce)", "all-reduce (FSDP2's HSDP)"],
               loc="upper left", ncol=7, fontsize=7, frameon=False,
               bbox_to_anchor=(0.005, 1.0 - (0.12 + 0.16 * len(lines)) / fig.get_figheight()))
    fig.suptitle("\n".join(lines), fontsize=9, x=0.01, y=1.0 - 0.06 / fig.get_figheight(), ha="left", va="top")
    fig.tight_layout(rect=(0, 0, 1, 1.0 - (0.34 + 0.16 * len(lines)) / fig.get_figheight()))
    fig.savefig(path, dpi=130)
    plt.close(fig)
