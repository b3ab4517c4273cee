"""Lamb and Lars: timm's results in one process (to fp32 rounding), the same under 2- and 4-rank
data parallel (DDP, CompressedOptimizer), and the same when the state is sharded and the
norms come from ``shard_layout``'s one all-reduce; linear_scaling; bad options.

timm is a test-only dependency: its two optimizer files are loaded without timm's package
``__init__`` (which needs torchvision). One spawn per world size runs every multi-rank case.
"""
import functools
import importlib
import importlib.util
import os
import sys
import types

import pytest
import torch

from gradcomp.optim import Lamb, Lars, linear_scaling
from ranks import run_ranks

STEPS = 5


@functools.lru_cache(maxsize=None)
def _timm_classes():
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("timm is not installed (pip install --no-deps timm)")
    root = list(spec.submodule_search_locations)[0]
    for name, path in (("timm", root), ("timm.optim", os.path.join(root, "optim"))):
        if name not in sys.modules or not hasattr(sys.modules[name], "__path__"):
            mod = types.ModuleType(name)
            mod.__path__ = [path]
            sys.modules[name] = mod
    return importlib.import_module("timm.optim.lamb").Lamb, importlib.import_module("timm.optim.lars").Lars


def _timm():
    """``(Lamb, Lars)`` of timm, or skip when timm is not installed."""
    return _timm_classes()


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _batch(rank, step, world=1):
    """Rank ``rank``'s part of step ``step``'s batch; with ``world=1`` the whole batch of 2 or 4 ranks."""
    parts = [torch.Generator().manual_seed(100 * r + step) for r in range(max(world, 1))]
    xs = [(torch.randn(8, 10, generator=g), torch.randn(8, 3, generator=g)) for g in parts]
    return xs[rank] if world > 1 else xs[0]


def _full_batch(step, world):
    parts = [torch.Generator().manual_seed(100 * r + step) for r in range(world)]
    xs = [(torch.randn(8, 10, generator=g), torch.randn(8, 3, generator=g)) for g in parts]
    return torch.cat([x for x, _ in xs]), torch.cat([y for _, y in xs])


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train_single(make, world, steps=STEPS):
    model = _model()
    opt = make(model.parameters())
    for s in range(steps):
        x, y = _full_batch(s, world)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return _flat(model)


LAMB_CASES = [dict(), dict(trust_clip=True), dict(weight_decay=0.0, always_adapt=True), dict(max_grad_norm=1.0),
              dict(grad_averaging=False, bias_correction=False), dict(weight_decay=0.0)]
LARS_CASES = [dict(weight_decay=1e-2, momentum=0.9), dict(weight_decay=1e-2, momentum=0.9, trust_clip=True),
              dict(always_adapt=True, momentum=0.9, nesterov=True), dict(weight_decay=1e-3, dampening=0.1, momentum=0.5)]


@pytest.mark.parametrize("kwargs", LAMB_CASES)
def test_lamb_matches_timm(kwargs):
    TimmLamb, _ = _timm()
    ours = _train_single(lambda p: Lamb(p, lr=1e-2, **kwargs), 1, steps=8)
    ref = _train_single(lambda p: TimmLamb(p, lr=1e-2, **{"max_grad_norm": None, **kwargs}), 1, steps=8)
    assert torch.allclose(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs", LARS_CASES)
def test_lars_matches_timm(kwargs):
    _, TimmLars = _timm()
    ours = _train_single(lambda p: Lars(p, lr=0.1, **kwargs), 1, steps=8)
    ref = _train_single(lambda p: TimmLars(p, lr=0.1, **kwargs), 1, steps=8)
    assert torch.allclose(ours, ref, rtol=1e-6, atol=1e-6)


# ---- multi-rank ------------------------------------------------------------------------------
def _make(kind):
    return {"lamb": lambda p: Lamb(p, lr=1e-2, weight_decay=0.01),
            "lamb_clip": lambda p: Lamb(p, lr=1e-2, weight_decay=0.01, trust_clip=True),
            "lars": lambda p: Lars(p, lr=0.1, momentum=0.9, weight_decay=1e-2),
            "larc": lambda p: Lars(p, lr=0.1, momentum=0.9, weight_decay=1e-2, trust_clip=True)}[kind]


def _train_rank(model, opt, rank, world):
    """STEPS steps on this rank's part of each batch."""
    for s in range(STEPS):
        x, y = _batch(rank, s, world)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _ddp(rank, world, kind):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model())
    opt = _make(kind)(model.parameters())
    _train_rank(model, opt, rank, world)
    return _flat(model.module)


