"""ZeroOneAdam (0/1 Adam) and OneBitLamb on real gloo ranks: the paper's policy (variance
updates thinning out, local-step intervals growing), replicas identical after every
synchronisation, DDP's hook and the optimizer's own averaging giving the same run, zero-gradient
parameters staying put, resume bit-identical across the freezes, non-finite steps changing
nothing, and bad options refused. One spawn per world size runs every multi-rank case.
"""
import pytest
import torch

from gradcomp.optim import OneBitLamb, ZeroOneAdam
from ranks import run_ranks

STEPS = 14
ZO = dict(lr=1e-2, var_freeze_step=6, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
LAMB = dict(lr=1e-2, freeze_step=4, weight_decay=0.01)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(12, 6), torch.nn.Flatten(), torch.nn.Linear(18, 8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _loss(model, rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step % 2)  # two batches per rank: the loss can fall
    x, y = torch.randint(0, 8, (16, 3), generator=g), torch.randn(16, 3, generator=g)  # rows 8.. never used
    return torch.nn.functional.mse_loss(model(x), y)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _make(kind, params):
    return ZeroOneAdam(params, **ZO) if kind == "zo" else OneBitLamb(params, **LAMB)


def _train(model, opt, rank, stop, start=0, record=None):
    for s in range(start, stop):
        syncing = opt.syncs() if isinstance(opt, ZeroOneAdam) else True
        opt.zero_grad()
        _loss(model, rank, s).backward()
        opt.step()
        if record is not None:
            record.append((syncing, _flat(model)))


def _run(rank, world, kind, ddp=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    wrapped = DDP(model) if ddp else model
    opt = _make(kind, wrapped.parameters())
    if ddp:
        wrapped.register_comm_hook(*opt.comm_hook())
    trace = []
    losses = []
    for s in range(STEPS):
        syncing = opt.syncs() if kind == "zo" else True
        opt.zero_grad()
        loss = _loss(wrapped, rank, s)
        loss.backward()
        opt.step()
        losses.append(float(loss))
        trace.append((syncing, _flat(model)))
    if kind == "zo":
        opt.synchronize()  # the run ends on a local step: bring the replicas together
    return {"trace": trace, "synced": _flat(model), "losses": losses, "rows": model[0].weight.detach()[8:].clone(),
            "rows0": _model()[0].weight.detach()[8:].clone(),
            "rows_momentum": opt.state[model[0].weight]["exp_avg"][8:].clone()}


def _resume(rank, world, kind, save_at):
    model = _model()
    opt = _make(kind, model.parameters())
    _train(model, opt, rank, STEPS)
    straight = _flat(model)
    model = _model()
    opt = _make(kind, model.parameters())
    _train(model, opt, rank, save_at)
    sd, w = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    model2 = _model(seed=9)
    model2.load_state_dict(w)
    opt2 = _make(kind, model2.parameters())
    opt2.load_state_dict(sd)
    _train(model2, opt2, rank, STEPS, start=save_at)
    return torch.equal(straight, _flat(model2))


def _nonfinite(rank, world, kind, at):
    model = _model()
    opt = _make(kind, model.parameters())
    _train(model, opt, rank, at)
    before = (_flat(model), opt.steps)
    opt.zero_grad()
    loss = _loss(model, rank, at)
    (loss * float("nan") if rank == world - 1 else loss).backward()
    opt.step()
    return torch.equal(before[0], _flat(model)) and before[1] == opt.steps


def _dense_means(rank, world):
    """``dense_mean`` with an agreed set (the variance phase's gradients): the first call is the
    checked allreduce, later ones a plain all-reduce: the same bits, and nothing read back."""
    from gradcomp.collectives import allreduce
    from gradcomp.optim import _common as common
    from syncs import HostSyncs

    agreed, same, reads = set(), [], []
    for step in range(3):
        g = torch.randn(1000, generator=torch.Generator().manual_seed(10 * step + rank))
        want = allreduce(g.clone(), "none", key="check")
        with HostSyncs() as syncs:
            got = common.dense_mean(g.clone(), None, key="zo/dense", agreed=agreed)
        same.append(torch.equal(want, got))
        reads.append(syncs.count)
    return {"same": same, "reads": reads, "agreed": len(agreed)}


def _everything(rank, world):
    res = {"dense_means": _dense_means(rank, world)}
    for kind in ("zo", "lamb"):
        res[f"{kind}_plain"] = _run(rank, world, kind)
        res[f"{kind}_ddp"] = _run(rank, world, kind, ddp=True)
        res[f"{kind}_resume"] = [_resume(rank, world, kind, at) for at in (3, 8)]
    # a dense step (step 1), a compressed-gradient step (step 3) of 0/1 Adam; a compressed step of 1-bit LAMB
    res["zo_nonfinite"] = [_nonfinite(rank, world, "zo", at) for at in (0, 2)]
    res["lamb_nonfinite"] = [_nonfinite(rank, world, "lamb", at) for at in (1, 6)]
    return res


@pytest.fixture(scope="module", params=[2, 4])
def runs(request, tmp_path_factory):
    world = request.param
    return world, run_ranks(_everything, world, tmp_path_factory.mktemp(f"zo{world}"), timeout_s=120)


@pytest.mark.parametrize("kind", ["zo", "lamb"])
def test_replicas_identical_after_every_synchronisation(runs, kind):
    world, res = runs
    for mode in ("plain", "ddp"):
        traces = [r[f"{kind}_{mode}"]["trace"] for r in res]
        for s in range(STEPS):
            if traces[0][s][0]:
                assert all(torch.equal(t[s][1], traces[0][s][1]) for t in traces), (mode, s)
    if kind == "zo":  # and local steps really are local: replicas apart between synchronisations
        local = [s for s in range(STEPS) if not traces[0][s][0] and s >= ZO["var_freeze_step"]]
        assert local and any(not torch.equal(traces[0][s][1], traces[1][s][1]) for s in local)


def test_synchronize_brings_replicas_together(runs):
    world, res = runs
    assert not res[0]["zo_plain"]["trace"][-1][0]  # the last step was local
    for mode in ("plain", "ddp"):
        assert all(torch.equal(r[f"zo_{mode}"]["synced"], res[0][f"zo_{mode}"]["synced"]) for r in res)


def test_dense_mean_is_checked_once_then_plain(runs):
    world, res = runs
    for r in res:
        d = r["dense_means"]
        assert d["same"] == [True] * 3 and d["agreed"] == 1, d
        assert d["reads"][0] > 0 and d["reads"][1:] == [0, 0], d


@pytest.mark.parametrize("kind", ["zo", "lamb"])
def test_ddp_hook_and_own_averaging_give_the_same_run(runs, kind):
    world, res = runs
    for r in res:
        a, b = r[f"{kind}_plain"]["trace"][-1][1], r[f"{kind}_ddp"]["trace"][-1][1]
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("kind", ["zo", "lamb"])
def test_trains_and_zero_gradient_rows_stay_put(runs, kind):
    world, res = runs
    for r in res:
        losses = r[f"{kind}_plain"]["losses"]
        assert sum(losses[-3:]) < sum(losses[:3])
        # rows never looked up: no momentum ever (masked out of the 1-bit code); without weight
        # decay (0/1 Adam here) they do not move at all
        assert not r[f"{kind}_plain"]["rows_momentum"].any()
        if kind == "zo":
            assert torch.equal(r[f"{kind}_plain"]["rows"], r[f"{kind}_plain"]["rows0"])


@pytest.mark.parametrize("kind", ["zo", "lamb"])
def test_resume_bit_identical_across_the_freeze(runs, kind):
    world, res = runs
    assert all(r[f"{kind}_resume"] == [True, True] for r in res)


@pytest.mark.parametrize("kind", ["zo", "lamb"])
def test_nonfinite_step_changes_nothing(runs, kind):
    world, res = runs
    assert all(r[f"{kind}_nonfinite"] == [True, True] for r in res)


# ---- one process -----------------------------------------------------------------------------
def test_zero_one_adam_policy():
    opt = ZeroOneAdam(_model().parameters(), lr=1e-2, var_freeze_step=12, var_update_scaler=2,
                      local_step_scaler=2, local_step_clipper=4)
    model = _model()
    opt = ZeroOneAdam(model.parameters(), lr=1e-2, var_freeze_step=12, var_update_scaler=2,
                      local_step_scaler=2, local_step_clipper=4)
    dense, syncs = [], []
    for s in range(24):
        dense.append(opt.wants_dense())
        syncs.append(opt.syncs())
        opt.zero_grad()
        _loss(model, 0, s).backward()
        opt.step()
    # kappa = 2 variance updates per interval, the interval doubling: steps 1, 2, 4, 6, 8, 12
    assert [s + 1 for s in range(24) if dense[s]] == [1, 2, 4, 6, 8, 12]
    # after step 12: intervals 1, 1, 2, 2, 4, 4 (doubling every 2 steps, at most 4)
    assert [s + 1 for s in range(12, 24) if syncs[s]] == [13, 14, 16, 20, 24]


def test_onebit_lamb_refuses_sharding():
    opt = OneBitLamb(_model().parameters(), freeze_step=2)
    assert not getattr(opt, "layerwise", False)
    with pytest.raises(ValueError, match="Lamb"):
        opt.shard_layout([], 1, None)


@pytest.mark.parametrize("make, word", [
    (lambda p: ZeroOneAdam(p, var_freeze_step=0), "var_freeze_step"),
    (lambda p: ZeroOneAdam(p, var_update_scaler=-1), "var_update_scaler"),
    (lambda p: ZeroOneAdam(p, local_step_clipper=0), "local_step_clipper"),
    (lambda p: ZeroOneAdam(p, betas=(0.9, 1.0)), "betas"),
    (lambda p: OneBitLamb(p, freeze_step=-1), "freeze_step"),
    (lambda p: OneBitLamb(p, min_coeff=0.0), "min_coeff"),
    (lambda p: OneBitLamb(p, factor_max=0.1), "factor_max"),
    (lambda p: OneBitLamb(p, compressor="bogus"), "bogus"),
])
def test_bad_options_raise_value_error(make, word):
    with pytest.raises(ValueError, match=word):
        make(_model().parameters())
