"""The worker's look-ahead: a bucket's local phase runs while the bucket before it is on the wire.

Invariant protected: whether a bucket was compressed ahead (``BucketExchange.prepare``, run by
the worker inside the previous bucket's largest exchange) changes nothing: through real DDP on
2 gloo ranks, with several buckets per iteration, on every model kind of ``tests/models.py``
and on a model with large layers (where the default size threshold lets it run), every
compressor route gives the same parameters bit for bit with the look-ahead as without it,
and the look-ahead did run. A non-finite gradient on one rank in an iteration whose buckets
were prepared ahead still undoes the whole iteration on every rank (the prepared local phase
joined the iteration's transaction), and a bad input refused by a prepared bucket's
compressor still raises on every rank and changes nothing.

All cases share one spawn of 2 ranks (the strict NCCL mode on).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from models import KINDS, data, model
from ranks import run_ranks

STEPS = 4
# a route of each kind: fused (onebit, topk + EF, variable-size threshold, int8), lockstep
# (PowerSGD's rounds, native fp16 beside dense biases), the whole-bucket cast (bf16)
COMPRESSORS = {"onebit": {}, "topk": {"ratio": 0.1}, "threshold": {}, "int8": {}, "powersgd": {"rank": 2},
               "fp16": {"min_numel": 64}, "bf16": {}}
BUCKET_MB = 0.004  # several buckets on every model (DDP's first iteration has one of up to 1 MB)


def _wide() -> nn.Module:
    """Large layers, each its own bucket: onebit payloads over the 4 KB the look-ahead waits for,
    each bucket followed by another compressed one."""
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 256),
                         nn.ReLU(), nn.Linear(256, 10))


def _train(kind, name, options, rank, world, ahead, *, nan_at=None, threshold=None, steps=STEPS, device="cpu"):
    import gradcomp.collectives.bucket as bucket_mod
    from torch.nn.parallel import DistributedDataParallel as DDP
    from gradcomp.training import ddp_comm_hook

    torch.manual_seed(0)
    net = _wide() if kind == "wide" else model(kind)
    x, y = data("many_small" if kind == "wide" else kind, 16 * world, seed=3)
    x, y = x[rank::world].to(device), y[rank::world].to(device)
    net = net.to(device)
    ddp = DDP(net, bucket_cap_mb=BUCKET_MB, device_ids=[0] if device != "cpu" else None)
    state, hook = ddp_comm_hook(name, model=net, **options)
    ddp.register_comm_hook(state, _all_at_once(hook))
    runtime = state.compression
    if not ahead:
        runtime.prepares_ahead = False
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    prepared = [0]
    original = bucket_mod.BucketExchange.finish

    def counted(self, work):  # the buckets whose local phase the worker ran ahead
        prepared[0] += self.ahead
        return original(self, work)

    bucket_mod.BucketExchange.finish = counted
    before = bucket_mod._OVERLAP_MIN_BYTES
    if threshold is not None:
        bucket_mod._OVERLAP_MIN_BYTES = threshold
    snapshots, iterations = [], []
    try:
        for step in range(steps):
            opt.zero_grad()
            out = ddp(x)
            loss = nn.functional.cross_entropy(out, y)
            if nan_at == step and rank == 1:
                loss = loss * float("nan")
            loss.backward()
            if nan_at != step:  # the step a loss scaler skips: the optimizer does not step
                opt.step()
            snapshots.append([p.detach().cpu().clone() for p in net.parameters()])
            iterations.append(runtime.iteration)
    finally:
        bucket_mod.BucketExchange.finish = original
        bucket_mod._OVERLAP_MIN_BYTES = before
    state_now = state.state_dict()["codecs"]
    return snapshots, iterations, prepared[0], state_now


def _all_at_once(hook):
    """The hook, with every bucket of a backward pass handed to it when the last one is ready:
    a model whose backward outruns its link (all buckets queued), here on small models whose
    backward would otherwise leave each exchange done before the next bucket is ready."""
    held = []

    def deferred(state, bucket):
        fut = torch.futures.Future()
        held.append((bucket, fut))
        if bucket.is_last():
            batch = list(held)
            held.clear()
            for b, f in batch:
                hook(state, b).add_done_callback(lambda done, f=f: f.set_result(done.value()))
        return fut

    return deferred


def _rank(rank, world):
    out = {}
    for kind in (*KINDS, "wide"):
        threshold = None if kind == "wide" else 0  # tiny models: let their small payloads run it too
        for name, options in COMPRESSORS.items():
            if kind == "wide" and name not in ("onebit", "topk", "powersgd"):
                continue
            with_ahead = _train(kind, name, options, rank, world, True, threshold=threshold)
            without = _train(kind, name, options, rank, world, False, threshold=threshold)
            out[(kind, name)] = (with_ahead[:3], without[:3])
    # a NaN on rank 1 at step 2: that iteration is undone everywhere, prepared buckets included,
    # so four steps with that one skipped leave what three clean steps leave (the same batch each)
    nan = _train("wide", "onebit", {}, rank, world, True, nan_at=2)
    clean = _train("wide", "onebit", {}, rank, world, True, steps=STEPS - 1)
    out["nan"] = (nan[1], nan[2], clean[1], nan[0][-1], clean[0][-1], nan[3], clean[3])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_rank, 2, tmp_path_factory.mktemp("ahead"), timeout_s=240)


CASES = [(k, n) for k in KINDS for n in COMPRESSORS] + [("wide", n) for n in ("onebit", "topk", "powersgd")]


@pytest.mark.parametrize("kind,name", CASES)
def test_look_ahead_gives_the_same_bits(results, kind, name):
    for rank_out in results:
        (snaps, iters, prepared), (snaps0, iters0, prepared0) = rank_out[(kind, name)]
        assert prepared0 == 0
        assert iters == iters0 == list(range(1, STEPS + 1))
        for step, (a, b) in enumerate(zip(snaps, snaps0)):
            for i, (p, q) in enumerate(zip(a, b)):
                assert torch.equal(p, q), (kind, name, step, i)
    # replicas stay identical
    for a, b in zip(results[0][(kind, name)][0][0], results[1][(kind, name)][0][0]):
        for p, q in zip(a, b):
            assert torch.equal(p, q)


@pytest.mark.parametrize("kind,name", CASES)
def test_look_ahead_ran(results, kind, name):
    prepared = [r[(kind, name)][0][2] for r in results]
    if name == "bf16":  # every bucket averaged whole (one cast): nothing to do ahead
        assert prepared == [0, 0]
    elif name != "fp16" and kind != "many_small":
        # fp16 keeps small tensors exact: whole casts or a lockstep, by model; many_small's one
        # compressed matrix has no compressed bucket after it, so there is nothing to run ahead
        assert all(n > 0 for n in prepared), prepared


def test_a_non_finite_iteration_with_prepared_buckets_is_undone_everywhere(results):
    for rank_out in results:
        iterations, prepared, clean, params, clean_params, codecs, clean_codecs = rank_out["nan"]
        assert prepared > 0
        assert clean == [1, 2, 3]
        assert iterations == [1, 2, 2, 3]  # step 2 skipped on both ranks, nothing counted
        for p, q in zip(params, clean_params):
            assert torch.equal(p, q)
        _assert_same(codecs, clean_codecs)


def _assert_same(a, b, where="codecs"):
    """Nested state dicts equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _cuda_rank(rank, world):
    out = {}
    for name in ("onebit", "topk", "powersgd"):
        with_ahead = _train("wide", name, COMPRESSORS[name], rank, world, True, device="cuda")
        without = _train("wide", name, COMPRESSORS[name], rank, world, False, device="cuda")
        out[name] = (with_ahead[:3], without[:3])
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_look_ahead_on_cuda_tensors(tmp_path):
    """Two gloo ranks sharing one GPU: the look-ahead waits on the next bucket's event and
    compresses on the worker's stream; the same bits as without it, replicas identical."""
    results = run_ranks(_cuda_rank, 2, tmp_path, timeout_s=240)
    for name in ("onebit", "topk", "powersgd"):
        for rank_out in results:
            (snaps, iters, prepared), (snaps0, iters0, prepared0) = rank_out[name]
            assert prepared > 0 and prepared0 == 0, name
            assert iters == iters0 == list(range(1, STEPS + 1))
            for a, b in zip(snaps, snaps0):
                for p, q in zip(a, b):
                    assert torch.equal(p, q), name
        for p, q in zip(results[0][name][0][0][-1], results[1][name][0][0][-1]):
            assert torch.equal(p, q), name
