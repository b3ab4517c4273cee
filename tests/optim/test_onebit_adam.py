"""OneBitAdam on real gloo ranks: torch.optim.Adam's bits before the freeze (under DDP), replicas
identical after, two-sided error feedback conserves mass, zero-gradient parameters stay put,
resume across the freeze is bit-identical, non-finite steps change nothing, disagreement and
foreign checkpoints are refused on every rank, and any compressor carries the momentum.

Each world size is ONE spawn running every case; the tests assert on its results.
"""
import pytest
import torch
import torch.distributed as dist

from gradcomp.optim import OneBitAdam
from ranks import run_ranks

FREEZE = 3
STEPS = 7


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(12, 6), torch.nn.Flatten(), torch.nn.Linear(18, 8),
                                torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return model.to(dtype)


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    # token ids 0..7 only: rows 8..11 of the embedding never get a gradient
    return torch.randint(0, 8, (16, 3), generator=g), torch.randn(16, 3, generator=g)


def _loss(model, rank, step, dtype=torch.float32):
    x, y = _batch(rank, step)
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _flat(model):
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def _train(model, opt, rank, steps, start=0, step_fn=None):
    out = []
    for s in range(start, steps):
        opt.zero_grad()
        (step_fn or _loss)(model, rank, s).backward()
        opt.step()
        out.append(_flat(model))
    return out


def _ddp_equivalence(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref_model = DDP(_model())
    ref = _train(ref_model, torch.optim.Adam(ref_model.parameters(), lr=1e-2), rank, STEPS)
    from gradcomp.collectives import reset_telemetry, telemetry

    model = DDP(_model())
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE)
    model.register_comm_hook(*opt.comm_hook())
    reset_telemetry()
    ours = _train(model, opt, rank, FREEZE)
    dense_bytes = telemetry()["total"]["bytes_sent"] / FREEZE
    reset_telemetry()
    ours += _train(model, opt, rank, STEPS, start=FREEZE)
    frozen_bytes = telemetry()["total"]["bytes_sent"] / (STEPS - FREEZE)
    return {"equal_before": [torch.equal(a, b) for a, b in zip(ref[:FREEZE], ours[:FREEZE])],
            "differs_after": not torch.equal(ref[-1], ours[-1]), "final": ours[-1], "ref_final": ref[-1],
            "dense_bytes": dense_bytes, "frozen_bytes": frozen_bytes}


def _plain(rank, world, compressor="onebit", options=None, dtype=torch.float32):
    model = _model(dtype=dtype)
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE, compressor=compressor,
                     compressor_options=options)
    init = _flat(model)
    traj = _train(model, opt, rank, STEPS)
    return {"final": traj[-1], "init": init, "finite": bool(torch.isfinite(traj[-1]).all()),
            "emb_rows": model[0].weight.detach()[8:].clone(), "emb_rows0": _model(dtype=dtype)[0].weight.detach()[8:]}


def _mass(rank, world, compressor="onebit", options=None):
    """One frozen step, taken apart: what this rank sent, its residuals before and after, and
    what every rank received."""
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE, compressor=compressor,
                     compressor_options=options)
    _train(model, opt, rank, FREEZE + 2)
    before = opt.error_state()
    opt.zero_grad()
    _loss(model, rank, 99).backward()
    from gradcomp.optim._base import flat

    sent = opt.to_send(opt._grads(dense=False))
    opt.step()
    delivered = flat([opt.state[p]["exp_avg"].float() / d for p, d in zip(opt._params, opt.denominators())],
                     opt.masks())
    kept = torch.cat([torch.ones(p.numel(), dtype=torch.bool) if m is None else ~m.reshape(-1)
                      for p, m in zip(opt._params, opt.masks())])
    after = opt.error_state()
    return {"sent": sent, "delivered": delivered, "w0": before["worker"], "w1": after["worker"],
            "s0": before["server"], "s1": after["server"], "kept": kept}


def _resume(rank, world, save_at):
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE)
    straight = _train(model, opt, rank, STEPS)[-1]
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE)
    _train(model, opt, rank, save_at)
    sd, weights = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    model2 = _model(seed=5)
    opt2 = OneBitAdam(model2.parameters(), lr=1e-2, freeze_step=FREEZE)
    model2.load_state_dict(weights)
    opt2.load_state_dict(sd)
    resumed = _train(model2, opt2, rank, STEPS, start=save_at)[-1]
    return torch.equal(straight, resumed)


