"""gradcomp.optim beyond its own small models, on 2 real gloo ranks (ONE spawn for every case):

- the conv net with BatchNorm, the transformer block and the many-small-tensors model of
  tests/models.py train under OneBitAdam (across its freeze), ZeroOneAdam, OneBitLamb and Lamb:
  finite, falling losses near dense Adam's, replicas bit-identical;
- a finite but huge gradient (loss x 1e30) at a warm-up step on one rank, or after the freeze on
  one or both ranks, is skipped on the ranks it concerns, counted in ``skipped`` and
  warned about, and training goes on (it used to give NaN parameters or stall for good);
- ranks that disagree on the learning rate or the compressor's options are refused at
  construction with the same error on every rank;
- sparse gradients raise a ValueError naming the parameter, on every rank, changing nothing.
"""
import math
import warnings

import pytest
import torch

import models
from gradcomp.optim import Lamb, Lars, OneBitAdam, OneBitLamb, ZeroOneAdam
from ranks import run_ranks

KINDS = ("conv_bn", "transformer", "many_small")
TRAIN_STEPS, FREEZE, BATCH = 24, 8, 32
OPTIMIZERS = ("adam", "onebit_adam", "zero_one_adam", "lamb", "onebit_lamb")
#: each optimizer against the dense run of its own algorithm (1-bit LAMB's warm-up is LAMB)
REFERENCE = {"onebit_adam": "adam", "zero_one_adam": "adam", "lamb": "adam", "onebit_lamb": "lamb"}


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _optimizer(name, params):
    if name == "adam":
        return torch.optim.Adam(params, lr=3e-3)
    if name == "onebit_adam":
        return OneBitAdam(params, lr=3e-3, freeze_step=FREEZE)
    if name == "zero_one_adam":
        return ZeroOneAdam(params, lr=3e-3, var_freeze_step=FREEZE, var_update_scaler=2, local_step_scaler=4,
                           local_step_clipper=4)
    if name == "onebit_lamb":  # the trust ratio scales the step: LAMB's learning rates are larger
        return OneBitLamb(params, lr=2e-2, freeze_step=FREEZE)
    return Lamb(params, lr=2e-2, weight_decay=0.0, always_adapt=True)


