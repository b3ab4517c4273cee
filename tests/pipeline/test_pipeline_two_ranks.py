"""A 2-stage pipeline on 2 real gloo ranks: every schedule gives the bits of single-process
training, so does ``torch.distributed.pipelining``'s Schedule1F1B; every codec's round trip
through the boundary is the reference's; shapes change between steps; 1F1B holds at most
``p`` micro-batches on stage 0 (measured); recompute changes no bit; delta mode keeps both
caches equal; a non-finite step changes no state; state round-trips and another rank's is
refused; ranks built differently, or a stage one rank finds wrong, raise the same error.

One spawn of ranks runs every case; the tests assert on its results."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _pipeline_helpers import (LOSS, NOT_BITWISE, chain, data, gathered_params, reference, seq_loss,  # noqa: E402
                               same_params, sgd)
from ranks import run_ranks  # noqa: E402

BALANCE = {"gpipe": [4, 3], "1f1b": [4, 3], "interleaved": [2, 2, 2, 1], "zb-h1": [4, 3], "zb-h2": [4, 3]}
CODECS = [("fp16", {}), ("bf16", {}), ("int8", {}), ("qsgd", {}), ("topk", {"ratio": 0.25})]
STEPS = 3
MODEL_BALANCE = {"conv_bn": [5, 6], "cnn1d": [4, 4], "transformer": [2, 3], "many_small": [14, 13]}


def _codec(name, options):
    from gradcomp.compress import get_compressor

    return get_compressor(name, **options)


def _batches(steps=STEPS, tokens=None, n=16):
    return [data(n, seed=10 + s, tokens=None if tokens is None else tokens[s]) for s in range(steps)]


def _train(schedule, *, microbatches=4, act=None, grad=None, tokens=None, loss_fn=LOSS, **kw):
    from gradcomp.pipeline import Pipeline

    pipe = Pipeline(chain(), balance=BALANCE[schedule], schedule=schedule, microbatches=microbatches,
                    activation_codec=act, grad_codec=grad, optimizer=sgd, **kw)
    losses = [float(pipe.step(x, y, loss_fn)) for x, y in _batches(tokens=tokens)]
    return losses, gathered_params(pipe)


def _messages():
    """Operations this rank posts per step (1F1B, 4 micro-batches): the first step's first
    message on each channel is a header and a tail; later steps fit the capacity carried over,
    until a larger batch grows each channel's first message once more. With each step's
    telemetry of gradcomp's point-to-point batches, which the transport posts them with, and its
    wire bytes."""
    from gradcomp.collectives import reset_telemetry, telemetry
    from gradcomp.pipeline import Pipeline

    pipe = Pipeline(chain(), balance=BALANCE["1f1b"], schedule="1f1b", microbatches=4, optimizer=sgd)
    counts, counted = [], []
    for x, y in _batches(steps=3) + _batches(steps=1, n=32):
        reset_telemetry()
        pipe.step(x, y, LOSS)
        counts.append(pipe._transport.messages)
        batches = telemetry()["by_op"]["p2p/batch"]
        counted.append((batches["bytes_sent"], batches["bytes_recv"], pipe.wire_bytes))
    return counts, counted


class _Marked(torch.nn.Module):
    """A stage whose output width follows the data (a shape no input shape shows): 12 columns
    where the batch's first input column is positive, 8 elsewhere; the next stage pads back."""

    def __init__(self):
        super().__init__()
        self.lin, self.bn, self.drop = torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.25)

    def forward(self, x):
        width = 12 if bool(x[0, 0] > 0) else 8
        return self.drop(self.bn(torch.tanh(self.lin(x))))[:, :width]


