"""``compress_fsdp`` on real FSDP2 (``fully_shard``) ranks: one 2-rank spawn checks every case.

Invariants protected:

- the dense custom reduce-scatter gives FSDP2's own gradients bit for bit (fp32 and a bf16
  ``reduce_dtype``; ``reshard_after_forward`` both ways), and ``set_gradient_divide_factor``
  scales them exactly (4 on 2 ranks: half of the default);
- a compressed run (int8 reduce-scatter, bf16 all-gather, gradient accumulation under
  ``set_requires_gradient_sync(False)``) keeps error feedback's invariant per shard: what each
  owner received over the steps plus what the senders still owe it is the dense mean's sum;
  the unsharded weights every forward sees are identical on both ranks;
- a non-finite step (rank 1 only) is skipped on both ranks and changes no residual and no
  weight, and a GradScaler is backed off; resuming from a checkpoint (model, optimizer and
  residuals) continues bit for bit; a checkpoint of another rank is refused on every rank;
- ranks that disagree on the configuration raise the same error; HSDP and a multi-round
  compressor are refused.
"""
from __future__ import annotations

import copy

import pytest
import torch

from ranks import run_ranks

STEPS = 4


def _shard(model, reshard=True, mp=None):
    from torch.distributed.fsdp import fully_shard

    kw = {"reshard_after_forward": reshard, **({"mp_policy": mp} if mp is not None else {})}
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, **kw)
    fully_shard(model, **kw)
    return model


def _build(kind, seed=0, **kw):
    from models import model

    torch.manual_seed(seed)
    return _shard(model(kind), **kw)


def _locals(model):
    return [p.to_local().detach().clone() for p in model.parameters()]


def _grads(model):
    return [p.grad.to_local().detach().clone() for p in model.parameters()]


def _loss(model, x, y, rank):
    return torch.nn.functional.cross_entropy(model(x[rank::2]), y[rank::2])


def _dense_identical(rank, kind, reshard, mp):
    """FSDP2's own gradients and the dense custom comm's, step by step: bit-identical."""
    from models import data

    from gradcomp.training import compress_fsdp

    x, y = data(kind, 32, seed=1)
    ref, ours, halved = _build(kind, reshard=reshard, mp=mp), _build(kind, reshard=reshard, mp=mp), \
        _build(kind, reshard=reshard, mp=mp)
    compress_fsdp(ours, None)
    compress_fsdp(halved, None)
    for m in halved.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(4.0)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, ours, halved)]
    same, scaled = True, True
    for step in range(3):
        for m, o in zip((ref, ours, halved), opts):
            o.zero_grad()
            _loss(m, x[8 * step:8 * step + 8], y[8 * step:8 * step + 8], rank).backward()
        g_ref, g_ours, g_half = _grads(ref), _grads(ours), _grads(halved)
        same &= all(torch.equal(a, b) for a, b in zip(g_ref, g_ours))
        if step == 0:  # the same weights once only: the halved model then trains on other steps
            scaled &= all(torch.equal(a * 0.5, c) for a, c in zip(g_ref, g_half))
        for o in opts:
            o.step()
    return same and all(torch.equal(a, b) for a, b in zip(_locals(ref), _locals(ours))), scaled


def _spy(handle):
    """Record every reduce-scatter's flat input and output on this rank, per module."""
    seen = {k: [] for k in handle.keys}
    real = handle._reduce_scatter

    def spy(key, output, flat, group, op):
        real(key, output, flat, group, op)
        seen[key].append((flat.detach().clone(), output.detach().clone()))

    handle._reduce_scatter = spy
    return seen


def _weights_seen(model):
    """Every leaf module's parameters as its forward sees them (unsharded), per forward."""
    seen = []

    def hook(mod, args):
        seen.append([p.detach().clone() for p in mod.parameters(recurse=False)])

    for m in model.modules():
        if any(True for _ in m.parameters(recurse=False)) and not list(m.children()):
            m.register_forward_pre_hook(hook)
    return seen


def _regathers(handle):
    """Per all-gather call: whether it gave the bits of the module's previous call when the
    weights had not changed since (the backward re-gather and the next micro-batch's)."""
    last, same = {}, []
    real = handle._all_gather

    def spy(key, output, shard, group):
        real(key, output, shard, group)
        versions = tuple(p._version for p in handle._params[key])
        if key in last and last[key][0] == versions:
            same.append(torch.equal(last[key][1], output))
        last[key] = (versions, output.detach().clone())

    handle._all_gather = spy
    return same


