"""Training survives overflow steps and failed exchanges, on 2 real gloo ranks.

Invariants protected (one spawn of ranks runs every case; the tests assert on its results):

- under ``torch.amp.GradScaler`` with inf injected into one rank's loss at chosen steps, the
  DDP hook and ``CompressedOptimizer`` end with parameters and compression state bit-identical
  to the same run with those steps removed (GradScaler skips them; gradcomp's residuals, warm
  starts, momenta and step counters must not remember them, on either rank);
- an exchange that fails after the local compression (the ranks pass different keys) leaves
  every residual as it was, so a retry gives exactly what a run without the failure gives.
"""
from __future__ import annotations

import io

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _training_helpers import batch, flat_params, mlp, teacher_data
from ranks import run_ranks

STEPS = 8
BAD = (2, 5)  # steps whose loss is inf on rank 1
CASES = {  # name -> (compressor, options)
    "topk": ("topk", {"ratio": 0.05}),  # residuals kept in place (the in-place error-feedback path)
    "onebit": ("onebit", {}),
    "powersgd": ("powersgd", {"rank": 2}),  # warm-start Q and residuals
    "randomk": ("randomk", {"ratio": 0.1}),  # step counters seed the shared positions
    "dgc": ("dgc", {"ratio": 0.05, "error_feedback": "dgc"}),  # velocity and accumulation
    "int8-ef21": ("int8", {"error_feedback": "ef21"}),  # EF21 estimates, local and aggregate
    "signum": ("signum", {}),  # momentum inside the compressor
}


def _state_bits(sd) -> bytes:
    buf = io.BytesIO()
    torch.save(sd, buf)
    return buf.getvalue()


def _train(rank, mode, compressor, options, schedule, scales):
    """Train with GradScaler; ``schedule``: the data step of each iteration and whether rank 1
    injects inf; ``scales``: the loss scale forced before each iteration (None: GradScaler's
    own). Returns (params, compression state bits, scales used, steps skipped, the iterations
    the step decision undid and counted: (holder.skipped, its decision's skipped))."""
    from gradcomp.training import CompressedOptimizer, ddp_comm_hook

    x, y = teacher_data(256, 20, 4)
    model = mlp(20, 64, 4, seed=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8 if scales is None else scales[0],
                                  growth_interval=10 ** 6)
    if mode == "hook":
        ddp = DDP(model)
        state, hook = ddp_comm_hook(compressor, model=model, min_numel=0, **options)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        net, holder = ddp, state
    else:
        opt = CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), compressor, model=model,
                                  min_numel=0, **options)
        net, holder = model, opt
    used, skipped = [], 0
    for it, (data_step, poison) in enumerate(schedule):
        used.append(scaler.get_scale() if it else (2.0 ** 8 if scales is None else scales[0]))
        xb, yb = batch(x, y, 32, rank, data_step)
        loss = torch.nn.functional.cross_entropy(net(xb), yb)
        if poison and rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if mode == "optimizer":
            opt.synchronize()
        before = flat_params(model)
        scaler.step(opt)
        scaler.update()
        if scales is not None and it + 1 < len(scales):
            scaler.update(scales[it + 1])  # the faulty run's scale: it halved after each overflow
        skipped += int(torch.equal(before, flat_params(model)))
        opt.zero_grad()
    sd = holder.state_dict()
    comp = sd if mode == "hook" else sd["gradcomp"]
    runtime = holder.compression  # the hook's and the optimizer's runtime, whose decision ends an iteration
    counted = (holder.skipped, type(runtime.decision).__name__, runtime.decision.skipped)
    return flat_params(model), _state_bits(comp), used, skipped, counted