class _Pad(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.pad(x, (0, 16 - x.shape[1]))


class _Keep(torch.nn.Module):
    """Holds every input it is given (a view of the received message) and a copy of it."""

    def __init__(self):
        super().__init__()
        self.kept = []

    def forward(self, x):
        self.kept.append((x, x.detach().clone()))
        return x


def _held():
    """A stage that keeps its inputs across steps: the transport must not receive into them again."""
    from gradcomp.pipeline import Pipeline

    model = chain()
    keep = _Keep()
    model = torch.nn.Sequential(*model[:4], keep, *model[4:])
    pipe = Pipeline(model, balance=[4, 4], schedule="1f1b", microbatches=4, optimizer=sgd)
    for x, y in _batches(steps=4):
        pipe.step(x, y, LOSS)
    return pipe.raw_steps, len(keep.kept), all(torch.equal(a, b) for a, b in keep.kept)


def _marked_model():
    torch.manual_seed(3)
    return torch.nn.Sequential(_Marked(), _Pad(), torch.nn.Linear(16, 3))


def _raw(schedule, act=None, grad=None, marks=None, check=False):
    """Training with raw steps (the default) or every message framed (check_messages=True):
    losses, parameters, raw steps and reruns. ``marks``: the sign of each step's first input
    column, which sets the first stage's output width (the model above)."""
    from gradcomp.pipeline import Pipeline

    if marks is None:
        model, balance, batches = chain(), BALANCE[schedule], _batches(steps=4)
    else:
        model, balance, batches = _marked_model(), [1, 2], []
        for s, mark in enumerate(marks):
            x, y = data(16, seed=30 + s)
            x[:, 0] = abs(x[:, 0]) * mark
            batches.append((x, y))
    torch.manual_seed(7)  # dropout's masks: the same stream in both runs
    pipe = Pipeline(model, balance=balance, schedule=schedule, microbatches=4, activation_codec=act,
                    grad_codec=grad, optimizer=sgd, check_messages=check)
    losses = [float(pipe.step(x, y, LOSS)) for x, y in batches]
    buffers = [b.clone() for b in pipe.local.buffers()]
    return losses, gathered_params(pipe), buffers, pipe.raw_steps, pipe.reruns


def _refused_early(rank, refuse):
    """The first stage's first forward runs while the batch agreement travels; a batch the last
    stage refuses then leaves no trace (dropout's random state, batch norm's statistics):
    training with a refused step between two good ones against the two good ones alone."""
    from gradcomp.pipeline import Pipeline

    torch.manual_seed(7)
    pipe = Pipeline(_marked_model(), balance=[1, 2], microbatches=4, optimizer=sgd)
    batches = [data(16, seed=40 + s) for s in range(2)]
    for x, _ in batches:
        x[:, 0] = abs(x[:, 0])
    losses, said = [], None
    for i, (x, y) in enumerate(batches):
        losses.append(float(pipe.step(x, y, LOSS)))
        if refuse and i == 0:
            try:
                pipe.step(x, None if rank == 1 else y, LOSS)
            except ValueError as exc:
                said = str(exc)
    return losses, gathered_params(pipe), [b.clone() for b in pipe.local.buffers()], said


def _torch_1f1b(rank, world):
    """torch.distributed.pipelining on the same model, split and data."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    model = chain()
    sub = model[:4] if rank == 0 else model[4:]
    sched = Schedule1F1B(PipelineStage(sub, rank, world, torch.device("cpu")), 4, loss_fn=LOSS)
    opt = sgd(sub.parameters())
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        per: list = []
        sched.step(x) if rank == 0 else sched.step(target=y, losses=per)
        losses.append(float(torch.stack([p.detach() for p in per]).mean()) if per else None)
        opt.step()
    return losses, [p.detach().clone() for p in sub.parameters()]


def _memory(schedule, checkpoint=None, budget=None):
    from gradcomp.memory import MemoryMeter
    from gradcomp.pipeline import Pipeline

    x, y = data(64, width=64)
    pipe = Pipeline(chain(width=64), balance=[4, 3], schedule=schedule, microbatches=8, checkpoint=checkpoint,
                    optimizer=sgd, memory_budget=budget, sample=x[:8])
    with MemoryMeter() as meter:
        pipe.step(x, y, LOSS)
    return pipe.peak_in_flight, meter.peak_saved_bytes, gathered_params(pipe)


def _delta(rank):
    """Three epochs over the same 16 samples, int8 activation deltas."""
    from gradcomp.pipeline import Pipeline

    pipe = Pipeline(chain(), balance=[4, 3], microbatches=4, activation_codec="int8", delta=True, optimizer=sgd)
    x, y = data(16)
    ids = torch.arange(16)
    losses = [float(pipe.step(x, y, LOSS, sample_ids=ids)) for _ in range(3)]
    cache = pipe._delta_out[0].state_dict() if rank == 0 else pipe._delta_in[0].state_dict()
    return losses, cache, pipe.delta_cache_bytes()


def _state(rank, world):
    """Non-finite step, state_dict round trip, another rank's checkpoint."""
    from gradcomp.pipeline import Pipeline

    out = {}
    pipe = Pipeline(chain(), balance=[4, 3], microbatches=4, activation_codec="qsgd", grad_codec="fp16", delta=True,
                    optimizer=sgd)
    x, y = data(16)
    ids = torch.arange(16)
    for _ in range(2):
        pipe.step(x, y, LOSS, sample_ids=ids)
    before = copy.deepcopy(pipe.state_dict())  # a state_dict holds references, as torch's do
    bad = x.clone()
    bad[3, 0] = float("inf")  # tanh keeps the loss finite; stage 0's gradients are not
    out["inf_loss"] = float(pipe.step(bad, y, LOSS, sample_ids=ids))
    out["inf_applied"] = pipe.applied
    bad[3, 0] = float("nan")
    out["nan_loss"] = float(pipe.step(bad, y, LOSS, sample_ids=ids))
    out["nan_applied"] = pipe.applied
    out["skipped"] = (pipe.skipped, type(pipe.decision).__name__, pipe.decision.skipped)
    out["unchanged"] = _same(pipe.state_dict(), before)
    after = [float(pipe.step(x, y, LOSS, sample_ids=ids)) for _ in range(2)]
    pipe.load_state_dict(before)
    again = [float(pipe.step(x, y, LOSS, sample_ids=ids)) for _ in range(2)]
    out["resumed"] = after == again
    others: list = [None] * world
    torch.distributed.all_gather_object(others, before)
    try:
        pipe.load_state_dict(others[1 - rank])
        out["other_rank"] = None
    except ValueError as exc:
        out["other_rank"] = str(exc)
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _mismatch(rank):
    """Ranks built differently; a problem one rank finds alone (a memory budget too small for
    its stage, a compressor name it does not know): the same error on every rank."""
    import re

    from gradcomp.pipeline import Pipeline

    said = {}
    sample = data(8, width=64)[0]
    for what, kw in (("microbatches", {"microbatches": 4 if rank == 0 else 2}),
                     ("activation_codec", {"activation_codec": "int8" if rank == 0 else "fp16"}),
                     ("memory_budget", {"memory_budget": 4096, "sample": sample, "balance": [6, 1]}),  # stage 0 only
                     ("unknown compressor", {"activation_codec": "int8" if rank == 0 else "int9"})):
        try:
            Pipeline(chain(width=64), optimizer=sgd, **{"microbatches": 4, "balance": [4, 3], **kw})
            said[what] = None
        except ValueError as exc:
            said[what] = str(exc)
    least = re.search(r"raise memory_budget to at least (\d+)$", said["memory_budget"] or "")
    said["least"] = int(least.group(1)) if least else None
    if least:  # the budget the error asks for is enough
        Pipeline(chain(width=64), optimizer=sgd, microbatches=4, balance=[6, 1], sample=sample,
                 memory_budget=said["least"])
    return said


def _bad_inputs():
    """A batch that does not split, given to every rank: refused on every rank before any
    message; the pipeline then trains as if nothing happened."""
    from gradcomp.pipeline import Pipeline

    pipe = Pipeline(chain(), balance=[4, 3], chunks=4, optimizer=sgd)  # chunks=, the keyword's other name
    x, y = data(16)
    try:
        pipe.step(x[:10], y[:10], LOSS)
        said = None
    except ValueError as exc:
        said = str(exc)
    return said, float(pipe.step(x, y, LOSS))


def _disagree(rank):
    """A batch only one rank finds wrong (issue 21): every rank raises the same ValueError and
    nothing is left in flight, so the next good step is the first step of a fresh pipeline."""
    from gradcomp.pipeline import Pipeline

    said = {}
    pipe = Pipeline(chain(), balance=[4, 3], microbatches=4, optimizer=sgd)
    x, y = data(16)
    for what, (xs, ys) in (("uneven", (x, y[:10])), ("sizes", (x, y[:8])), ("missing", (x, None))):
        try:
            pipe.step(xs if rank == 0 else None, ys if rank == 1 else None, LOSS)
            said[what] = None
        except ValueError as exc:
            said[what] = str(exc)
    said["after"] = float(pipe.step(x if rank == 0 else None, y if rank == 1 else None, LOSS))
    delta = Pipeline(chain(), balance=[4, 3], microbatches=4, activation_codec="int8", delta=True, optimizer=sgd)
    ids = torch.arange(16)
    try:
        delta.step(x, y, LOSS, sample_ids=ids if rank == 0 else ids.flip(0))
        said["ids"] = None
    except ValueError as exc:
        said["ids"] = str(exc)
    said["ids_after"] = float(delta.step(x, y, LOSS, sample_ids=ids))
    said["ids_cache"] = delta._delta_out[0].state_dict() if rank == 0 else delta._delta_in[0].state_dict()
    return said


def _models(rank):
    """tests/models.py's sequential models on 2 stages: 1F1B, exact boundaries, 2 steps."""
    from models import KINDS, data as model_data, sequential
    from gradcomp.pipeline import Pipeline

    out = {}
    for kind in KINDS:
        torch.manual_seed(0)
        model = sequential(kind)
        pipe = Pipeline(model, balance=MODEL_BALANCE[kind], microbatches=4, optimizer=sgd)
        batches = [model_data(kind, 16, seed=s) for s in range(2)]
        losses = [float(pipe.step(xb, yb, LOSS)) for xb, yb in batches]
        out[kind] = losses, gathered_params(pipe), [b.clone() for m in pipe.modules for b in m.buffers()]
    for schedule in ("1f1b", "zb-h1"):  # torch's recompute with BatchNorm, under B and under the B/W split
        torch.manual_seed(0)
        pipe = Pipeline(sequential("conv_bn"), balance=MODEL_BALANCE["conv_bn"], schedule=schedule, microbatches=4,
                        checkpoint="always", optimizer=sgd)
        losses = [float(pipe.step(xb, yb, LOSS)) for xb, yb in [model_data("conv_bn", 16, seed=s) for s in range(2)]]
        out[("recompute", schedule)] = losses, gathered_params(pipe), [b.clone() for b in pipe.local.buffers()]
    for schedule in ("gpipe", "1f1b", "zb-h1", "zb-h2"):  # the last micro-batch not recomputed, foreach SGD
        torch.manual_seed(0)
        pipe = Pipeline(sequential("conv_bn"), balance=MODEL_BALANCE["conv_bn"], schedule=schedule, microbatches=4,
                        checkpoint="except_last", optimizer=_sgd_foreach)
        losses = [float(pipe.step(xb, yb, LOSS)) for xb, yb in [model_data("conv_bn", 16, seed=s) for s in range(2)]]
        out[("except_last", schedule)] = losses, gathered_params(pipe), [b.clone() for b in pipe.local.buffers()]
    return out


def _sgd_foreach(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)


def _adamw_fused(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, fused=True)


class _InPlace(torch.nn.Module):
    """Changes its input in place (doubles it, then ReLU): the first layer of every stage but the first."""

    def forward(self, x):
        return x.mul_(2).relu_()


def _in_place_model():
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(16, 16), _InPlace()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(16, 3))


