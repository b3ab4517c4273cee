"""Agreed layouts of variable-size payloads (threshold's ``[values, indices]``): after a set's
first, checked exchange, every rank's sizes travel in one small all-gather, read at once, and
the payloads in one all-gather padded to the largest rank's bytes, with no header. Those sizes
set a capacity per payload (under error feedback): the next ``REAGREE`` exchanges send payloads
of exactly that size as fixed-size ones, nothing read, and then one sized exchange sets new
capacities.

Runs on 2 ranks (allgather, the default there) and on 4 (scatter-reduce, the default there,
and allgather named) check: the same bits as the checked path at every step, sized and bounded
alike, payloads of different sizes on each rank and an empty one among them; one host read in
the collectives per exchange phase of a sized exchange (the sizes: one for allgather, two for
scatter-reduce) and none in a bounded one, besides the step's own (the transaction's); a
payload that outgrows its capacity keeps what it could not send in the residual (no gradient
mass lost) and the next sized exchange raises the capacity; threshold without error feedback
stays sized; payloads empty on every rank decode to zeros; a peer that fails locally, refuses its input on the device, announces sizes its
payload cannot have, or whose payload no longer fits the layout, makes every rank raise and
leaves every rank's error feedback as it was.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradcomp.collectives import allreduce_fused
from gradcomp.collectives.wire import bounds, layouts as wire_layouts
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


def _server_residuals(codec):
    from gradcomp.collectives.scatter_reduce import server_feedback
    return {k: v.clone().reshape(-1) for k, v in server_feedback(codec).state_dict()["state"].items()}


def _attempt(out, name, call):
    try:
        call()
        out[name] = "returned"
    except (RuntimeError, ValueError) as exc:
        out[name] = str(exc)


STEPS = 6  # checked, sized, three bounded (REAGREE patched to 3), sized again
MODES = ["checked", "sized", "bounded", "bounded", "bounded", "sized"]


def _entry(layouts: dict):
    (entry,) = layouts.values()
    return entry


def _rank(rank: int, world: int, algorithm):
    bounds.REAGREE = 3
    out = {}
    checked, agreed = _codecs(), _codecs()
    layouts: dict = {}
    same, reads, sizes, caps = [], [], [], []
    for step in range(STEPS):
        a = allreduce_fused(_items(rank, step, checked), algorithm=algorithm)
        with HostSyncs() as syncs:
            b = allreduce_fused(_items(rank, step, agreed), algorithm=algorithm, layouts=layouts)
        reads.append(dict(syncs.sites))
        same.append(all(torch.equal(x, y) for x, y in zip(a, b)))
        sizes.append([c.base.compress(t, key="probe").tensors[0].numel()
                      for _, t, c in _items(rank, step, _codecs()) if t.numel()])
        caps.append(dict(_entry(layouts).caps or {}))
    out.update(same=same, layouts=len(layouts), reads=reads, sizes=sizes, caps=caps)
    out["bounds"] = all(isinstance(v, bounds.Bounds) and v.bounded for v in layouts.values())

    # a payload that outgrows its capacity: what did not fit stays in the residual
    grow, layouts5 = [ErrorFeedback(get_compressor("threshold", tau=1.0))], {}

    def grow_items(step):
        t = torch.randn(2000, generator=torch.Generator().manual_seed(10 * step + rank))
        return [("g", t * (20.0 if step == 2 else 1.0), grow[0])]  # step 2: nearly every element above tau
    for step in range(2):
        allreduce_fused(grow_items(step), algorithm=algorithm, layouts=layouts5)
    cap = dict(_entry(layouts5).caps)

    def left_behind():  # the residual, and scatter-reduce's server-side residual of this rank's chunk (of the mean)
        kept = sum(_residuals(grow)[0].values()).double()
        for key, v in _server_residuals(grow[0]).items():
            kept[2000 * rank // world:2000 * (rank + 1) // world] += world * v.double()
        return kept
    before = left_behind()
    (got,) = allreduce_fused(grow_items(2), algorithm=algorithm, layouts=layouts5)
    # sum over ranks of what went in (gradient + what was left behind) = world x mean + what is left behind now
    total_in, total_left = grow_items(2)[0][1].double() + before, left_behind()
    dist.all_reduce(total_in)
    dist.all_reduce(total_left)
    out["kept_mass"] = float((total_in - world * got.double() - total_left).abs().max())
    above = grow_items(2)[0][1].abs() >= 1.0
    chunks = {"g": above} if "g" in cap else {f"g/chunk{j}": c for j, c in enumerate(above.tensor_split(world))}
    out["overflowed"] = all(int(c.sum()) > cap[k] for k, c in chunks.items())
    for _ in range(2):  # the period's last bounded exchanges
        allreduce_fused(grow_items(3), algorithm=algorithm, layouts=layouts5)
    allreduce_fused(grow_items(2), algorithm=algorithm, layouts=layouts5)  # sized: new capacities
    out["grown"] = [cap, dict(_entry(layouts5).caps)]

    # threshold without error feedback: what does not fit would be lost, so it stays sized
    plain, layouts6 = [get_compressor("threshold", tau=1.0)], {}
    plain_reads = []
    for step in range(4):
        t = torch.randn(500, generator=torch.Generator().manual_seed(step + 7 * rank))
        with HostSyncs() as syncs:
            allreduce_fused([("t", t, plain[0])], algorithm=algorithm, layouts=layouts6)
        plain_reads.append(sum(n for s, n in syncs.sites.items() if "collectives/wire/layouts.py" in s))
    out["plain"] = [_entry(layouts6).bounded, plain_reads]

    # every payload empty on every rank (nothing reaches tau): the agreed exchanges carry no
    # payload bytes (rows of a (world, 0) buffer) and decode to zeros, in every dtype; sized
    # (a set with a plain threshold stays sized) and bounded (under error feedback)
    out["quiet"] = []
    for codecs in ([ErrorFeedback(get_compressor("threshold", tau=1e3)) for _ in range(3)],
                   [ErrorFeedback(get_compressor("threshold", tau=1e3)) for _ in range(2)]
                   + [get_compressor("threshold", tau=1e3)]):
        layouts7: dict = {}
        for step in range(5):
            quiet = [("a", torch.full((300,), 1e-3 * (rank + 1)), codecs[0]),
                     ("b", torch.full((7,), -1e-3, dtype=torch.bfloat16), codecs[1]),
                     ("c", torch.full((5, 3), 1e-2, dtype=torch.float16), codecs[2])]
            got = allreduce_fused(quiet, algorithm=algorithm, layouts=layouts7)
            out["quiet"].append([(tuple(g.shape), g.dtype, bool(g.eq(0).all())) for g in got])

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
        lay = _entry(layouts4).sized
        lay = lay if isinstance(lay, wire_layouts.SizedLayout) else lay[0][1]  # scatter-reduce: the chunks for rank 1
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
        assert r["same"] == [True] * STEPS, f"rank {rank}: the agreed path changed the bits: {r['same']}"
        assert r["layouts"] == 1 and r["bounds"]
        assert any("wire/header.py" in s for s in r["reads"][0]), r["reads"][0]
        for step, sites in enumerate(r["reads"][1:], start=1):
            ours = {s: n for s, n in sites.items() if "collectives/" in s or "transaction.py" in s}
            # the sizes' reads in the collectives (none when bounded), the transaction's read of the step's flags
            want = reads if MODES[step] == "sized" else 0
            assert sum(n for s, n in ours.items() if "collectives/wire/layouts.py" in s) == want, (rank, step, sites)
            assert [n for s, n in ours.items() if "transaction.py" in s] == [1] and len(ours) == 1 + bool(want), ours
        # capacities: every threshold payload's (the int8 and top-k ones are fixed), the same on every rank
        assert r["caps"][0] == {} and r["caps"][1] and r["caps"][1] == results[0]["caps"][1], r["caps"]
        assert r["caps"][5] == results[0]["caps"][5]
        if world == 2 or algorithm == "allgather":
            assert set(r["caps"][1]) == {"p0", "p2"}, r["caps"][1]
            # the largest count seen plus half of it (at least 64 more), at most the tensor's size
            assert r["caps"][1]["p2"] == 7 and 64 < r["caps"][1]["p0"] < 64 * 33, r["caps"][1]
        # fp32 rounding of values up to ~80 (the sums and the mean), not elements of magnitude >= 20 left out
        assert r["kept_mass"] < 1e-3, f"rank {rank}: gradient mass lost where a payload outgrew its capacity"
        assert r["overflowed"], "the growth step should have overflowed the capacity"
        cap_before, cap_after = r["grown"]
        assert all(cap_after[k] > cap_before[k] for k in cap_before), r["grown"]
        assert r["plain"][0] is False and r["plain"][1][1:] == [reads] * 3, r["plain"]
        assert r["kept"], f"rank {rank}: a failed step changed the error feedback"
        assert r["refused_kept"], f"rank {rank}: a refused step changed the error feedback"
        if rank != 1:
            assert "rank(s) [1] failed to compress" in r["failure"], (rank, r["failure"])
            assert "rank(s) [1] failed to compress" in r["refused"], (rank, r["refused"])
        assert "announced payload sizes" in r["corrupt"] and "rank 0" in r["corrupt"], (rank, r["corrupt"])
        assert "no longer fit the layout" in r["changed"] and "[0]" in r["changed"], (rank, r["changed"])
    assert "this rank's compressor failed" in results[1]["failure"]
    want = [((300,), torch.float32, True), ((7,), torch.bfloat16, True), ((5, 3), torch.float16, True)]
    assert all(r["quiet"] == [want] * 10 for r in results), results[0]["quiet"]
    assert "float32 range" in results[1]["refused"], results[1]["refused"]
