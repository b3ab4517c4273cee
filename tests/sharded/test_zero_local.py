"""``ShardedOptimizer`` without a process group: one rank holds every shard, and the run is
plain ``torch.optim`` bit for bit (dense), checkpoints round-trip, and bad options are refused
with a message naming what is allowed."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from gradcomp.sharded import ShardedOptimizer


def _pair(seed=0):
    torch.manual_seed(seed)
    a = nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 3))
    torch.manual_seed(seed)
    return a, nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 3))


def _steps(model, opt, n, start=0):
    for s in range(start, start + n):
        g = torch.Generator().manual_seed(s)
        opt.zero_grad()
        model(torch.randn(5, 6, generator=g)).pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("cls,kw", [(torch.optim.AdamW, {"lr": 0.01}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})])
def test_alone_it_is_the_inner_optimizer(cls, kw):
    ours, ref = _pair()
    opt = ShardedOptimizer(ours.parameters(), cls, bucket_mb=0.0005, **kw)
    plain = cls(ref.parameters(), **kw)
    _steps(ours, opt, 4)
    _steps(ref, plain, 4)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters()))


@pytest.mark.parametrize("compensation", ["stochastic", "feedback"])
def test_checkpoints_alone(compensation):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 800), nn.Tanh(), nn.Linear(800, 3))  # 8,003 elements: 8-bit state
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01, compressor="int8",
                           weight_compressor="bf16", state_bits=8, state_compensation=compensation)
    _steps(model, opt, 2)
    full, shard = opt.consolidated_state_dict(), opt.state_dict()
    assert full is not None and full["kind"] == "consolidated" and shard["kind"] == "sharded"
    packed = full["state"][0]["exp_avg"]
    assert isinstance(packed, dict) and ("residual" in packed) == (compensation == "feedback")
    opt.load_state_dict(full)
    again = opt.consolidated_state_dict()
    assert again is not None and torch.equal(again["state"][0]["exp_avg"]["codes"], packed["codes"])
    opt.load_state_dict(shard)
    _steps(model, opt, 1, start=2)
    with pytest.raises(ValueError, match="to=1 must be a rank"):
        opt.consolidated_state_dict(to=1)


def test_a_shard_whose_error_feedback_identity_is_of_an_older_form_loads_whole():
    """The optimizer's identity says whose the residuals are; the error feedback's own identity
    (another form before the Identity value) refused after the inner state had loaded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 800), nn.Tanh(), nn.Linear(800, 3))
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01, compressor="int8",
                           weight_compressor="bf16", state_bits=8)
    _steps(model, opt, 2)
    shard = opt.state_dict()
    for ef in ("grad_feedback", "weight_feedback"):
        shard[ef]["identity"] = {"world": 1, "rank": 0, "config": -123456789}  # as gradcomp saved it before
    opt2 = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01, compressor="int8",
                            weight_compressor="bf16", state_bits=8)
    opt2.load_state_dict(shard)
    again = opt2.state_dict()
    assert torch.equal(again["master"][0], shard["master"][0]) and again["skipped"] == shard["skipped"]
    assert again["inner"]["state"][0]["exp_avg"]["codes"].equal(shard["inner"]["state"][0]["exp_avg"]["codes"])
    assert all(torch.equal(again["grad_feedback"]["state"][k], v) for k, v in shard["grad_feedback"]["state"].items())


@pytest.mark.parametrize("kw,message", [
    ({"state_bits": 16}, "state_bits=16 is not allowed; allowed: 32, 8"),
    ({"state_bits": 4}, "state_bits=4 is not allowed \\(4-bit state is not offered"),
    ({"stage": 0}, "stage=0 is not allowed"),
    ({"bucket_mb": 0}, "bucket_mb=0 is not allowed"),
    ({"state_compensation": "kahan"}, "state_compensation='kahan' is not allowed; allowed: stochastic, feedback, none"),
    ({"compressor": 3}, "compressor must be a registered name, a Compressor or an error-feedback wrapper"),
    ({"weight_compressor": "bf17"}, "bf17"),
    ({"betas": 0.9}, "AdamW refused the options"),
])
def test_bad_options(kw, message):
    model, _ = _pair()
    with pytest.raises(ValueError, match=message):
        ShardedOptimizer(model.parameters(), torch.optim.AdamW, **{"lr": 0.01, **kw})


def test_bad_parameters():
    model, _ = _pair()
    with pytest.raises(ValueError, match="optimizer_class must be a torch.optim.Optimizer subclass"):
        ShardedOptimizer(model.parameters(), "adamw")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty parameter list"):
        ShardedOptimizer([], torch.optim.AdamW)
    w = nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="more than once"):
        ShardedOptimizer([w, w], torch.optim.AdamW)
    with pytest.raises(ValueError, match="mixes dtypes"):
        ShardedOptimizer([w, nn.Parameter(torch.ones(3, dtype=torch.float64))], torch.optim.AdamW)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW)
    with pytest.raises(ValueError, match="cannot add parameter groups"):
        opt.add_param_group({"params": [w]})
    with pytest.raises(ValueError, match="not a ShardedOptimizer checkpoint"):
        opt.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())


def test_buckets_are_cut_last_parameter_first_under_the_cap():
    """The bucket plan (gradcomp's one ``plan_buckets``, elements counted as 4 bytes) is the
    layout every rank agrees on and every checkpoint's residual keys name: it must not move."""
    from gradcomp.sharded.layout import group_buckets, group_layout

    def plan(numels, cap_elements):
        params = [torch.zeros(n) for n in numels]
        got = group_buckets(group_layout(numels, 2), 1, params, cap_elements * 4 / 2 ** 20)
        return [(b.group, b.members, b.start, b.stop) for b in got]

    # offsets 0, 3, 8, 10, 17: filled from the last, a new bucket when the next would pass 8
    assert plan([3, 5, 2, 7, 1], 8) == [(1, (3, 4), 10, 18), (1, (1, 2), 3, 10), (1, (0,), 0, 3)]
    assert plan([20, 1], 8) == [(1, (1,), 20, 21), (1, (0,), 0, 20)]  # a larger parameter is a bucket alone
    assert plan([4, 0, 4], 8) == [(1, (0, 1, 2), 0, 8)]
    assert plan([], 8) == []


def test_prefetch_needs_the_model_of_the_parameters():
    ours, _ = _pair()
    with pytest.raises(ValueError, match="prefetch=True needs model="):
        ShardedOptimizer(ours.parameters(), torch.optim.AdamW, lr=0.01, prefetch=True)
    with pytest.raises(ValueError, match="prefetch='yes' is not allowed"):
        ShardedOptimizer(ours.parameters(), torch.optim.AdamW, lr=0.01, model=ours, prefetch="yes")
    stray = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not parameters of the model given"):
        ShardedOptimizer([*ours.parameters(), stray], torch.optim.AdamW, lr=0.01, model=ours, prefetch=True)


def test_prefetch_alone_is_the_inner_optimizer():
    """One process: the gathers complete at once, the bits are plain torch.optim's."""
    ours, ref = _pair()
    opt = ShardedOptimizer(ours.parameters(), torch.optim.AdamW, bucket_mb=0.0005, lr=0.01, model=ours,
                           prefetch=True)
    plain = torch.optim.AdamW(ref.parameters(), lr=0.01)
    _steps(ours, opt, 4)
    _steps(ref, plain, 4)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters()))
