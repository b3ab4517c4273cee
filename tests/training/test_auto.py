"""``compressor="auto"`` on real gloo ranks: identical decisions, no mass lost, resume, training.

One 4-rank spawn checks:

- with real measurements (conv_bn model, ``CompressedOptimizer``), every rank makes the same
  decision for every bucket, and training stays correct (replicas identical);
- with an injected link (transformer shapes through the runtime itself): a slow link picks
  top-k (scatter-reduce on four ranks: client and server residuals); switching to a fast link
  mid-run re-decides dense at the next check, and the error-feedback invariant
  ``sum over ranks of g == w * sum of averages + sum of owed`` holds before and after: the
  residuals left behind are carried into the next dense gradient, none is lost;
- resume keeps the decisions (no new trials), and another rank's checkpoint, or a fixed
  compressor's, is refused on every rank.

One 2-rank spawn (each case's test reports its own failure):

- a fast injected link keeps a tiny conv_bn / transformer dense through DDP's hook and
  ``CompressedOptimizer`` (training equal to plain DDP), a slow one compresses and still trains;
- an iteration skipped right after top-k -> dense (NaN on one rank) leaves what is owed exactly
  as it was, and under GradScaler with ``AdamW(foreach=True)`` the run equals the run without
  that step;
- ``threshold`` among the candidates with gradients far larger on one rank (so its payload
  size differs per rank): no false disagreement, the same decisions on every rank;
- the gradient copies the trials time candidates on stay within ``trial_memory_mb`` (bf16
  model, ``AdamW(fused=True)``), and the trials still end in decisions;
- after DDP rebuilds its buckets, ``decisions()`` lists the new ones only (none "on trial"
  forever), and a tiny model's latency-bound buckets leave the probed rate as it was.

Argument errors are checked in-process; the plan, the cost model and the link refit, pure
functions, in ``test_auto_plan.py``.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from models import data, model
from ranks import run_ranks


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _decisions(rt):
    return sorted((list(k), c) for k, c in rt.decisions().items())


def _real_decisions(rank, world):
    """conv_bn trained with auto on real measurements: decisions and final parameters."""
    from gradcomp.training import CompressedOptimizer

    torch.manual_seed(0)
    net = model("conv_bn")
    x, y = data("conv_bn", 64, seed=rank)
    opt = CompressedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05), "auto", model=net, bucket_mb=0.01,
                              trial_steps=2, recheck_every=None, min_numel=0,
                              candidates=("dense", "fp16", "powersgd:rank=2", "topk"))
    for step in range(4):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[step * 16:(step + 1) * 16]), y[step * 16:(step + 1) * 16]).backward()
        opt.step()
    rt = opt.compression
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    return {"decisions": _decisions(rt), "params": flat, "syncs": rt.syncs, "described": rt.describe()}


SHAPES = [("w1", (64, 48)), ("b1", (64,)), ("w2", (16, 64)), ("b2", (16,))]
BUCKETS = [["w2", "b2"], ["w1", "b1"]]  # as backward produces them


def _steps(rt, rank, world, shapes=SHAPES, buckets=BUCKETS, scale=1.0):
    """Drive ``rt`` (a runtime on ``shapes``) as a launcher does: each call of the returned
    ``step`` submits the buckets of one iteration (True when the runtime kept it);
    ``step(poison=True)`` puts NaN into rank 1's gradient of the second bucket. Returns
    (step, owed, gap): ``owed()`` per name, ``gap()`` the largest error of the mass
    invariant, with an iteration the runtime did not keep left out (its averages are not
    applied, its gradients not owed)."""
    gen = torch.Generator().manual_seed(100 + rank)
    local = {n: torch.zeros(s, dtype=torch.float64) for n, s in shapes}
    sent = {n: torch.zeros(s, dtype=torch.float64) for n, s in shapes}

    def step(poison=False):
        grads = {n: torch.randn(s, generator=gen) * scale * (1 + rank) for n, s in shapes}
        if poison and rank == 1:
            grads[buckets[1][0]].view(-1)[5] = float("nan")
        mine = {n: g.double() for n, g in grads.items()}  # before the exchange adds what is owed to them
        before = rt.iteration
        futs = [rt.submit(b, [grads[n] for n in b], advance=j == len(buckets) - 1, inline=j == len(buckets) - 1)
                for j, b in enumerate(buckets)]
        outs = [f.wait() for f in futs]
        kept = rt.iteration == before + 1
        if kept:
            for b, avgs in zip(buckets, outs):
                for n, avg in zip(b, avgs):
                    local[n] += mine[n]
                    sent[n] += avg.double()
        return kept

    def owed():
        return {n: rt.owed(n, s).clone() for n, s in shapes}

    def gap():
        """max |sum_r g - w * sum avg - sum_r owed| over every element (0 when no mass is lost)."""
        worst = 0.0
        for n, s in shapes:
            lhs = local[n] - rt.owed(n, s)
            dist.all_reduce(lhs)
            worst = max(worst, float((lhs - world * sent[n]).abs().max()))
        return worst

    return step, owed, gap


def _runtime(opts, shapes=SHAPES):
    """An ``"auto"`` runtime on ``shapes``, started as the hook or the optimizer starts it."""
    from gradcomp.training.auto import AutoRuntime, make_runtime

    rt = make_runtime("auto", opts)
    assert isinstance(rt, AutoRuntime)
    rt.names = [n for n, _ in shapes]
    rt.start([(n, torch.zeros(s)) for n, s in shapes])
    return rt


def _mass_and_resume(rank, world, tmp):
    from gradcomp.training.auto import Link, make_runtime

    shapes = [(n, p.shape) for n, p in model("transformer").named_parameters()]
    names = [n for n, _ in shapes]
    # two buckets, as a launcher would cut them
    cut = len(names) // 2
    buckets = [list(range(cut)), list(range(cut, len(names)))]
    opts = dict(candidates=("dense", "topk"), trial_steps=1, recheck_every=3, min_numel=0,
                link=Link.of(0.0, 0.001))  # 1 Mbit/s: compression pays
    rt = _runtime(opts, shapes)
    step, _, gap = _steps(rt, rank, world, shapes, [[names[i] for i in b] for b in buckets])

    for _ in range(4):  # 1 trial, then top-k from iteration 1
        step()
    chose = _decisions(rt)
    gap_before = gap()
    owed_before = max(float(rt.owed(n, s).abs().max()) for n, s in shapes)
    rt.set_link(Link.of(0.0, 1e6))  # a fast link: dense now wins
    for _ in range(3):  # the check after iteration 3 re-decides: dense from iteration 4
        step()
    after = _decisions(rt)
    gap_after = gap()
    owed_after = max(float(rt.owed(n, s).abs().max()) for n, s in shapes)
    history = [(h["from"], h["to"], h["reason"]) for h in rt.history]
    # resume: a new runtime of the same configuration keeps the decisions, with no trials
    torch.save(rt.state_dict(), os.path.join(tmp, f"auto{rank}.pt"))
    fresh = make_runtime("auto", opts)
    fresh.names = list(names)
    fresh.load_state_dict(torch.load(os.path.join(tmp, f"auto{rank}.pt")))
    resumed = _decisions(fresh)
    routes = [c is None for _, _, c in fresh.route([names[i] for i in buckets[0]], [torch.zeros(shapes[i][1]) for i in
                                                                                  buckets[0]])]
    modes = set(fresh.auto.mode.values())
    refusals = []
    for path, rt2 in ((f"auto{(rank + 1) % world}.pt", make_runtime("auto", opts)),
                      (f"auto{rank}.pt", make_runtime("topk", {}))):
        rt2.names = list(names)
        try:
            rt2.load_state_dict(torch.load(os.path.join(tmp, path)))
            refusals.append(None)
        except ValueError as e:
            refusals.append(str(e))
    return {"chose": chose, "after": after, "gap_before": gap_before, "gap_after": gap_after,
            "owed_before": owed_before, "owed_after": owed_after, "history": history, "resumed": resumed,
            "dense_routes": routes, "modes": modes, "refusals": refusals}


def _four(rank, world, tmp):
    return {"real": _real_decisions(rank, world), "mass": _mass_and_resume(rank, world, tmp)}


def test_auto_four_ranks(tmp_path):
    res = run_ranks(_four, 4, tmp_path, str(tmp_path), timeout_s=120.0)
    real = [r["real"] for r in res]
    assert all(r["decisions"] == real[0]["decisions"] for r in real), [r["decisions"] for r in real]
    assert real[0]["decisions"] and all(c is not None for _, c in real[0]["decisions"])
    assert all(torch.equal(r["params"], real[0]["params"]) for r in real)
    assert torch.isfinite(real[0]["params"]).all()
    assert "predicted ms" in real[0]["described"]

    mass = [r["mass"] for r in res]
    m = mass[0]
    assert all(x["chose"] == m["chose"] and x["after"] == m["after"] for x in mass)
    assert {c for _, c in m["chose"]} == {"topk"}  # the slow link compresses
    assert {c for _, c in m["after"]} == {"dense"}  # the fast one does not
    assert ("topk", "dense", "re-decision") in m["history"]
    assert m["owed_before"] > 1e-3  # top-k left residuals (client and server)...
    for x in mass:  # ...and no mass is lost, neither while compressing nor across the change
        assert x["gap_before"] < 1e-3 and x["gap_after"] < 1e-3, (x["gap_before"], x["gap_after"])
        assert x["owed_after"] < 1e-6  # everything owed went out with the first dense exchange
    assert m["resumed"] == m["after"] and all(m["dense_routes"]) and m["modes"] == {"run"}
    for x in mass:
        other, fixed = x["refusals"]
        assert other is not None and "refused the checkpoint" in other and "nothing was loaded" in other
        assert fixed is not None and "refused the checkpoint" in fixed


def _two(rank, world, tmp):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradcomp.training import CompressedOptimizer, ddp_comm_hook
    from gradcomp.training.auto import Link

    fast, slow = Link.of(0.0, 1e6), Link.of(0.0, 0.001)
    out = {}
    for kind in ("conv_bn", "transformer"):
        x, y = data(kind, 96, seed=rank)
        runs = {}
        for label, link in (("plain", None), ("fast", fast), ("slow", slow)):
            torch.manual_seed(1)
            net = model(kind)
            if label == "plain":
                ddp = DDP(net)
                opt = torch.optim.SGD(net.parameters(), lr=0.05)
            elif kind == "conv_bn":  # the DDP hook
                ddp = DDP(net)
                state, hook = ddp_comm_hook("auto", model=net, trial_steps=1, link=link,
                                            candidates=("dense", "bf16", "onebit"))
                ddp.register_comm_hook(state, hook)
                opt = torch.optim.SGD(net.parameters(), lr=0.05)
            else:
                ddp = net
                opt = CompressedOptimizer(torch.optim.SGD(net.parameters(), lr=0.05), "auto", model=net,
                                          bucket_mb=0.05, trial_steps=1, link=link, min_numel=256,
                                          candidates=("dense", "int8", "powersgd:rank=2"))
            losses = []
            for step in range(6):
                opt.zero_grad()
                sl = slice(16 * step, 16 * (step + 1))
                loss = torch.nn.functional.cross_entropy(ddp(x[sl]), y[sl])
                loss.backward()
                opt.step()
                losses.append(float(loss))
            rt = None if label == "plain" else (state.compression if kind == "conv_bn" else opt.compression)
            runs[label] = {"params": torch.cat([p.detach().reshape(-1) for p in net.parameters()]),
                           "choices": None if rt is None else {c for _, c in _decisions(rt)},
                           "losses": losses}
        out[kind] = runs
    return out


def _skip_after_switch(rank, world):
    """top-k on a slow link, then a fast link: dense from the next iteration, whose gradients
    carry the top-k residuals left behind; that iteration is not finite (NaN on rank 1) and is
    skipped: what is owed must be exactly as before it, and go out with the next one."""
    from gradcomp.training.auto import Link

    rt = _runtime(dict(candidates=("dense", "topk"), trial_steps=1, recheck_every=3, min_numel=0,
                       link=Link.of(0.0, 0.001)))
    step, owed, gap = _steps(rt, rank, world)
    for _ in range(4):  # 1 trial, top-k from iteration 1, checked at 3
        assert step()
    chose = _decisions(rt)
    before = owed()
    rt.set_link(Link.of(0.0, 1e6))
    skipped = not step(poison=True)  # the re-decision (top-k -> dense) and a non-finite iteration
    after = owed()
    history = [(h["from"], h["to"]) for h in rt.history]
    same = all(torch.equal(before[n], after[n]) for n in before)
    lost = max(float((before[n] - after[n]).abs().sum()) for n in before)
    mass = max(float(before[n].abs().sum()) for n in before)
    kept = step()
    return {"chose": chose, "skipped": skipped, "same": same, "lost": lost, "mass": mass, "history": history,
            "after": _decisions(rt), "kept": kept, "gap": gap(),
            "owed_end": max(float(t.abs().max()) for t in owed().values()),
            "scaled": _scaled_run(rank, True), "reference": _scaled_run(rank, False)}


def _scaled_run(rank, poison: bool):
    """CompressedOptimizer(AdamW(foreach=True)) under GradScaler (its scale held fixed): top-k
    on a slow link for 4 iterations, then a fast link; with ``poison`` an overflow step (inf
    on rank 1, skipped by GradScaler) comes first after it, where the bucket turns dense.
    Returns the parameters and what is owed at the end."""
    from _training_helpers import batch, flat_params, mlp, teacher_data
    from gradcomp.training import CompressedOptimizer
    from gradcomp.training.auto import Link

    x, y = teacher_data(256, 20, 4)
    model = mlp(20, 64, 4, seed=0)
    opt = CompressedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True), "auto", model=model,
                              candidates=("dense", "topk"), trial_steps=1, recheck_every=3, min_numel=0,
                              link=Link.of(0.0, 0.001))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=10 ** 6)
    schedule = [(s, False) for s in range(4)] + [(4, True)] * poison + [(s, False) for s in range(4, 7)]
    skipped = 0
    for data_step, bad in schedule:
        if data_step == 4 and (bad or not poison):
            opt.compression.set_link(Link.of(0.0, 1e6))
        xb, yb = batch(x, y, 32, rank, data_step)
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        if bad and rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        opt.synchronize()
        before = flat_params(model)
        scaler.step(opt)
        scaler.update(2.0 ** 8)
        skipped += int(torch.equal(before, flat_params(model)))
        opt.zero_grad()
    rt = opt.compression
    owed = torch.cat([rt.owed(n, p.shape).reshape(-1) for n, p in model.named_parameters()])
    return {"params": flat_params(model), "owed": owed, "skipped": skipped, "iteration": rt.iteration,
            "history": [(h["from"], h["to"]) for h in rt.history]}


def _variable_size_candidate(rank, world):
    """threshold among the candidates, gradients 600x larger on rank 1: rank 0 alone would send
    almost nothing with threshold, rank 1 almost every element (values and indices: more than
    dense); every rank must make the same decision."""
    from gradcomp.training.auto import Link

    rt = _runtime(dict(candidates=("dense", "threshold:tau=0.5"), trial_steps=1, recheck_every=None, min_numel=0,
                       link=Link.of(0.0, 0.001)))
    step, _, gap = _steps(rt, rank, world, scale=0.01 if rank == 0 else 3.0)
    for _ in range(3):
        assert step()
    return {"decisions": _decisions(rt), "gap": gap()}


def _held(rt) -> int:
    """Bytes of the gradient copies auto holds now for timing its candidates."""
    return sum(t.numel() * t.element_size() for item in rt.auto.untimed for part in item if isinstance(part, list)
               for t in part)


def _trial_copies_bounded(rank, world):
    """A bf16 MLP under CompressedOptimizer(AdamW(fused=True)), trial_memory_mb below the model's
    gradient bytes: the copies held at once (measured when the iteration ends, where they are
    most) stay within it, the trials still end in a decision, the same on every rank."""
    from _training_helpers import batch, flat_params, mlp, teacher_data
    from gradcomp.training import CompressedOptimizer
    from gradcomp.training.auto import Link

    x, y = teacher_data(256, 32, 8)
    model = mlp(32, 64, 64, 64, 8, seed=0).to(torch.bfloat16)
    budget = 0.01  # MB: 10.5 kB of the model's 21.9 kB of gradients; its largest gradient is 8 kB
    opt = CompressedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), "auto", model=model,
                              bucket_mb=0.015, candidates=("dense", "int8", "topk"), trial_steps=2, min_numel=0,
                              recheck_every=None, link=Link.of(0.0, 0.001), trial_memory_mb=budget)
    rt = opt.compression
    peak, end = [0], rt.end_iteration

    def measured_end(keep=True):
        peak[0] = max(peak[0], _held(rt))
        return end(keep)

    rt.end_iteration = measured_end
    decided_at = None
    for step in range(6):
        xb, yb = batch(x, y, 32, rank, step)
        torch.nn.functional.cross_entropy(model(xb.bfloat16()), yb).backward()
        opt.step()
        opt.zero_grad()
        if decided_at is None and all(c is not None for c in rt.decisions().values()):
            decided_at = step
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    return {"peak": peak[0], "accounted": getattr(rt, "trial_bytes_peak", None),
            "held_now": getattr(rt, "trial_bytes", None), "bound": budget * 2 ** 20, "largest": largest,
            "grads": grads, "decided_at": decided_at, "decisions": _decisions(rt), "params": flat_params(model)}


def _ddp_rebuild(rank, world):
    """DDP's first iteration buckets the gradients in parameter order, then rebuilds its buckets
    in the order backward produced them: the first layout is never seen again. Measured link,
    a tiny model (every bucket latency-bound)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradcomp.training import ddp_comm_hook

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 4))
    ddp = DDP(net, bucket_cap_mb=0.01)
    state, hook = ddp_comm_hook("auto", model=net, trial_steps=2, candidates=("dense", "bf16"))
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    rt, probed, seen = state.compression, None, set()
    for step in range(5):
        opt.zero_grad()
        ddp(torch.randn(8, 32)).sum().backward()
        opt.step()
        probed = probed or rt.link
        seen.update(rt.auto.buckets)
    return {"decisions": _decisions(rt), "layouts": len(seen), "summary": rt.summary(), "probed": probed,
            "link": rt.link, "names": sorted(n for n, _ in net.named_parameters())}


