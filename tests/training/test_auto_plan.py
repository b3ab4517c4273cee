"""``compressor="auto"``'s pure parts, without ranks: the plan (measurements -> a choice per
bucket), the cost model (each collective algorithm's own cost on a link), the link refit and
probe, the one link and spec parsers, and the router's residual moves."""
from __future__ import annotations

import pytest
import torch

from gradcomp.collectives import ALGORITHMS
from gradcomp.training.auto import Link, Option, PlanBucket, make_runtime, parse_candidate, plan
from gradcomp.training.auto import cost
from gradcomp.training.auto.router import Router

OPTIONS = [Option("dense"), Option("int8", light=True), Option("topk", light=False)]
COSTS = {"dense": 50.0, "int8": 30.0, "topk": 10.0}


def _buckets(ready, costs=COSTS, **kw):
    return {(name,): PlanBucket(r, dict(costs), **kw) for name, r in zip("ab", ready)}


def test_plan_overlap():
    """A bucket whose exchange hides behind the rest of backward gets the most faithful method
    that keeps the step's time; the last one, with nothing to hide behind, the fastest."""
    # a: ready at 0 ms, 100 ms of backward after it; b: ready at 100 ms, the last
    assert plan(_buckets([0.0, 100.0]), OPTIONS, 0.1, 0.02) == {("a",): "dense", ("b",): "topk"}
    # nothing to hide behind: both the fastest
    assert plan(_buckets([0.0, 0.0]), OPTIONS, 0.1, 0.02) == {("a",): "topk", ("b",): "topk"}


def test_plan_margin_and_dense_fallback():
    """A compressed method must beat dense by the margin; with no margin, the fastest wins."""
    near = {"dense": 50.0, "int8": 47.0, "topk": 46.0}
    assert set(plan(_buckets([0.0, 0.0], near), OPTIONS, 0.1, 0.02).values()) == {"dense"}
    assert set(plan(_buckets([0.0, 0.0], near), OPTIONS, 0.0, 0.0).values()) == {"topk"}


def test_plan_accordion_failed_and_closed_buckets():
    """Accordion's critical regime takes light methods only; a bucket whose choice failed its
    check takes only methods really measured; a bucket not open keeps its choice."""
    buckets = _buckets([0.0, 0.0])
    buckets[("b",)].critical = True
    assert plan(buckets, OPTIONS, 0.1, 0.02) == {("a",): "topk", ("b",): "int8"}
    buckets = _buckets([0.0, 0.0])
    buckets[("b",)].failed, buckets[("b",)].measured = True, frozenset({"dense", "int8"})
    assert plan(buckets, OPTIONS, 0.1, 0.02)[("b",)] == "int8"
    buckets = _buckets([0.0, 0.0])
    buckets[("a",)].open, buckets[("a",)].choice = False, "int8"
    assert plan(buckets, OPTIONS, 0.1, 0.02) == {("a",): "int8", ("b",): "topk"}


def test_plan_is_the_same_for_the_same_numbers():
    buckets = _buckets([0.0, 40.0])
    assert plan(buckets, OPTIONS, 0.1, 0.02) == plan(_buckets([0.0, 40.0]), OPTIONS, 0.1, 0.02)


def test_refit_from_bandwidth_bound_exchanges_only():
    """The rate is refit from real dense exchanges only where bytes, not latency, set their
    time: a tiny model's small buckets (latency plus the machine's noise) would otherwise make
    a 10 Gbit/s link look like a few Mbit/s."""
    probe = Link(0.05, 1.25e6)  # 50 us per message, 10 Gbit/s
    assert cost.refit(probe, [(4e3, 0.5)], 2) == probe  # 0.5 ms: ten latencies, on a busy machine
    slow = 2.5e5  # bytes per ms: 2 Gbit/s, what an 8 MiB exchange really took
    fit = cost.refit(probe, [(4e3, 0.5), (8 * 2 ** 20, probe.alpha_ms + 8 * 2 ** 20 / slow), (8 * 2 ** 20, -1.0)], 2)
    assert fit.alpha_ms == probe.alpha_ms and fit.rate == pytest.approx(slow)


def test_probe():
    link = cost.probed(0.1, 0.1 + 4 * cost.PROBE_NUMEL / 1e5, 2)  # 2 ranks: each sends the tensor once
    assert link.alpha_ms == 0.1 and link.rate == pytest.approx(1e5)


