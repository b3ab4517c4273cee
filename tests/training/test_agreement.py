"""Ranks that disagree get one clear error on every rank; a checkpoint knows whose it is.

Invariants protected (2 real gloo ranks, one spawn for every case):

- a per-rank difference in the compressor's options (seed, PowerSGD rank, random-k ratio), the
  policy (``min_numel``, ``start_iter``) or the model raises ``ValueError`` naming the
  difference on every rank, at registration of the hook or ``CompressedOptimizer`` — never a
  silent divergence, never a gloo abort — and both ranks can go on afterwards;
- an option valid on some ranks only (PowerSGD's ``rank=dist.get_rank()``: the matrix rank, not
  the process rank) and a model with no parameter that requires a gradient raise the same
  ``ValueError`` on every rank;
- a rank resumed from a checkpoint of another step is caught at its first bucket;
- ``load_state_dict`` refuses rank 0's file on rank 1 (on both ranks), a file saved without
  ``model=`` loaded with it (and the reverse), another model and another world size, before
  anything is loaded.
"""
from __future__ import annotations

import io

import pytest
import torch

from _training_helpers import batch, mlp, teacher_data
from ranks import run_ranks

DISAGREE = {  # case -> (compressor, options per rank)
    "seed": ("randomk", lambda r: {"ratio": 0.1, "seed": r}),
    "powersgd rank": ("powersgd", lambda r: {"rank": 1 + r}),
    "ratio": ("randomk", lambda r: {"ratio": 0.1 * (1 + r)}),
    "min_numel": ("topk", lambda r: {"min_numel": 100 * r}),
    "start_iter": ("topk", lambda r: {"start_iter": r}),
}

INVALID = {  # case -> (compressor, options per rank, model per rank): refused on some ranks only
    "powersgd rank=dist.get_rank()": ("powersgd", lambda r: {"rank": r}, lambda r: mlp(20, 64, 4, seed=0)),
    "frozen model": ("topk", lambda r: {}, lambda r: mlp(20, 64, 4, seed=0).requires_grad_(False)),
}
INVALID_SAID = {"powersgd rank=dist.get_rank()": ["powersgd: option rank=0 is not allowed", "matrix rank",
                                                  "not a process rank", "on rank 0"],
                "frozen model": ["no parameter requires a gradient"]}


def _error(fn):
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    except RuntimeError as exc:  # DDP reports a hook's error wrapped in its own
        return f"RuntimeError: {exc}"
    return None