def _two_cases(rank, world, tmp):
    out = {}
    for name, fn, args in (("skip", _skip_after_switch, ()), ("variable", _variable_size_candidate, ()),
                           ("bound", _trial_copies_bounded, ()), ("rebuild", _ddp_rebuild, ()),
                           ("train", _two, (tmp,))):
        try:
            out[name] = fn(rank, world, *args)
        except Exception as exc:  # noqa: BLE001 (each case's test reports its own failure)
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auto2")
    return run_ranks(_two_cases, 2, tmp, str(tmp), timeout_s=120.0)


def _case(res, name):
    out = [r[name] for r in res]
    for r in out:
        assert "error" not in r, r["error"]
    return out


def test_auto_skipped_step_after_a_switch_loses_nothing(two):
    for r in _case(two, "skip"):
        assert {c for _, c in r["chose"]} == {"topk"} and ("topk", "dense") in r["history"]
        assert r["mass"] > 1e-2  # top-k left residuals behind
        assert r["skipped"], "the non-finite iteration was kept"
        assert r["same"], f"the skipped iteration lost {r['lost']:.3g} of {r['mass']:.3g} owed"
        assert r["kept"] and {c for _, c in r["after"]} == {"dense"}
        assert r["gap"] < 1e-4 and r["owed_end"] < 1e-6, (r["gap"], r["owed_end"])
        # the user's path: GradScaler skips the overflow step, and the run is the run without it
        bad, ref = r["scaled"], r["reference"]
        assert ("topk", "dense") in bad["history"] and bad["history"] == ref["history"]
        assert bad["skipped"] == 1 and ref["skipped"] == 0 and bad["iteration"] == ref["iteration"]
        assert torch.equal(bad["owed"], ref["owed"]) and torch.equal(bad["params"], ref["params"]), \
            float((bad["params"] - ref["params"]).abs().max())


