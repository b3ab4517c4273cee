"""CompressedOptimizer on 2 real gloo ranks (no DDP): every compressor, resume, optimizer API.

One spawn runs every check; the tests assert on its results:

- parameters are broadcast from rank 0 at construction (and by ``add_param_group``);
- with ``none`` the wrapper gives exactly the parameters of plain DDP, also with gradient
  accumulation under ``no_sync``;
- every compressor keeps the replicas bit-identical and the loss finite, compressing from the
  first step, with state under parameter names;
- buckets are sent during backward (before ``step``);
- checkpoint -> resume (``state_dict`` with error-feedback state) is bit-identical;
- threshold whose payloads are empty on every rank (nothing reaches tau) decodes to zeros,
  fp32 and bf16, on the agreed layout;
- a parameter whose gradient is None on every rank is left as the inner optimizer leaves it
  (AdamW foreach and fused, SGD with momentum; weight decay included; its gradient stays None
  and what its error feedback owes stays), one that is None on some ranks only is averaged
  with zeros there (the bits of DDP's ``find_unused_parameters``), and ``step()`` without a
  backward pass moves nothing;
- LR schedulers, ``zero_grad``, ``param_groups`` and ``add_param_group`` act as on the inner
  optimizer.
"""
from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _training_helpers import batch, flat_params, mlp, teacher_data
from ranks import run_ranks
from syncs import HostSyncs
from gradcomp.compress import available_compressors

STEPS = 6
OPTIONS = {"powersgd": {"rank": 1}}
RESUMED = {"powersgd": {"rank": 2}, "topk": {"ratio": 0.05}, "signum": {}, "qsgd": {}}
QUIET = (torch.float32, torch.bfloat16)


