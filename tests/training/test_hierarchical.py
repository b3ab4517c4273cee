"""Dense inside a node, compressed across nodes: ``ddp_comm_hook(..., local_size=L)`` and
``CompressedOptimizer(..., local_size=L)`` on 4 real gloo ranks as 2 nodes of 2.

Invariants protected:

- every replica ends with the same bits, for top-k with error feedback, onebit, PowerSGD and
  the optimizer wrapper, over several steps and buckets;
- ``none`` gives the two-level mean (node mean, then the mean of the node means): the plain
  DDP average up to rounding;
- each gradient crosses the slow links once per node, compressed: the two ranks of a node
  together send the payload bytes one rank sends without the hierarchy, each about half;
- a resumed run (hook state saved per rank) continues bit-identically;
- a ``local_size`` that does not divide the ranks, or one with a process group, is refused.
"""
from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _training_helpers import batch, flat_params, mlp, restore, snapshot, teacher_data
from ranks import run_ranks

STEPS = 4


def _ddp(me, compressor, steps, *, start=0, checkpoint=None, save_at=None, telemetry_at=None, **options):
    from gradcomp.collectives import reset_telemetry, telemetry
    from gradcomp.training import ddp_comm_hook

    x, y = teacher_data(256, 20, 4)
    model = mlp(20, 64, 32, 4)
    ddp = DDP(model, bucket_cap_mb=0.004)  # several buckets
    state = None
    if compressor is not None:
        state, hook = ddp_comm_hook(compressor, model=model, min_numel=0, **options)
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    restore(model, state, checkpoint)
    saved, tele = None, None
    for step in range(start, start + steps):
        xb, yb = batch(x, y, 8, me, step)
        opt.zero_grad()
        if telemetry_at == step:
            reset_telemetry()
        torch.nn.functional.cross_entropy(ddp(xb), yb).backward()
        if telemetry_at == step:
            tele = telemetry()["by_op"]
        opt.step()
        if save_at == step + 1:
            saved = snapshot(model, state)
    return flat_params(model), saved, tele


def _optimizer(me, **options):
    from gradcomp.training import CompressedOptimizer

    x, y = teacher_data(256, 20, 4)
    model = mlp(20, 64, 4, seed=3)
    opt = CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "topk", model=model, ratio=0.1,
                              min_numel=0, **options)
    for step in range(STEPS):
        xb, yb = batch(x, y, 8, me, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    return flat_params(model)


def _grads_once(me, **options):
    """One backward of plain DDP and of the hook: the averaged gradients of each."""
    from gradcomp.training import ddp_comm_hook

    x, y = teacher_data(256, 20, 4)
    out = []
    for hooked in (False, True):
        model = mlp(20, 64, 32, 4)
        ddp = DDP(model, bucket_cap_mb=0.004)
        if hooked:
            state, hook = ddp_comm_hook("none", model=model, **options)
            ddp.register_comm_hook(state, hook)
        xb, yb = batch(x, y, 8, me, 0)
        torch.nn.functional.cross_entropy(ddp(xb), yb).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return out


def _errors(me):
    from gradcomp.training import ddp_comm_hook

    out = {}
    for label, kwargs in (("divides", {"local_size": 3}), ("bool", {"local_size": True}),
                          ("group", {"local_size": 2, "process_group": torch.distributed.group.WORLD})):
        try:
            ddp_comm_hook("topk", **kwargs)
            out[label] = "no error"
        except ValueError as exc:
            out[label] = str(exc)
    return out


def _failure(me):
    """An owner whose compressor refuses its input: every rank of both nodes raises, none hangs."""
    from gradcomp.training.engine import Runtime
    from gradcomp.training.policy import Policy

    comp = Runtime(Policy("int8", min_numel=0, error_feedback="none"), None, 2)
    comp.start()
    grads = [torch.ones(300, dtype=torch.float64), torch.ones(40, 10, dtype=torch.float64)]
    if me == 0:
        grads[1][0, 0] = 1e300  # the node mean stays beyond what int8's fp32 scales can carry
    try:
        comp.submit(["a", "b"], grads).wait()
        return "no error"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _rank(rank, world):
    hier = {"local_size": 2}
    straight, saved, tele = _ddp(rank, "topk", STEPS + 2, save_at=STEPS, telemetry_at=1, ratio=0.1, **hier)
    resumed, _, _ = _ddp(rank, "topk", 2, start=STEPS, checkpoint=saved, ratio=0.1, **hier)
    return {
        "topk": straight, "resumed": resumed, "tele": tele,
        "onebit": _ddp(rank, "onebit", STEPS, **hier)[0],
        "powersgd": _ddp(rank, "powersgd", STEPS, rank=1, **hier)[0],
        "optimizer": _optimizer(rank, **hier),
        "none": _grads_once(rank, **hier),
        "errors": _errors(rank),
        "failure": _failure(rank),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_rank, 4, tmp_path_factory.mktemp("hier"), timeout_s=240)


def test_replicas_stay_identical(runs):
    for key in ("topk", "onebit", "powersgd", "optimizer"):
        for r in runs[1:]:
            assert torch.equal(r[key], runs[0][key]), key


def test_none_is_the_two_level_mean(runs):
    for r in runs:
        plain, hooked = r["none"]
        assert torch.allclose(hooked, plain, rtol=1e-5, atol=1e-7)
        assert torch.equal(hooked, runs[0]["none"][1])


def test_each_gradient_crosses_nodes_once_compressed(runs):
    total = 4 * sum(p.numel() for p in mlp(20, 64, 32, 4).parameters())  # fp32 gradient bytes
    across = [sum(v["dense_bytes"] for k, v in r["tele"].items() if k != "allreduce/intra-node") for r in runs]
    payload = [sum(v["payload_bytes"] for k, v in r["tele"].items() if k != "allreduce/intra-node") for r in runs]
    for r in runs:  # the node's dense mean covers every gradient on every rank
        assert r["tele"]["allreduce/intra-node"]["dense_bytes"] == total
    assert across[0] + across[1] == total == across[2] + across[3]
    assert across[0] == across[2] and payload[0] == payload[2]  # local rank i owns the same gradients on each node
    assert max(across) < 0.7 * total  # the slow links of a node share the gradients
    assert all(0 < p < a / 2 for p, a in zip(payload, across))  # and send them compressed (top-k 10 %, biases dense)


def test_resume_is_bit_identical(runs):
    for r in runs:
        assert torch.equal(r["resumed"], r["topk"])


def test_bad_local_size_is_refused(runs):
    for r in runs:
        assert "divides the number of ranks" in r["errors"]["divides"]
        assert "divides the number of ranks" in r["errors"]["bool"]
        assert "default process group only" in r["errors"]["group"]


def test_a_failing_owner_fails_every_rank(runs):
    for r in runs:
        assert r["failure"].startswith("ValueError"), r["failure"]
    assert "float32 range" in runs[0]["failure"] or "float32 range" in runs[1]["failure"]
