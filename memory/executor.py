"""Running a schedule (``memory/schedule.py``): the module ``Plan.apply`` returns.

``PlannedSequential`` is an ``nn.Sequential`` over the same stage modules (same parameters,
same ``state_dict`` keys), whose training forward follows the schedule:

- ``Plain(i, "keep")``: stage ``i`` as it is;
- ``Plain(i, "compress:<codec>")``: what stage ``i`` saves goes through the codec
  (:class:`StageStore`), keyed by the step, the stage and the tensor's place in it, so a
  stochastic codec stores the same bits however often the stage is recomputed;
- ``Plain(i, "offload")``: under ``offload_activations`` (CUDA; host memory, prefetched);
- ``Recompute(s, k, inner)``: :class:`_Recompute`, an autograd function that runs ``s .. k``
  without saving anything and, in backward, runs them again from its stored input by
  ``inner`` (random number state restored, so dropout draws the same masks) and
  backpropagates through them. Parameter gradients accumulate inside that nested backward, as
  in ``torch.utils.checkpoint``'s reentrant form; under DDP keep ``find_unused_parameters``
  off (the graph walk cannot see through it).

  Buffers that the first forward changed (BatchNorm's running statistics and its count) are
  replaced by copies of themselves while the stages run again, so the recomputation updates
  the copies: the module's own buffers move once per step, as without a plan, and are never
  written while a backward that saved them is pending. The recomputation sees them as the
  first forward left them, which is exact for BatchNorm (its training forward normalises by
  the batch's statistics; in evaluation it changes nothing). A stage that changes its input
  in place (``ReLU(inplace=True)``, measured by the planner: ``inplace``) starts a
  recomputation on a copy of its input, so the stored input stays what it was.

Outside training (``torch.no_grad()``, evaluation) the forward is the plain chain.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from gradcomp.kernels.rng import stream_key

from . import _ledger
from .codecs import get_codec
from .meter import _Held, is_parameter
from .offload import offload_activations
from .schedule import Block, Plain, Recompute

__all__ = ["PlannedSequential", "StageStore", "run_blocks", "MIN_NUMEL", "OFFLOAD_MIN_NUMEL"]

MIN_NUMEL = 1024  # smaller saved tensors are kept as they are by a compressing stage
OFFLOAD_MIN_NUMEL = 4096  # and by an offloading one (offload_activations' default)


class _Stored:
    """One saved tensor of a compressed stage: raw until the stage ends, then its payload."""

    __slots__ = ("raw", "packed", "release", "__weakref__")

    def __init__(self, raw: torch.Tensor) -> None:
        self.raw: Optional[torch.Tensor] = raw
        self.packed: Any = None
        self.release: Any = None  # ends the ledger's holding of the raw storage

    def get(self) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.decode()
        assert self.raw is not None
        return self.raw


class StageStore:
    """Saved-tensor hooks that store what the stages of one run save through a codec.

    Each tensor is keyed by what it is, not by who saved it first: the stage's input and
    output by the activation they are (``(step, i, "out")``), other saved tensors by ``(step,
    stage, their order)``. The input is encoded when it is saved; the rest when the stage has
    returned and its output is known (until then it is held as it is); what a stage saves at
    its input's place after changing it in place is its output. A storage saved twice
    (ReLU's output, which the next Linear saves as its input) is encoded once. Kept as they
    are: parameters, non-floating tensors, tensors under ``min_numel`` elements, storages in
    ``exclude`` (held anyway, e.g. a recomputation's stored input), and any tensor whose
    payload would not be smaller.
    """

    def __init__(self, codec: str, step: int, *, min_numel: int = MIN_NUMEL, exclude: Sequence[Any] = ()) -> None:
        self.codec = get_codec(codec)
        self.step = step
        self.min_numel = min_numel
        # storage and version: a stage that changes its input in place saves a new value there,
        # which nobody else holds
        self.exclude = {_ledger.storage_key(t) + (t._version,) for t in exclude if isinstance(t, torch.Tensor)}
        self.seen: Dict[Tuple[Any, ...], Any] = {}
        self.pending: List[_Stored] = []  # saved by the current stage, encoded when it returns
        self.stage = -1
        self.input: Optional[Tuple[Any, ...]] = None  # where the stage's input lives (never the
        # tensor: autograd keeps these hooks with what they saved, and a reference to the
        # graph from here would be a cycle it cannot see)

    def _pack(self, t: torch.Tensor) -> Any:
        if (is_parameter(t) or not t.is_floating_point() or t.numel() < self.min_numel
                or _ledger.storage_key(t) + (t._version,) in self.exclude):
            return _Held(t)
        ident = (_ledger.storage_key(t), t.storage_offset(), tuple(t.shape), t.stride(), t._version)
        entry = self.seen.get(ident)
        if entry is None:
            entry = self.seen[ident] = _Stored(t.detach())  # no history: see meter._Held
            if _where(t, version=True) == self.input:  # known now: encoded at once, never held as it is
                self._encode(entry, (self.step, self.stage - 1, "out"))
            else:
                self.pending.append(entry)
            if entry.packed is None:
                entry.release = _ledger.hold(entry, ("storage",) + _ledger.storage_key(t), _ledger.storage_nbytes(t))
        return entry

    def _encode(self, entry: _Stored, key: Tuple[Any, ...]) -> None:
        t = entry.raw
        assert t is not None
        if not self.codec.accepts(t.dtype):
            return
        packed = self.codec.encode_if_smaller(t, stream_key(0x6D656D, repr(key), self.step), t.numel() * t.element_size())
        if packed is not None:
            entry.packed, entry.raw = packed, None
            if entry.release is not None:  # the raw storage is no longer kept by this entry
                entry.release()
            _ledger.hold(packed, ("payload", id(packed)), packed.nbytes)

    @staticmethod
    def _unpack(entry: Any) -> torch.Tensor:
        return entry.tensor if isinstance(entry, _Held) else entry.get()

    @contextlib.contextmanager
    def stage_of(self, i: int, x: Any) -> Iterator[None]:
        """Stage ``i`` runs inside: its saved tensors are hooked; encoded when it returns."""
        self.stage, self.input = i, _where(x, version=True)  # changed in place, it is the output
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def finish(self, y: Any, *, last: bool = False) -> None:
        """Encode what the current stage saved, now that its output ``y`` is known. ``last``:
        the run's last stage, whose output the next block holds as it is anyway (a kept
        stage saves its input, a recomputation stores it), so it stays as it is here too."""
        i, order = self.stage, 0
        out = _where(y)
        for entry in self.pending:
            where = _where(entry.raw)
            if where == out:
                if not last:
                    self._encode(entry, (self.step, i, "out"))
            else:
                self._encode(entry, (self.step, i, "saved", order))
                order += 1
        self.pending = []
        # only the output can be saved again (as the next stage's input), and its storage is
        # alive while that stage runs; any other entry could match a new tensor that the
        # allocator places where a freed one was
        self.seen = {k: e for k, e in self.seen.items() if (k[0], k[1], k[2]) == out}


def _where(t: Any, version: bool = False) -> Optional[Tuple[Any, ...]]:
    """A tensor's place: its storage, offset and shape (None for anything else); ``version``:
    and its version (what is there now)."""
    if not isinstance(t, torch.Tensor):
        return None
    place = (_ledger.storage_key(t), t.storage_offset(), tuple(t.shape))
    return place + (t._version,) if version else place


_ANCHOR: Dict[torch.device, torch.Tensor] = {}


def _anchor(device: torch.device) -> torch.Tensor:
    """A tensor that requires grad, passed to every recomputation so its backward runs even
    when its input needs no gradient (the parameters inside do)."""
    if device not in _ANCHOR:
        _ANCHOR[device] = torch.zeros((), device=device, requires_grad=True)
    return _ANCHOR[device]


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, anchor, chain, block, step, flags):
        ctx.chain, ctx.block, ctx.step, ctx.flags = chain, block, step, flags
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        ctx.needs_input_grad = x.requires_grad
        stages = [chain[i] for i in range(block.start, block.end + 1)]
        inplace = flags[2][block.start]
        before = _buffers(stages)
        version = x._version
        y = x.clone() if inplace else x  # the stored input stays what it was
        for stage in stages:
            y = stage(y)
        if not inplace and x._version != version:
            raise ValueError(f"stage {block.start} changed its input in place, so a recomputation cannot start "
                             f"from it; build the planned model with plan_memory(...).apply, which measures "
                             f"this (or pass inplace= to PlannedSequential)")
        # the buffers this forward changed (in place or by assignment): copies stand in for them
        # while the stages run again. BatchNorm's kernel updates its statistics without counting a
        # new version, so a normalisation layer in training counts as changing them all.
        ctx.changed = [(m, name) for m, name, t, v in before
                       if m._buffers.get(name) is not t or t._version != v or (m.training and isinstance(m, _NormBase))]
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(ctx.needs_input_grad)
        devices = [x.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices), _stand_ins(ctx.changed):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, x.device)
            with torch.enable_grad():
                # a stage that works in place gets a tensor of its own with a history (not the leaf)
                xin = x.clone() if ctx.flags[2][ctx.block.start] else x
                y = run_blocks(ctx.chain, ctx.block.inner, xin, ctx.step, saves_in=ctx.flags[0],
                               saves_out=ctx.flags[1], inplace=ctx.flags[2])
        # the module's own buffers are back, untouched: what the recomputed graph saved is the copies
        torch.autograd.backward(y, grad)
        return (x.grad if ctx.needs_input_grad else None), None, None, None, None, None


_NormBase = nn.modules.batchnorm._NormBase  # BatchNorm, InstanceNorm, SyncBatchNorm


def _buffers(stages: Iterable[nn.Module]) -> List[Tuple[nn.Module, str, torch.Tensor, int]]:
    """Every buffer of ``stages``: its module, name, tensor and version."""
    seen: Set[int] = set()
    out: List[Tuple[nn.Module, str, torch.Tensor, int]] = []
    for stage in stages:
        for m in stage.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            out.extend((m, name, t, t._version) for name, t in m._buffers.items() if t is not None)
    return out


@contextlib.contextmanager
def _stand_ins(changed: Sequence[Tuple[nn.Module, str]]) -> Iterator[None]:
    """Within: copies in place of the buffers ``changed`` (what a recomputation updates);
    afterwards the modules' own buffers again, as the first forward left them."""
    own: List[Tuple[nn.Module, str, torch.Tensor]] = []
    for m, name in changed:
        t = m._buffers.get(name)
        if t is not None:
            own.append((m, name, t))
    try:
        for m, name, t in own:
            m._buffers[name] = t.detach().clone()
        yield
    finally:
        for m, name, t in own:
            m._buffers[name] = t


def _runs(blocks: Sequence[Block]) -> Iterator[Tuple[str, List[Block]]]:
    """Consecutive plain blocks of one mode together (one store or offload context each)."""
    i = 0
    while i < len(blocks):
        b = blocks[i]
        if isinstance(b, Recompute):
            yield "recompute", [b]
            i += 1
            continue
        j = i
        while j < len(blocks) and isinstance(blocks[j], Plain) and blocks[j].mode == b.mode:  # type: ignore[union-attr]
            j += 1
        yield b.mode, list(blocks[i:j])
        i = j


def _kind(b: Optional[Block]) -> str:
    if b is None:
        return "end"
    return b.mode if isinstance(b, Plain) else "recompute"


def run_blocks(chain: Sequence[nn.Module], blocks: Sequence[Block], x: Any, step: int, *,
               saves_in: Sequence[bool], saves_out: Sequence[bool], inplace: Optional[Sequence[bool]] = None) -> Any:
    """Run ``blocks`` of ``chain`` on ``x`` with autograd. Where a run of compressing stages
    meets another block, its boundary activation is held once, in the form the schedule's
    cost model says (``schedule.boundary``): the run leaves its input as it is when what came
    before holds it so (the caller, or a kept stage that saves its output), and its output when
    what follows does (a recomputation, the end, a kept stage that saves its input).
    ``inplace``: per stage, whether it changes its input in place (default: none does)."""
    flags = (saves_in, saves_out, list(inplace) if inplace is not None else [False] * len(chain))
    runs = list(_runs(blocks))
    for r, (mode, run) in enumerate(runs):
        after = _kind(runs[r + 1][1][0]) if r + 1 < len(runs) else "end"
        if mode == "recompute":
            b = run[0]
            assert isinstance(b, Recompute)
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"stage {b.start} gets a {type(x).__name__}; a recomputed stage needs a tensor input")
            x = _Recompute.apply(x, _anchor(x.device), chain, b, step, flags)
        elif mode == "keep":
            for b in run:
                x = chain[b.stage](x)  # type: ignore[union-attr]
        elif mode.startswith("compress:"):
            first = run[0].stage  # type: ignore[union-attr]
            prev = runs[r - 1][1][-1] if r else None  # a kept stage that saves its output holds it as it is
            before_holds = prev is None or (isinstance(prev, Plain) and prev.mode == "keep" and saves_out[first - 1])
            store = StageStore(mode.split(":", 1)[1], step, exclude=[x] if before_holds else [])
            last = run[-1].stage  # type: ignore[union-attr]
            after_holds = after in ("end", "recompute") or (after == "keep" and saves_in[last + 1])
            for b in run:
                with store.stage_of(b.stage, x):  # type: ignore[union-attr]
                    x = chain[b.stage](x)  # type: ignore[union-attr]
                store.finish(x, last=b is run[-1] and after_holds)
        elif mode == "offload":
            with offload_activations():
                for b in run:
                    x = chain[b.stage](x)  # type: ignore[union-attr]
        else:
            raise ValueError(f"unknown storage mode {mode!r}")
    return x


class PlannedSequential(nn.Sequential):
    """The stages of a chain, run by a memory plan in training (see the module docstring).
    ``saves_in`` / ``saves_out`` / ``inplace``: per stage, whether it saves its input / its
    output, and whether it changes its input in place (the plan measured them)."""

    def __init__(self, stages: "OrderedDict[str, nn.Module]", blocks: Sequence[Block], saves_in: Sequence[bool],
                 saves_out: Sequence[bool], plan: Any = None, inplace: Optional[Sequence[bool]] = None) -> None:
        super().__init__(stages)
        self.blocks = list(blocks)
        self.saves_in, self.saves_out = list(saves_in), list(saves_out)
        self.inplace = list(inplace) if inplace is not None else [False] * len(self.saves_in)
        self.plan = plan
        self.step = 0  # keys the codecs' random streams: each training step draws afresh

    def forward(self, x: Any) -> Any:
        if not torch.is_grad_enabled():
            return super().forward(x)
        self.step += 1
        return run_blocks(list(self), self.blocks, x, self.step, saves_in=self.saves_in, saves_out=self.saves_out,
                          inplace=self.inplace)
