"""Pipelines on 4 real gloo ranks: 4 stages under every schedule give the bits of one process;
a 2 x 2 grid (2 stages x 2 replicas) averages each stage's gradients over its replicas with a
gradcomp compressor, the replicas stay identical (a stage without parameters among them); ranks
built differently raise the same error; a peer that dies mid-step is a ``CommunicationError`` on
the others, not a hang.

One spawn runs the training cases, one more the death of a rank. Neither times the machine:
each waits for its ranks' results with deadlines far above what the work takes on a loaded
machine (a rank's own group timeout bounds a hang)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _pipeline_helpers import (LOSS, chain, data, gathered_params, micro_step, pieces_of, reference,  # noqa: E402
                               same_params, sgd)
from ranks import run_ranks  # noqa: E402

BALANCE = {"gpipe": [2, 2, 2, 2], "1f1b": [2, 2, 2, 2], "interleaved": [1] * 8, "zb-h1": [2, 2, 2, 2], "zb-h2": [2, 2, 2, 2]}
DP = [("none", {}), ("topk", {"ratio": 0.5, "min_numel": 0})]
STEPS = 3


def _batches(replica=0):
    return [data(16, seed=10 + s + 100 * replica) for s in range(STEPS)]


def _four_stages(schedule):
    from gradcomp.pipeline import Pipeline

    pipe = Pipeline(chain(depth=7), balance=BALANCE[schedule], schedule=schedule, microbatches=4, optimizer=sgd,
                    activation_codec=None)
    losses = [float(pipe.step(x, y, LOSS)) for x, y in _batches()]
    return losses, gathered_params(pipe)


def _grid(rank, compressor, options, schedule="1f1b"):
    from gradcomp.pipeline import Pipeline

    pipe = Pipeline(chain(), balance=[4, 3], schedule=schedule, microbatches=4, replicas=2, dp_compressor=compressor,
                    dp_options=options, optimizer=sgd, activation_codec="int8", grad_codec="fp16")
    replica = pipe.grid.replica
    launched = []  # whether the step's messages were all done when each data-parallel bucket left
    launch = pipe.optimizer._launch
    pipe.optimizer._launch = lambda b: (launched.append(pipe._transport.idle), launch(b))[1]
    losses = [float(pipe.step(x, y, LOSS)) for x, y in _batches(replica)]
    return losses, (pipe.grid.stage, replica), gathered_params(pipe, 0), gathered_params(pipe, 1), launched


def _parameterless_grid(rank):
    """2 stages x 2 replicas, the first stage without parameters: it gets no optimizer (nor a
    data-parallel exchange), the second averages over its replicas."""
    from gradcomp.pipeline import Pipeline

    pipe = Pipeline(_parameterless_model(), balance=[1, 3], microbatches=4, replicas=2, dp_compressor="none",
                    optimizer=_adamw_fused)
    replica = pipe.grid.replica
    losses = [float(pipe.step(x, y, LOSS)) for x, y in _batches(replica)]
    return losses, pipe.optimizer is None, gathered_params(pipe, 0), gathered_params(pipe, 1)


def _parameterless_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _adamw_fused(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, fused=True)


def _mismatch(rank):
    from gradcomp.pipeline import Pipeline

    try:
        Pipeline(chain(depth=7), balance=[2, 2, 2, 2] if rank != 3 else [2, 2, 3, 1], optimizer=sgd)
    except ValueError as exc:
        return str(exc)
    return None


def _rank(rank, world):
    res = {}
    for schedule in BALANCE:
        res[("exact", schedule)] = _four_stages(schedule)
    for name, options in DP:
        res[("grid", name)] = _grid(rank, name, options)
    res[("grid", "zb-h1")] = _grid(rank, "none", {}, "zb-h1")  # the exchange after the last W
    res["parameterless"] = _parameterless_grid(rank)
    res["mismatch"] = _mismatch(rank)
    return res


def _dies(rank, world):
    """Rank 2 dies at the start of the second step; the others must raise, not hang. (No
    optimizer: building the first torch optimizer imports torch._dynamo, 5 s alone and 25 s on
    four ranks of a loaded 2-core machine, which the 60 s this run may take need not hold.)"""
    from gradcomp.pipeline import Pipeline

    pipe = Pipeline(chain(depth=7), balance=[2, 2, 2, 2], microbatches=4)
    x, y = data(16)
    pipe.step(x, y, LOSS)
    if rank == 2:
        os._exit(1)  # killed: no cleanup, no goodbye
    pipe.step(x, y, LOSS)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_rank, 4, tmp_path_factory.mktemp("pipeline4"), timeout_s=120)


@pytest.mark.parametrize("schedule", list(BALANCE))
def test_four_stages_equal_single_process(results, schedule):
    ref_losses, ref_params = reference(chain(depth=7), BALANCE[schedule], _batches(), 4)
    for rank in range(4):
        losses, params = results[rank][("exact", schedule)]
        assert losses == ref_losses
        assert same_params(schedule, params, ref_params), f"rank {rank}: parameters differ"


@pytest.mark.parametrize("name", [n for n, _ in DP])
def test_pp_x_dp_replicas_stay_identical(results, name):
    losses, _, replica0, replica1, _ = results[0][("grid", name)]
    places = sorted(results[r][("grid", name)][1] for r in range(4))
    assert places == [(0, 0), (0, 1), (1, 0), (1, 1)], "group rank g is stage g % 2 of replica g // 2"
    assert all(torch.equal(a, b) for a, b in zip(replica0, replica1)), "stage replicas diverged"
    assert all(results[r][("grid", name)][0] == losses for r in range(4)), "every rank returns the same loss"
    for r in range(4):  # issue 22 item 7: no exchange on the replica group beside the pipeline's messages
        launched = results[r][("grid", name)][4]
        assert launched and all(launched), f"rank {r}: a data-parallel bucket left while messages were in flight"
    if name == "none":  # the mean over replicas of what each would compute alone
        ref_losses, ref_params = _dp_reference()
        assert losses == pytest.approx(ref_losses, abs=1e-6)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(replica0, ref_params))


def test_pp_x_dp_under_zero_bubble_exchanges_after_the_last_w(results):
    """Issue 27: with the B/W split the replicas' exchange starts after every W (no bucket
    leaves while messages are in flight) and gives 1F1B's result."""
    losses, _, replica0, replica1, _ = results[0][("grid", "zb-h1")]
    assert losses == results[0][("grid", "none")][0]
    assert all(torch.equal(a, b) for a, b in zip(replica0, results[0][("grid", "none")][2]))
    assert all(torch.equal(a, b) for a, b in zip(replica0, replica1))
    for r in range(4):
        launched = results[r][("grid", "zb-h1")][4]
        assert launched and all(launched), f"rank {r}: a data-parallel bucket left while messages were in flight"


