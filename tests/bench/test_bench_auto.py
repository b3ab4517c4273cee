"""The main job's ``auto`` row measures what it names: on 2 real gloo ranks, its bytes and
rel.err are those of the methods it chose, never of a residual its trial or check calls left.

One spawn runs both cases: a switch forced into the call that used to be the first measured
one (topk chosen on a slow link, then dense once the link is fast), and the benchmark's own
loopback run of ``auto`` beside the fixed methods it may choose from.
"""
import functools
import math

import pytest
import torch

from gradcomp.bench import collective
from ranks import run_ranks

NUMEL = 128 * 128
HEADER = 256  # bytes: one self-describing frame's header, far below what tells two methods apart


def _forced_switch(rank, world):
    """topk decided at iteration 3 (a 1 Mbit/s link), the link made fast before iteration 5's
    re-decision (recheck_every=4): dense from then on, owing topk's residual to the gradient."""
    from gradcomp.training.auto import Link

    layout = [[("grad", collective.matrix_shape(NUMEL))]]
    spec = {"label": "auto", "kind": "auto", "ef": True,
            "options": {"candidates": ["dense", "topk"], "link": Link.of(0.05, 0.001), "recheck_every": 4}}
    run = collective._method(spec, world, layout, None, False)
    auto = run.auto
    seen = [0]

    @functools.wraps(run)  # keeps the benchmark's attributes (set-up calls, settling, what is owed)
    def switching(bufs):
        if seen[0] == 4:
            auto.set_link(Link.of(0.05, 1e4))
        seen[0] += 1
        return run(bufs)

    flat = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
    exact = flat.clone()
    torch.distributed.all_reduce(exact)
    exact.div_(world)
    res = collective._time_calls(switching, flat, lambda t: [t], exact, 1, 2, lambda: None)
    return {"rel_error": res["rel_error"], "bytes": [st["bytes"] for st in res["stats"]],
            "choices": res["stats"][-1]["auto"], "history": [(h["from"], h["to"]) for h in auto.history]}


def _bench_rows(rank, world):
    auto = {"label": "auto", "kind": "auto", "ef": True, "options": {"candidates": ["dense", "fp16", "topk"]}}
    cfg = {"numel": NUMEL, "model": None, "methods": [auto, *collective.parse_methods("fp16,topk", "auto")],
           "algorithm": None, "repeats": 3, "warmup": 1, "seed": 0}
    return collective.run_rank(rank, world, cfg, lambda **kw: None)


def _both(rank, world):
    return _forced_switch(rank, world), _bench_rows(rank, world)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_both, 2, tmp_path_factory.mktemp("auto"), timeout_s=300.0)


def test_a_switch_in_the_set_up_calls_leaves_the_measured_call_alone(results):
    forced = results[0][0]
    assert forced["history"] == [(None, "topk"), ("topk", "dense")], forced["history"]
    assert forced["choices"] == "dense x1"
    assert forced["bytes"] == [4 * NUMEL] * 2  # a 2-rank ring sends the tensor's bytes: dense's
    # the error is dense's own (none), not the topk residual flushed into the call
    assert forced["rel_error"] < 1e-6, forced["rel_error"]


def test_the_auto_row_has_the_bytes_and_error_of_what_it_chose(results):
    records = results[0][1]
    by = {r["compressor"]: r for r in records}
    auto = next(r for r in records if r["method"] == "auto")
    assert auto["auto_settled"] and auto["auto_changed_while_timed"] == 0
    chosen = auto["auto_choices"]
    label = {"dense x1": "dense", "fp16 x1": "fp16", "topk x1": "topk+ef"}[chosen]
    # auto's exchange runs on the runtime's agreed layouts, the fixed row through allreduce(), whose
    # frame may add a header: the payloads are the same, so the two agree to within one header's bytes
    # (dense and fp16, the nearest two, differ by half the tensor)
    assert abs(auto["bytes_per_rank"] - by[label]["bytes_per_rank"]) <= HEADER, (chosen, auto["bytes_per_rank"])
    assert auto["rel_error"] == pytest.approx(by[label]["rel_error"], rel=0.1, abs=1e-6), (chosen, auto["rel_error"])
    for r in records:  # every row carries its spread, and its speed-up is against dense calls made beside it
        assert r["collective_ms_span"][0] <= r["collective_ms"] <= r["collective_ms_span"][1]
        assert r["speedup"] == pytest.approx(r["dense_ms"] / r["collective_ms"])
        assert r["vs_dense"] in (("baseline",) if r["method"] == "dense" else ("faster", "slower", "tie"))
        assert math.isfinite(r["speedup_span"][0])
    assert len(by["dense"]["collective_ms_repeats"]) == 3 * len(records)  # its own calls and every paired one
