"""``plan_memory``: measure a chain, choose per stage keep / recompute / compress / offload
under a byte budget, and run the choice.

::

    plan = plan_memory(model, x, budget_bytes=64 * 2**20, allow=("recompute", "compress"))
    print(plan)                      # one row per stage: what it saves, what the plan does
    model = plan.apply(model)        # same modules and parameters, run by the plan

The budget is the peak of saved-activation bytes in one training step, as
:class:`~gradcomp.memory.MemoryMeter` measures it (what autograd keeps for backward, plus
what a plan stores for recomputation; parameters and gradients are not activations). Every
figure the plan predicts comes from measuring the stages on the real device with
``sample_input``: forward and backward time per storage mode, the bytes each stage adds to
the saved set per mode (codec payloads as encoded, not as estimated), output bytes. The
schedule is the exact optimum of the dynamic programme in ``memory/schedule.py`` for those
measurements.

What is a chain: an ``nn.Sequential`` (or a list of modules) whose stages each take the
previous stage's output, one tensor, and return one tensor. Branches inside a stage are fine
(a residual block is one stage); a model whose forward is not ``x -> stage_n(...stage_1(x))``
(skip connections across stages, several inputs, tuples between stages) is not a chain: wrap
its parts into stages that are.
"""
from __future__ import annotations

import json
import math
import statistics
import time as _time
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Sequence, Tuple, Union

import torch
from torch import nn

from . import schedule as sch
from .codecs import get_codec
from . import _ledger
from .executor import MIN_NUMEL, OFFLOAD_MIN_NUMEL, PlannedSequential, StageStore
from .meter import MemoryMeter, _Held, _unpack, is_parameter
from .offload import offload_activations
from .schedule import Block, Costs, Plain

__all__ = ["plan_memory", "Plan", "BudgetTooSmall", "CHOICES"]

CHOICES = ("recompute", "compress", "offload")
PLAN_VERSION = 2  # 2: fingerprints with the modules inside each stage; stages that work in place


class BudgetTooSmall(ValueError):
    """No schedule fits the budget; ``smallest_budget`` is the least that does (bytes)."""

    def __init__(self, message: str, smallest_budget: int) -> None:
        super().__init__(message)
        self.smallest_budget = smallest_budget


def _stages(model: Any) -> "OrderedDict[str, nn.Module]":
    if isinstance(model, OrderedDict):
        return model
    if isinstance(model, nn.Sequential):
        return OrderedDict(model.named_children())
    if isinstance(model, (list, tuple, nn.ModuleList)) and all(isinstance(m, nn.Module) for m in model):
        return OrderedDict((str(i), m) for i, m in enumerate(model))
    raise ValueError(f"plan_memory plans a chain: an nn.Sequential or a list of modules, got {type(model).__name__} "
                     f"(a model whose forward is not stage after stage is not a chain; wrap its parts into stages)")


def _fingerprint(stages: "OrderedDict[str, nn.Module]") -> List[Any]:
    """What a plan was measured on: per stage, its name and every module inside it (the stage
    itself first): where it sits, its type, its settings (``extra_repr``: ReLU's ``inplace``,
    GELU's ``approximate``, a convolution's stride) and its own parameters' and buffers' names,
    shapes and dtypes. Lists only, so it survives JSON unchanged."""
    def module(where: str, m: nn.Module) -> List[Any]:
        tensors = [[kind, n, list(t.shape), str(t.dtype)]
                   for kind, items in (("parameter", m._parameters), ("buffer", m._buffers))
                   for n, t in items.items() if t is not None]
        return [where, type(m).__qualname__, m.extra_repr(), tensors]

    return [[name, [module(where, m) for where, m in stage.named_modules()]] for name, stage in stages.items()]


