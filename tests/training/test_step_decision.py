"""The one step decision (``gradcomp.training.step.StepDecision``): flags and sums over the
ranks in one all-reduce, then every transaction kept or undone together, one ``skipped``."""
from __future__ import annotations

import torch

from gradcomp.compress.transaction import Transaction, replace
from gradcomp.training.step import StepDecision, Verdict
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