def _nonfinite(rank, world):
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE)
    _train(model, opt, rank, FREEZE + 1)
    snap = (_flat(model), [v.clone() for s in opt.state.values() for v in s.values()], opt.error_state(), opt.steps)

    def bad(model, r, s):  # only rank 0's gradient is NaN
        loss = _loss(model, r, s)
        return loss * float("nan") if r == 0 else loss

    _train(model, opt, rank, FREEZE + 2, start=FREEZE + 1, step_fn=bad)
    now = (_flat(model), [v.clone() for s in opt.state.values() for v in s.values()], opt.error_state(), opt.steps)
    same = (torch.equal(snap[0], now[0]) and all(torch.equal(a, b) for a, b in zip(snap[1], now[1]))
            and all(torch.equal(snap[2][k], now[2][k]) for k in ("worker", "server")) and snap[3] == now[3])
    _train(model, opt, rank, FREEZE + 3, start=FREEZE + 2)  # and it goes on
    return {"unchanged": same, "then": _flat(model)}


def _refusals(rank, world):
    out = {}
    try:
        OneBitAdam(_model().parameters(), lr=1e-2, freeze_step=FREEZE + rank)
        out["disagree"] = None
    except ValueError as exc:
        out["disagree"] = str(exc)
    model = _model()
    opt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE)
    _train(model, opt, rank, FREEZE + 1)
    gathered = [None] * world
    dist.all_gather_object(gathered, opt.state_dict())
    try:
        opt.load_state_dict(gathered[(rank + 1) % world])
        out["other_rank"] = None
    except ValueError as exc:
        out["other_rank"] = str(exc)
    other = OneBitAdam(torch.nn.Linear(3, 2).parameters(), lr=1e-2, freeze_step=FREEZE)
    try:
        other.load_state_dict(opt.state_dict())
        out["other_model"] = None
    except ValueError as exc:
        out["other_model"] = str(exc)
    return out


def _everything(rank, world):
    res = {"ddp": _ddp_equivalence(rank, world), "plain": _plain(rank, world), "mass": _mass(rank, world),
           "resume_before": _resume(rank, world, FREEZE - 1), "resume_after": _resume(rank, world, FREEZE + 2),
           "nonfinite": _nonfinite(rank, world), "refusals": _refusals(rank, world)}
    if world == 2:
        res["topk"] = _plain(rank, world, "topk", {"ratio": 0.1})
        res["int8"] = _plain(rank, world, "int8")
        res["mass_topk"] = _mass(rank, world, "topk", {"ratio": 0.1})
        res["bf16"] = _plain(rank, world, dtype=torch.bfloat16)
    return res


@pytest.fixture(scope="module", params=[2, 4])
def runs(request, tmp_path_factory):
    world = request.param
    return world, run_ranks(_everything, world, tmp_path_factory.mktemp(f"onebit{world}"), timeout_s=120)


def test_bit_identical_to_torch_adam_under_ddp_before_freeze(runs):
    world, res = runs
    for r in res:
        assert r["ddp"]["equal_before"] == [True] * FREEZE
        assert r["ddp"]["differs_after"]  # after the freeze it is 1-bit Adam, not Adam
        # and close to it: a few compressed steps move it little
        assert float((r["ddp"]["final"] - r["ddp"]["ref_final"]).abs().max()) < 0.1


def test_ddp_hook_sends_only_the_compressed_momentum_after_freeze(runs):
    world, res = runs
    numel = sum(p.numel() for p in _model().parameters())
    for r in res:  # dense: DDP's bucket, 4 bytes per element (a ring's 2 (w-1)/w of it)
        assert r["ddp"]["dense_bytes"] >= 4 * numel * (world - 1) / world
        # then 1 bit per element plus the collectives' headers (which dominate for this 251-element
        # model; the benchmark measures the ratio at size): DDP's dense reduction is gone
        assert 0 < r["ddp"]["frozen_bytes"] < r["ddp"]["dense_bytes"] / 1.5


def test_replicas_identical_after_freeze(runs):
    world, res = runs
    for key in ("ddp", "plain"):
        assert all(torch.equal(r[key]["final"], res[0][key]["final"]) for r in res)
    # without DDP the optimizer averages and broadcasts itself: the same run as under DDP
    assert torch.allclose(res[0]["plain"]["final"], res[0]["ddp"]["final"], atol=1e-5)


