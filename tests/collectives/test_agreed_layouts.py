"""Agreed layouts (``allreduce_fused(..., layouts=)``, what the training runtime passes): after a
set's first, checked exchange, fixed-size payloads travel as raw tensors with no header.

One run on 2 ranks (allgather) and one on 4 (scatter-reduce) check: the same bits as the checked path at every step; no host read in the
collectives once the layout is agreed (the step's one read is the transaction's); a peer that
fails locally, refuses its input on the device (no read back: its status word says it), or whose
payloads no longer fit the layout, makes every rank raise and leaves every rank's error feedback
as it was.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradcomp.collectives import allreduce_fused
from gradcomp.compress import ErrorFeedback, get_compressor

from ranks import run_ranks
from syncs import HostSyncs

SHAPES = [(64, 33), (0,), (7,), (4096,)]  # an empty one and an odd size among them


def _items(rank: int, step: int, codecs):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [(f"p{i}", torch.randn(s, generator=g), c) for i, (s, c) in enumerate(zip(SHAPES, codecs))]


def _codecs():
    return [ErrorFeedback(get_compressor("onebit")), get_compressor("int8"), ErrorFeedback(get_compressor("topk")),
            get_compressor("signsgd")]


def _residuals(codecs):
    return {i: {k: v.clone() for k, v in c.state_dict()["state"].items()}
            for i, c in enumerate(codecs) if isinstance(c, ErrorFeedback)}


def _raise_on_call(codec):
    def boom(*args, **kwargs):
        raise RuntimeError("this rank's compressor failed")
    for name in ("compress", "compress_decoded", "compress_residual"):
        setattr(codec.base, name, boom)


def _rank(rank: int, world: int):
    out = {}
    checked, agreed = _codecs(), _codecs()
    layouts: dict = {}
    same, reads = [], []
    for step in range(4):
        a = allreduce_fused(_items(rank, step, checked))
        with HostSyncs() as syncs:
            b = allreduce_fused(_items(rank, step, agreed), layouts=layouts)
        reads.append(dict(syncs.sites))
        same.append(all(torch.equal(x, y) for x, y in zip(a, b)))
    out["same"] = same
    out["layouts"] = len(layouts)
    out["reads"] = reads

    # a peer that fails locally: every rank raises, nobody's residuals change
    before = _residuals(agreed)
    if rank == 1:
        _raise_on_call(agreed[0])
    try:
        allreduce_fused(_items(rank, 9, agreed), layouts=layouts)
        out["failure"] = "returned"
    except (RuntimeError, ValueError) as exc:
        out["failure"] = str(exc)
    after = _residuals(agreed)
    out["kept"] = all(torch.equal(before[i][k], after[i][k]) for i in before for k in before[i])

    # a refusal found on the device (qsgd: a bucket's norm beyond float32, on rank 1): nothing
    # read back for it, every rank raises through rank 1's status word, rank 1 says which
    refusing, layouts3 = [get_compressor("qsgd"), ErrorFeedback(get_compressor("onebit"))], {}

    def refusal_items(step):
        huge = torch.ones(1000)
        if step and rank == 1:
            huge[:2] = 3e38
        return [("q", huge, refusing[0]), ("e", torch.randn(300, generator=torch.Generator().manual_seed(rank)),
                                            refusing[1])]
    allreduce_fused(refusal_items(0), layouts=layouts3)
    before = _residuals(refusing)
    with HostSyncs() as syncs:
        try:
            allreduce_fused(refusal_items(1), layouts=layouts3)
            out["refused"] = "returned"
        except ValueError as exc:
            out["refused"] = str(exc)
    out["refused_reads"] = dict(syncs.sites)
    after = _residuals(refusing)
    out["refused_kept"] = all(torch.equal(before[i][k], after[i][k]) for i in before for k in before[i])

    # payloads that no longer fit the layout (their meta changed on rank 0): every rank raises
    fresh, layouts2 = _codecs(), {}
    allreduce_fused(_items(rank, 0, fresh), layouts=layouts2)
    if rank == 0:
        base = fresh[3]  # signsgd, of the (4096,) tensor
        original = base.compress

        def other_meta(*args, **kwargs):
            p = original(*args, **kwargs)
            p.meta = {**p.meta, "another": 1}
            return p
        base.compress = other_meta
    try:
        allreduce_fused(_items(rank, 1, fresh), layouts=layouts2)
        out["changed"] = "returned"
    except ValueError as exc:
        out["changed"] = str(exc)
    dist.barrier()
    return out


@pytest.mark.parametrize("world", [2, 4])  # allgather on two ranks, scatter-reduce on four
def test_agreed_layouts(tmp_path, world):
    results = run_ranks(_rank, world, tmp_path)
    for rank, r in enumerate(results):
        assert r["same"] == [True] * 4, f"rank {rank}: the agreed path changed the bits: {r['same']}"
        assert r["layouts"] == 1
        # step 0 is the checked exchange (header, sizes, parsing); afterwards the collectives
        # read nothing back and the step's one read is the transaction's (the compressors' own
        # reads, top-k's selection, are counted by tests/training/test_host_syncs.py)
        assert any("collectives/" in s for s in r["reads"][0]), r["reads"][0]
        for step, sites in enumerate(r["reads"][1:], start=1):
            ours = {s: n for s, n in sites.items() if "collectives/" in s or "transaction.py" in s}
            assert list(ours.values()) == [1] and "transaction.py" in next(iter(ours)), (rank, step, sites)
        assert r["kept"], f"rank {rank}: a failed step changed the error feedback"
    assert "this rank's compressor failed" in results[1]["failure"]
    for rank, r in enumerate(results):
        if rank != 1:
            assert "rank(s) [1] failed to compress" in r["failure"], (rank, r["failure"])
        assert "no longer fit the layout" in r["changed"] and "[0]" in r["changed"], (rank, r["changed"])
        assert "rank(s) [1] failed to compress" in r["refused"], (rank, r["refused"])
        assert ("float32 range" in r["refused"]) == (rank == 1), (rank, r["refused"])
        assert r["refused_kept"], f"rank {rank}: a refused step changed the error feedback"
        assert [s for s in r["refused_reads"] if "collectives/" in s or "transaction.py" in s] == [
            next(s for s in r["refused_reads"] if "transaction.py" in s)], (rank, r["refused_reads"])