def _opt_run(me, compressor, steps, *, start=0, checkpoint=None, save_at=None, seed=0, accumulate=1,
             bucket_mb=25.0, dtype=torch.float32, **options):
    from gradcomp.training import CompressedOptimizer

    x, y = teacher_data(512, 20, 4)
    x = x.to(dtype)
    model = mlp(20, 64, 4, seed=seed).to(dtype)
    opt = CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), compressor,
                              model=model, min_numel=0, bucket_mb=bucket_mb, **options)
    if checkpoint is not None:
        ck = torch.load(io.BytesIO(checkpoint), weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
    losses, saved, launched = [], None, []
    for step in range(start, start + steps):
        opt.zero_grad()
        for micro in range(accumulate):
            xb, yb = batch(x, y, 16, me, step * accumulate + micro)
            with opt.no_sync() if micro < accumulate - 1 else contextlib.nullcontext():
                loss = torch.nn.functional.cross_entropy(model(xb), yb)
                loss.backward()
        launched.append(all(f is not None for f in opt._launcher.futures))
        opt.step()
        losses.append(float(loss.detach()))
        if save_at == step + 1:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
            saved = buf.getvalue()
    return model, opt, losses, saved, launched


def _plain_ddp(me, steps, accumulate=1):
    x, y = teacher_data(512, 20, 4)
    model = mlp(20, 64, 4)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            xb, yb = batch(x, y, 16, me, step * accumulate + micro)
            with ddp.no_sync() if micro < accumulate - 1 else contextlib.nullcontext():  # forward included
                torch.nn.functional.cross_entropy(ddp(xb), yb).backward()
        opt.step()
    return flat_params(model)


def _api(me):
    """Broadcast, add_param_group, LR scheduler, zero_grad and param_groups on the wrapper."""
    from gradcomp.training import CompressedOptimizer

    x, y = teacher_data(512, 20, 4)
    model = mlp(20, 64, 4, seed=me)  # different on each rank: the wrapper broadcasts rank 0's
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = CompressedOptimizer(inner, "topk", ratio=0.05, min_numel=0)
    out = {"broadcast": flat_params(model), "same_groups": opt.param_groups is inner.param_groups}
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    head = torch.nn.Linear(4, 3)
    torch.manual_seed(100 + me)
    torch.nn.init.normal_(head.weight)
    lrs = []
    for step in range(STEPS):
        if step == 2:
            opt.add_param_group({"params": head.parameters(), "lr": 0.05})
        opt.zero_grad()
        xb, yb = batch(x, y, 16, me, step)
        out_ = model(xb)
        if step >= 2:
            out_ = head(out_)
        torch.nn.functional.cross_entropy(out_, yb % out_.shape[1]).backward()
        opt.step()
        sched.step()
        lrs.append([g["lr"] for g in inner.param_groups])
    opt.zero_grad(set_to_none=True)
    out.update(params=torch.cat([flat_params(model), flat_params(head)]), lrs=lrs,
               grads_cleared=all(p.grad is None for p in model.parameters()), groups=len(inner.param_groups))
    return out


class _Branches(torch.nn.Module):
    """A trunk and a head that every rank uses, a branch used at the first step only, one that
    rank 0 alone uses and one that nothing uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.head = torch.nn.Linear(20, 16), torch.nn.Linear(16, 4)
        self.first, self.rank0, self.never = torch.nn.Linear(16, 4), torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)

    def forward(self, x, rank, step):
        h = torch.relu(self.trunk(x))
        out = self.head(h)
        if step == 0:
            out = out + self.first(h)
        if rank == 0:
            out = out + self.rank0(h)
        return out


INNER = {  # the optimizer paths users take on GPUs, and plain SGD with momentum; weight decay in each
    "adamw foreach": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, foreach=True),
    "adamw fused": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, fused=True),
    "sgd momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1),
}
BRANCHES = ("none", "topk")  # None: plain DDP (find_unused_parameters) and the inner optimizer


def _branches_run(me, inner, compressor, steps=4):
    """Train :class:`_Branches` (plain DDP when ``compressor`` is None): what moved at a step()
    without backward, each parameter after the first step and at the end, which gradients are
    None at the end, and the first-step branch's residual after the first step and at the end."""
    from gradcomp.training import CompressedOptimizer

    x, y = teacher_data(512, 20, 4)
    model = _Branches()
    if compressor is None:
        ddp = DDP(model, find_unused_parameters=True)
        opt = INNER[inner](model.parameters())
    else:
        ddp = model
        opt = CompressedOptimizer(INNER[inner](model.parameters()), compressor, model=model, min_numel=0,
                                  compress_1d=True, **({"ratio": 0.1} if compressor == "topk" else {}))
    params = lambda: {n: p.detach().clone() for n, p in model.named_parameters()}  # noqa: E731
    initial = params()
    opt.step()  # no backward at all: nothing moves, weight decay included
    out = {"idle moved": sorted(n for n, p in params().items() if not torch.equal(p, initial[n])),
           "initial": initial, "residual": [], "syncs": []}
    for step in range(steps):
        opt.zero_grad()
        xb, yb = batch(x, y, 16, me, step)
        with HostSyncs() as syncs:  # which gradients every rank had is read with the step's one read
            torch.nn.functional.cross_entropy(ddp(xb, me, step), yb).backward()
            opt.step()
        out["syncs"].append(syncs.count)
        if step == 0:
            out["after first"] = params()
        if compressor == "topk" and step in (0, steps - 1):
            out["residual"].append(opt.compression.policy.codecs()["*"].residual("first.weight").clone())
    out.update(final=params(), none=sorted(n for n, p in model.named_parameters() if p.grad is None),
               states=sorted(n for n, p in model.named_parameters() if opt.state.get(p)))
    return out


def _optimizer_rank(rank, world):
    out = {"plain": _plain_ddp(rank, STEPS), "plain_acc": _plain_ddp(rank, 3, accumulate=2)}
    out["none wrapper"] = flat_params(_opt_run(rank, "none", STEPS)[0])
    out["none_acc"] = flat_params(_opt_run(rank, "none", 3, accumulate=2)[0])
    for name in available_compressors():
        model, opt, losses, _, launched = _opt_run(rank, name, STEPS, bucket_mb=0.002, **OPTIONS.get(name, {}))
        sd = opt.state_dict()["gradcomp"]
        out[name] = {"params": flat_params(model), "losses": losses, "launched": launched,
                     "iteration": sd["iteration"], "buckets": len(opt._launcher.buckets)}
    for name, options in RESUMED.items():
        straight, _, _, saved, _ = _opt_run(rank, name, 6, save_at=3, **options)
        resumed, *_ = _opt_run(rank, name, 3, start=3, checkpoint=saved, seed=7, **options)
        out["resume:" + name] = (flat_params(straight), flat_params(resumed))
    for dtype in QUIET:  # threshold, every |gradient + residual| under tau on every rank: empty payloads everywhere
        model, opt, *_ = _opt_run(rank, "threshold", STEPS, dtype=dtype, tau=1e3, compress_1d=True)
        out[f"quiet {dtype}"] = (flat_params(model), flat_params(mlp(20, 64, 4).to(dtype)),
                                 opt.state_dict()["gradcomp"]["iteration"])
    for inner in INNER:
        out["branches plain " + inner] = _branches_run(rank, inner, None)
        for name in BRANCHES:
            out[f"branches {name} {inner}"] = _branches_run(rank, inner, name)
    out["api"] = _api(rank)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_optimizer_rank, 2, tmp_path_factory.mktemp("optimizer"), timeout_s=120)


