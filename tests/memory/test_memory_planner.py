"""The memory planner: the dynamic programme against brute force, predictions against the
meter, plans against the plain model."""
import json
import random
from collections import OrderedDict

import pytest
import torch
from torch import nn

from gradcomp.memory import BudgetTooSmall, MemoryMeter, Plan, plan_memory
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
        costs = [(total_peak(b, c), sched_time(b, c)) for b in every]  # each schedule's (peak, time), once
        least, blocks = min_peak(c, recompute)
        assert least == min(peak for peak, _ in costs) and total_peak(blocks, c) == least
        for budget in range(0, 40, 3):
            got = solve(c, budget, slots=max(budget, 1), recompute=recompute)  # 1-byte slots: exact
            fits = [time for peak, time in costs if peak <= budget]
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
    # a budget only offloading could meet: the error says offloading needs CUDA, not just "too small"
    with pytest.raises(BudgetTooSmall, match=r"^plan_memory: offloading needs a CUDA model .* no schedule keeps"):
        plan_memory(model, x, 1, allow=("offload",), repeats=1)
    with pytest.raises(BudgetTooSmall) as other:
        plan_memory(model, x, 1, allow=("compress",), repeats=1)
    assert "CUDA" not in str(other.value)


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


# ---- real layers: BatchNorm recomputed, stages that work in place, the fingerprint ---------
def _bn_linear():
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.BatchNorm1d(64),
                         nn.ReLU(), nn.Linear(64, 10)), torch.randn(64, 32)


def _bn_conv():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 10)), torch.randn(8, 3, 12, 12)


def _bn_residual():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), _Residual(8), _Residual(8), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 10)), torch.randn(8, 3, 12, 12)


def _bn_models_conv():
    import models
    return models.sequential("conv_bn"), models.data("conv_bn", 32)[0]


BN_CHAINS = {"linear_bn": _bn_linear, "conv_bn2d": _bn_conv, "residual_bn": _bn_residual, "models_conv_bn": _bn_models_conv}


def _has_bn(stage):
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in stage.modules())


def _train_alike(planned, reference, x, steps, exact=True):
    """``steps`` SGD steps of both models on ``x``: the losses, gradients and buffers (BatchNorm's
    running statistics and count) after each are the same bits (``exact=False``: to float32
    rounding, for CUDA kernels whose accumulation order is not fixed)."""
    same = torch.equal if exact else (lambda a, b: torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-6))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (planned, reference)]
    for step in range(steps):
        losses, grads = [], []
        for m, opt in zip((planned, reference), opts):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)
            loss = m(x).square().mean()
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad.clone() for p in m.parameters()])
            opt.step()
        assert same(*losses), step
        assert all(same(a, b) for a, b in zip(*grads)), step
        bufs = [list(m.buffers()) for m in (planned, reference)]
        assert len(bufs[0]) == len(bufs[1])
        assert all(same(a, b) for a, b in zip(*bufs)), step