def _compressed_run(rank, world):
    """int8 RS + bf16 AG on the transformer: EF invariant, equal replicas, a skipped step, resume."""
    import torch.distributed as dist
    from models import data

    from syncs import HostSyncs

    from gradcomp.collectives.shards import piece_key
    from gradcomp.training import compress_fsdp

    x, y = data("transformer", 64, seed=2)
    model = _build("transformer")
    h = compress_fsdp(model, "int8", all_gather="bf16")
    seen, weights, regathers = _spy(h), _weights_seen(model), _regathers(h)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out = {"stepped": [], "skip_kept_state": None, "skip_kept_weights": None}
    snapshot = None
    counts = {id(calls): 0 for calls in seen.values()}
    for step in range(STEPS + 2):
        xb, yb = x[8 * step:8 * step + 8], y[8 * step:8 * step + 8]
        if step == 3:  # resume point: everything a checkpoint holds
            snapshot = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), h.state_dict())
        before = (copy.deepcopy(h.state_dict()), _locals(model))
        model.set_requires_gradient_sync(False)  # accumulate one micro-batch without exchanging it
        _loss(model, xb[:4], yb[:4], rank).backward()
        model.set_requires_gradient_sync(True)
        loss = _loss(model, xb[4:], yb[4:], rank)
        if step == 1 and rank == 1:
            loss = loss * float("inf")
        with HostSyncs() as syncs:
            loss.backward()
            out["stepped"].append(h.step(opt))
        out["syncs"] = syncs.sites  # the last step's
        opt.zero_grad()
        if not out["stepped"][-1]:  # rolled back: its exchanges owe nothing
            for calls in seen.values():
                del calls[counts[id(calls)]:]
        counts = {id(calls): len(calls) for calls in seen.values()}
        if step == 1:
            # the weight residual moved in this step's forward (the weights of step 0 were new)
            out["skip_kept_state"] = _same(before[0]["reduce_scatter"], h.state_dict()["reduce_scatter"])
            out["skip_kept_weights"] = all(torch.equal(a, b) for a, b in zip(before[1], _locals(model)))
    final = _locals(model)
    out["skipped"] = h.skipped
    # error feedback per shard: sum_t out_t + (1/w) sum_{r != me} e_{r->me} == sum_t mean_r(piece_me of input_r)
    residuals = h.state_dict()["reduce_scatter"]["state"]
    gathered = [None] * world
    dist.all_gather_object(gathered, ({k: [f for f, _ in v] for k, v in seen.items()}, residuals))
    worst = 0.0
    for key, calls in seen.items():
        got = sum(o.double() for _, o in calls)
        want = 0
        for t in range(len(calls)):
            pieces = [g[0][key][t].view(world, -1)[rank].double() for g in gathered]
            want = want + sum(pieces) / world
        owed = sum(g[1][piece_key(key, rank)].double() for r, g in enumerate(gathered) if r != rank) / world
        gap = float((got + owed - want).abs().max() / (want.abs().max() + 1e-12))
        worst = gap if not gap <= worst else worst  # a NaN stays
    out["ef_worst"] = worst
    out["ef_calls"] = sum(len(v) for v in seen.values())
    out["weights_seen"] = [[w.tolist() for w in ws] for ws in weights]
    out["regathers"] = (len(regathers), all(regathers))
    # resume: a fresh model loads the snapshot and runs the last steps again
    model2 = _build("transformer", seed=5)
    h2 = compress_fsdp(model2, "int8", all_gather="bf16")
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    model2.load_state_dict(snapshot[0])
    opt2.load_state_dict(snapshot[1])
    h2.load_state_dict(snapshot[2])
    for step in range(3, STEPS + 2):
        xb, yb = x[8 * step:8 * step + 8], y[8 * step:8 * step + 8]
        model2.set_requires_gradient_sync(False)
        _loss(model2, xb[:4], yb[:4], rank).backward()
        model2.set_requires_gradient_sync(True)
        _loss(model2, xb[4:], yb[4:], rank).backward()
        h2.step(opt2)
        opt2.zero_grad()
    out["resume_identical"] = all(torch.equal(a, b) for a, b in zip(final, _locals(model2)))
    # another rank's checkpoint, on rank 1 only: refused on both ranks, nothing loaded
    other = [None] * world
    dist.all_gather_object(other, h.state_dict())
    try:
        h2.load_state_dict(other[0])
        out["refused"] = None
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    return a == b


def _scaler_run(rank):
    """onebit RS under a GradScaler on the conv net: an overflow on rank 1 is skipped everywhere."""
    from models import data

    from gradcomp.training import compress_fsdp

    x, y = data("cnn1d", 32, seed=3)
    model = _build("cnn1d", reshard=False)
    h = compress_fsdp(model, "onebit")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    stepped, scales, kept = [], [], None
    for step in range(3):
        before = copy.deepcopy(h.state_dict())
        loss = _loss(model, x[8 * step:8 * step + 8], y[8 * step:8 * step + 8], rank)
        if step == 1 and rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        stepped.append(h.step(opt, scaler))
        scales.append(scaler.get_scale())
        opt.zero_grad()
        if step == 1:
            kept = _same(before["reduce_scatter"], h.state_dict()["reduce_scatter"])
    return stepped, scales, kept


def _refusals(rank):
    from gradcomp.training import compress_fsdp

    said = {}
    for case, spec in (("disagree", "int8" if rank == 0 else "onebit"), ("multi_round", "powersgd"),
                       ("unknown", "int8" if rank == 0 else "no-such-codec")):
        try:
            compress_fsdp(_build("cnn1d"), spec)
            said[case] = None
        except ValueError as exc:
            said[case] = str(exc)
    return said