IN_PLACE_BALANCE = {"interleaved": [1, 2, 2, 4]}  # every stage after the first starts with _InPlace; else [3, 6]


def _in_place(schedule, checkpoint=None, optimizer=sgd, act=None):
    """A stage that changes its received input in place, as it may in one process."""
    from gradcomp.pipeline import Pipeline

    pipe = Pipeline(_in_place_model(), balance=IN_PLACE_BALANCE.get(schedule, [3, 6]), schedule=schedule,
                    microbatches=4, checkpoint=checkpoint, optimizer=optimizer, activation_codec=act)
    losses = [float(pipe.step(x, y, LOSS)) for x, y in _batches()]
    return losses, gathered_params(pipe), pipe.raw_steps


class _Stem(torch.nn.Module):
    """A transformer-like first layer's output as a tuple: ``(hidden, mask, ids, bias, skip, unused,
    None)`` -- a bool mask and integer ids (exact across a boundary, no gradient), a float additive
    mask that needs no gradient, a hidden state passed on unchanged (``skip``), one no later stage
    uses (no gradient comes back for it) and a None."""

    def __init__(self, dtype):
        super().__init__()
        self.lin, self.side, self.dtype = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), dtype

    def forward(self, x):
        mask = x[:, 0] > -0.5
        ids = (x[:, 1] > 0).long() + 2 * (x[:, 2] > 0).long()
        bias = torch.where(x[:, 3:4] > 0, 0.0, -1.0).expand(-1, 16)
        h = self.lin(x)
        return h.to(self.dtype), mask, ids, bias, (h * 0.5).to(self.dtype), self.side(x), None