@pytest.mark.parametrize("name", list(BN_CHAINS))
def test_recomputed_batchnorm_stages_train_exactly_as_the_plain_model(name):
    """BatchNorm in training mode inside recomputed stages: the backward runs (the running
    statistics are not written while it is pending), the recomputation normalises by the same
    batch statistics and the statistics move once per step, for several steps, flat and nested."""
    import copy
    torch.manual_seed(0)
    model, x = BN_CHAINS[name]()
    start = copy.deepcopy(model)
    costs, _ = profile(model, x, ["keep"], repeats=1)
    n = costs.length
    keep = lambda s, t: tuple(Plain(i) for i in range(s, t + 1))  # noqa: E731
    schedules = {"flat": [Recompute(0, n - 2, keep(0, n - 2)), Plain(n - 1)],
                 "nested": [Recompute(0, n - 2, (Recompute(0, 2, keep(0, 2)),) + keep(3, n - 2)), Plain(n - 1)]}
    # and the planner's own schedule at the smallest budget recompute reaches
    with pytest.raises(ValueError) as info:
        plan_memory(model, x, 0, allow=("recompute",), repeats=1)
    plan = plan_memory(model, x, info.value.smallest_budget, allow=("recompute",), repeats=1)
    recomputed = [r["stage"] for r in plan.decisions() if r["forward_runs"] > 1]
    stages = list(model.children())
    assert any(_has_bn(stages[i]) for i in recomputed), (name, plan.decisions())
    for label, blocks in list(schedules.items()) + [("planned", plan.blocks)]:
        assert any(_has_bn(stages[i]) for i in _recomputed(blocks)), label
        model.load_state_dict(start.state_dict())
        planned = PlannedSequential(OrderedDict(model.named_children()), blocks, costs.saves_in, costs.saves_out)
        _train_alike(planned, copy.deepcopy(start), x, steps=3)
    # evaluation mode with gradients (BatchNorm frozen): nothing moves, the gradients agree
    model.load_state_dict(start.state_dict())
    reference = copy.deepcopy(start)
    model.eval(), reference.eval()
    _train_alike(plan.apply(model), reference, x, steps=1)


def _recomputed(blocks):
    """The stages a schedule runs forward more than once."""
    out = []
    for b in blocks:
        if isinstance(b, Recompute):
            out.extend(range(b.start, b.end + 1))
    return out


def _inplace_chain():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(inplace=True), nn.Linear(128, 128), nn.ReLU(inplace=True),
                         nn.Linear(128, 10)), torch.randn(64, 64)


def test_stages_that_work_in_place_plan_and_run_recomputed_compressed_or_offloaded():
    """``ReLU(inplace=True)`` as a stage of its own: planned (measured on inputs of their own:
    the sample and the model are untouched), and run exactly by schedules that recompute from
    it, compress what comes into it or what it saves, offload, nest; the meter measures what
    the cost model predicts."""
    import copy
    model, x = _inplace_chain()
    sample = x.clone()
    plan = plan_memory(model, x, 10**7, allow=("recompute", "compress"), repeats=1)
    assert plan.costs.inplace == [False, True, False, True, False]
    # what a stage that works in place saves is its output, never its (overwritten) input
    assert plan.costs.saves_out[1] and not plan.costs.saves_in[1]
    assert torch.equal(x, sample)
    modes = ["keep", "compress:lossless", "compress:int8"]
    costs, _ = profile(model, x, modes + ["offload"], repeats=1)
    assert costs.inplace == plan.costs.inplace
    lossless, K = "compress:lossless", "keep"
    schedules = {
        "recompute from it": [Plain(0), Recompute(1, 2, (Plain(1), Plain(2))), Plain(3), Plain(4)],
        "compressed through it": [Plain(0, lossless), Plain(1, lossless), Plain(2, lossless), Plain(3), Plain(4)],
        "its input compressed": [Plain(0, lossless), Plain(1, K), Plain(2, lossless), Plain(3, K), Plain(4)],
        "recomputed, compressed inside": [Plain(0), Recompute(1, 3, (Plain(1, lossless), Plain(2), Plain(3))), Plain(4)],
        "nested": [Recompute(0, 3, (Plain(0, lossless), Recompute(1, 2, (Plain(1), Plain(2, lossless))), Plain(3))),
                   Plain(4)],
        "offloaded": [Plain(i, "offload") for i in range(5)],
    }
    for label, blocks in schedules.items():
        planned = PlannedSequential(OrderedDict(model.named_children()), blocks, costs.saves_in, costs.saves_out,
                                    inplace=costs.inplace)
        _train_alike(planned, copy.deepcopy(model), x, steps=1)
        planned.load_state_dict(model.state_dict())
        if "offload" not in label:  # the meter's figure is the cost model's
            peak, _, _ = _step(planned, x)
            predicted = total_peak(blocks, costs)
            assert abs(peak - predicted) <= 0.02 * predicted, (label, peak, predicted)
        assert torch.equal(x, sample), label
    # the planner's schedules run too, and a lossy one stays close
    for allow, codecs in ((("recompute",), ("lossless",)), (("recompute", "compress"), ("int8",))):
        with pytest.raises(ValueError) as info:
            plan_memory(model, x, 0, allow=allow, codecs=codecs, repeats=1)
        plan = plan_memory(model, x, info.value.smallest_budget, allow=allow, codecs=codecs, repeats=1)
        base = _step(model, x)[1]
        peak, grads, _ = _step(plan.apply(model), x)
        assert peak <= info.value.smallest_budget * 1.1
        for a, b in zip(grads, base):
            assert (a - b).norm() <= (0.0 if codecs == ("lossless",) else 0.05) * b.norm()


