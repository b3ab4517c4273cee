"""Agreed layouts of variable-size payloads (threshold's ``[values, indices]``): after a set's
first, checked exchange, every rank's sizes travel in one small all-gather, read at once, and
the payloads in one all-gather padded to the largest rank's bytes, with no header.

Runs on 2 ranks (allgather, the default there) and on 4 (scatter-reduce, the default there,
and allgather named) check: the same bits as the checked path at every step, payloads of
different sizes on each rank and an empty one among them; one host read in the collectives per
exchange phase (the sizes: one for allgather, two for scatter-reduce) besides the step's own
(the transaction's); a peer that fails locally, refuses its input on the device,
announces sizes its payload cannot have, or whose payload no longer fits the layout, makes
every rank raise and leaves every rank's error feedback as it was.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradcomp.collectives import _shared, allreduce_fused
from gradcomp.compress import ErrorFeedback, get_compressor

from ranks import run_ranks
from syncs import HostSyncs

SHAPES = [(64, 33), (0,), (7,), (4096,)]


def _items(rank: int, step: int, codecs):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tensors = [torch.randn(s, generator=g) for s in SHAPES]
    if step == 2 and rank == 1:
        tensors[2] *= 1e-3  # nothing of it reaches tau on this rank: an empty payload beside full ones
    return [(f"p{i}", t, c) for i, (t, c) in enumerate(zip(tensors, codecs))]


def _codecs():
    return [ErrorFeedback(get_compressor("threshold", tau=1.0)), get_compressor("int8"),
            ErrorFeedback(get_compressor("threshold", tau=0.5)), ErrorFeedback(get_compressor("topk"))]


def _residuals(codecs):
    return {i: {k: v.clone() for k, v in c.state_dict()["state"].items()}
            for i, c in enumerate(codecs) if isinstance(c, ErrorFeedback)}


def _attempt(out, name, call):
    try:
        call()
        out[name] = "returned"
    except (RuntimeError, ValueError) as exc:
        out[name] = str(exc)


def _rank(rank: int, world: int, algorithm):
    out = {}
    checked, agreed = _codecs(), _codecs()
    layouts: dict = {}
    same, reads, sizes = [], [], []
    for step in range(4):
        a = allreduce_fused(_items(rank, step, checked), algorithm=algorithm)
        with HostSyncs() as syncs:
            b = allreduce_fused(_items(rank, step, agreed), algorithm=algorithm, layouts=layouts)
        reads.append(dict(syncs.sites))
        same.append(all(torch.equal(x, y) for x, y in zip(a, b)))
        sizes.append([c.base.compress(t, key="probe").tensors[0].numel()
                      for _, t, c in _items(rank, step, _codecs()) if t.numel()])
    out.update(same=same, layouts=len(layouts), reads=reads, sizes=sizes)
    out["sized"] = all(isinstance(v, _shared.SizedLayout) or all(isinstance(x, _shared.SizedLayout) for x in v[0])
                       for v in layouts.values())

    # a peer that fails locally: every rank raises, nobody's residuals change
    before = _residuals(agreed)
    if rank == 1:
        def boom(*args, **kwargs):
            raise RuntimeError("this rank's compressor failed")
        agreed[0].base.compress_residual = agreed[0].base.compress_decoded = agreed[0].base.compress = boom
    _attempt(out, "failure", lambda: allreduce_fused(_items(rank, 9, agreed), algorithm=algorithm, layouts=layouts))
    after = _residuals(agreed)
    out["kept"] = all(torch.equal(before[i][k], after[i][k]) for i in before for k in before[i])

    # a refusal found on the device (qsgd: a norm beyond float32, rank 1) beside a variable-size payload
    refusing, layouts3 = [get_compressor("qsgd"), ErrorFeedback(get_compressor("threshold", tau=1.0))], {}

    def refusal_items(step):
        huge = torch.ones(1000)
        if step and rank == 1:
            huge[:2] = 3e38
        return [("q", huge, refusing[0]), ("t", torch.randn(300, generator=torch.Generator().manual_seed(rank)),
                                            refusing[1])]
    allreduce_fused(refusal_items(0), algorithm=algorithm, layouts=layouts3)
    before = _residuals(refusing)
    _attempt(out, "refused", lambda: allreduce_fused(refusal_items(1), algorithm=algorithm, layouts=layouts3))
    after = _residuals(refusing)
    out["refused_kept"] = all(torch.equal(before[i][k], after[i][k]) for i in before for k in before[i])

    # sizes that the payload cannot have (more values than elements), announced by rank 0
    fresh, layouts4 = _codecs(), {}
    allreduce_fused(_items(rank, 0, fresh), algorithm=algorithm, layouts=layouts4)
    if rank == 0:
        lay = next(iter(layouts4.values()))
        lay = lay if isinstance(lay, _shared.SizedLayout) else lay[0][1]  # scatter-reduce: the chunks for rank 1
        honest = lay.dims
        lay.dims = lambda payloads: [d + 10_000 if i == 0 else d for i, d in enumerate(honest(payloads))]
    _attempt(out, "corrupt", lambda: allreduce_fused(_items(rank, 1, fresh), algorithm=algorithm, layouts=layouts4))

    # a payload that no longer fits the layout (its meta changed on rank 0): every rank raises
    fresh, layouts2 = _codecs(), {}
    allreduce_fused(_items(rank, 0, fresh), algorithm=algorithm, layouts=layouts2)
    if rank == 0:
        base = fresh[2].base
        original = base.compress_residual

        def other_meta(*args, **kwargs):
            p = original(*args, **kwargs)
            p.meta = {**p.meta, "another": 1}
            return p
        base.compress_residual = other_meta
        base.compress = lambda *a, **k: other_meta(*a, **k)
    _attempt(out, "changed", lambda: allreduce_fused(_items(rank, 1, fresh), algorithm=algorithm, layouts=layouts2))
    dist.barrier()
    return out


@pytest.mark.parametrize("world,algorithm", [(2, None), (4, None), (4, "allgather")])
def test_agreed_variable_sizes(tmp_path, world, algorithm):
    results = run_ranks(_rank, world, tmp_path, algorithm)
    reads = 1 if world == 2 or algorithm == "allgather" else 2  # scatter-reduce: its two phases' sizes
    assert results[0]["sizes"] != results[1]["sizes"], "the ranks' payload sizes should differ"
    assert 0 in results[1]["sizes"][2], results[1]["sizes"]
    for rank, r in enumerate(results):
        assert r["same"] == [True] * 4, f"rank {rank}: the agreed path changed the bits: {r['same']}"
        assert r["layouts"] == 1 and r["sized"]
        assert any("_header.py" in s for s in r["reads"][0]), r["reads"][0]
        for step, sites in enumerate(r["reads"][1:], start=1):
            ours = {s: n for s, n in sites.items() if "collectives/" in s or "transaction.py" in s}
            # the sizes' reads in the collectives, the transaction's read of the step's flags
            assert sum(n for s, n in ours.items() if "collectives/_shared.py" in s) == reads, (rank, step, sites)
            assert [n for s, n in ours.items() if "transaction.py" in s] == [1] and len(ours) == 2, ours
        assert r["kept"], f"rank {rank}: a failed step changed the error feedback"
        assert r["refused_kept"], f"rank {rank}: a refused step changed the error feedback"
        if rank != 1:
            assert "rank(s) [1] failed to compress" in r["failure"], (rank, r["failure"])
            assert "rank(s) [1] failed to compress" in r["refused"], (rank, r["refused"])
        assert "announced payload sizes" in r["corrupt"] and "rank 0" in r["corrupt"], (rank, r["corrupt"])
        assert "no longer fit the layout" in r["changed"] and "[0]" in r["changed"], (rank, r["changed"])
    assert "this rank's compressor failed" in results[1]["failure"]
    assert "float32 range" in results[1]["refused"], results[1]["refused"]