class _Layer(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.lin, self.embed, self.dtype = torch.nn.Linear(16, 16), torch.nn.Embedding(4, 16), dtype

    def forward(self, parts):
        h, mask, ids, bias, skip, unused, none = parts
        h = torch.tanh(self.lin(h.float()) + self.embed(ids) + bias) * mask[:, None]
        return h.to(self.dtype), mask, ids, bias, skip, unused, none


class _Out(torch.nn.Module):
    """The logits and the mask: the last stage's output is a tuple too."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 3)

    def forward(self, parts):
        h, mask, _, _, skip, _, _ = parts
        return self.lin((h + skip).float()), mask


def _tuple_model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(_Stem(dtype), *[_Layer(dtype) for _ in range(5)], _Out())


def _tuple_loss(out, y):
    return LOSS(out[0], y)


def _tuples(schedule, act=None, grad=None, dtype=torch.float32, delta=False):
    """Stages that pass tuples of tensors of several dtypes (the first steps framed, the later
    raw); the last stage's eval_step output, a tuple joined micro-batch by micro-batch."""
    from gradcomp.pipeline import Pipeline

    pipe = Pipeline(_tuple_model(dtype), balance=BALANCE[schedule], schedule=schedule, microbatches=4,
                    activation_codec=act, grad_codec=grad, optimizer=sgd, delta=delta)
    ids = torch.arange(16) if delta else None
    losses = [float(pipe.step(x, y, _tuple_loss, sample_ids=ids)) for x, y in _batches()]
    out, _ = pipe.eval_step(_batches()[0][0])
    cache = None
    if delta:
        cache = pipe._delta_out[0].state_dict() if pipe.is_first else pipe._delta_in[0].state_dict()
    return losses, gathered_params(pipe), pipe.raw_steps, out, cache


class _Tokens(torch.nn.Module):
    """A first stage without parameters whose output is integer token ids."""

    def forward(self, x):
        return (x[:, :4] > 0).long() + 2 * (x[:, 4:8] > 0).long()


class _Pool(torch.nn.Module):
    def forward(self, h):
        return h.mean(1)


def _parameterless_model(where):
    torch.manual_seed(0)
    if where == "first, integer output":
        return torch.nn.Sequential(_Tokens(), torch.nn.Embedding(4, 16), _Pool(), torch.nn.Linear(16, 3))
    if where == "first":
        return torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3),
                               torch.nn.LogSoftmax(dim=1))


PARAMETERLESS = {"first, integer output": [1, 3], "first": [1, 3], "last": [3, 1]}


def _parameterless(rank):
    """A stage without parameters, given optimizer=: it gets no optimizer and trains as one
    process; a factory that raises on one rank raises the same error on every rank."""
    from gradcomp.pipeline import Pipeline

    out = {}
    for where, balance in PARAMETERLESS.items():
        for schedule, optimizer in (("1f1b", _adamw_fused), ("zb-h1", _sgd_foreach)):
            pipe = Pipeline(_parameterless_model(where), balance=balance, schedule=schedule, microbatches=4,
                            optimizer=optimizer)
            losses = [float(pipe.step(x, y, LOSS)) for x, y in _batches()]
            out[(where, schedule)] = losses, gathered_params(pipe), pipe.optimizer is None
    try:
        Pipeline(chain(), balance=[4, 3], microbatches=4,
                 optimizer=(lambda p: torch.optim.AdamW(p, lr=-1.0)) if rank == 1 else _adamw_fused)
        out["raises"] = None
    except ValueError as exc:
        out["raises"] = str(exc)
    return out


def _eval():
    from gradcomp.pipeline import Pipeline

    pipe = Pipeline(chain(), balance=[4, 3], microbatches=4, optimizer=sgd)
    x, y = data(16)
    out, loss = pipe.eval_step(x, y, LOSS)
    return out, float(loss)


def _explicit(rank, schedule):
    """This rank's own modules instead of a balance: the same run as with the balance."""
    from gradcomp.pipeline import Pipeline

    model = chain()
    bounds = [0] + [sum(BALANCE[schedule][:i + 1]) for i in range(len(BALANCE[schedule]))]
    pieces = [model[a:b] for a, b in zip(bounds, bounds[1:])]
    mine = pieces[rank::2]
    pipe = Pipeline(mine if len(mine) > 1 else mine[0], schedule=schedule, microbatches=4, optimizer=sgd)
    losses = [float(pipe.step(x, y, LOSS)) for x, y in _batches()]
    return losses, gathered_params(pipe)


