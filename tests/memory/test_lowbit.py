"""``LowBitState``: optimizer state in 8 bits, on one process.

Invariants protected: the codec's round trip error is at most half a grid step (nearest) or
one grid step and unbiased (stochastic); the compensated state's error against fp32 Adam does
not accumulate over 1000 steps (it does without compensation); state bytes are measured at
~1/4 (stochastic) and ~1/2 (feedback) of fp32; small tensors keep fp32 state; a resumed run is
bit-identical; a non-finite step changes nothing; bad options raise ``ValueError``.
"""
from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from gradcomp.memory import LowBitState, state_nbytes
from gradcomp.memory.lowbit import BLOCK, SIGNED, TABLES, UNSIGNED, pack, unpack


def _max_gap(table):
    return float((TABLES[table][1:] - TABLES[table][:-1]).max())


@pytest.mark.parametrize("table", [SIGNED, UNSIGNED])
def test_round_trip_error_is_bounded(table):
    x = torch.randn(5 * BLOCK + 17) * torch.logspace(-2, 2, 5 * BLOCK + 17)
    if table == UNSIGNED:
        x = x.abs()
    blocks = torch.nn.functional.pad(x.abs(), (0, 3 * BLOCK - 17)).view(-1, BLOCK).amax(1)
    bound = blocks.repeat_interleave(BLOCK)[:x.numel()] * _max_gap(table)
    near = unpack(pack(x, table=table, compensation="none", key128=0))
    assert near.shape == x.shape
    assert bool(((near - x).abs() <= bound / 2 * (1 + 1e-5)).all())
    draws = torch.stack([unpack(pack(x, table=table, compensation="stochastic", key128=k)) for k in range(400)])
    assert bool(((draws - x).abs() <= bound * (1 + 1e-5)).all())
    # unbiased: the mean of 400 draws is within a few standard errors of x
    assert bool(((draws.mean(0) - x).abs() <= 4 * bound / math.sqrt(400) + 1e-12).all())


def test_stochastic_rounding_is_keyed():
    x = torch.randn(3000)
    a = pack(x, table=SIGNED, compensation="stochastic", key128=7)
    b = pack(x, table=SIGNED, compensation="stochastic", key128=7)
    c = pack(x, table=SIGNED, compensation="stochastic", key128=8)
    assert torch.equal(a["codes"], b["codes"]) and not torch.equal(a["codes"], c["codes"])


def _moment_errors(compensation, steps=1000, n=4096, at=(100, 500, 1000)):
    """Relative error of the stored moments and of Adam's update against fp32 Adam, both fed
    the same gradients (whose scale swings 19x over the run)."""
    torch.manual_seed(0)
    ref_p = torch.nn.Parameter(torch.zeros(n))
    low_p = torch.nn.Parameter(torch.zeros(n))
    ref = torch.optim.Adam([ref_p], lr=1e-3)
    low = LowBitState(torch.optim.Adam([low_p], lr=1e-3), compensation=compensation)
    base = torch.rand(n) * 3 + 0.1
    out = {}
    for t in range(steps):
        g = torch.randn(n) * base * (1 + 0.9 * math.sin(t / 100))
        ref_p.grad, low_p.grad = g.clone(), g.clone()
        ref.step()
        low.step()
        if t + 1 in at:
            rs, ls = ref.state[ref_p], low.state[low_p]
            m, v = unpack(ls["exp_avg"]), unpack(ls["exp_avg_sq"])
            bc1, bc2 = 1 - 0.9 ** (t + 1), 1 - 0.999 ** (t + 1)
            u_ref = (rs["exp_avg"] / bc1) / ((rs["exp_avg_sq"] / bc2).sqrt() + 1e-8)
            u_low = (m / bc1) / ((v / bc2).sqrt() + 1e-8)
            out[t + 1] = {"m": float((m - rs["exp_avg"]).norm() / rs["exp_avg"].norm()),
                          "v": float((v - rs["exp_avg_sq"]).norm() / rs["exp_avg_sq"].norm()),
                          "update": float((u_low - u_ref).norm() / u_ref.norm())}
    return out, state_nbytes(low) / state_nbytes(ref)