def test_a_stage_that_works_in_place_first_in_the_chain_leaves_the_sample_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    x = torch.randn(32, 64)
    sample = x.clone()
    plan = plan_memory(model, x, 10**7, allow=("recompute",), repeats=1)
    assert torch.equal(x, sample) and plan.costs.inplace[0]
    blocks = [Recompute(0, 2, tuple(Plain(i) for i in range(3))), Plain(3)]
    planned = PlannedSequential(OrderedDict(model.named_children()), blocks, plan.costs.saves_in,
                                plan.costs.saves_out, inplace=plan.costs.inplace)
    ref = _step(model, x.clone())[1]
    assert all(torch.equal(a, b) for a, b in zip(_step(planned, x.clone())[1], ref))
    # told nothing, a recomputation that starts at such a stage is refused before it is wrong
    blind = PlannedSequential(OrderedDict(model.named_children()), blocks, plan.costs.saves_in, plan.costs.saves_out)
    with pytest.raises(ValueError, match="changed its input in place"):
        blind(x.clone())


def _nested(act):
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(16, 32), act()), nn.Sequential(nn.Linear(32, 32), act()),
                         nn.Linear(32, 4))


def test_a_plan_is_refused_on_stages_whose_modules_differ():
    """The fingerprint holds every module inside the stages, their settings and their tensors'
    shapes and dtypes: a plan measured on ReLU stages is refused on GELU or Tanh ones."""
    x = torch.randn(8, 16)
    plan = plan_memory(_nested(nn.ReLU), x, 10**6, repeats=1)
    plan.apply(_nested(nn.ReLU))  # another instance of the same chain
    Plan.from_json(plan.to_json()).apply(_nested(nn.ReLU))
    for other, says in ((_nested(nn.GELU), "GELU"), (_nested(nn.Tanh), "Tanh"),
                        (_nested(lambda: nn.ReLU(inplace=True)), "inplace=True"),
                        (_nested(nn.ReLU).double(), "float64"),
                        (nn.Sequential(*_nested(nn.ReLU)[:2], nn.Linear(32, 5)), r"\(5, 32\)")):
        with pytest.raises(ValueError, match=f"another chain .*{says}.*plan this model with plan_memory"):
            plan.apply(other)
    conv = lambda stride: nn.Sequential(nn.Sequential(nn.Conv1d(1, 4, 3, stride=stride)))  # noqa: E731
    with pytest.raises(ValueError, match=r"stride=\(2,\)"):
        plan_memory(conv(1), torch.randn(2, 1, 16), 10**6, repeats=1).apply(conv(2))
    old = plan.to_dict()
    old["version"] = 1
    with pytest.raises(ValueError, match="earlier gradcomp.*plan the model again"):
        Plan.from_dict(old)


# ---- the shared models of other kinds -----------------------------------------------------
def _only(costs, modes):
    """``costs`` with only ``modes`` (the planner's figures for a narrower ``allow``)."""
    pick = lambda rows: [{m: r[m] for m in modes} for r in rows]  # noqa: E731
    return Costs(fwd=pick(costs.fwd), bwd=pick(costs.bwd), internal=pick(costs.internal), form=pick(costs.form),
                 out=costs.out, saves_in=costs.saves_in, saves_out=costs.saves_out, inp=costs.inp,
                 spike=pick(costs.spike), rerun=costs.rerun, inplace=costs.inplace)