def _auto(rank):
    """balance='auto' on an uneven model: every rank cuts where rank 0 measured."""
    from gradcomp.pipeline import Pipeline

    torch.manual_seed(0)
    wide = torch.nn.Sequential(torch.nn.Linear(16, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Tanh(),
                               torch.nn.Linear(512, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    x, y = data(16)
    pipe = Pipeline(wide, balance="auto", sample=x[:4], microbatches=4, optimizer=sgd, activation_codec="int8",
                    link_bps=1e9)
    return pipe.balance, float(pipe.step(x, y, LOSS))


def _auto_tuples():
    """balance='auto' on layers that pass tuples."""
    from gradcomp.pipeline import Pipeline

    x, y = data(16)
    pipe = Pipeline(_tuple_model(), balance="auto", sample=x[:4], microbatches=4, optimizer=sgd, link_bps=1e9)
    return pipe.balance, float(pipe.step(x, y, _tuple_loss))


def _rank(rank, world):
    res = {"auto": _auto(rank), "auto tuples": _auto_tuples()}
    for schedule in BALANCE:
        res[("exact", schedule)] = _train(schedule)
    res["torch_1f1b"] = _torch_1f1b(rank, world)
    res["messages"] = _messages()
    for schedule, act, grad in (("1f1b", None, None), ("zb-h1", "int8", "fp16"), ("gpipe", "topk", "fp16")):
        for check in (False, True):
            res[("raw", schedule, act, check)] = _raw(schedule, act, grad, check=check)
    res["held"] = _held()
    for refuse in (False, True):
        res[("refused early", refuse)] = _refused_early(rank, refuse)
    for check in (False, True):
        res[("raw moved", check)] = _raw("1f1b", marks=[1, 1, -1, -1, 1], check=check)
    for schedule in ("1f1b", "interleaved"):
        res[("explicit", schedule)] = _explicit(rank, schedule)
    for name, options in CODECS:
        res[("codec", name)] = _train("1f1b", act=_codec(name, options), grad=_codec(name, options))
    res[("codec", "int8+fp16")] = _train("1f1b", act="int8", grad="fp16")
    for codec in (None, "int8"):
        res[("tokens", codec)] = _train("1f1b", act=codec, tokens=[5, 9, 3], loss_fn=seq_loss)
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        res[("memory", schedule)] = _memory(schedule)
    res[("memory", "except_last")] = _memory("1f1b", "except_last")
    res[("memory", "plan")] = _memory("1f1b", budget=20480)
    res[("memory", "zb-h1 except_last")] = _memory("zb-h1", "except_last")  # recompute under the B/W split
    res[("memory", "zb-h1 plan")] = _memory("zb-h1", budget=20480)
    res[("codec", "zb-h1 int8+fp16")] = _train("zb-h1", act="int8", grad="fp16")
    res["delta"] = _delta(rank)
    res["state"] = _state(rank, world)
    res["mismatch"] = _mismatch(rank)
    res["eval"] = _eval()
    res["bad_inputs"] = _bad_inputs()
    res["disagree"] = _disagree(rank)
    res["models"] = _models(rank)
    for schedule in BALANCE:
        res[("in place", schedule)] = _in_place(schedule)
        res[("tuples", schedule)] = _tuples(schedule)
    for schedule, checkpoint in (("1f1b", "always"), ("zb-h1", "except_last"), ("zb-h2", "always")):
        res[("in place", schedule, checkpoint)] = _in_place(schedule, checkpoint)
    res[("in place", "1f1b", "foreach bf16")] = _in_place("1f1b", optimizer=_sgd_foreach, act="bf16")
    res[("tuples", "1f1b", "int8+fp16")] = _tuples("1f1b", act="int8", grad="fp16")
    res[("tuples", "zb-h1", "qsgd")] = _tuples("zb-h1", act="qsgd", grad="qsgd")
    res[("tuples", "1f1b", "bf16")] = _tuples("1f1b", dtype=torch.bfloat16)
    res[("tuples", "delta")] = _tuples("1f1b", act="int8", delta=True)
    res["parameterless"] = _parameterless(rank)
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_rank, 2, tmp_path_factory.mktemp("pipeline2"), timeout_s=120)


def test_capacities_carry_over_between_steps(results):
    # each rank sends 4 messages on one channel and receives 4 on the other: 8 operations, plus a
    # tail each way for a channel's first message (the first step) and for a message that grew
    for r in results:
        assert r["messages"][0] == [10, 8, 8, 10], r["messages"][0]


def test_boundary_bytes_are_counted_in_telemetry(results):
    # the transport posts through collectives.p2p.batch_send_recv: telemetry's "p2p/batch" holds
    # every byte of the step's messages (framed or raw), what the other rank received
    for r, other in ((results[0], results[1]), (results[1], results[0])):
        for (sent, _, wire), (_, recv, _) in zip(r["messages"][1], other["messages"][1]):
            assert sent == wire == recv > 0, (sent, wire, recv)


@pytest.mark.parametrize("schedule,act", [("1f1b", None), ("zb-h1", "int8"), ("gpipe", "topk")])
def test_raw_steps_equal_framed_ones(results, schedule, act):
    # after the first (framed) step every step's messages travel raw on the learned layouts:
    # the same bits as when every message is framed and checked (check_messages=True)
    for r in results:
        raw, framed = r[("raw", schedule, act, False)], r[("raw", schedule, act, True)]
        assert raw[3:] == (3, 0) and framed[3:] == (0, 0), (raw[3:], framed[3:])
        assert raw[0] == framed[0]
        assert all(torch.equal(a, b) for a, b in zip(raw[1], framed[1]))


def test_a_received_tensor_held_by_the_stage_is_not_received_into_again(results):
    # the transport keeps its buffers from step to step, but not one a tensor of the caller views
    raw_steps, kept, same = results[1]["held"]
    assert (raw_steps, kept, same) == (3, 16, True)
    assert results[0]["held"][1] == 0


def test_a_batch_refused_after_the_early_first_forward_leaves_no_trace(results):
    for r in results:
        plain, refused = r[("refused early", False)], r[("refused early", True)]
        assert refused[3] is not None and "targets is missing" in refused[3]
        assert plain[0] == refused[0]
        assert all(torch.equal(a, b) for a, b in zip(plain[1], refused[1]))
        assert all(torch.equal(a, b) for a, b in zip(plain[2], refused[2]))


def test_a_layout_that_moves_reruns_the_step_framed(results):
    # steps: width 12 (framed, learned), 12 (raw), 8 (raw: the payload leaves its layout, so every
    # rank undoes the step and runs it again framed; raw steps end), 8, 12 (framed): the bits,
    # dropout's masks and batch norm's statistics of training with every message framed
    for r in results:
        raw, framed = r[("raw moved", False)], r[("raw moved", True)]
        assert raw[3:] == (1, 1) and framed[3:] == (0, 0), (raw[3:], framed[3:])
        assert raw[0] == framed[0]
        assert all(torch.equal(a, b) for a, b in zip(raw[1], framed[1]))
        assert len(raw[2]) == len(framed[2]) and all(torch.equal(a, b) for a, b in zip(raw[2], framed[2]))


@pytest.mark.parametrize("schedule", list(BALANCE))
def test_schedule_equals_single_process(results, schedule):
    ref_losses, ref_params = reference(chain(), BALANCE[schedule], _batches(), 4)
    for rank in range(2):
        losses, params = results[rank][("exact", schedule)]
        assert losses == ref_losses, f"rank {rank}: the returned loss must be the last stage's, bit for bit"
        assert same_params(schedule, params, ref_params), "parameters differ from one process"


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_per_rank_modules_equal_the_balanced_split(results, schedule):
    for rank in range(2):
        assert results[rank][("explicit", schedule)][0] == results[rank][("exact", schedule)][0]
        assert all(torch.equal(a, b) for a, b in zip(results[rank][("explicit", schedule)][1],
                                                     results[rank][("exact", schedule)][1]))


def test_same_as_torch_pipelining_1f1b(results):
    torch_losses = results[1]["torch_1f1b"][0]
    torch_params = results[0]["torch_1f1b"][1] + results[1]["torch_1f1b"][1]
    losses, params = results[0][("exact", "1f1b")]
    assert losses == torch_losses
    assert all(torch.equal(a, b) for a, b in zip(params, torch_params))


@pytest.mark.parametrize("name", [n for n, _ in CODECS] + ["int8+fp16"])
def test_codec_round_trip_through_the_boundary(results, name):
    if name == "int8+fp16":
        act, grad = _codec("int8", {}), _codec("fp16", {})
    else:
        options = dict(CODECS)[name]
        act, grad = _codec(name, options), _codec(name, options)
    ref_losses, ref_params = reference(chain(), [4, 3], _batches(), 4, act=act, grad=grad)
    losses, params = results[0][("codec", name)]
    assert losses == ref_losses, f"{name}: the pipeline's boundary is not the codec's round trip"
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    exact = results[0][("exact", "1f1b")][0]
    assert abs(losses[-1] - exact[-1]) < 0.05, "a codec at this ratio must not derail training"


@pytest.mark.parametrize("codec", [None, "int8"])
def test_shapes_change_between_steps(results, codec):
    from gradcomp.compress import get_compressor

    act = None if codec is None else get_compressor(codec)
    ref_losses, ref_params = reference(chain(), [4, 3], _batches(tokens=[5, 9, 3]), 4, act=act, loss_fn=seq_loss)
    losses, params = results[0][("tokens", codec)]
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def test_1f1b_holds_at_most_p_micro_batches_on_stage_0(results):
    gpipe_live, gpipe_bytes, gpipe_params = results[0][("memory", "gpipe")]
    live, saved, params = results[0][("memory", "1f1b")]
    assert gpipe_live == 8 and live == 2, (gpipe_live, live)
    # measured saved-activation bytes follow: the micro-batches are views of one input batch
    # (64 x 64 fp32, counted once), on top of which 1F1B holds 2 of GPipe's 8 micro-batches
    shared = 64 * 64 * 4
    assert (saved - shared) * 4 == gpipe_bytes - shared, (saved, gpipe_bytes)
    assert all(torch.equal(a, b) for a, b in zip(params, gpipe_params))


def test_recompute_except_last_changes_no_bit_and_saves_memory(results):
    _, plain_bytes, plain = results[0][("memory", "1f1b")]
    _, bytes_, params = results[0][("memory", "except_last")]
    assert all(torch.equal(a, b) for a, b in zip(params, plain))
    assert bytes_ < plain_bytes, (bytes_, plain_bytes)


def test_memory_plan_inside_stages_changes_no_bit_and_saves_memory(results):
    _, plain_bytes, plain = results[0][("memory", "1f1b")]
    _, bytes_, params = results[0][("memory", "plan")]
    assert all(torch.equal(a, b) for a, b in zip(params, plain)), "a lossless plan must not change a bit"
    assert bytes_ < plain_bytes, (bytes_, plain_bytes)


def test_zero_bubble_split_backward_changes_no_bit_with_recompute_plans_and_codecs(results):
    """Issue 27: ZB-H1's I and W passes give 1F1B's bits, at 1F1B's stage-0 memory, with
    torch's recompute, with a memory plan and through compressed boundaries."""
    _, plain_bytes, plain = results[0][("memory", "1f1b")]
    for rank in range(2):
        live, _, params = results[rank][("memory", "zb-h1")]
        assert live == 2, f"rank {rank}: ZB-H1 holds {live} micro-batches, 1F1B's stage 0 holds 2"
        assert all(torch.equal(a, b) for a, b in zip(params, plain))
    for case in ("zb-h1 except_last", "zb-h1 plan"):
        _, bytes_, params = results[0][("memory", case)]
        assert all(torch.equal(a, b) for a, b in zip(params, plain)), case
        assert bytes_ < results[0][("memory", "zb-h1")][1], case
    assert results[0][("codec", "zb-h1 int8+fp16")][0] == results[0][("codec", "int8+fp16")][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][("codec", "zb-h1 int8+fp16")][1],
                                                 results[0][("codec", "int8+fp16")][1]))


