"""Resuming at another world size keeps the gradient mass the training still owes.

Invariant protected: the mass not yet applied is the mean of the ranks' residuals plus, under
scatter-reduce (3 ranks), the server-side residuals of every chunk; after
``reshard_states`` every new rank holds exactly that (up to one rounding of the mean), the
states load on the new world size (and nowhere else) and training goes on.
"""
from __future__ import annotations

import io

import pytest
import torch

from _training_helpers import batch, mlp, teacher_data
from ranks import run_ranks

STEPS = 3


def _optimizer(model, compressor, options):
    from gradcomp.training import CompressedOptimizer

    return CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), compressor, model=model, min_numel=0,
                               **options)


def _train(model, opt, rank, steps, start=0):
    x, y = teacher_data(256, 20, 4)
    for s in range(start, start + steps):
        xb, yb = batch(x, y, 16, rank, s)
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()


def _save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _first(rank, world):
    out = {}
    for name, (compressor, options) in CASES.items():
        model = mlp(20, 64, 4, seed=0)
        opt = _optimizer(model, compressor, options)
        _train(model, opt, rank, STEPS)
        out[name] = _save(opt.state_dict()["gradcomp"])
    return out


def _resumed(rank, world, states):
    for name, (compressor, options) in CASES.items():
        model = mlp(20, 64, 4, seed=0)
        opt = _optimizer(model, compressor, options)
        sd = opt.state_dict()
        sd["gradcomp"] = torch.load(io.BytesIO(states[name][rank]), weights_only=False)
        opt.load_state_dict(sd)
        _train(model, opt, rank, 2, start=STEPS)
    return True


CASES = {"topk": ("topk", {"ratio": 0.05}), "dgc": ("dgc", {"ratio": 0.05, "error_feedback": "dgc"}),
         "int8-ef21": ("int8", {"error_feedback": "ef21"}), "powersgd": ("powersgd", {"rank": 2})}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    raw = run_ranks(_first, 3, tmp_path_factory.mktemp("first"), timeout_s=90.0)
    return {name: [torch.load(io.BytesIO(r[name]), weights_only=False) for r in raw] for name in CASES}


def _server_state(state):
    """The scatter-reduce server residuals of a saved runtime state (inside the codec's error
    feedback)."""
    return (state["codecs"]["*"].get("server") or {}).get("state", {})


def _owed(states, key):
    """Mean worker-side state of ``key`` plus the server-side chunks (3 ranks: scatter-reduce)."""
    codec = [s["codecs"]["*"] for s in states]
    mean = torch.stack([c["state"][key].double() for c in codec]).mean(0)
    chunks = []
    for s in states:
        for k, v in _server_state(s).items():
            if k.startswith(key + "/chunk"):
                chunks.append((int(k[len(key) + 6:].split("/")[0]), v))
    if chunks:
        mean = mean + torch.cat([v.reshape(-1) for _, v in sorted(chunks)]).double().reshape(mean.shape)
    return mean


@pytest.mark.parametrize("name", ["topk", "dgc", "powersgd"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_reshard_keeps_the_owed_mass(saved, name, world):
    from gradcomp.training import reshard_states

    states = saved[name]
    new = reshard_states(states, world)
    assert [s["identity"]["rank"] for s in new] == list(range(world))
    keys = list(states[0]["codecs"]["*"]["state"])
    assert keys, "nothing was owed: the test would check nothing"
    for key in keys:
        want = _owed(states, key)
        for s in new:
            got = s["codecs"]["*"]["state"][key].double()
            assert torch.allclose(got, want, rtol=0, atol=1e-6 * max(1.0, float(want.abs().max()))), key


def test_ef21_estimates_become_their_mean(saved):
    from gradcomp.training import reshard_states

    states = saved["int8-ef21"]
    new = reshard_states(states, 2)
    for key, agg in states[0]["codecs"]["*"]["aggregate"].items():
        server = [v for s in states for k, v in sorted(_server_state(s).items()) if k.startswith(key + "/")]
        owed = torch.cat([v.reshape(-1) for v in server]).reshape(agg.shape)  # 3 ranks: chunks 0, 1, 2 in rank order
        assert torch.equal(new[1]["codecs"]["*"]["aggregate"][key], agg + owed)
        mean = torch.stack([s["codecs"]["*"]["state"][key].double() for s in states]).mean(0).float()
        assert torch.equal(new[0]["codecs"]["*"]["state"][key], mean)


def test_resharded_states_load_and_train(saved, tmp_path):
    from gradcomp.training import reshard_states

    two = {name: [_save(s) for s in reshard_states(saved[name], 2)] for name in CASES}
    assert run_ranks(_resumed, 2, tmp_path, two, timeout_s=90.0) == [True, True]
    for name, (compressor, options) in CASES.items():
        one = reshard_states(saved[name], 1)[0]
        model = mlp(20, 64, 4, seed=0)  # one process, no process group
        opt = _optimizer(model, compressor, options)
        sd = opt.state_dict()
        sd["gradcomp"] = one
        opt.load_state_dict(sd)
        _train(model, opt, 0, 1, start=STEPS)
        sd["gradcomp"] = saved[name][0]
        with pytest.raises(ValueError, match="saved on 3 ranks"):
            opt.load_state_dict(sd)


def test_reshard_refuses_a_partial_job(saved):
    from gradcomp.training import reshard_states

    with pytest.raises(ValueError, match="all 3 ranks"):
        reshard_states(saved["topk"][:2], 2)
    with pytest.raises(ValueError, match="world_size"):
        reshard_states(saved["topk"], 0)
