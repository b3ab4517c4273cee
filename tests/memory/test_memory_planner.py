"""The memory planner: the dynamic programme against brute force, predictions against the
meter, plans against the plain model."""
import json
import random
from collections import OrderedDict

import pytest
import torch
from torch import nn

from gradcomp.memory import MemoryMeter, Plan, plan_memory
from gradcomp.memory.executor import PlannedSequential
from gradcomp.memory.planner import profile
from gradcomp.memory.schedule import (Costs, Plain, Recompute, min_peak, solve, stages_of, time as sched_time,
                                      total_peak)


# ---- the dynamic programme ---------------------------------------------------------------
def _schedules(s, t, modes, recompute):
    """Every schedule of stages s..t (the brute force the DP is checked against)."""
    if s == t:
        for m in modes:
            yield [Plain(s, m)]
        return
    for m in modes:
        for rest in _schedules(s + 1, t, modes, recompute):
            yield [Plain(s, m)] + rest
    if recompute:
        for k in range(s, t):
            for inner in _schedules(s, k, modes, recompute):
                for rest in _schedules(k + 1, t, modes, recompute):
                    yield [Recompute(s, k, tuple(inner))] + rest


def _random_costs(rng, n, modes):
    out = [rng.randint(1, 6) for _ in range(n)]
    return Costs(fwd=[{m: rng.randint(1, 5) * (1.5 if m != "keep" else 1.0) for m in modes} for _ in range(n)],
                 bwd=[{m: float(rng.randint(1, 9)) for m in modes} for _ in range(n)],
                 internal=[{m: rng.randint(0, 8) if m == "keep" else rng.randint(0, 3) for m in modes} for _ in range(n)],
                 form=[{m: out[i] if m == "keep" else (0 if m == "offload" else rng.randint(0, out[i])) for m in modes}
                       for i in range(n)],
                 out=out, saves_in=[rng.random() < 0.7 for _ in range(n)],
                 saves_out=[rng.random() < 0.5 for _ in range(n)], inp=rng.randint(0, 5),
                 spike=[{m: rng.randint(0, 10) if m.startswith("compress") else 0 for m in modes} for _ in range(n)])


def test_the_dynamic_programme_is_optimal_against_brute_force():
    rng = random.Random(1)
    checked = 0
    for _ in range(120):
        n = rng.randint(1, 5)
        modes = ["keep", "compress:int8", "offload"][:rng.randint(1, 3)]
        c = _random_costs(rng, n, modes)
        recompute = rng.random() < 0.8
        every = list(_schedules(0, n - 1, modes, recompute))
        least, blocks = min_peak(c, recompute)
        assert least == min(total_peak(b, c) for b in every) and total_peak(blocks, c) == least
        for budget in range(0, 40, 3):
            got = solve(c, budget, slots=max(budget, 1), recompute=recompute)  # 1-byte slots: exact
            fits = [sched_time(b, c) for b in every if total_peak(b, c) <= budget]
            if not fits:
                assert got is None
                continue
            assert got is not None and stages_of(got) == list(range(n))
            assert total_peak(got, c) <= budget
            assert sched_time(got, c) == pytest.approx(min(fits))
            checked += 1
    assert checked > 500


def test_a_coarse_budget_never_overshoots():
    rng = random.Random(2)
    for _ in range(30):
        c = _random_costs(rng, 12, ["keep", "compress:int8"])
        for budget in (40, 60, 90):
            got = solve(c, budget, slots=16)  # costs rounded up to budget/16: the plan always fits
            if got is not None:
                assert total_peak(got, c) <= budget


# ---- chains ------------------------------------------------------------------------------
class _Residual(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
                                  nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c))

    def forward(self, x):
        return torch.relu(x + self.body(x))


class _Block(nn.Module):
    """A pre-norm transformer block (attention, MLP, dropout)."""

    def __init__(self, d, heads=4, p=0.1):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(p), nn.Linear(4 * d, d))

    def forward(self, x):
        y = self.ln1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(10)]), torch.randn(128, 256)


def _conv():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), *[_Residual(16) for _ in range(5)],
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    return model, torch.randn(8, 3, 24, 24)


def _transformer():
    torch.manual_seed(0)
    return nn.Sequential(*[_Block(64) for _ in range(6)]), torch.randn(4, 32, 64)


CHAINS = {"mlp": _mlp, "conv": _conv, "transformer": _transformer}