def test_delta_mode_keeps_both_caches_equal(results):
    losses0, sent, nbytes0 = results[0]["delta"]
    losses1, received, nbytes1 = results[1]["delta"]
    assert losses0 == losses1
    assert sent.keys() == received.keys() == {str(i) for i in range(16)}
    assert all(torch.equal(sent[k], received[k]) for k in sent), "sender and receiver caches drifted apart"
    assert nbytes0 == nbytes1 == 16 * 16 * 4, "one fp32 activation row per sample on each side"
    ref_losses, _ = reference(chain(), [4, 3], [data(16)] * 3, 4)
    assert max(abs(a - b) for a, b in zip(losses0, ref_losses)) < 0.02


def test_nonfinite_step_changes_no_state_and_state_round_trips(results):
    for rank in range(2):
        out = results[rank]["state"]
        assert out["nan_loss"] != out["nan_loss"], "the NaN loss is returned to every rank"
        assert out["inf_loss"] == out["inf_loss"] and not out["inf_applied"] and not out["nan_applied"]
        assert out["skipped"] == (2, "StepDecision", 2), out["skipped"]  # both steps, by the step decision
        assert out["unchanged"], f"rank {rank}: a non-finite step changed the state"
        assert out["resumed"], f"rank {rank}: steps after load_state_dict differ from the first run"
        assert out["other_rank"] is not None and "it is rank 1's, loaded on rank 0" in out["other_rank"], \
            out["other_rank"]
    assert results[0]["state"]["other_rank"] == results[1]["state"]["other_rank"], "refused alike on every rank"


@pytest.mark.parametrize("what", ["microbatches", "activation_codec"])
def test_mismatched_config_raises_on_every_rank(results, what):
    said = [results[r]["mismatch"][what] for r in range(2)]
    assert said[0] is not None and said[0] == said[1], said
    assert what in said[0] and "ranks disagree" in said[0]


def test_a_memory_budget_too_small_says_the_budget_that_fits_on_every_rank(results):
    """Issue 28: not a disagreement between ranks, nor cut short, and the budget it asks for works."""
    said = [results[r]["mismatch"]["memory_budget"] for r in range(2)]
    assert said[0] is not None and said[0] == said[1], said
    assert "ranks disagree" not in said[0] and "..." not in said[0], said[0]
    assert said[0].startswith("Pipeline: memory_budget=4096 bytes") and "stage 0 (rank 0) needs at least" in said[0]
    least = results[0]["mismatch"]["least"]
    assert least is not None and least > 4096 and said[0].endswith(f"raise memory_budget to at least {least}")