def _overflow_case(rank, mode, name):
    compressor, options = CASES[name]
    faulty = [(s, s in BAD) for s in range(STEPS)]
    params, state, scales, skipped, counted = _train(rank, mode, compressor, options, faulty, None)
    kept = [i for i in range(STEPS) if i not in BAD]
    ref = _train(rank, mode, compressor, options, [(s, False) for s in kept], [scales[i] for i in kept])
    return {"params": params, "state": state, "skipped": skipped,
            "ref_params": ref[0], "ref_state": ref[1], "ref_skipped": ref[3], "counted": counted,
            "ref_counted": ref[4]}


def _halfway_case(rank, name):
    """Rank 1 passes another key: the exchange fails after each rank compressed its input."""
    from gradcomp.collectives import allreduce, allreduce_fused
    from gradcomp.compress import ErrorFeedback, get_compressor

    def codec():
        return ErrorFeedback(get_compressor(name))

    torch.manual_seed(10 + rank)
    grads = [torch.randn(64, 33) for _ in range(3)]
    out = {}
    for how in ("allreduce", "fused"):
        ef, ref = codec(), codec()
        results, ref_results, errors = [], [], []
        for s, g in enumerate(grads):
            if s == 1:
                before = ef.residual("w")
                try:
                    if how == "allreduce":
                        allreduce(g, ef, key="w" if rank == 0 else "zzz")
                    else:
                        allreduce_fused([("w" if rank == 0 else "zzz", g, ef)])
                except ValueError as exc:
                    errors.append(str(exc))
                assert torch.equal(ef.residual("w"), before), f"{how}: the failed exchange changed the residual"
            if how == "allreduce":
                results.append(allreduce(g, ef, key="w"))
                ref_results.append(allreduce(g, ref, key="w"))
            else:
                results.append(allreduce_fused([("w", g, ef)])[0])
                ref_results.append(allreduce_fused([("w", g, ref)])[0])
        out[how] = {"same": all(torch.equal(a, b) for a, b in zip(results, ref_results)),
                    "state": _state_bits(ef.state_dict()) == _state_bits(ref.state_dict()), "errors": errors}
    return out


def _all_cases(rank, world):
    overflow = {(mode, name): _overflow_case(rank, mode, name)
                for mode in ("hook", "optimizer") for name in CASES}
    halfway = {name: _halfway_case(rank, name) for name in ("topk", "onebit", "int8", "efsignsgd")}
    return overflow, halfway


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_all_cases, 2, tmp_path_factory.mktemp("faults"), timeout_s=120.0)


@pytest.mark.parametrize("mode", ["hook", "optimizer"])
@pytest.mark.parametrize("name", list(CASES))
def test_overflow_steps_are_as_if_removed(results, mode, name):
    for rank, (overflow, _) in enumerate(results):
        r = overflow[(mode, name)]
        assert r["skipped"] == len(BAD) and r["ref_skipped"] == 0, f"rank {rank}: GradScaler skipped {r['skipped']}"
        # the runtime's step decision undid those iterations and counted them (skipped)
        assert r["counted"] == (len(BAD), "StepDecision", len(BAD)) and r["ref_counted"][0] == 0, r["counted"]
        assert torch.equal(r["params"], r["ref_params"]), \
            f"{mode}+{name}, rank {rank}: parameters differ from the run without the overflow steps"
        assert r["state"] == r["ref_state"], \
            f"{mode}+{name}, rank {rank}: compression state differs from the run without the overflow steps"
    assert torch.equal(results[0][0][(mode, name)]["params"], results[1][0][(mode, name)]["params"])


@pytest.mark.parametrize("name", ["topk", "onebit", "int8", "efsignsgd"])
@pytest.mark.parametrize("how", ["allreduce", "fused"])
def test_failed_exchange_loses_nothing(results, name, how):
    for rank, (_, halfway) in enumerate(results):
        r = halfway[name][how]
        assert r["errors"] and "different keys" in r["errors"][0], f"rank {rank}: {r['errors']}"
        assert r["same"] and r["state"], f"{how}+{name}, rank {rank}: the retry differs from a run without the failure"
