"""Every layer refuses a wrong checkpoint on every rank, with the same message, loading nothing.

Invariant protected (2 real gloo ranks, one spawn for every layer): when rank 1 alone is
given a checkpoint that is not its own (rank 0's file, or another layer's) and rank 0 its own,
``load_state_dict`` raises the same ``ValueError`` on both ranks and neither rank's state
changes — the training runtime (through ``CompressedOptimizer`` and the DDP hook's state),
a ``gradcomp.optim`` optimizer (``OneBitAdam``), ``ShardedOptimizer`` and a 2-stage
``Pipeline``. Before, only ``ShardedOptimizer`` did: the others raised on rank 1 and loaded on
rank 0, whose next exchange then waited on a peer in another state. Afterwards each rank loads
its own file.
"""
from __future__ import annotations

import copy

import pytest
import torch

from ranks import run_ranks


def _same(a, b) -> bool:
    """Whether two state trees are equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _refusal(obj, mine, given, snapshot):
    """(message or None, state unchanged, own file loads afterwards) of ``obj.load_state_dict(given)``."""
    before = copy.deepcopy(snapshot())
    try:
        obj.load_state_dict(given)
        said = None
    except ValueError as exc:
        said = str(exc)
    unchanged = _same(before, snapshot())
    obj.load_state_dict(mine)
    return said, unchanged


def _step(model, opt, rank, x, y):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x[rank::2]), y[rank::2]).backward()
    opt.step()


def _layers(rank, world):
    import torch.distributed as dist

    from gradcomp.memory import ShardedOptimizer
    from gradcomp.optim import OneBitAdam
    from gradcomp.pipeline import Pipeline
    from gradcomp.training import CompressedOptimizer, ddp_comm_hook

    def rank0s(state):  # rank 0's file on every rank; each keeps its own too
        box = [state]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    torch.manual_seed(0)
    x, y = torch.randn(16, 6), torch.randn(16, 3)
    out = {}

    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "topk", model=model, ratio=0.3,
                              min_numel=0)
    _step(model, opt, rank, x, y)
    mine = opt.state_dict()
    theirs = rank0s(mine)
    runtime_state = mine["gradcomp"]
    out["CompressedOptimizer"] = _refusal(opt, mine, theirs if rank == 1 else mine, opt.state_dict)
    # a plain optimizer's state_dict on one rank: before, that rank loaded only the inner optimizer
    plain = {k: v for k, v in mine.items() if k != "gradcomp"}
    out["CompressedOptimizer, no gradcomp state"] = _refusal(opt, mine, plain if rank == 1 else mine, opt.state_dict)

    hook_state, _ = ddp_comm_hook("topk", model=model, ratio=0.3)
    own = hook_state.state_dict()
    theirs = rank0s(own)
    out["DDP hook state"] = _refusal(hook_state, own, theirs if rank == 1 else own, hook_state.state_dict)

    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    adam = OneBitAdam(model.parameters(), lr=1e-2, freeze_step=1)
    _step(model, adam, rank, x, y)
    _step(model, adam, rank, x, y)  # one compressed step: residuals exist
    mine = adam.state_dict()
    theirs = rank0s(mine)
    out["OneBitAdam"] = _refusal(adam, mine, theirs if rank == 1 else mine, adam.state_dict)
    # another layer's checkpoint: the training runtime's state where OneBitAdam's belongs
    out["OneBitAdam, another kind"] = _refusal(adam, mine, {"gradcomp": runtime_state} if rank == 1 else mine,
                                               adam.state_dict)

    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    sharded = ShardedOptimizer(model.parameters(), torch.optim.AdamW, model=model, lr=0.01)
    _step(model, sharded, rank, x, y)
    mine = sharded.state_dict()
    theirs = rank0s(mine)
    out["ShardedOptimizer"] = _refusal(sharded, mine, theirs if rank == 1 else mine, sharded.state_dict)

    torch.manual_seed(1)
    chain = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 3))
    pipe = Pipeline(chain, balance=[2, 3], optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    pipe.step(x[:8], y[:8], torch.nn.functional.mse_loss)
    mine = pipe.state_dict()
    theirs = rank0s(mine)  # stage 0's file given to stage 1
    out["Pipeline"] = _refusal(pipe, mine, theirs if rank == 1 else mine, pipe.state_dict)
    return out


LAYERS = ["CompressedOptimizer", "CompressedOptimizer, no gradcomp state", "DDP hook state", "OneBitAdam", "OneBitAdam, another kind", "ShardedOptimizer",
          "Pipeline"]
WORDS = {"CompressedOptimizer": "it is rank 0's, loaded on rank 1",
         "CompressedOptimizer, no gradcomp state": "it holds no gradcomp state",
         "DDP hook state": "it is rank 0's, loaded on rank 1",
         "OneBitAdam": "it is rank 0's, loaded on rank 1",
         "OneBitAdam, another kind": "it was saved by gradcomp.training, not by OneBitAdam",
         "ShardedOptimizer": "it is rank 0's, loaded on rank 1", "Pipeline": "it is rank 0's, loaded on rank 1"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_layers, 2, tmp_path_factory.mktemp("refuse"), timeout_s=120.0)


@pytest.mark.parametrize("layer", LAYERS)
def test_a_wrong_checkpoint_on_one_rank_is_refused_on_every_rank(results, layer):
    (said0, unchanged0), (said1, unchanged1) = results[0][layer], results[1][layer]
    assert said1 is not None, f"{layer}: rank 1 loaded a checkpoint that is not its own"
    assert said0 == said1, f"{layer}: the ranks said different things (rank 0: {said0!r}, rank 1: {said1!r})"
    assert f"(rank 1: {WORDS[layer]}" in said1 and said1.endswith("; nothing was loaded"), said1
    assert unchanged0 and unchanged1, f"{layer}: a refused load changed the state"