def test_a_compressor_one_rank_does_not_know_raises_on_every_rank(results):
    said = [results[r]["mismatch"]["unknown compressor"] for r in range(2)]
    assert said[0] is not None and said[0] == said[1], said
    assert said[0].startswith("Pipeline: rank 1: activation_codec: unknown compressor 'int9'"), said[0]


def test_eval_step_is_the_model_forward(results):
    x, y = data(16)
    model = chain()
    with torch.no_grad():
        want = torch.cat([model(xb) for xb in x.chunk(4)])
    out, loss = results[1]["eval"]
    assert torch.equal(out, want)
    assert results[0]["eval"][0] is None and results[0]["eval"][1] == loss


@pytest.mark.parametrize("case", ["auto", "auto tuples"])
def test_auto_balance_is_shared_by_every_rank(results, case):
    balance, loss = results[0][case]
    assert results[1][case] == (balance, loss)
    assert sum(balance) == 7 and len(balance) == 2 and loss == loss


def test_bad_inputs_are_refused_before_any_message(results):
    said = [results[r]["bad_inputs"][0] for r in range(2)]
    assert said[0] is not None and said[0] == said[1] and "does not split into microbatches=4" in said[0]
    ref_losses, _ = reference(chain(), [4, 3], [data(16)], 4)
    assert [results[r]["bad_inputs"][1] for r in range(2)] == ref_losses * 2, "the refused step changed something"


@pytest.mark.parametrize("what", ["uneven", "sizes", "missing"])
def test_a_batch_wrong_on_one_rank_raises_on_every_rank(results, what):
    said = [results[r]["disagree"][what] for r in range(2)]
    assert said[0] is not None and said[0] == said[1], said
    assert "refused on every rank" in said[0]
    want = {"uneven": "rank 1: the batch of 10 targets does not split into microbatches=4",
            "sizes": "batches of different sizes", "missing": "rank 1: targets is missing"}[what]
    assert want in said[0], said[0]


def test_a_refused_batch_leaves_nothing_in_flight(results):
    ref_losses, _ = reference(chain(), [4, 3], [data(16)], 4)
    assert [results[r]["disagree"]["after"] for r in range(2)] == ref_losses * 2, \
        "the step after a refused one is not a fresh first step: a message of the refused step was consumed"


def test_delta_sample_ids_differing_between_stages_raise_on_both(results):
    said = [results[r]["disagree"]["ids"] for r in range(2)]
    assert said[0] is not None and said[0] == said[1] and "sample_ids differ" in said[0], said
    fresh = results[0]["delta"][0][0]  # the first step of a delta pipeline with the same ids
    assert [results[r]["disagree"]["ids_after"] for r in range(2)] == [fresh, fresh]
    sent, received = results[0]["disagree"]["ids_cache"], results[1]["disagree"]["ids_cache"]
    assert sent.keys() == received.keys() == {str(i) for i in range(16)}
    assert all(torch.equal(sent[k], received[k]) for k in sent)


@pytest.mark.parametrize("kind", list(MODEL_BALANCE))
def test_other_models_equal_single_process(results, kind):
    """BatchNorm normalises each micro-batch (and updates its running statistics once per
    micro-batch, in order), as the one-process reference on the same micro-batches does."""
    from models import data as model_data, sequential

    torch.manual_seed(0)
    model = sequential(kind)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: a convolution's weight gradient sums in another order on more threads
    try:
        ref_losses, ref_params = reference(model, MODEL_BALANCE[kind], [model_data(kind, 16, seed=s) for s in range(2)],
                                           4)
    finally:
        torch.set_num_threads(threads)
    ref_buffers = [b for b in model.buffers()]
    for rank in range(2):
        losses, params, _ = results[rank]["models"][kind]
        assert losses == ref_losses, (kind, rank, losses, ref_losses)
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params)), f"{kind}: parameters differ"
    buffers = results[0]["models"][kind][2] + results[1]["models"][kind][2]
    assert len(buffers) == len(ref_buffers) and all(torch.equal(a, b) for a, b in zip(buffers, ref_buffers))


def test_zero_bubble_recompute_moves_batchnorm_statistics_as_b_does(results):
    """Issue 27: torch's checkpoint recomputes its region again in the W pass; the stage's
    buffers are put back after it, so BatchNorm's statistics and the bits are 1F1B's."""
    for rank in range(2):
        b, zb = (results[rank]["models"][("recompute", s)] for s in ("1f1b", "zb-h1"))
        assert zb[0] == b[0]
        assert all(torch.equal(x, y) for x, y in zip(zb[1], b[1]))
        assert len(zb[2]) == len(b[2]) and all(torch.equal(x, y) for x, y in zip(zb[2], b[2])), f"rank {rank}"


def _plain(rank, world):
    return {schedule: _train(schedule, act="int8")[0] for schedule in ("1f1b", "interleaved")}


def test_plain_gloo_runs_the_transport(tmp_path):
    """Without the strict mode (plain gloo, what CPU users run): gloo moves a send only while it
    is waited, which the strict mode's own waiting hides; every step still completes, with the
    strict run's bits."""
    plain = run_ranks(_plain, 2, tmp_path, timeout_s=60, strict=False)  # the backend's own progress rules
    for schedule in ("1f1b", "interleaved"):
        ref_losses, _ = reference(chain(), BALANCE[schedule], _batches(), 4, act=_codec("int8", {}))
        assert plain[0][schedule] == plain[1][schedule] == ref_losses, schedule


@pytest.mark.parametrize("case", [(s,) for s in BALANCE] + [("1f1b", "always"), ("zb-h1", "except_last"),
                                                           ("zb-h2", "always"), ("1f1b", "foreach bf16")])