def test_none_wrapper_equals_plain_ddp(results):
    for r in results:
        assert torch.equal(r["none wrapper"], r["plain"])
        assert torch.equal(r["none_acc"], r["plain_acc"])  # gradient accumulation under no_sync


@pytest.mark.parametrize("name", available_compressors())
def test_every_compressor_in_the_wrapper(results, name):
    r0, r1 = results[0][name], results[1][name]
    assert torch.equal(r0["params"], r1["params"]), "replicas differ"
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in (r0, r1))
    assert r0["iteration"] == STEPS
    assert r0["buckets"] > 1 and all(r0["launched"]), "buckets must leave during backward"


@pytest.mark.parametrize("name", sorted(RESUMED))
def test_wrapper_resume_is_bit_identical(results, name):
    for r in results:
        straight, resumed = r["resume:" + name]
        assert torch.equal(straight, resumed)


@pytest.mark.parametrize("dtype", QUIET)
def test_threshold_with_every_payload_empty(results, dtype):
    # checked at the first step, then on the agreed layout (sized, bounded) with no value
    # reaching tau on any rank: the means are zeros, nothing moves
    for r in results:
        params, initial, iteration = r[f"quiet {dtype}"]
        assert iteration == STEPS and torch.equal(params, initial)


@pytest.mark.parametrize("inner", sorted(INNER))
@pytest.mark.parametrize("name", BRANCHES)
def test_parameters_without_a_gradient_are_left_as_the_inner_optimizer_leaves_them(results, name, inner):
    unused = ["first.bias", "first.weight", "never.bias", "never.weight"]  # at the last step
    for rank, r in enumerate(results):
        plain, ours = r["branches plain " + inner], r[f"branches {name} {inner}"]
        assert plain["idle moved"] == [] and ours["idle moved"] == [], "step() without backward moved parameters"
        assert plain["none"] == unused and ours["none"] == unused, (rank, ours["none"])
        assert ours["states"] == plain["states"], "optimizer state for parameters that never had a gradient"
        for n in ("never.weight", "never.bias"):  # no rank ever had a gradient for it: not moved
            assert torch.equal(ours["final"][n], ours["initial"][n]), (rank, n)
        for n in ("first.weight", "first.bias"):  # a gradient at the first step only: not moved afterwards
            assert torch.equal(ours["final"][n], ours["after first"][n]), (rank, n)
        assert ours["syncs"][1:] == [1] * 3, ours["syncs"]  # on the agreed layout: the step's one host read
        if name == "none":  # the bits of plain DDP: rank0's branch sent as zeros by rank 1, averaged
            assert all(torch.equal(ours["final"][n], plain["final"][n]) for n in plain["final"]), rank
        else:  # what the first-step branch still owes is kept while no rank has its gradient
            first, last = ours["residual"]
            assert first.abs().sum() > 0 and torch.equal(first, last)
    assert all(torch.equal(results[0][k]["final"][n], results[1][k]["final"][n])
               for k in results[0] if k.startswith("branches ") for n in results[0][k]["final"])


def test_optimizer_api(results):
    a0, a1 = results[0]["api"], results[1]["api"]
    assert torch.equal(a0["broadcast"], a1["broadcast"])
    assert torch.equal(a0["params"], a1["params"])  # the added group was broadcast too
    assert a0["same_groups"] and a0["grads_cleared"] and a0["groups"] == 2
    assert a0["lrs"][1] == [0.05] and a0["lrs"][2] == [0.05, 0.05] and a0["lrs"][3] == [0.025, 0.025]
