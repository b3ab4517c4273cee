"""The one step decision (``gradcomp.training.step.StepDecision``): flags and sums over the
ranks in one all-reduce, then every transaction kept or undone together, one ``skipped``; every
layer that steps holds one and reports its counter (``Stepping``)."""
from __future__ import annotations

import pytest
import torch

from gradcomp.compress.transaction import Transaction, replace
from gradcomp.training.step import StepDecision, Stepping, Verdict
from ranks import run_ranks


def test_alone_the_flags_are_read_as_they_are():
    d = StepDecision(owner="test")
    v = d.reduce({"nonfinite": torch.tensor(True), "invalid": None, "new": False}, {"loss": torch.tensor(2.5)})
    assert v.flags == {"nonfinite": True, "invalid": False, "new": False} and v.sums == {"loss": 2.5}
    assert not v.clean and v["nonfinite"]
    assert Verdict({"a": False}).clean


def test_settle_commits_or_rolls_back_every_transaction_and_counts_a_skip():
    state = {"r": torch.ones(3)}
    d = StepDecision()
    for keep, value in ((True, 7.0), (False, 9.0)):
        txns = [Transaction(), Transaction()]
        with txns[1].active():
            replace(state, "r")
        state["r"] = torch.full((3,), value)
        assert d.settle(keep, *txns, None) is keep
        assert torch.equal(state["r"], torch.full((3,), 7.0))  # kept, then the 9s undone
    assert d.skipped == 1


def _ranks(rank: int, world: int):
    d = StepDecision(owner="test")
    bad = torch.tensor(float("nan") if rank == world - 1 else 1.0)
    v = d.reduce({"nonfinite": ~torch.isfinite(bad), "mine": rank == 0}, {"loss": torch.tensor(float(rank))})
    d.settle(v.clean)
    return v.flags, v.sums, d.skipped


def test_two_ranks_agree(tmp_path):
    out = run_ranks(_ranks, 2, tmp_path)
    for flags, sums, skipped in out:
        assert flags == {"nonfinite": True, "mine": True} and sums == {"loss": 1.0} and skipped == 1


def _alone(kind, params):
    from gradcomp.optim import OneBitAdam
    from gradcomp.sharded import LowBitState, ShardedOptimizer
    from gradcomp.training import CompressedOptimizer

    if kind == "CompressedOptimizer":
        return CompressedOptimizer(torch.optim.SGD(params, lr=0.1), "topk", ratio=0.5, min_numel=0)
    if kind == "ShardedOptimizer":
        return ShardedOptimizer(params, torch.optim.AdamW, lr=0.01, compressor="int8", state_bits=8)
    if kind == "LowBitState":
        return LowBitState(torch.optim.Adam(params, lr=0.01), min_numel=0)
    return OneBitAdam(params, lr=0.01, freeze_step=1)


@pytest.mark.parametrize("kind", ["CompressedOptimizer", "ShardedOptimizer", "LowBitState", "OneBitAdam"])
def test_every_stepping_layer_counts_a_nonfinite_step_in_its_decision(kind):
    """One process: a step whose gradient is not finite is undone and counted once,
    in ``skipped``, the counter of the layer's StepDecision (the spawned tests of compress_fsdp,
    ShardedOptimizer, Pipeline, the DDP hook and the 1-bit optimizers count it across ranks)."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = _alone(kind, list(model.parameters()))
    assert isinstance(opt, Stepping) and isinstance(opt.decision, StepDecision) and opt.skipped == 0
    x = torch.randn(6, 8)
    for step, scale in enumerate((1.0, float("nan"))):
        opt.zero_grad()
        (model(x).pow(2).mean() * scale).backward()
        before = [p.detach().clone() for p in model.parameters()]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the 1-bit optimizers warn of the skipped step
            opt.step()
        moved = not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        # CompressedOptimizer undoes the iteration's compression state; skipping the inner step is
        # the loss scaler's (tests/training/test_faults.py)
        assert moved is (step == 0) or kind == "CompressedOptimizer", (kind, step)
        assert opt.skipped == opt.decision.skipped == step, (kind, step, opt.skipped)


def test_every_stepping_layer_is_a_stepping_and_the_old_name_reads_the_counter():
    from gradcomp.optim import OneBitAdam
    from gradcomp.pipeline import Pipeline
    from gradcomp.sharded import FSDPCompression, LowBitState, ShardedOptimizer
    from gradcomp.training import CompressedOptimizer, HookState, Runtime

    for cls in (FSDPCompression, ShardedOptimizer, LowBitState, Pipeline, OneBitAdam, CompressedOptimizer,
                HookState, Runtime):
        assert issubclass(cls, Stepping), cls
    opt = OneBitAdam(torch.nn.Linear(3, 2).parameters(), lr=0.01)
    opt.skipped = 3  # as load_state_dict restores it
    assert opt.skipped_steps == opt.decision.skipped == 3
    with pytest.raises(AttributeError):
        opt.skipped_steps = 4  # the older name reads the counter only