@pytest.fixture(scope="module")
def runs():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 4096-element steps: one thread is fastest, and steady on a busy machine
    try:
        return {c: _moment_errors(c) for c in ("stochastic", "feedback", "none")}
    finally:
        torch.set_num_threads(threads)


def test_compensated_error_does_not_accumulate(runs):
    fb, _ = runs["feedback"]
    assert fb[1000]["update"] < 0.05 and fb[1000]["v"] < 0.05
    assert fb[1000]["update"] <= 1.5 * fb[100]["update"]
    st, _ = runs["stochastic"]
    assert st[1000]["update"] < 0.15
    assert st[1000]["update"] <= 1.15 * st[500]["update"]  # settled: no longer growing
    near, _ = runs["none"]
    # without compensation the second moment freezes and its error keeps growing
    assert near[1000]["v"] > 1.5 * near[100]["v"]
    assert near[1000]["v"] > 2 * fb[1000]["v"]


def test_state_bytes_are_measured_at_a_quarter(runs):
    assert runs["stochastic"][1] == pytest.approx(0.254, abs=0.002)
    assert runs["none"][1] == pytest.approx(0.254, abs=0.002)
    assert runs["feedback"][1] == pytest.approx(0.508, abs=0.003)


def _train(opt, params, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("cls,kw", [(torch.optim.AdamW, {"lr": 1e-2}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})])
@pytest.mark.parametrize("compensation", ["stochastic", "feedback"])
def test_resume_is_bit_identical_and_small_tensors_stay(cls, kw, compensation):
    params = [torch.nn.Parameter(torch.randn(5000)), torch.nn.Parameter(torch.randn(10))]
    opt = LowBitState(cls(params, **kw), compensation=compensation)
    _train(opt, params, 3, seed=1)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    saved = [p.detach().clone() for p in params]
    _train(opt, params, 3, seed=2)
    again = [torch.nn.Parameter(t.clone()) for t in saved]
    opt2 = LowBitState(cls(again, **kw), compensation=compensation)
    opt2.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    _train(opt2, again, 3, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(params, again))
    big, small = opt.state[params[0]], opt.state[params[1]]
    key = "exp_avg" if cls is torch.optim.AdamW else "momentum_buffer"
    assert isinstance(big[key], dict) and isinstance(small[key], torch.Tensor)  # < 4096 elements: fp32


def test_scheduler_and_nonfinite_step():
    p = torch.nn.Parameter(torch.randn(5000))
    opt = LowBitState(torch.optim.Adam([p], lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _train(opt, [p], 2, seed=0)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    before, state = p.detach().clone(), copy.deepcopy(opt.state_dict())
    p.grad = torch.full_like(p, float("inf"))
    opt.step()
    assert torch.equal(p, before) and opt.skipped == 1
    after = opt.state_dict()
    assert torch.equal(after["state"][0]["exp_avg"]["codes"], state["state"][0]["exp_avg"]["codes"])


def test_bad_options():
    p = [torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(ValueError, match="bits=4"):
        LowBitState(torch.optim.Adam(p), bits=4)
    with pytest.raises(ValueError, match="compensation='kahan'.*stochastic, feedback, none"):
        LowBitState(torch.optim.Adam(p), compensation="kahan")
    with pytest.raises(ValueError, match="min_numel"):
        LowBitState(torch.optim.Adam(p), min_numel=-1)
    with pytest.raises(ValueError, match="wraps a torch.optim.Optimizer"):
        LowBitState(object())  # type: ignore[arg-type]
    opt = LowBitState(torch.optim.Adam(p))
    with pytest.raises(ValueError, match="compensation='feedback'"):
        LowBitState(torch.optim.Adam(p), compensation="feedback").load_state_dict(opt.state_dict())