def _step(model, x, seed=7):
    """One training step: peak saved bytes, gradients, BatchNorm statistics."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    with MemoryMeter() as meter:
        model(x).square().mean().backward()
    stats = [b.clone() for b in model.buffers()]
    return meter.peak_saved_bytes, [p.grad.clone() for p in model.parameters()], stats


@pytest.fixture(scope="module", params=list(CHAINS))
def chain(request):
    model, x = CHAINS[request.param]()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    peak, grads, stats = _step(model, x)
    model.load_state_dict(state)  # the reference step moved BatchNorm's statistics
    return request.param, model, x, state, peak, grads, stats


@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_lossless_plans_fit_predict_and_keep_gradients_bit_identical(chain, fraction):
    name, model, x, state, base_peak, base_grads, base_stats = chain
    budget = int(base_peak * fraction)
    try:
        plan = plan_memory(model, x, budget, allow=("recompute", "compress"), repeats=1)
    except ValueError as exc:
        pytest.fail(f"{name} at {fraction}: {exc}")
    assert plan.predicted_peak <= budget
    model.load_state_dict(state)
    peak, grads, stats = _step(plan.apply(model), x)
    model.load_state_dict(state)
    # the prediction is what the meter measures (within 10 %), and the plan fits the budget
    assert abs(peak - plan.predicted_peak) <= 0.1 * plan.predicted_peak, (name, peak, plan.predicted_peak)
    assert peak <= budget * 1.1
    assert peak < base_peak
    assert all(torch.equal(a, b) for a, b in zip(grads, base_grads)), name
    # BatchNorm's running statistics move once per step, recomputed or not
    assert all(torch.equal(a, b) for a, b in zip(stats, base_stats)), name


def test_without_a_budget_the_plan_keeps_everything(chain):
    name, model, x, state, base_peak, _, _ = chain
    plan = plan_memory(model, x, base_peak * 2, allow=("recompute", "compress"), repeats=1)
    assert plan.predicted_peak == plan.baseline_peak
    assert all(r["forward_runs"] == 1 for r in plan.decisions())
    model.load_state_dict(state)
    peak, _, _ = _step(plan.apply(model), x)
    model.load_state_dict(state)
    assert abs(peak - base_peak) <= 0.1 * base_peak


def test_a_budget_too_small_names_the_smallest_that_fits():
    model, x = _mlp()
    with pytest.raises(ValueError, match=r"smallest budget that fits is (\d+) bytes") as info:
        plan_memory(model, x, 1000, allow=("recompute",), repeats=1)
    least = int(info.value.args[0].split("smallest budget that fits is ")[1].split(" ")[0])
    assert info.value.smallest_budget == least
    plan = plan_memory(model, x, least, allow=("recompute",), repeats=1)
    assert plan.predicted_peak <= least
    peak, _, _ = _step(plan.apply(model), x)
    assert abs(peak - plan.predicted_peak) <= 0.1 * plan.predicted_peak
    with pytest.raises(ValueError, match="lowers it"):  # without recompute: say what would help
        plan_memory(model, x, least, allow=(), repeats=1)


def test_a_lossy_codec_is_chosen_only_when_named_and_stays_close():
    model, x = _mlp()
    base_peak, base_grads, _ = _step(model, x)
    plan = plan_memory(model, x, int(base_peak * 0.55), allow=("compress",), codecs=("int8",), repeats=1)
    assert {r["mode"] for r in plan.decisions()} <= {"keep", "compress:int8"}
    assert any(r["mode"] == "compress:int8" for r in plan.decisions())
    planned = plan.apply(model)
    peak, grads, _ = _step(planned, x)
    assert abs(peak - plan.predicted_peak) <= 0.1 * plan.predicted_peak
    for a, b in zip(grads, base_grads):
        assert (a - b).norm() <= 0.05 * b.norm()
    # keyed randomness: the same step gives the same bits, the next step other ones
    planned.step = 0
    _, again, _ = _step(planned, x)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    _, other, _ = _step(planned, x)
    assert not all(torch.equal(a, b) for a, b in zip(grads, other))


def test_recomputation_reproduces_what_a_stochastic_codec_stored():
    """A recomputed stage stores the same bits it would have stored unrecomputed: the codec's
    streams are keyed by step, stage and tensor, not by when they were drawn."""
    model, x = _mlp()
    costs, _ = profile(model, x, ["keep", "compress:int8"], repeats=1)
    n = costs.length
    flags = (costs.saves_in, costs.saves_out)
    inner = tuple(Plain(i, "compress:int8") for i in range(4))
    plans = {"plain": [Plain(i, "compress:int8") for i in range(n)],
             "recomputed": [Recompute(0, 3, inner)] + [Plain(i, "compress:int8") for i in range(4, n)],
             "nested": [Recompute(0, 3, (Recompute(0, 1, inner[:2]),) + inner[2:])]
             + [Plain(i, "compress:int8") for i in range(4, n)]}
    grads = {}
    for name, blocks in plans.items():
        planned = PlannedSequential(OrderedDict(model.named_children()), blocks, *flags)
        grads[name] = _step(planned, x)[1]
    # stages 4.. store identical bits in every plan, so their gradients are the same bits
    for name in ("recomputed", "nested"):
        for a, b in zip(grads[name][8:], grads["plain"][8:]):
            assert torch.equal(a, b), name
        for a, b in zip(grads[name], grads["plain"]):
            assert (a - b).norm() <= 0.05 * b.norm().clamp_min(1e-12)
    # where a segment ends, its last stage keeps its output as it is (the next block holds it
    # so anyway): only the stages before a segment's end can see other bits
    for a, b in zip(grads["recomputed"][4:], grads["nested"][4:]):
        assert torch.equal(a, b)


def test_plans_print_serialise_and_refuse_another_model():
    model, x = _conv()
    plan = plan_memory(model, x, 2**21, allow=("recompute", "compress"), repeats=1)
    text = str(plan)
    assert "predicted peak" in text and len(text.splitlines()) >= len(list(model.children())) + 3
    again = Plan.from_json(plan.to_json())
    assert again.blocks == plan.blocks and again.predicted_peak == plan.predicted_peak
    assert again.predicted_time == pytest.approx(plan.predicted_time)
    json.loads(plan.to_json())
    again.apply(model)
    other, _ = _mlp()
    with pytest.raises(ValueError, match="another chain"):
        again.apply(other)
    with pytest.raises(ValueError, match="not a gradcomp memory plan"):
        Plan.from_dict({"version": 99})


def test_what_is_not_a_chain_is_refused_clearly():
    class Pair(nn.Module):
        def forward(self, x):
            return x, x

    with pytest.raises(ValueError, match="not a chain: stage 1"):
        plan_memory(nn.Sequential(nn.Linear(4, 4), Pair()), torch.randn(2, 4), 10**6, repeats=1)
    with pytest.raises(ValueError, match="nn.Sequential or a list of modules"):
        plan_memory(nn.Linear(4, 4), torch.randn(2, 4), 10**6)
    with pytest.raises(ValueError, match="unknown choice"):
        plan_memory(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4), 10**6, allow=("swap",))
    with pytest.raises(ValueError, match="budget_bytes"):
        plan_memory(nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4), -1)


def test_planning_leaves_the_model_as_it_was():
    model, x = _conv()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    rng = torch.get_rng_state()
    plan_memory(model, x, 2**21, repeats=1)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in model.parameters())
    assert torch.equal(rng, torch.get_rng_state())


def test_offload_is_not_planned_on_the_cpu_and_the_plan_says_so():
    model, x = _mlp()
    plan = plan_memory(model, x, 10**8, allow=("offload",), repeats=1)
    assert all(r["mode"] == "keep" for r in plan.decisions())
    assert "offload: not considered" in str(plan)


def test_evaluation_runs_the_plain_chain():
    model, x = _mlp()
    plan = plan_memory(model, x, 2**19, repeats=1)
    planned = plan.apply(model)
    with torch.no_grad():
        assert torch.equal(planned(x), model(x))
    assert planned.step == 0


def _random_schedule(rng, s, t, modes, depth=0):
    blocks = []
    while s <= t:
        if s < t and depth < 3 and rng.random() < 0.3:
            k = rng.randint(s, t - 1)
            blocks.append(Recompute(s, k, tuple(_random_schedule(rng, s, k, modes, depth + 1))))
            s = k + 1
        else:
            blocks.append(Plain(s, rng.choice(modes)))
            s += 1
    return blocks


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_the_cost_model_is_what_the_meter_measures_for_any_schedule(name):
    """Random schedules (storage modes mixed, recomputation nested): the predicted peak is the
    measured one. This is what lets the dynamic programme's optimum be real."""
    model, x = CHAINS[name]()
    modes = ["keep", "compress:int8", "compress:lossless"]
    costs, _ = profile(model, x, modes, repeats=1)
    rng = random.Random(5)
    flags = (costs.saves_in, costs.saves_out)
    for _ in range(12):
        blocks = _random_schedule(rng, 0, costs.length - 1, modes)
        planned = PlannedSequential(OrderedDict(model.named_children()), blocks, *flags)
        peak, _, _ = _step(planned, x)
        predicted = total_peak(blocks, costs)
        assert abs(peak - predicted) <= 0.02 * predicted, (blocks, peak, predicted)


@pytest.mark.gpu
def test_on_cuda_a_plan_may_offload_and_still_predicts_the_meter():
    model, x = _mlp()
    model, x = model.cuda(), x.cuda()
    base_peak, base_grads, _ = _step(model, x)
    plan = plan_memory(model, x, int(base_peak * 0.3), allow=("recompute", "compress", "offload"), repeats=2)
    peak, grads, _ = _step(plan.apply(model), x)
    assert all(torch.equal(a, b) for a, b in zip(grads, base_grads))
    assert abs(peak - plan.predicted_peak) <= 0.1 * max(plan.predicted_peak, 1)
    assert peak <= base_peak * 0.3 * 1.1