def test_predict_asks_each_algorithm():
    """dense: native's one allreduce; a candidate: its codec time, its rounds (an allreduce
    each) and its gathered payloads, at the algorithm its codec takes on the world size
    (allgather on two ranks, scatter-reduce on more)."""
    rt = make_runtime("auto", {"candidates": ("dense", "powersgd:rank=2", "topk")})
    cands = rt.policy.candidates
    link = Link(0.5, 1e4)
    # per candidate: codec ms, bytes over its rounds, rounds, gathered bytes (dense: unused)
    row = [0.0, 1.0, 1.0, -1.0] + [0, 0, 0, 0] + [2.0, 3e3, 2, 0.0] + [1.0, 400.0, 1, 5e3]
    for world, gather in ((2, "allgather"), (4, "scatter-reduce")):
        out = cost.predict(link, world, cands, 1e6, row, {}, {}, True)
        ring = 2 * (world - 1) / world
        assert out["dense"] == pytest.approx(0.5 + ring * 1e6 / 1e4)
        assert out["dense"] == ALGORITHMS["native"].wire(1e6, world).ms(link)
        assert out["powersgd:rank=2"] == pytest.approx(2.0 + 2 * 0.5 + ring * 3e3 / 1e4)
        assert out["topk"] == pytest.approx(1.0 + ALGORITHMS["native"].wire(400.0, world).ms(link)
                                            + ALGORITHMS[gather].wire(5e3, world).ms(link))
    # measured exchanges are believed over the model (a measured link); an untimed candidate
    # keeps its saved prediction, or has none
    untimed = row[:8] + [-1.0, -1.0, -1.0, -1.0] + row[12:]
    out = cost.predict(link, 2, cands, 1e6, untimed, {"topk": 7.0}, {"powersgd:rank=2": 9.0}, True)
    assert out["topk"] == 7.0 and out["powersgd:rank=2"] == 9.0
    assert "powersgd:rank=2" not in cost.predict(link, 2, cands, 1e6, untimed, {}, {}, False)


def test_link_and_rate_parsers():
    assert Link.parse("1gbit") == Link.of(0.0, 1) and Link.parse("100mbit,5ms") == Link.of(5.0, 0.1)
    assert Link.parse("2.5Gbit, 250us").rate_bit == 2_500_000_000
    assert str(Link.of(0.0, 10)) == "10 Gbit/s" and Link.of(0.05, 10).ms(1.25e6, 2) == pytest.approx(1.1)
    for bad in ("1gb", "fast", "1gbit,5", "1gbit,5ms,1%", ""):
        with pytest.raises(ValueError, match="link"):
            Link.parse(bad)
    from gradcomp.bench import netem, projection

    assert netem.Link is Link and projection.parse_links("100mbit, 25gbit") == [10**8, 25 * 10**9]


def test_candidates_use_the_one_spec_parser():
    from gradcomp.compress import parse_spec

    assert parse_candidate("powersgd:rank=4") == ("powersgd:rank=4", "powersgd", {"rank": 4})
    assert parse_spec("topk : ratio=0.01:name=x") == ("topk", {"ratio": 0.01, "name": "x"})
    with pytest.raises(ValueError, match="auto: candidate: option 'rank' .* name=value"):
        parse_candidate("powersgd:rank")


def test_router_moves_what_is_owed():
    """A bucket leaving top-k: each parameter's residual moves into the new method's error
    feedback (int8), or into a carry for the next gradient (dense); what is owed is unchanged."""
    rt = make_runtime("auto", {"candidates": ("dense", "int8", "topk"), "min_numel": 0})
    router = Router(rt.policy)
    names, metas = ["w"], [torch.empty(4, 8, device="meta")]
    topk = rt.policy.by_label["topk"].codec
    residual = torch.arange(32, dtype=torch.float32).view(4, 8)
    topk.update("w", residual.clone(), torch.zeros(4, 8))
    before = router.owed("w", (4, 8)).clone()
    assert torch.equal(before, residual.double())
    assert router.switch(names, metas, 0, "topk", "int8") == 1
    assert torch.equal(router.owed("w", (4, 8)), before) and not router.carry
    assert torch.equal(rt.policy.by_label["int8"].codec.residual("w").view(4, 8), residual)
    assert router.switch(names, metas, 0, "int8", "dense") == 1
    assert torch.equal(router.owed("w", (4, 8)), before) and torch.equal(router.carry["w"].view(4, 8), residual)
    grad = torch.ones(4, 8)
    router.add_carry([("w", grad, None)])
    assert torch.equal(grad, residual + 1) and not router.carry