def _train_model(rank, kind, name):
    """TRAIN_STEPS steps under DDP (the compressed-momentum optimizers through their hook);
    the held-out loss before and after (rank 0's model), every rank's parameters at the end."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = models.model(kind)
    ddp = DDP(net)
    opt = _optimizer(name, ddp.parameters())
    if hasattr(opt, "comm_hook"):
        ddp.register_comm_hook(*opt.comm_hook())
    x, y = models.data(kind, BATCH * TRAIN_STEPS, seed=1 + rank)
    ex, ey = models.data(kind, 256, seed=99)

    def held_out():
        net.eval()
        with torch.no_grad():
            loss = float(torch.nn.functional.cross_entropy(net(ex), ey))
        net.train()
        return loss

    before = held_out()
    losses = []
    for s in range(TRAIN_STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x[s * BATCH:(s + 1) * BATCH]), y[s * BATCH:(s + 1) * BATCH])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    if isinstance(opt, ZeroOneAdam):
        opt.synchronize()  # the last steps may have been local
    return {"before": before, "after": held_out(), "losses": losses, "params": _flat(net),
            "frozen": getattr(opt, "frozen", None)}


# ---- finite but huge gradients -------------------------------------------------------------
def _small(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _limit_optimizer(name, params):
    if name == "onebit_adam":
        return OneBitAdam(params, lr=1e-2, freeze_step=4)
    if name == "zero_one_adam":  # dense steps 1, 2, 4, 6; compressed momentum 3, 5; local from 7
        return ZeroOneAdam(params, lr=1e-2, var_freeze_step=6, var_update_scaler=2, local_step_scaler=2,
                           local_step_clipper=4)
    return OneBitLamb(params, lr=1e-2, freeze_step=4)


def _huge(rank, name, at, huge_ranks, steps=12):
    """``steps`` steps; at step ``at`` the loss of the ranks in ``huge_ranks`` is multiplied by
    1e30 (gradients ~1e29: finite, but their squares overflow fp32)."""
    model = _small()
    opt = _limit_optimizer(name, model.parameters())
    moved, finite, losses, skipped, caught, aliases = [], [], [], [], [], []
    for s in range(steps):
        g = torch.Generator().manual_seed(100 * rank + s % 2)
        x, y = torch.randn(16, 10, generator=g), torch.randn(16, 3, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        (loss * 1e30 if s == at and rank in huge_ranks else loss).backward()
        before = _flat(model).clone()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt.step()
        after = _flat(model)
        moved.append(not torch.equal(before, after))
        finite.append(bool(torch.isfinite(after).all()))
        losses.append(float(loss.detach()))
        skipped.append(opt.skipped)
        # the step decision's counter, and the older name reads it too
        aliases.append(opt.decision.skipped == opt.skipped_steps == opt.skipped)
        caught.append([str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)])
    if isinstance(opt, ZeroOneAdam):
        opt.synchronize()
    state_finite = all(bool(torch.isfinite(v).all()) for st in opt.state.values() for v in st.values()
                       if torch.is_tensor(v))
    return {"moved": moved, "finite": finite, "losses": losses, "skipped": skipped, "warnings": caught,
            "aliases": all(aliases),
            "final": _flat(model), "state_finite": state_finite, "saved_skips": opt.state_dict()["gradcomp"]["skipped"]}


HUGE_CASES = {  # name: (optimizer, step, ranks whose gradient is huge, the step exchanges)
    "onebit_adam-warmup-one": ("onebit_adam", 1, (0,), True),
    "onebit_adam-frozen-one": ("onebit_adam", 6, (0,), True),
    "onebit_adam-frozen-both": ("onebit_adam", 6, (0, 1), True),
    "zero_one_adam-warmup-one": ("zero_one_adam", 1, (0,), True),
    "zero_one_adam-momentum-one": ("zero_one_adam", 2, (0,), True),
    "zero_one_adam-local-one": ("zero_one_adam", 8, (0,), False),  # a local step that does not synchronise
    "zero_one_adam-local-both": ("zero_one_adam", 8, (0, 1), False),
    "onebit_lamb-warmup-one": ("onebit_lamb", 1, (0,), True),
    "onebit_lamb-frozen-one": ("onebit_lamb", 6, (0,), True),
    "onebit_lamb-frozen-both": ("onebit_lamb", 6, (0, 1), True),
}


# ---- disagreement and sparse gradients -----------------------------------------------------
def _refused(make):
    try:
        make()
    except ValueError as exc:
        return str(exc)
    return None


def _disagreements(rank):
    params = lambda: _small().parameters()  # noqa: E731
    lr = 1e-2 * (1 + rank)
    return {
        "onebit_adam_lr": _refused(lambda: OneBitAdam(params(), lr=lr, freeze_step=4)),
        "zero_one_adam_lr": _refused(lambda: ZeroOneAdam(params(), lr=lr)),
        "onebit_lamb_lr": _refused(lambda: OneBitLamb(params(), lr=lr)),
        "group_lr": _refused(lambda: OneBitAdam([{"params": list(_small()[0].parameters()), "lr": lr},
                                                 {"params": list(_small()[2].parameters())}], freeze_step=4)),
        "codec_options": _refused(lambda: OneBitAdam(params(), freeze_step=4, compressor="topk",
                                                     compressor_options={"ratio": 0.1 * (1 + rank)})),
        "betas": _refused(lambda: OneBitLamb(params(), betas=(0.9, 0.999 - 0.009 * rank))),
        "eps": _refused(lambda: ZeroOneAdam(params(), eps=1e-8 * (1 + rank))),
        "weight_decay": _refused(lambda: OneBitAdam(params(), weight_decay=0.01 * rank, freeze_step=4)),
        "agreed": _refused(lambda: ZeroOneAdam(params(), lr=1e-2)),
    }


def _sparse(rank):
    out = {}
    makers = {"onebit_adam": lambda p: OneBitAdam(p, freeze_step=4), "zero_one_adam": lambda p: ZeroOneAdam(p),
              "onebit_lamb": lambda p: OneBitLamb(p), "lamb": lambda p: Lamb(p), "lars": lambda p: Lars(p)}
    for name, make in makers.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Flatten(), torch.nn.Linear(12, 2))
        opt = make(model.parameters())
        model(torch.tensor([[1, 2, 3]])).sum().backward()
        before = _flat(model).clone()
        out[name] = (_refused(opt.step), torch.equal(before, _flat(model)))
    return out


def _everything(rank, world):
    res = {"models": {(kind, name): _train_model(rank, kind, name) for kind in KINDS for name in OPTIMIZERS}}
    res["huge"] = {case: _huge(rank, name, at, ranks) for case, (name, at, ranks, _) in HUGE_CASES.items()}
    res["clean"] = {name: _huge(rank, name, -1, ()) for name in ("onebit_adam", "zero_one_adam", "onebit_lamb")}
    res["disagree"] = _disagreements(rank)
    res["sparse"] = _sparse(rank)
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_everything, 2, tmp_path_factory.mktemp("optim_models"), timeout_s=240)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", OPTIMIZERS[1:])
def test_trains_other_models_near_dense_adam(runs, kind, name):
    ours, dense = [r["models"][(kind, name)] for r in runs], runs[0]["models"][(kind, REFERENCE[name])]
    assert all(torch.equal(r["params"], ours[0]["params"]) for r in ours)  # replicas bit-identical
    assert all(bool(torch.isfinite(r["params"]).all()) and all(map(math.isfinite, r["losses"])) for r in ours)
    if ours[0]["frozen"] is not None:
        assert ours[0]["frozen"]  # the run went past the freeze
    r = ours[0]
    assert r["after"] < 0.9 * r["before"], (r["before"], r["after"])  # it learns
    # and near the dense run: at least 60 % of its fall in the same steps
    assert r["before"] - r["after"] > 0.6 * (dense["before"] - dense["after"]), (r["after"], dense["after"])
    assert sum(r["losses"][-4:]) < sum(r["losses"][:4])


@pytest.mark.parametrize("case", list(HUGE_CASES))
def test_finite_huge_gradient_is_skipped_counted_and_training_goes_on(runs, case):
    name, at, huge_ranks, exchanged = HUGE_CASES[case]
    affected = [0, 1] if exchanged else list(huge_ranks)  # an exchanged step is skipped on every rank
    for rank, r in enumerate(x["huge"][case] for x in runs):
        assert all(r["finite"]) and r["state_finite"], case
        hit = rank in affected
        assert r["moved"][at] is not hit, (case, rank)
        assert r["skipped"][at] == int(hit) and r["skipped"][-1] == int(hit) and r["saved_skips"] == int(hit)
        assert r["aliases"], "skipped is not the step decision's counter, or skipped_steps does not read it"
        assert bool(r["warnings"][at]) is hit and (not hit or "skipped" in r["warnings"][at][0])
        assert all(r["moved"][at + 1:]), (case, rank)  # not stalled: every later step moves
        assert all(not w for s, w in enumerate(r["warnings"]) if s != at)
        clean = runs[rank]["clean"][name]
        assert r["losses"][-1] < r["losses"][1]  # and it still learns, about as the clean run does
        assert abs(r["losses"][-1] - clean["losses"][-1]) < 0.1 * clean["losses"][0]
    assert torch.equal(runs[0]["huge"][case]["final"], runs[1]["huge"][case]["final"])


def test_clean_runs_skip_nothing(runs):
    for r in runs:
        assert all(c["skipped"][-1] == 0 and all(c["moved"]) for c in r["clean"].values())


# what each rank passed, as the message shows it (a long configuration is cut before the groups)
SHOWN = {"codec_options": "ratio=0.1", "betas": "", "eps": "", "weight_decay": ""}


@pytest.mark.parametrize("case", ["onebit_adam_lr", "zero_one_adam_lr", "onebit_lamb_lr", "group_lr",
                                  "codec_options", "betas", "eps", "weight_decay"])
def test_disagreement_refused_at_construction_on_every_rank(runs, case):
    msgs = [r["disagree"][case] for r in runs]
    assert msgs[0] is not None and len(set(msgs)) == 1, msgs
    field = "learning rates" if case.endswith("_lr") else "configuration"
    assert "disagree" in msgs[0] and field in msgs[0]
    assert SHOWN.get(case, "0.01") in msgs[0], msgs[0]  # each rank's value is shown
    assert all(r["disagree"]["agreed"] is None for r in runs)


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam", "onebit_lamb", "lamb", "lars"])
def test_sparse_gradients_refused_naming_the_parameter(runs, name):
    msgs = [r["sparse"][name][0] for r in runs]
    assert msgs[0] is not None and len(set(msgs)) == 1
    assert "parameter 0" in msgs[0] and "(10, 4)" in msgs[0] and "sparse=False" in msgs[0]
    assert all(r["sparse"][name][1] for r in runs)  # nothing changed


# ---- one process ---------------------------------------------------------------------------
def test_layer_norms_stay_on_the_tensors_device_one_collective(monkeypatch):
    """Under a layout the per-layer squares are summed on the tensors' device and all-reduced
    there, once (NCCL refuses a CPU tensor); here the tensors are on the meta device, which
    cannot be copied to the host at all, so a host round trip fails."""
    import torch.distributed as dist

    from gradcomp.optim import LayerNorms

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None: calls.append((t.device, t.dtype, tuple(t.shape))))
    norms = LayerNorms(2, "Lamb")
    norms.set_layout([[(0, 0, 3), (1, 3, 5)], [(1, 0, 4)]], 3, None, [5, 4])
    out = norms.norms([[torch.ones(5, device="meta"), torch.ones(4, device="meta")], [None, torch.ones(4, device="meta")]])
    assert calls == [(torch.device("meta"), torch.float64, (2, 3))]
    assert out.device.type == "meta" and out.shape == (2, 3)
    # and on the CPU the values: squares summed per layer over the slices
    cpu = norms.norms([[torch.arange(5.0), torch.ones(4)], [None, torch.full((4,), 2.0)]])
    expected = torch.tensor([[5.0, 9 + 16 + 4, 0.0], [0.0, 16.0, 0.0]], dtype=torch.float64).sqrt()
    assert torch.equal(cpu, expected)


def test_learning_rate_left_out_of_the_checkpoint_identity_only():
    """A scheduler changes the learning rate between saving and resuming: the checkpoint loads."""
    for make in (lambda p, lr: OneBitAdam(p, lr=lr, freeze_step=2), lambda p, lr: ZeroOneAdam(p, lr=lr),
                 lambda p, lr: OneBitLamb(p, lr=lr, freeze_step=2)):
        model = _small()
        opt = make(model.parameters(), 1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(2, 10)).sum().backward()
            opt.step()
            sched.step()
        resumed = make(_small().parameters(), 1e-2)
        resumed.load_state_dict(opt.state_dict())
        assert resumed.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 1e-2 / 8


def test_onebit_lamb_reads_the_host_once_per_step(monkeypatch):
    """1-bit LAMB's trust ratios and factors stay on the device: its own code reads the host once
    per warm-up step (whether the step can go ahead) and not at all after the freeze (where the
    exchanged mean's finiteness is read once, by the collectives' transaction), where it used to
    read several times per parameter and step."""
    import inspect
    import os

    reads = []
    real_bool, real_float, real_item = torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.item

    def counted(real):
        def read(self, *args):
            caller = inspect.currentframe().f_back.f_code.co_filename
            if os.sep + "optim" + os.sep in caller and "tests" not in caller:
                reads.append(caller)
            return real(self, *args)
        return read

    model = _small()
    opt = OneBitLamb(model.parameters(), lr=1e-2, freeze_step=2, weight_decay=0.01)
    x = torch.randn(8, 10)
    per_step = []
    for s in range(5):
        opt.zero_grad()
        model(x).square().mean().backward()
        reads.clear()
        monkeypatch.setattr(torch.Tensor, "__bool__", counted(real_bool))
        monkeypatch.setattr(torch.Tensor, "__float__", counted(real_float))
        monkeypatch.setattr(torch.Tensor, "item", counted(real_item))
        opt.step()
        monkeypatch.undo()
        per_step.append(len(reads))
    # step 2 also starts the compression stage, step 3 finds the masks (once: per layer)
    assert per_step[0] == 1 and per_step[3] == per_step[4] == 0, per_step
    assert bool(torch.isfinite(_flat(model)).all())