def _compressed(rank, world, kind):
    from gradcomp.training import CompressedOptimizer

    model = _model()
    opt = CompressedOptimizer(_make(kind)(model.parameters()), compressor="int8", model=model)
    _train_rank(model, opt, rank, world)
    return _flat(model)


def _shards(numels, rank, world, split):
    """This rank's ``(layout, sizes)``: the flat concatenation of every parameter cut into
    ``world`` ranges, each range cut again into ``split`` shard tensors."""
    total = sum(numels)
    bounds = [total * r // world for r in range(world + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    cuts = [lo + (hi - lo) * k // split for k in range(split + 1)]
    starts = [sum(numels[:i]) for i in range(len(numels))]
    layout, sizes = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        row = [(layer, max(a, s) - a, min(b, s + n) - a)
               for layer, (s, n) in enumerate(zip(starts, numels)) if max(a, s) < min(b, s + n)]
        layout.append(row)
        sizes.append((a, b))
    return layout, sizes


def _sharded(rank, world, kind, split, with_layout=True):
    """The model's parameters and gradients flattened, this rank's slices as the inner
    optimizer's tensors, the full model's gradient averaged by all_reduce: the setting of
    ShardedOptimizer, without it."""
    import torch.distributed as dist

    model = _model()
    numels = [p.numel() for p in model.parameters()]
    layout, ranges = _shards(numels, rank, world, split)
    full = _flat(model)
    shards = [full[a:b].clone().requires_grad_(True) for a, b in ranges]
    opt = _make(kind)(shards)
    if with_layout:
        opt.shard_layout(layout, len(numels), None)
    for s in range(STEPS):
        with torch.no_grad():  # the model holds the gathered weights
            gathered = [torch.zeros(0)] * world
            dist.all_gather_object(gathered, torch.cat([t.detach() for t in shards]))
            torch.nn.utils.vector_to_parameters(torch.cat(gathered), model.parameters())
        model.zero_grad()
        x, y = _batch(rank, s, world)
        torch.nn.functional.mse_loss(model(x), y).backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()]) / world
        dist.all_reduce(g)
        for t, (a, b) in zip(shards, ranges):
            t.grad = g[a:b].clone()
        opt.step()
    gathered = [torch.zeros(0)] * world
    dist.all_gather_object(gathered, torch.cat([t.detach() for t in shards]))
    return torch.cat(gathered)


def _with_sharded_optimizer(rank, world, kind):
    """gradcomp.memory.ShardedOptimizer around our class: it calls shard_layout itself."""
    try:
        from gradcomp.memory import ShardedOptimizer
    except ImportError:
        return None
    from gradcomp.optim import Lamb, Lars

    model = _model()
    cls, kw = ((Lamb, dict(lr=1e-2, weight_decay=0.01)) if kind == "lamb"
               else (Lars, dict(lr=0.1, momentum=0.9, weight_decay=1e-2)))
    opt = ShardedOptimizer(model.parameters(), cls, model=model, **kw)
    _train_rank(model, opt, rank, world)
    return _flat(model)


def _errors(rank, world):
    out = {}
    model = _model()
    try:
        Lamb(model.parameters(), max_grad_norm=1.0).shard_layout([[(0, 0, 1)]] * 4, 4, None)
    except ValueError as exc:
        out["clip"] = str(exc)
    try:
        Lamb(model.parameters()).shard_layout([[(7, 0, 1)]] * 4, 4, None)
    except ValueError as exc:
        out["range"] = str(exc)
    try:
        Lars(model.parameters()).shard_layout([[(0, 0, 1)]] * 3, 4, None)
    except ValueError as exc:
        out["count"] = str(exc)
    return out


def _everything(rank, world):
    res = {}
    for kind in KINDS:
        res[f"ddp_{kind}"] = _ddp(rank, world, kind)
        res[f"sharded_{kind}"] = _sharded(rank, world, kind, split=2)
    for kind in ("lamb", "lars"):
        res[f"compressed_{kind}"] = _compressed(rank, world, kind)
    res["sharded_lamb_one"] = _sharded(rank, world, "lamb", split=1)
    res["local_norms_lamb"] = _sharded(rank, world, "lamb", split=2, with_layout=False)
    res["errors"] = _errors(rank, world)
    for kind in ("lamb", "lars"):
        res[f"zero_{kind}"] = _with_sharded_optimizer(rank, world, kind)
    return res


@pytest.fixture(scope="module", params=[2, 4])
def runs(request, tmp_path_factory):
    world = request.param
    return world, run_ranks(_everything, world, tmp_path_factory.mktemp(f"lamb{world}"), timeout_s=120)


KINDS = ["lamb", "lamb_clip", "lars", "larc"]