@pytest.mark.parametrize("kind", ["conv_bn", "transformer", "many_small"])
def test_plans_on_the_other_models_fit_and_train_as_the_plain_model(kind):
    """tests/models.py's conv net with BatchNorm, transformer and many small stages, planned at
    the smallest budget each choice reaches (so each is forced onto some stage): the meter's
    peak is the prediction and within the budget; lossless plans train bit-identically for two
    steps (gradients, BatchNorm statistics), int8 ones stay close."""
    import copy

    import models
    torch.manual_seed(0)
    model = models.sequential(kind)
    x = models.data(kind, 64)[0]
    start = copy.deepcopy(model)
    base_peak = _step(model, x)[0]
    model.load_state_dict(start.state_dict())
    every = ["keep", "compress:lossless", "compress:int8"]
    costs, _ = profile(model, x, every, repeats=1)
    lossless = ("lossless",)
    cases = [(("recompute",), lossless, "recompute"), (("compress",), lossless, "compress:lossless"),
             (("compress",), ("int8",), "compress:int8"), (("recompute", "compress"), ("lossless", "int8"), None)]
    for allow, codecs, forced in cases:
        modes = ["keep"] + ([f"compress:{c}" for c in codecs] if "compress" in allow else [])
        least, _ = min_peak(_only(costs, modes), recompute="recompute" in allow)
        if least >= base_peak:  # this choice saves nothing on this model (lossless on incompressible data)
            assert forced == "compress:lossless", (kind, allow)
            continue
        plan = plan_memory(model, x, least, allow=allow, codecs=codecs, repeats=1)
        rows = plan.decisions()
        used = {r["mode"] for r in rows} | ({"recompute"} if any(r["forward_runs"] > 1 for r in rows) else set())
        assert forced is None or forced in used, (kind, allow, codecs, rows)
        model.load_state_dict(start.state_dict())
        planned = plan.apply(model)
        peak = _step(planned, x)[0]
        assert peak <= least * 1.1 and abs(peak - plan.predicted_peak) <= 0.1 * plan.predicted_peak, (kind, allow)
        assert peak < base_peak
        model.load_state_dict(start.state_dict())
        if "compress:int8" not in used:
            _train_alike(planned, copy.deepcopy(start), x, steps=2)
            continue
        _, grads, stats = _step(planned, x)
        reference = copy.deepcopy(start)
        _, base_grads, base_stats = _step(reference, x)
        flat, base_flat = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in base_grads])
        assert (flat - base_flat).norm() <= 0.05 * base_flat.norm(), (kind, allow)
        # per tensor too, but a bias before BatchNorm has a gradient of zero up to rounding
        for a, b in zip(grads, base_grads):
            assert (a - b).norm() <= 0.1 * b.norm() + 1e-3 * base_flat.norm(), (kind, allow)
        assert all(torch.equal(a, b) for a, b in zip(stats, base_stats))  # the forward is exact


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["conv_bn", "transformer", "many_small"])
def test_on_cuda_the_other_models_may_offload_and_train_as_the_plain_model(kind):
    import copy

    import models
    torch.manual_seed(0)
    model = models.sequential(kind).cuda()
    x = models.data(kind, 256)[0].cuda()
    start = copy.deepcopy(model)
    base_peak = _step(model, x)[0]
    model.load_state_dict(start.state_dict())
    plan = plan_memory(model, x, int(base_peak * 0.5), allow=("recompute", "offload"), repeats=2)
    assert "offload" in {r["mode"] for r in plan.decisions()}, plan.decisions()
    planned = plan.apply(model)
    peak = _step(planned, x)[0]
    assert peak <= base_peak * 0.5 * 1.1
    model.load_state_dict(start.state_dict())
    _train_alike(planned, copy.deepcopy(start), x, steps=2, exact=False)