def _difference(plan: List[Any], here: List[Any]) -> str:
    """Where two fingerprints differ first, in words."""
    def show(entry: List[Any]) -> str:
        where, kind, extra, tensors = entry
        shapes = ", ".join(f"{n} {tuple(shape)} {dtype}" for _, n, shape, dtype in tensors)
        return f"{kind}({extra})" + (f" [{shapes}]" if shapes else "") + (f" at {where!r}" if where else "")

    if len(plan) != len(here):
        return f"the plan has {len(plan)} stages, this model {len(here)}"
    for i, (a, b) in enumerate(zip(plan, here)):
        if a[0] != b[0]:
            return f"stage {i} is named {a[0]!r} in the plan, {b[0]!r} here"
        for ma, mb in zip(a[1], b[1]):
            if ma != mb:
                return f"stage {i} ({b[0]}): the plan has {show(ma)}, this model {show(mb)}"
        if len(a[1]) != len(b[1]):
            return f"stage {i} ({b[0]}): the plan has {len(a[1])} modules in it, this model {len(b[1])}"
    return "they differ"  # not reached: equal lists are equal


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Preserved:
    """Measuring runs the model: keep its buffers (BatchNorm statistics), gradients and the
    random number state as they were."""

    def __init__(self, stages: Iterable[nn.Module], device: torch.device) -> None:
        self.mods = list(stages)
        self.device = device

    def __enter__(self) -> "_Preserved":
        self.buffers = [(b, b.detach().clone()) for m in self.mods for b in m.buffers()]
        self.grads = [(p, None if p.grad is None else p.grad.detach().clone()) for m in self.mods for p in m.parameters()]
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return self

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        for p, g in self.grads:
            p.grad = g
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)


def _fresh(x: torch.Tensor, needs_grad: bool) -> torch.Tensor:
    """``x`` as a stage meets it in a chain: a tensor of its own (a stage that works in place
    changes this copy, not the caller's), with a history when it needs a gradient (a leaf that
    requires grad can neither be changed in place nor be told from a parameter)."""
    if needs_grad and x.is_floating_point():
        return x.detach().requires_grad_().clone()
    return x.detach().clone()


def _classify(stage: nn.Module, x: torch.Tensor) -> Tuple[bool, bool, bool, int, Any]:
    """Run ``stage`` once with autograd and sort what it saves: whether its input and its
    output are among it, whether it changes its input in place, and the bytes of the rest
    (unique storages, parameters left out). A stage that returns its input changed in place
    (``ReLU(inplace=True)``) saves its output, not its input: that value is gone."""
    saved: List[Tuple[Any, int, bool]] = []

    def pack(t: torch.Tensor) -> Any:
        saved.append((_ledger.storage_key(t), _ledger.storage_nbytes(t), is_parameter(t)))
        return _Held(t)

    version = x._version
    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        y = stage(x)
    inplace = x._version != version
    if not isinstance(y, torch.Tensor):
        return False, False, inplace, 0, y
    kin, kout = _ledger.storage_key(x), _ledger.storage_key(y)
    saves_in = any(k == kin for k, _, _ in saved) and not (inplace and kin == kout)
    saves_out = any(k == kout for k, _, _ in saved)
    internal = {k: n for k, n, param in saved if k not in (kin, kout) and not param}
    return saves_in, saves_out, inplace, sum(internal.values()), y