def test_a_stage_that_changes_its_input_in_place_trains_as_one_process(results, case):
    """A stage whose first layer changes its input in place (``ReLU(inplace=True)``, here
    ``x.mul_(2).relu_()``) gets the received tensor as one process gives a layer its input, in
    every schedule; a recomputed stage recomputes from the input it was given (in one process
    torch's checkpoint refuses that input change)."""
    from gradcomp.compress import get_compressor

    schedule = case[0]
    optimizer, act = (_sgd_foreach, get_compressor("bf16")) if case[1:] == ("foreach bf16",) else (None, None)
    ref_losses, ref_params = reference(_in_place_model(), IN_PLACE_BALANCE.get(schedule, [3, 6]), _batches(), 4,
                                       act=act, optimizer=optimizer)
    for rank in range(2):
        losses, params, raw_steps = results[rank][("in place",) + case]
        assert losses == ref_losses, (rank, losses, ref_losses)
        assert same_params(schedule, params, ref_params), f"rank {rank}: parameters differ from one process"
        assert raw_steps == STEPS - 1


def test_zero_bubble_recompute_except_last_with_batchnorm_equals_gpipe_1f1b_and_one_process(results):
    """The W pass puts BatchNorm's statistics back after its recomputation without moving their
    version counter, which the not-recomputed last micro-batch's graph saved. The statistics move
    at each forward and each recomputation, so they are those of the schedule with the same order
    of forwards and backwards: ZB-H1's are 1F1B's on both ranks, ZB-H2's on the last."""
    from models import data as model_data, sequential

    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks
    try:
        ref_losses, ref_params = reference(sequential("conv_bn"), MODEL_BALANCE["conv_bn"],
                                           [model_data("conv_bn", 16, seed=s) for s in range(2)], 4,
                                           optimizer=_sgd_foreach)
    finally:
        torch.set_num_threads(threads)
    for rank in range(2):
        runs = {s: results[rank]["models"][("except_last", s)] for s in ("gpipe", "1f1b", "zb-h1", "zb-h2")}
        for schedule, (losses, params, _) in runs.items():
            assert losses == ref_losses, (schedule, rank)
            assert all(torch.equal(a, b) for a, b in zip(params, ref_params)), (schedule, rank)
        for schedule in ("zb-h1", "zb-h2") if rank == 1 else ("zb-h1",):
            buffers, want = runs[schedule][2], runs["1f1b"][2]
            assert len(buffers) == len(want) and all(torch.equal(a, b) for a, b in zip(buffers, want)), (schedule, rank)


@pytest.mark.parametrize("where", list(PARAMETERLESS))
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_stage_without_parameters_gets_no_optimizer_and_trains_as_one_process(results, where, schedule):
    optimizer = _adamw_fused if schedule == "1f1b" else _sgd_foreach
    ref_losses, ref_params = reference(_parameterless_model(where), PARAMETERLESS[where], _batches(), 4,
                                       optimizer=optimizer)
    without = 0 if where.startswith("first") else 1
    for rank in range(2):
        losses, params, no_optimizer = results[rank]["parameterless"][(where, schedule)]
        assert no_optimizer == (rank == without)
        assert losses == ref_losses, (rank, losses, ref_losses)
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params)), f"rank {rank}: parameters differ"


def test_an_optimizer_factory_that_raises_on_one_rank_raises_on_every_rank(results):
    said = [results[r]["parameterless"]["raises"] for r in range(2)]
    assert said[0] is not None and said[0] == said[1], said
    assert said[0].startswith("Pipeline: rank 1: optimizer= raised") and "learning rate" in said[0], said[0]


TUPLE_CASES = [(s,) for s in BALANCE] + [("1f1b", "int8+fp16"), ("zb-h1", "qsgd"), ("1f1b", "bf16")]


@pytest.mark.parametrize("case", TUPLE_CASES)
def test_stages_that_pass_tuples_train_as_one_process(results, case):
    """Tuples cross every boundary in every schedule, framed and raw: floating-point values
    through the boundary compressors (keyed per value), bool and integer tensors exact, None as
    None; a value no later stage uses gets no gradient (its layer none, as in one process)."""
    from gradcomp.compress import get_compressor

    schedule, variant = case[0], case[1:]
    codecs = {("int8+fp16",): ("int8", "fp16"), ("qsgd",): ("qsgd", "qsgd")}.get(variant)
    act, grad = (get_compressor(codecs[0]), get_compressor(codecs[1])) if codecs else (None, None)
    dtype = torch.bfloat16 if variant == ("bf16",) else torch.float32
    ref_model = _tuple_model(dtype)
    ref_losses, ref_params = reference(ref_model, BALANCE[schedule], _batches(), 4, act=act, grad=grad,
                                       loss_fn=_tuple_loss)
    assert ref_model[0].side.weight.grad is None, "the unused value's layer gets no gradient in one process"
    for rank in range(2):
        losses, params, raw_steps, out, _ = results[rank][("tuples",) + case]
        assert losses == ref_losses, (rank, losses, ref_losses)
        assert same_params(schedule, params, ref_params), f"rank {rank}: parameters differ from one process"
        assert raw_steps == STEPS - 1
    x = _batches()[0][0]
    with torch.no_grad():
        want = [ref_model(xb) for xb in x.chunk(4)]
    logits, mask = results[1][("tuples",) + case][3]
    assert results[0][("tuples",) + case][3] is None
    if codecs is None and schedule not in NOT_BITWISE:  # else within rounding, or through the codecs
        assert torch.equal(logits, torch.cat([w[0] for w in want]))
    assert mask.dtype == torch.bool and torch.equal(mask, torch.cat([w[1] for w in want]))


def test_tuples_in_delta_mode_keep_both_caches_equal(results):
    losses0, _, _, _, sent = results[0][("tuples", "delta")]
    losses1, _, _, _, received = results[1][("tuples", "delta")]
    assert losses0 == losses1
    # a row per sample and floating-point value that is not None: hidden, bias, skip, unused
    assert sent.keys() == received.keys() == {f"{i}.{v}" for i in range(16) for v in (0, 3, 4, 5)}
    assert all(torch.equal(sent[k], received[k]) for k in sent)
    exact = results[0][("tuples", "1f1b")][0]
    assert max(abs(a - b) for a, b in zip(losses0, exact)) < 0.05