def test_auto_variable_size_candidate_decides_alike(two):
    res = _case(two, "variable")
    assert res[0]["decisions"] == res[1]["decisions"]
    assert all(c is not None for _, c in res[0]["decisions"])
    assert all(r["gap"] < 1e-4 for r in res)


def test_auto_trial_copies_are_bounded(two):
    res = _case(two, "bound")
    for r in res:
        assert r["largest"] < r["bound"] < r["grads"]  # the set-up: a bound that binds
        assert 0 < r["peak"] <= r["bound"], \
            f"held {r['peak']} B of gradient copies at once; the bound is {r['bound']:.0f} B"
        assert r["accounted"] == r["peak"] and r["held_now"] == 0
        assert r["decided_at"] is not None and all(c is not None for _, c in r["decisions"])
    assert res[0]["decisions"] == res[1]["decisions"] and torch.equal(res[0]["params"], res[1]["params"])


def test_auto_decisions_are_the_current_buckets(two):
    res = _case(two, "rebuild")
    for r in res:
        assert all(c is not None for _, c in r["decisions"]), f"decisions() reads as still on trial: {r['decisions']}"
        assert r["layouts"] > len(r["decisions"])  # the set-up: DDP rebuilt its buckets
        assert sorted(n for k, _ in r["decisions"] for n in k) == r["names"]  # each parameter once
        assert "trial" not in r["summary"]
        # latency-bound buckets only: the rate stays the probe's
        assert r["link"] == r["probed"], (r["link"], r["probed"])
    assert res[0]["decisions"] == res[1]["decisions"]