def _all_checks(rank, world):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"dense_fp32": _dense_identical(rank, "transformer", True, None),
            "dense_bf16": _dense_identical(rank, "cnn1d", False, MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)),
            "compressed": _compressed_run(rank, world), "scaler": _scaler_run(rank), "refusals": _refusals(rank)}


def test_compress_fsdp_on_two_ranks(tmp_path):
    r0, r1 = run_ranks(_all_checks, 2, tmp_path, timeout_s=120)
    for r in (r0, r1):
        assert r["dense_fp32"] == (True, True), "dense custom reduce-scatter differs from FSDP2's (fp32)"
        assert r["dense_bf16"] == (True, True), "dense custom reduce-scatter differs from FSDP2's (bf16 reduce)"
        c = r["compressed"]
        assert c["stepped"] == [True, False, True, True, True, True] and c["skipped"] == 1
        assert c["skip_kept_state"] and c["skip_kept_weights"], "a skipped step changed the state or weights"
        assert c["ef_calls"] > 0 and c["ef_worst"] < 1e-5, f"error feedback lost mass: {c['ef_worst']}"
        assert c["regathers"][0] > 0 and c["regathers"][1], "a re-gather of unchanged weights gave other bits"
        assert c["resume_identical"], "resuming from the checkpoint did not continue bit for bit"
        ours = {site: n for site, n in c["syncs"].items() if "training/fsdp.py" in site}
        assert sum(ours.values()) == 1, f"compress_fsdp's own host syncs per step (the decision only): {ours}"
        # every exchange of a step after the first travels on its agreed layout: no size round, no parsing
        wire = {site: n for site, n in c["syncs"].items() if "collectives/" in site}
        assert not wire, f"the collectives read back during a step on agreed layouts: {wire}"
        stepped, scales, kept = r["scaler"]
        assert stepped == [True, False, True] and kept
        assert scales[1] == scales[0] * 0.5, scales
    assert r0["compressed"]["refused"] == r1["compressed"]["refused"] is not None
    assert "rank 1" in r0["compressed"]["refused"]
    assert r0["compressed"]["weights_seen"] == r1["compressed"]["weights_seen"], "replicas differ"
    assert r0["scaler"][1] == r1["scaler"][1]
    for case in ("disagree", "unknown"):
        assert r0["refusals"][case] == r1["refusals"][case] is not None, case
    assert "ranks disagree on the compressor" in r0["refusals"]["disagree"]
    assert "multi-round" in r0["refusals"]["multi_round"]


def test_refusals_without_ranks():
    """torch < 2.9 and an HSDP mesh are refused with errors naming the fix."""
    from unittest import mock

    from gradcomp.training import fsdp

    with mock.patch.object(torch, "__version__", "2.8.0"):
        assert "torch >= 2.9" in fsdp._torch_problem() and "2.8.0" in fsdp._torch_problem()
    assert fsdp._torch_problem() is None

    class Mesh:
        ndim = 2

    assert "HSDP" in fsdp._mesh_problem([Mesh()])
    assert "fully_shard" in fsdp._mesh_problem([])
    assert fsdp._op_scale(torch.distributed.ReduceOp.SUM, 4) == 4.0
    assert fsdp._op_scale(torch.distributed.ReduceOp.PREMUL_SUM(0.25), 2) == 0.5
    with pytest.raises(ValueError, match="MAX"):
        fsdp._op_scale(torch.distributed.ReduceOp.MAX, 2)


@pytest.mark.gpu
def test_compress_fsdp_cuda_one_rank(tmp_path):
    """On one GPU under NCCL: the comms keep every tensor on the GPU and training steps (FSDP
    calls no comm on a group of one, so the comms are also called directly)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert run_ranks(_cuda_one, 1, tmp_path, timeout_s=120, torchrun_env=True, strict=False) == [True]


def _cuda_one(rank, world):
    import torch.distributed as dist
    from models import data
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradcomp.training import compress_fsdp

    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (1,))
    torch.manual_seed(0)
    from models import model as make

    model = make("transformer").cuda()
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    h = compress_fsdp(model, "int8", all_gather="bf16")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = data("transformer", 16, seed=0)
    for _ in range(2):
        torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda()).backward()
        assert h.step(opt)
        opt.zero_grad()
    key, group = h.keys[0], mesh.get_group()
    n = sum(p.numel() for p in h._params[key])  # a group of one: the shard is the whole module
    flat = torch.randn(n, device="cuda")
    out = h.reduce_scatters[key].allocate((n,), dtype=torch.float32, device=flat.device)
    h.reduce_scatters[key](out, flat, group, dist.ReduceOp.AVG)
    full = torch.empty(n, device="cuda")
    h.all_gathers[key](full, flat, group)
    ok = out.is_cuda and full.is_cuda and torch.equal(out, flat) and torch.allclose(full, flat, rtol=1e-2)
    dist.destroy_process_group()
    return bool(ok)