@pytest.mark.parametrize("kind", KINDS)
def test_data_parallel_equals_one_process_on_the_whole_batch(runs, kind):
    world, res = runs
    ref = _train_single(_make(kind), world)
    for r in res:
        assert torch.allclose(r[f"ddp_{kind}"], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_compressed_gradients_keep_replicas_identical(runs, kind):
    world, res = runs
    assert all(torch.equal(r[f"compressed_{kind}"], res[0][f"compressed_{kind}"]) for r in res)
    ref = _train_single(_make(kind), world)  # int8 with error feedback: close to the dense run
    assert float((res[0][f"compressed_{kind}"] - ref).abs().max()) < 0.05


@pytest.mark.parametrize("kind", KINDS + ["lamb_one"])
def test_sharded_norms_equal_whole_layer_norms(runs, kind):
    world, res = runs
    ref = _train_single(_make(kind.replace("_one", "")), world)
    for r in res:
        assert torch.allclose(r[f"sharded_{kind}"], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["lamb", "lars"])
def test_inside_gradcomp_sharded_optimizer(runs, kind):
    world, res = runs
    if res[0][f"zero_{kind}"] is None:
        pytest.skip("gradcomp.memory.ShardedOptimizer is not available")
    ref = _train_single(_make(kind), world)
    for r in res:
        assert torch.allclose(r[f"zero_{kind}"], ref, rtol=1e-5, atol=1e-6)


def test_local_shard_norms_would_be_wrong(runs):
    world, res = runs
    ref = _train_single(_make("lamb"), world)
    assert not torch.allclose(res[0]["local_norms_lamb"], ref, rtol=1e-4, atol=1e-5)


def test_shard_layout_refuses_bad_layouts(runs):
    world, res = runs
    errs = res[0]["errors"]
    assert "max_grad_norm" in errs["clip"]
    assert "out of range" in errs["range"]
    assert "3 entries" in errs["count"]


# ---- one process -----------------------------------------------------------------------------
def test_layerwise_contract_attribute():
    assert Lamb.layerwise is True and Lars.layerwise is True


def test_nonfinite_gradient_changes_nothing():
    for make in (lambda p: Lamb(p, lr=1e-2), lambda p: Lars(p, lr=0.1, momentum=0.9, weight_decay=1e-2)):
        model = _model()
        opt = make(model.parameters())
        x, y = _full_batch(0, 1)
        for bad in (False, True):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss * float("inf") if bad else loss).backward()
            before = (_flat(model), [v.clone() if torch.is_tensor(v) else v for s in opt.state.values()
                                     for v in s.values()])
            opt.step()
        after = (_flat(model), [v.clone() if torch.is_tensor(v) else v for s in opt.state.values()
                                for v in s.values()])
        assert torch.equal(before[0], after[0])
        assert all((torch.equal(a, b) if torch.is_tensor(a) else a == b) for a, b in zip(before[1], after[1]))


def test_state_dict_round_trip_is_bit_identical():
    for make in (lambda p: Lamb(p, lr=1e-2), lambda p: Lars(p, lr=0.1, momentum=0.9, weight_decay=1e-2)):
        straight = _train_single(make, 1, steps=6)
        model = _model()
        opt = make(model.parameters())
        for s in range(6):
            if s == 3:
                sd, w = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
                model = _model(seed=3)
                model.load_state_dict(w)
                opt = make(model.parameters())
                opt.load_state_dict(sd)
            x, y = _full_batch(s, 1)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        assert torch.equal(_flat(model), straight)


def test_linear_scaling_and_warmup_with_torch_schedulers():
    assert linear_scaling(0.1, 8192) == pytest.approx(3.2)
    assert linear_scaling(1e-3, 64, base_batch=32) == pytest.approx(2e-3)
    model = _model()
    opt = Lars(model.parameters(), lr=linear_scaling(0.1, 1024), momentum=0.9)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=4)
    main = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, main], milestones=[4])
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.1) and lrs[4] == pytest.approx(0.4)


@pytest.mark.parametrize("call, word", [
    (lambda: linear_scaling(-0.1, 256), "base_lr"), (lambda: linear_scaling(0.1, 0), "batch"),
    (lambda: linear_scaling(0.1, 256, base_batch=2.5), "base_batch"),
    (lambda: Lamb(_model().parameters(), betas=(0.9, 1.5)), "betas"),
    (lambda: Lamb(_model().parameters(), max_grad_norm=0.0), "max_grad_norm"),
    (lambda: Lars(_model().parameters(), momentum=-1.0), "momentum"),
    (lambda: Lars(_model().parameters(), nesterov=True), "nesterov"),
    (lambda: Lars(_model().parameters(), trust_coeff=0.0), "trust_coeff"),
])
def test_bad_options_raise_value_error(call, word):
    with pytest.raises(ValueError, match=word):
        call()