def _stored(mode: str, stage: nn.Module, i: int, x: torch.Tensor, out_form: int,
            saves_out: bool, inplace: bool = False) -> Tuple[int, int, float, float]:
    """One stage alone under a compressing or offloading ``mode``, measured by the meter: the
    device bytes of what it saves besides its input and output, the most it holds at once
    while it runs, and the seconds the storing adds to forward (encoding) and backward
    (decoding; 0 for offloading, whose copies overlap the compute)."""
    device = x.device
    # the input as a stage meets it in a chain: an activation (not a leaf that requires grad,
    # which the meter would take for a parameter), so views of it that the stage saves count
    x = _fresh(x, x.requires_grad)
    enc = dec = 0.0
    with MemoryMeter() as meter:
        if mode.startswith("compress:"):
            store = StageStore(mode.split(":", 1)[1], 0)
            version = x._version  # changed in place, what is saved there is the output
            with store.stage_of(i, x):
                y = stage(x)
            entries = list(store.pending)
            # the input's own entry is the boundary before this stage: its caller's, not counted here
            here = (_ledger.storage_key(x), x.storage_offset(), tuple(x.shape), version)
            mine = [e for k, e in store.seen.items() if (k[0], k[1], k[2], k[4]) == here]
            before = sum(e.packed.nbytes if e.packed is not None else _ledger.storage_nbytes(e.raw) for e in mine)
            _sync(device)
            t0 = _time.perf_counter()
            store.finish(y, last=True)  # the output stays as it is: counted apart
            _sync(device)
            enc = _time.perf_counter() - t0
            t0 = _time.perf_counter()
            for e in entries:
                e.get()
            _sync(device)
            dec = _time.perf_counter() - t0
            held = meter.live_saved_bytes - before - (y.untyped_storage().nbytes() if saves_out else 0)
            spike = meter.peak_saved_bytes - before
        else:
            if not inplace:  # offloaded or not, the input is the caller's (a leaf: not counted)
                x = x.detach().requires_grad_(x.is_floating_point())
            with offload_activations():
                y = stage(x)
                _sync(device)
            held = meter.live_saved_bytes - (out_form if saves_out else 0)
            spike = meter.peak_saved_bytes
        del y
    return max(0, held), max(0, spike), enc, dec


def _out_form(mode: str, y: torch.Tensor) -> Tuple[int, float, float]:
    """Device bytes of the stage's output ``y`` in ``mode``'s form, and the seconds to encode
    and decode it (a compressing run encodes its stages' outputs)."""
    raw = y.untyped_storage().nbytes()
    if mode.startswith("compress:"):
        codec = get_codec(mode.split(":", 1)[1])
        if not codec.accepts(y.dtype) or y.numel() < MIN_NUMEL:
            return raw, 0.0, 0.0
        _sync(y.device)
        t0 = _time.perf_counter()
        packed = codec.encode_if_smaller(y, 0, y.numel() * y.element_size())
        _sync(y.device)
        t1 = _time.perf_counter()
        if packed is None:
            return raw, t1 - t0, 0.0
        packed.decode()
        _sync(y.device)
        return packed.nbytes, t1 - t0, _time.perf_counter() - t1
    if mode == "offload":
        return (0 if (y.is_cuda and y.is_floating_point() and y.numel() >= OFFLOAD_MIN_NUMEL) else raw), 0.0, 0.0
    return raw, 0.0, 0.0


def _time_stage(stage: nn.Module, x: torch.Tensor, repeats: int) -> Tuple[float, float, float]:
    """Median seconds of one stage: forward and backward with what it saves kept, and
    forward without autograd (as a recomputation first runs it)."""
    device = x.device
    fw, bw, ng = [], [], []
    grad = None
    for _ in range(repeats + 1):  # the first is a warm-up
        xn, xi = _fresh(x, False), _fresh(x, x.requires_grad)  # each run its own (a stage may work in place)
        _sync(device)
        t0 = _time.perf_counter()
        with torch.no_grad():
            stage(xn)
        _sync(device)
        t1 = _time.perf_counter()
        y = stage(xi)
        _sync(device)
        t2 = _time.perf_counter()
        if grad is None:
            grad = torch.ones_like(y)
        if y.requires_grad:
            y.backward(grad)
        _sync(device)
        t3 = _time.perf_counter()
        ng.append(t1 - t0)
        fw.append(t2 - t1)
        bw.append(t3 - t2)
    return statistics.median(fw[1:]), statistics.median(bw[1:]), statistics.median(ng[1:])