@pytest.mark.parametrize("case", ["mass", "mass_topk"])
def test_two_sided_error_feedback_conserves_mass(runs, case):
    world, res = runs
    if case not in res[0]:
        pytest.skip("run on 2 ranks")
    m = [r[case] for r in res]
    assert all(torch.equal(x["delivered"], m[0]["delivered"]) for x in m)
    mean = lambda key: torch.stack([x[key].double() for x in m]).mean(0)  # noqa: E731
    server0 = torch.cat([x["s0"].double() for x in m])
    server1 = torch.cat([x["s1"].double() for x in m])
    lhs = mean("sent") + mean("w0") + server0  # what was to be delivered
    rhs = m[0]["delivered"].double() + mean("w1") + server1  # delivered plus what is still owed
    # delivered is read back from the stored momentum (one rounding each way), where it is kept
    # (masked elements are sent as zero and what is decoded there is dropped)
    kept = m[0]["kept"]
    assert not kept.all() and kept.any()
    assert torch.allclose(lhs[kept], rhs[kept], atol=1e-5 * float(lhs.abs().max()) + 1e-9)
    assert float(mean("w1").abs().max()) > 0  # the code is lossy: the residuals carry something
    if world > 1:
        assert float(server1.abs().max()) > 0


def test_zero_gradient_parameters_stay_put(runs):
    world, res = runs
    for r in res:
        # rows 8..11 never get a gradient: masked out of the 1-bit exchange, they never move
        assert torch.equal(r["plain"]["emb_rows"], r["plain"]["emb_rows0"])


def test_resume_bit_identical_across_the_freeze(runs):
    world, res = runs
    assert all(r["resume_before"] for r in res)
    assert all(r["resume_after"] for r in res)


def test_nonfinite_step_changes_nothing_on_any_rank(runs):
    world, res = runs
    assert all(r["nonfinite"]["unchanged"] for r in res)
    assert all(torch.equal(r["nonfinite"]["then"], res[0]["nonfinite"]["then"]) for r in res)
    assert all(bool(torch.isfinite(r["nonfinite"]["then"]).all()) for r in res)


def test_disagreement_and_foreign_checkpoints_are_refused(runs):
    world, res = runs
    msgs = [r["refusals"]["disagree"] for r in res]
    assert all(m is not None and "disagree" in m and "freeze_step" in m for m in msgs)
    assert len(set(msgs)) == 1  # the same error on every rank
    assert all("rank" in r["refusals"]["other_rank"] for r in res)
    assert all("other parameters" in r["refusals"]["other_model"] for r in res)


@pytest.mark.parametrize("name", ["topk", "int8", "bf16"])
def test_any_compressor_and_16_bit_parameters(runs, name):
    world, res = runs
    if name not in res[0]:
        pytest.skip("run on 2 ranks")
    assert all(r[name]["finite"] for r in res)
    assert all(torch.equal(r[name]["final"], res[0][name]["final"]) for r in res)
    assert not torch.equal(res[0][name]["final"], res[0][name]["init"])
    assert torch.equal(res[0][name]["emb_rows"], res[0][name]["emb_rows0"])


# ---- one process ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, word", [
    ({"freeze_step": -1}, "freeze_step"), ({"freeze_step": 0}, "freeze_step"), ({"freeze_step": 2.5}, "freeze_step"),
    ({"betas": (1.0, 0.999)}, "betas[0]"), ({"betas": (0.9, -0.1)}, "betas[1]"), ({"betas": 0.9}, "betas"),
    ({"lr": -1.0}, "lr"), ({"eps": float("nan")}, "eps"), ({"weight_decay": -0.1}, "weight_decay"),
    ({"compressor": "nope"}, "nope"), ({"compressor": "topk", "compressor_options": {"ratio": 2.0}}, "ratio"),
])
def test_bad_options_raise_value_error(kwargs, word):
    with pytest.raises(ValueError, match=word.replace("[", r"\[").replace("]", r"\]")):
        OneBitAdam(_model().parameters(), **kwargs)


def _lockstep(pairs, step):
    """One step of each ``(model, optimizer)`` on the same batch."""
    for m, o in pairs:
        o.zero_grad()
        _loss(m, 0, step).backward()
        o.step()


def test_one_process_equals_adam_then_moves_on():
    model, ref = _model(), _model()
    opt, ropt = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE), torch.optim.Adam(ref.parameters(), lr=1e-2)
    for s in range(FREEZE):
        _lockstep(((model, opt), (ref, ropt)), s)
        assert torch.equal(_flat(model), _flat(ref))
    assert opt.frozen and not opt.wants_dense()


def test_param_groups_follow_torch_adam_and_cannot_grow():
    model, ref = _model(), _model()

    def groups(m):
        return [{"params": list(m[0].parameters())}, {"params": list(m[2:].parameters()), "lr": 3e-3}]

    opt = OneBitAdam(groups(model), lr=1e-2, freeze_step=FREEZE)
    ropt = torch.optim.Adam(groups(ref), lr=1e-2)
    for s in range(FREEZE):
        _lockstep(((model, opt), (ref, ropt)), s)
    assert torch.equal(_flat(model), _flat(ref))
    with pytest.raises(ValueError, match="cannot be added"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