def _save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _load(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _train_steps(model, opt, rank, steps):
    x, y = teacher_data(128, 20, 4)
    for s in range(steps):
        xb, yb = batch(x, y, 16, rank, s)
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()


def _cases(rank, world, single_rank_state):
    from gradcomp.compress import ErrorFeedback, get_compressor
    from gradcomp.training import CompressedOptimizer, ddp_comm_hook

    out = {}
    for case, (name, options) in DISAGREE.items():
        model = mlp(20, 64, 4, seed=0)
        out[("hook", case)] = _error(lambda: ddp_comm_hook(name, model=model, **options(rank)))
        out[("optimizer", case)] = _error(lambda: CompressedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), name, model=model, **options(rank)))
    for case, (name, options, make) in INVALID.items():
        model = make(rank)
        out[("hook", case)] = _error(lambda: ddp_comm_hook(name, model=model, **options(rank)))
        out[("optimizer", case)] = _error(lambda: CompressedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), name, model=model, **options(rank)))
    other = mlp(20, 64 if rank == 0 else 32, 4, seed=0)  # another model on rank 1
    out[("optimizer", "model")] = _error(lambda: CompressedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1),
                                                                     "topk", model=other))
    out[("hook", "model")] = _error(lambda: ddp_comm_hook("topk", model=mlp(20, 64 if rank == 0 else 32, 4)))

    # everything agrees: training works after the errors above, on both ranks
    model = mlp(20, 64, 4, seed=0)
    opt = CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "topk", model=model, ratio=0.1,
                              min_numel=0)
    _train_steps(model, opt, rank, 3)
    out["trained"] = True
    mine = _save(opt.state_dict())

    # a checkpoint of another step on rank 1 only: caught at the first bucket, on both ranks
    earlier = mlp(20, 64, 4, seed=0)
    opt_e = CompressedOptimizer(torch.optim.SGD(earlier.parameters(), lr=0.1), "topk", model=earlier, ratio=0.1,
                                min_numel=0)
    _train_steps(earlier, opt_e, rank, 1)
    at_step1 = _save(opt_e.state_dict())
    _train_steps(earlier, opt_e, rank, 2)
    resumed = mlp(20, 64, 4, seed=0)
    opt_r = CompressedOptimizer(torch.optim.SGD(resumed.parameters(), lr=0.1), "topk", model=resumed, ratio=0.1,
                                min_numel=0)
    opt_r.load_state_dict(_load(at_step1 if rank == 1 else _save(opt_e.state_dict())))
    out["stale checkpoint"] = _error(lambda: _train_steps(resumed, opt_r, rank, 1))

    # checkpoints refused before anything is loaded
    got = [mine]
    torch.distributed.broadcast_object_list(got, src=0)
    fresh = mlp(20, 64, 4, seed=0)
    opt_f = CompressedOptimizer(torch.optim.SGD(fresh.parameters(), lr=0.1), "topk", model=fresh, ratio=0.1,
                                min_numel=0)
    out["rank 0's file"] = _error(lambda: opt_f.load_state_dict(_load(got[0])))
    unnamed = mlp(20, 64, 4, seed=0)
    opt_u = CompressedOptimizer(torch.optim.SGD(unnamed.parameters(), lr=0.1), "topk", ratio=0.1, min_numel=0)
    out["unnamed into named"] = _error(lambda: opt_f.load_state_dict(_load(_save(opt_u.state_dict()))))
    out["named into unnamed"] = _error(lambda: opt_u.load_state_dict(_load(mine)))
    deeper = mlp(20, 64, 64, 4, seed=0)
    opt_d = CompressedOptimizer(torch.optim.SGD(deeper.parameters(), lr=0.1), "topk", model=deeper, ratio=0.1,
                                min_numel=0)
    out["another model"] = _error(lambda: opt_d.load_state_dict(_load(mine)))
    out["another world size"] = _error(lambda: opt_f.load_state_dict(_load(single_rank_state)))
    out["own file"] = _error(lambda: opt_f.load_state_dict(_load(mine)))
    ef = ErrorFeedback(get_compressor("topk"))
    ef.compress(torch.randn(100), key="w")
    sd = [ef.state_dict()]
    torch.distributed.broadcast_object_list(sd, src=0)
    out["ef rank 0's state"] = _error(lambda: ErrorFeedback(get_compressor("topk")).load_state_dict(sd[0]))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from gradcomp.training import CompressedOptimizer

    model = mlp(20, 64, 4, seed=0)  # one process, no process group: a world of 1
    opt = CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "topk", model=model, ratio=0.1,
                              min_numel=0)
    _train_steps(model, opt, 0, 2)
    return run_ranks(_cases, 2, tmp_path_factory.mktemp("agree"), _save(opt.state_dict()), timeout_s=90.0)


@pytest.mark.parametrize("mode", ["hook", "optimizer"])
@pytest.mark.parametrize("case", list(DISAGREE) + ["model"])
def test_disagreement_raises_on_every_rank(results, mode, case):
    field = {"min_numel": "policy settings", "start_iter": "policy settings", "model": "parameters"}.get(
        case, "compressor and policy")
    for rank, out in enumerate(results):
        msg = out[(mode, case)]
        assert msg is not None, f"rank {rank}: {mode} with a different {case} was accepted"
        assert f"ranks disagree on the {field}" in msg and "rank 0:" in msg and "rank 1:" in msg, msg
    assert all(out["trained"] for out in results)


@pytest.mark.parametrize("mode", ["hook", "optimizer"])
@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_configuration_raises_the_same_error_on_every_rank(results, mode, case):
    # PowerSGD's rank=dist.get_rank() is invalid on rank 0 only: every rank says so, alike, and
    # that it is the matrix rank; a frozen model has nothing to average (torch's DDP refuses it)
    said = [out[(mode, case)] for out in results]
    assert said[0] is not None and said[0] == said[1], said
    assert all(words in said[0] for words in INVALID_SAID[case]), said[0]
    assert all(out["trained"] for out in results)


def test_stale_checkpoint_on_one_rank_is_caught_at_the_first_bucket(results):
    for out in results:
        msg = out["stale checkpoint"]
        assert msg is not None and "ranks disagree on the iteration" in msg, msg


@pytest.mark.parametrize("case,words", [
    ("unnamed into named", "model="), ("named into unnamed", "model="), ("another model", "other parameters"),
    ("another world size", "saved on 1 ranks")])
def test_checkpoint_of_another_identity_is_refused(results, case, words):
    for out in results:
        assert out[case] is not None and words in out[case], out[case]


def test_rank_checkpoint_loads_only_on_its_rank(results):
    """Rank 0's file on rank 1 is refused on both ranks alike (rank 0 loads nothing either)."""
    assert results[0]["own file"] is None and results[1]["own file"] is None
    msg = results[1]["rank 0's file"]
    assert msg is not None and "(rank 1: it is rank 0's, loaded on rank 1" in msg, msg
    assert results[0]["rank 0's file"] == msg
    assert results[0]["ef rank 0's state"] is None
    msg = results[1]["ef rank 0's state"]
    assert msg is not None and "ef: it is rank 0's, loaded on rank 1" in msg, msg