def profile(model: Any, sample_input: torch.Tensor, modes: Sequence[str], repeats: int = 3) -> Tuple[Costs, List[str]]:
    """Measure every stage of the chain under every mode, on the device of ``sample_input``:
    :class:`~gradcomp.memory.schedule.Costs` and the stages' descriptions. The model's
    buffers, gradients and random number state are left as they were."""
    stages = _stages(model)
    chain = list(stages.values())
    if not isinstance(sample_input, torch.Tensor):
        raise ValueError(f"plan_memory needs one tensor as sample_input, got {type(sample_input).__name__}")
    n = len(chain)
    if n == 0:
        raise ValueError("plan_memory: the chain has no stages")
    fwd: List[Dict[str, float]] = [{} for _ in chain]
    bwd: List[Dict[str, float]] = [{} for _ in chain]
    internal: List[Dict[str, int]] = [{} for _ in chain]
    form: List[Dict[str, int]] = [{} for _ in chain]
    spike: List[Dict[str, int]] = [{} for _ in chain]
    rerun = [0.0] * n
    saves_in, saves_out, out, inplace = [False] * n, [False] * n, [0] * n, [False] * n
    with _Preserved(chain, sample_input.device), torch.enable_grad():
        x = sample_input.detach()
        needs_grad = sample_input.requires_grad
        for i, (name, stage) in enumerate(stages.items()):
            xi = _fresh(x, needs_grad)
            si, so, inplace[i], inner, y = _classify(stage, xi)
            if not isinstance(y, torch.Tensor):
                raise ValueError(f"not a chain: stage {i} ({name}: {type(stage).__name__}) returned a "
                                 f"{type(y).__name__}, not one tensor")
            saves_in[i], saves_out[i], out[i] = si, so, y.untyped_storage().nbytes()
            f_keep, b_keep, rerun[i] = _time_stage(stage, _fresh(x, needs_grad), repeats)
            for mode in modes:
                form[i][mode], enc_out, dec_out = _out_form(mode, y.detach())
                if mode == "keep":
                    internal[i][mode], spike[i][mode] = inner, 0
                    fwd[i][mode], bwd[i][mode] = f_keep, b_keep
                    continue
                # a storing mode costs the stage's own time plus its storing, measured apart
                # (two noisy timings of the same compute would let noise choose the mode)
                internal[i][mode], spike[i][mode], enc, dec = _stored(mode, stage, i, _fresh(x, needs_grad), form[i][mode], so,
                                                                      inplace[i])
                fwd[i][mode], bwd[i][mode] = f_keep + enc + enc_out, b_keep + dec + dec_out
            x = y.detach()
            needs_grad = True  # every later input is an activation with a history
    names = [f"{name}: {type(m).__name__}" for name, m in stages.items()]
    return Costs(fwd=fwd, bwd=bwd, internal=internal, form=form, out=out, saves_in=saves_in, saves_out=saves_out,
                 inp=sample_input.untyped_storage().nbytes(), spike=spike, rerun=rerun, inplace=inplace), names


