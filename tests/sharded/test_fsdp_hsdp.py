"""HSDP with compression: FSDP2 on a 2-D mesh's shard dimension, the replicas' all-reduce by
``compress_fsdp(replicate=mesh, replicate_compressor=...)``, on 4 real gloo ranks (2 replicas x
2 shards). Dense, it trains as FSDP2's own HSDP does (to fp32 rounding); compressed, the replicas
stay identical, train, and a non-finite gradient on one rank skips the step on all four.
One spawn runs every case."""
from __future__ import annotations

import pytest
import torch

from ranks import run_ranks

STEPS = 6


def _model(mesh, seed=0):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
    for child in (m[0], m[2]):
        fully_shard(child, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(8, 12, generator=g)
    return x, (x[:, :5] * 3).argmax(dim=1)


def _full(model):
    return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])


def _train(rank, model, opt, fsdp=None):
    losses, params = [], []
    for s in range(STEPS):
        x, y = _batch(rank, s)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if fsdp is None:
            opt.step()
        else:
            fsdp.step(opt)
        opt.zero_grad()
        losses.append(float(loss.detach()))
        params.append(_full(model))
    return losses, params


def _everything(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from gradcomp.sharded import compress_fsdp, overlap_gathers

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    native = _model(mesh)  # FSDP2's own HSDP
    out["native"] = _train(rank, native, torch.optim.AdamW(native.parameters(), lr=1e-2, foreach=True))
    for name, codec in (("dense", None), ("int8", "int8"), ("int4", "int4")):
        m = _model(mesh["shard"])
        fsdp = compress_fsdp(m, None, replicate=mesh, replicate_compressor=codec)
        out[name] = _train(rank, m, torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True), fsdp)
        out[name + "_describe"] = fsdp.describe()
    # a bf16 weight all-gather, synchronous and resent, against asynchronous, prefetched and
    # re-gathered locally (overlap_gathers, regather="local"): the same bits
    for name, fast in (("bf16ag", False), ("bf16ag_fast", True)):
        m = _model(mesh["shard"])
        fsdp = compress_fsdp(m, None, replicate=mesh, replicate_compressor="int8", all_gather="bf16",
                             regather="local" if fast else "wire")
        if fast:
            overlap_gathers(m, [m[0], m[2]])
        out[name] = _train(rank, m, torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True), fsdp)
        out[name + "_describe"] = fsdp.describe()
    # a non-finite input on one rank: every rank skips that step
    m = _model(mesh["shard"])
    fsdp = compress_fsdp(m, None, replicate=mesh, replicate_compressor="int8")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    before = None
    for s in range(3):
        x, y = _batch(rank, s)
        if s == 1 and rank == 3:
            x = x.clone()
            x[0, 0] = float("nan")
        torch.nn.functional.cross_entropy(m(x), y).backward()
        if s == 1:
            before = _full(m)
        kept = fsdp.step(opt)
        opt.zero_grad()
        if s == 1:
            out["skip"] = (kept, fsdp.skipped, torch.equal(before, _full(m)))
    out["after_skip"] = _full(m)
    # FSDP2's own 2-D mesh is refused with the fix
    try:
        compress_fsdp(_model(mesh), "int8")
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_everything, 4, tmp_path_factory.mktemp("hsdp"), timeout_s=120)


def test_dense_hsdp_trains_as_fsdp2s_own_hsdp(runs):
    for r in runs:
        for a, b in zip(r["native"][1], r["dense"][1]):
            assert (a - b).abs().max().item() < 1e-5
        assert r["native"][0] == pytest.approx(r["dense"][0], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("name", ["dense", "int8", "int4", "bf16ag", "bf16ag_fast"])
def test_every_rank_holds_the_same_model(runs, name):
    for r in runs[1:]:
        for a, b in zip(runs[0][name][1], r[name][1]):
            assert torch.equal(a, b)
    assert "2 replicas" in runs[0][name + "_describe"]


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_compressed_replicas_train_near_dense(runs, name):
    for r in runs:
        assert r[name][0][-1] < r[name][0][0]
        assert (r[name][1][-1] - r["dense"][1][-1]).abs().max().item() < 0.05


def test_a_non_finite_gradient_on_one_rank_skips_the_step_on_all(runs):
    for r in runs:
        kept, skipped, unchanged = r["skip"]
        assert kept is False and skipped == 1 and unchanged
    for r in runs[1:]:
        assert torch.equal(r["after_skip"], runs[0]["after_skip"])


def test_fsdp2s_own_2d_mesh_is_refused_with_the_fix(runs):
    for r in runs:
        assert "replicate=mesh" in r["refused"]


def test_overlapped_local_regathers_change_no_bit(runs):
    """HSDP with a bf16 weight all-gather: asynchronous and prefetched (``overlap_gathers``),
    backward's re-gathers decoded locally (``regather="local"``), the same losses and weights
    as the synchronous, resending run, bit for bit."""
    for r in runs:
        assert r["bf16ag_fast"][0] == r["bf16ag"][0]
        assert all(torch.equal(a, b) for a, b in zip(r["bf16ag_fast"][1], r["bf16ag"][1]))
        assert "decoded from the forward" in r["bf16ag_fast_describe"]