def test_a_stage_without_parameters_among_replicas_gets_no_optimizer(results):
    losses, _, replica0, replica1 = results[0]["parameterless"]
    assert [results[r]["parameterless"][1] for r in range(4)] == [True, False, True, False]
    assert all(results[r]["parameterless"][0] == losses for r in range(4))
    assert all(torch.equal(a, b) for a, b in zip(replica0, replica1)), "stage replicas diverged"
    ref_losses, ref_params = _dp_reference(_parameterless_model(), [1, 3], None, None, _adamw_fused)
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(replica0, ref_params))


def _dp_reference(model=None, balance=(4, 3), act="int8", grad="fp16", optimizer=sgd):
    """One process, 2 stage boundaries' codecs, each step's gradient the mean of the two
    replicas' (summation order differs from the all-reduce's: equal to rounding)."""
    from gradcomp.compress import get_compressor

    act, grad = (None if c is None else get_compressor(c) for c in (act, grad))
    model = chain() if model is None else model
    pieces = pieces_of(model, list(balance))
    opt = optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        per, grads = [], []
        for replica in range(2):
            opt.zero_grad()
            per.append(micro_step(pieces, *_batches(replica)[step], 4, step, act, grad))
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = g0 * 0.5 + g1 * 0.5
        opt.step()
        losses.append((per[0] + per[1]) / 2)
    return losses, [p.detach().clone() for p in model.parameters()]


def test_mismatched_balance_raises_on_every_rank(results):
    said = [results[r]["mismatch"] for r in range(4)]
    assert said[0] is not None and all(s == said[0] for s in said), said
    assert "balance" in said[0] and "ranks disagree" in said[0]


def test_dead_peer_raises_on_the_others(tmp_path):
    """The survivors raise CommunicationError (a hang would end with every rank killed and no
    result). Nothing here is timed: the survivors notice the closed connections at once on an
    idle machine, but four ranks starting on a loaded one can take minutes, so the deadlines are
    generous (group timeout 120 s; run_ranks waits three times that for the ranks to finish,
    and 120 s once one has reported)."""
    with pytest.raises(AssertionError) as killed:
        run_ranks(_dies, 4, tmp_path, timeout_s=120.0)
    report = str(killed.value)
    assert "rank 2: exited with code 1" in report, report
    for r in (0, 1, 3):
        part = report.split(f"rank {r}:", 1)[1][:600]
        assert "CommunicationError" in part, f"rank {r} did not name a lost peer: {part}"