def test_auto_two_ranks_train(two):
    res = _case(two, "train")
    for kind in ("conv_bn", "transformer"):
        runs = [r[kind] for r in res]
        for label in ("plain", "fast", "slow"):
            assert torch.equal(runs[0][label]["params"], runs[1][label]["params"]), (kind, label)
        assert runs[0]["fast"]["choices"] == {"dense"}, kind
        assert "dense" != runs[0]["slow"]["choices"] and runs[0]["slow"]["choices"] - {"dense"}, kind
        # dense decisions (and dense trials) train as plain DDP does
        torch.testing.assert_close(runs[0]["fast"]["params"], runs[0]["plain"]["params"], rtol=1e-5, atol=1e-6)
        slow = runs[0]["slow"]["losses"]
        assert all(map(torch.isfinite, map(torch.tensor, slow))) and min(slow[3:]) < slow[0], (kind, slow)


def test_auto_arguments():
    from gradcomp.compress import as_codec
    from gradcomp.memory import ShardedOptimizer
    from gradcomp.training.auto import AutoRuntime
    from gradcomp.training.auto import make_runtime

    with pytest.raises(ValueError, match="unknown compressor 'auto'"):
        as_codec("auto")
    with pytest.raises(ValueError, match="biased and runs without error feedback"):
        make_runtime("auto", {"candidates": ("dense", "signsgd")})
    with pytest.raises(ValueError, match="must include 'dense'"):
        make_runtime("auto", {"candidates": ("topk",)})
    with pytest.raises(ValueError, match="trial_steps=0"):
        make_runtime("auto", {"trial_steps": 0})
    with pytest.raises(ValueError, match="trial_memory_mb=0 .* must be a finite number > 0"):
        make_runtime("auto", {"trial_memory_mb": 0})
    with pytest.raises(ValueError, match="layers= and error_feedback= need a fixed compressor"):
        make_runtime("auto", {"layers": {"*": "dense"}})
    with pytest.raises(ValueError, match="local_size"):
        make_runtime("auto", {}, local_size=2)
    with pytest.raises(ValueError, match="not offered"):
        ShardedOptimizer(torch.nn.Linear(2, 2).parameters(), torch.optim.SGD, compressor="auto", lr=0.1)
    with pytest.raises(ValueError, match="link= 'fast' is not RATE"):
        make_runtime("auto", {"link": "fast"})
    rt = make_runtime("auto", {})
    assert isinstance(rt, AutoRuntime) and "powersgd:rank=4" in rt.policy.describe()
    # composition: the runtime asks its strategy; a fixed compressor's is the policy's routing
    from gradcomp.training.auto import AutoStrategy, Link
    from gradcomp.training.engine import Routing

    assert isinstance(rt.strategy, AutoStrategy) and rt.strategy is rt.auto and not rt.strategy.prepares_ahead
    fixed = make_runtime("topk", {})
    assert type(fixed.strategy) is Routing and fixed.strategy.prepares_ahead
    assert make_runtime("auto", {"link": "10gbit,0.05ms"}).link == Link.of(0.05, 10)