def _mib(n: float) -> str:
    """Bytes in the largest binary unit that keeps a leading digit."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _describe(blocks: Sequence[Block], depth: int, into: Dict[int, Tuple[str, int]]) -> None:
    for b in blocks:
        if isinstance(b, Plain):
            into[b.stage] = (b.mode, depth)
        else:
            _describe(b.inner, depth + 1, into)


class Plan:
    """A schedule for one chain, with what it was measured on and what it predicts."""

    def __init__(self, costs: Costs, blocks: Sequence[Block], budget: int, names: List[str],
                 fingerprint: List[Any], device: str, notes: Sequence[str] = ()) -> None:
        if sch.stages_of(blocks) != list(range(costs.length)):  # every stage once, in order
            raise ValueError("the schedule does not cover the chain's stages in order")
        self.costs, self.blocks, self.budget = costs, list(blocks), int(budget)
        self.names, self.fingerprint, self.device = names, fingerprint, device
        self.notes = list(notes)

    # ---- what it predicts -------------------------------------------------------------------
    @property
    def predicted_peak(self) -> int:
        """Peak saved-activation bytes of a training step under this plan."""
        return sch.total_peak(self.blocks, self.costs)

    @property
    def predicted_time(self) -> float:
        """Seconds of forward, recomputation and backward per step (stage times measured)."""
        return sch.time(self.blocks, self.costs)

    @property
    def baseline_peak(self) -> int:
        """The same without saving memory: every stage kept."""
        return sch.total_peak(self._keep_all(), self.costs)

    @property
    def baseline_time(self) -> float:
        return sch.time(self._keep_all(), self.costs)

    def _keep_all(self) -> List[Block]:
        return [Plain(i, "keep") for i in range(self.costs.length)]

    def decisions(self) -> List[Dict[str, Any]]:
        """Per stage: what its saved tensors become and how often its forward runs per step."""
        where: Dict[int, Tuple[str, int]] = {}
        _describe(self.blocks, 0, where)
        rows = []
        for i in range(self.costs.length):
            mode, depth = where[i]
            c = self.costs
            so = c.saves_out[i]
            rows.append({"stage": i, "name": self.names[i], "mode": mode, "forward_runs": depth + 1,
                         "out_bytes": c.out[i], "saved_bytes": c.internal[i]["keep"] + (c.out[i] if so else 0),
                         "stored_bytes": c.internal[i][mode] + (c.form[i][mode] if so else 0)})
        return rows

    def __str__(self) -> str:
        # column widths from the cells themselves: a long stage name or mode never shifts a column
        head = ("stage", "output", "saves", "plan", "stores", "fwd runs")
        cells = [(r["name"], _mib(r["out_bytes"]), _mib(r["saved_bytes"]),
                  r["mode"] if r["forward_runs"] == 1 else f"{r['mode']}, recomputed", _mib(r["stored_bytes"]),
                  str(r["forward_runs"])) for r in self.decisions()]
        least = (28, 11, 11, 22, 11, 8)
        widths = [max([least[i]] + [len(row[i]) for row in [head, *cells]]) for i in range(len(head))]

        def line(row: Sequence[str]) -> str:
            return " ".join(c.ljust(w) if i in (0, 3) else c.rjust(w)
                            for i, (c, w) in enumerate(zip(row, widths))).rstrip()

        lines = [line(head), "-" * len(line(head))] + [line(row) for row in cells]
        lines.append(f"budget {_mib(self.budget)}; predicted peak {_mib(self.predicted_peak)} "
                     f"(no saving: {_mib(self.baseline_peak)}); predicted step {self.predicted_time * 1e3:.1f} ms "
                     f"(no saving: {self.baseline_time * 1e3:.1f} ms, {self.predicted_time / max(self.baseline_time, 1e-12):.2f}x)")
        lines.extend(self.notes)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Plan({self.costs.length} stages, budget {_mib(self.budget)}, peak {_mib(self.predicted_peak)}, "
                f"{self.predicted_time / max(self.baseline_time, 1e-12):.2f}x time)")

    # ---- running it -------------------------------------------------------------------------
    def apply(self, model: Any) -> PlannedSequential:
        """A module over ``model``'s own stages (same parameters and state_dict keys) that
        trains by this plan. Refuses a model the plan was not measured on."""
        stages = _stages(model)
        here = _fingerprint(stages)
        if here != self.fingerprint:
            raise ValueError(f"this plan was measured on another chain ({_difference(self.fingerprint, here)}); "
                             f"plan this model with plan_memory")
        return PlannedSequential(stages, self.blocks, self.costs.saves_in, self.costs.saves_out, self,
                                 inplace=self.costs.inplace)

    # ---- saving it --------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        c = self.costs
        return {"version": PLAN_VERSION, "budget": self.budget, "device": self.device, "names": self.names,
                "fingerprint": self.fingerprint, "notes": self.notes, "schedule": sch.to_json(self.blocks),
                "costs": {"fwd": c.fwd, "bwd": c.bwd, "internal": c.internal, "form": c.form, "out": c.out,
                          "saves_in": c.saves_in, "saves_out": c.saves_out, "inp": c.inp,
                          "spike": c.spike, "rerun": c.rerun, "inplace": c.inplace}}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Plan":
        if d.get("version") == 1:
            raise ValueError("a memory plan of an earlier gradcomp (version 1): it does not record the modules "
                             "inside the stages or which stages work in place; plan the model again with plan_memory")
        if d.get("version") != PLAN_VERSION:
            raise ValueError(f"not a gradcomp memory plan (version {d.get('version')!r})")
        c = d["costs"]
        ints = lambda rows: [{k: int(v) for k, v in r.items()} for r in rows]  # noqa: E731
        return cls(Costs(fwd=c["fwd"], bwd=c["bwd"], internal=ints(c["internal"]), form=ints(c["form"]),
                         out=[int(o) for o in c["out"]], saves_in=[bool(b) for b in c["saves_in"]],
                         saves_out=[bool(b) for b in c["saves_out"]], inp=int(c["inp"]),
                         spike=ints(c["spike"]), rerun=[float(r) for r in c["rerun"]],
                         inplace=[bool(b) for b in c["inplace"]]),
                   sch.from_json(d["schedule"]), d["budget"], d["names"], d["fingerprint"], d["device"], d["notes"])

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


def plan_memory(model: Any, sample_input: torch.Tensor, budget_bytes: Union[int, float],
                allow: Sequence[str] = CHOICES, *, codecs: Sequence[str] = ("lossless",), slots: int = 500,
                repeats: int = 3) -> Plan:
    """The fastest schedule of ``model`` (a chain, see the module docstring) whose peak of
    saved-activation bytes per training step stays within ``budget_bytes``.

    ``allow``: what the plan may do besides keeping, any of ``"recompute"``, ``"compress"``
    (with each codec of ``codecs``; the default, ``"lossless"``, keeps gradients
    bit-identical — name ``"int8"`` etc. to allow lossy storage) and ``"offload"`` (CUDA only:
    on CPU there is no device memory to free, and the plan says so). ``slots``: the budget's
    resolution in the dynamic programme. ``repeats``: timed runs per stage and mode.
    Raises :class:`BudgetTooSmall` (a ``ValueError``) when no schedule fits, with the smallest
    budget that does (in its message and as ``smallest_budget``).
    """
    if isinstance(allow, str):
        allow = (allow,)
    unknown = [a for a in allow if a not in CHOICES]
    if unknown:
        raise ValueError(f"plan_memory: unknown choice(s) {unknown}; allowed: {', '.join(CHOICES)}")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)) or not budget_bytes >= 0 \
            or not math.isfinite(budget_bytes):
        raise ValueError(f"plan_memory: budget_bytes={budget_bytes!r} must be a number of bytes >= 0")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"plan_memory: slots={slots!r} must be an int >= 1")
    if isinstance(sample_input, torch.Tensor):
        on_cuda = sample_input.device.type == "cuda"
    else:
        on_cuda = False
    modes = ["keep"]
    notes = []
    if "compress" in allow:
        for c in codecs:
            get_codec(c)  # an unknown codec is refused before anything is measured
            modes.append(f"compress:{c}")
    if "offload" in allow:
        if on_cuda:
            modes.append("offload")
        else:
            notes.append("offload: not considered (the model runs on the CPU: there is no device memory to free)")
    stages = _stages(model)
    costs, names = profile(stages, sample_input, modes, repeats)
    recompute = "recompute" in allow
    blocks = sch.solve(costs, int(budget_bytes), slots=slots, recompute=recompute)
    if blocks is None:
        least, least_blocks = sch.min_peak(costs, recompute=recompute)
        if least > budget_bytes:
            # offloading asked for on the CPU: that, not the budget, is what the user must hear first
            cpu = ("offloading needs a CUDA model (sample_input on the CPU: there is no device memory to free), "
                   "so it was not considered; " if "offload" in allow and not on_cuda else "")
            raise BudgetTooSmall(f"plan_memory: {cpu}no schedule keeps the saved activations within "
                                 f"{int(budget_bytes)} bytes ({_mib(budget_bytes)}); the smallest budget that fits is "
                                 f"{least} bytes ({_mib(least)}) with allow={tuple(allow)}"
                                 + ("" if recompute else "; allowing 'recompute' lowers it"), least)
        blocks = least_blocks  # fits, but only finer than the resolution shows
    return Plan(costs, blocks, int(budget_bytes), names, _fingerprint(stages),
                str(sample_input.device), notes)
