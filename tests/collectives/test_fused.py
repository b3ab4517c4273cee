"""``allreduce_fused`` on 2, 3 and 4 real gloo ranks (one spawn per world size runs every check).

Invariants protected:

- each tensor's result, over several steps, is the same bits as ``allreduce(...,
  algorithm=A)`` of that tensor alone with its own key (so error feedback, server-side
  residuals and compressor state per key evolve the same), on every rank, for every
  single-round compressor; A is what the fused call chooses by default (allgather on 2 ranks,
  scatter-reduce on more), and scatter-reduce when asked for on 2 ranks;
  with and without error feedback, fixed-size and variable-size payloads, mixed compressors,
  dtypes and empty tensors in one call; async equals sync;
- the whole set costs one recorded call, and fewer bytes than the per-tensor calls (headers
  and length prefixes shared);
- mismatched layouts (shapes, dtypes, count), compressors or keys, or a rejected input raise
  ValueError on every rank, and the group stays usable; multi-round compressors are refused before sending.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from ranks import run_ranks
from gradcomp.compress import ErrorFeedback, available_compressors, get_compressor

NAMES = [n for n in available_compressors() if not get_compressor(n).multi_round]
SHAPES = [("w1", (33, 17), torch.float32), ("b1", (0,), torch.float32), ("w2", (7, 3), torch.float16),
          ("w3", (40,), torch.float64)]
STEPS = 3


def _data(tag: str, rank: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(tag.encode()) + 7919 * rank)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _codec(name: str, ef: bool):
    c = get_compressor(name)
    return ErrorFeedback(c) if ef else c


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _default(world):
    return "allgather" if world <= 2 else "scatter-reduce"


def _compare(rank, world):
    """{(name, ef, algorithm): [(fused results, per-tensor results) per step]} plus one
    mixed-compressor run."""
    from gradcomp.collectives import allreduce, allreduce_fused

    out = {}
    algos = [None] + (["scatter-reduce"] if world == 2 else [])  # None: the fused call's own choice
    cases = [((n, ef, a), [n] * len(SHAPES)) for n in NAMES for ef in (False, True) for a in algos]
    cases.append((("mixed", True, None), ["topk", "threshold", "onebit", "fp16"]))
    for case, names in cases:
        fused = [_codec(n, case[1]) for n in names]
        single = [_codec(n, case[1]) for n in names]
        algo = case[2]
        steps = []
        for step in range(STEPS):
            ts = [_data(f"{case}/{k}/{step}", rank, s, d) for k, s, d in SHAPES]
            before = [t.clone() for t in ts]
            got = allreduce_fused([(k, t, c) for (k, _, _), t, c in zip(SHAPES, ts, fused)], algorithm=algo)
            want = [allreduce(t, c, key=k, algorithm=algo or _default(world))
                    for (k, _, _), t, c in zip(SHAPES, ts, single)]
            assert all(torch.equal(t, b) for t, b in zip(ts, before)), "input written to"
            steps.append((got, want))
        out[case] = steps
    ts = [_data(f"async/{k}", rank, s, d) for k, s, d in SHAPES]
    c1, c2 = _codec("qsgd", True), _codec("qsgd", True)
    out["async"] = (allreduce_fused([(k, t, c1) for (k, _, _), t in zip(SHAPES, ts)], async_op=True).wait(),
                    allreduce_fused([(k, t, c2) for (k, _, _), t in zip(SHAPES, ts)]))
    return out


def _telemetry(rank, world):
    from gradcomp.collectives import allreduce, allreduce_fused, reset_telemetry, telemetry

    op = f"allreduce/{_default(world)}"
    ts = [_data(f"bytes/{k}", rank, s, torch.float32) for k, s in (("a", (300,)), ("b", (50, 4)), ("c", (9,)))]
    reset_telemetry()
    allreduce_fused([(f"k{i}", t, "onebit") for i, t in enumerate(ts)])
    fused = telemetry()["by_op"][op]
    reset_telemetry()
    for i, t in enumerate(ts):
        allreduce(t, "onebit", key=f"k{i}", algorithm=_default(world))
    return fused, telemetry()["by_op"][op]


def _mismatches(rank):
    from gradcomp.collectives import allreduce_fused

    one = [("a", torch.ones(4), "topk"), ("b", torch.ones(6), "topk")]
    cases = {
        "layout": [("a", torch.ones(4), "topk"), ("b", torch.ones(6 + rank), "topk")],
        "count": one[:1 + rank],
        "compressor": [("a", torch.ones(4), "topk"), ("b", torch.ones(6), "onebit" if rank else "topk")],
        "key": [("a", torch.ones(4), "topk"), (f"b{rank}", torch.ones(6), "topk")],
        "dtype": [("a", torch.ones(4), "topk"),
                  ("b", torch.ones(6, dtype=torch.float64) if rank else torch.ones(6), "topk")],
        "rejected": [("a", torch.ones(4), "topk"), ("b", torch.ones(6, dtype=torch.int64), "topk")],
        # a compressor that refuses its input halfway through the local work (rank 0 only)
        "refused": [("a", torch.ones(4), "topk"),
                    ("b", torch.full((6,), 1e300 if rank == 0 else 1.0, dtype=torch.float64), "int8")],
    }
    out = {}
    for what, items in cases.items():
        try:
            allreduce_fused(items)
            out[what] = "no error"
        except ValueError as exc:
            out[what] = str(exc)
    for what, call in (("multi-round", lambda: allreduce_fused([("p", torch.ones(4, 4), "powersgd")])),
                       ("algorithm", lambda: allreduce_fused([("p", torch.ones(4), "topk")], algorithm="native"))):
        try:
            call()
            out[what] = "no error"
        except ValueError as exc:
            out[what] = str(exc)
    out["after"] = allreduce_fused([("after", torch.full((3,), float(rank)), "none")])[0]
    return out


def _wrappers(rank, world):
    """EF21 and DGC momentum (the hook's other error_feedback choices), fused against one call
    each: {label: [bit-identical per step]}."""
    from gradcomp.collectives import allreduce, allreduce_fused
    from gradcomp.compress import EF21, DGCMomentum

    out = {}
    for label, wrap in (("ef21+topk", lambda: EF21(get_compressor("topk"))),
                        ("ef21+onebit", lambda: EF21(get_compressor("onebit"))),
                        ("dgc+topk", lambda: DGCMomentum(get_compressor("topk")))):
        fused, single = [wrap() for _ in SHAPES], [wrap() for _ in SHAPES]
        out[label] = []
        for step in range(STEPS):
            ts = [_data(f"{label}/{k}/{step}", rank, s, d) for k, s, d in SHAPES]
            got = allreduce_fused([(k, t, c) for (k, _, _), t, c in zip(SHAPES, ts, fused)])
            want = [allreduce(t, c, key=k, algorithm=_default(world)) for (k, _, _), t, c in zip(SHAPES, ts, single)]
            out[label].append(all(torch.equal(_bits(g), _bits(x)) for g, x in zip(got, want)))
    return out


def _rank_main(rank, w):
    torch.manual_seed(99 + rank)  # compressors must not depend on it
    return {"compare": _compare(rank, w), "telemetry": _telemetry(rank, w), "mismatch": _mismatches(rank),
            "wrappers": _wrappers(rank, w)}


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"{w}ranks")
def runs(request, tmp_path_factory):
    return run_ranks(_rank_main, request.param, tmp_path_factory.mktemp("fused"), timeout_s=240)


def test_fused_equals_per_tensor_calls_bit_for_bit_on_every_rank(runs):
    for case, steps in runs[0]["compare"].items():
        if case == "async":
            continue
        for step, (got, want) in enumerate(steps):
            for (key, shape, dtype), g, x in zip(SHAPES, got, want):
                assert g.shape == torch.Size(shape) and g.dtype == dtype, (case, key)
                assert torch.equal(_bits(g), _bits(x)), (case, step, key)
                for other in runs[1:]:
                    assert torch.equal(_bits(g), _bits(other["compare"][case][step][0][SHAPES.index((key, shape, dtype))]))
    for r in runs:
        a, s = r["compare"]["async"]
        assert all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a, s))


def test_ef21_and_dgc_wrappers_fused_equal_one_call_each(runs):
    for r in runs:
        for label, steps in r["wrappers"].items():
            assert all(steps), (label, steps)


def test_one_call_and_fewer_bytes_than_per_tensor(runs):
    for r in runs:
        fused, single = r["telemetry"]
        assert fused["calls"] == 1 and single["calls"] == 3
        assert fused["payload_bytes"] == single["payload_bytes"] > 0
        assert fused["dense_bytes"] == single["dense_bytes"] == 4 * (300 + 200 + 9)
        assert fused["payload_bytes"] < fused["bytes_sent"] < single["bytes_sent"]


def test_mismatch_raises_on_every_rank_and_says_so(runs):
    expect = {"layout": "different tensors", "count": "different tensors", "dtype": "different tensors",
              "compressor": "compressor", "key": "keys", "rejected": "int64", "multi-round": "several rounds",
              "algorithm": "unknown algorithm 'native'"}
    for rank, r in enumerate(runs):
        for what, word in expect.items():
            assert word in r["mismatch"][what], (what, r["mismatch"][what])
        assert ("float32 range" if rank == 0 else "rank(s) [0] rejected") in r["mismatch"]["refused"]
        assert torch.equal(r["mismatch"]["after"], torch.full((3,), (len(runs) - 1) / 2))


def _mixed_calls(rank, world):
    from gradcomp.collectives import allreduce, allreduce_fused

    out = {}
    try:  # rank 0 in allreduce, rank 1 in allreduce_fused of the same tensor under the same key
        if rank == 0:
            allreduce(torch.ones(100), "topk", key="m")
        else:
            allreduce_fused([("m", torch.ones(100), "topk")])
        out["mixed"] = "no error"
    except ValueError as exc:
        out["mixed"] = str(exc)
    out["after"] = allreduce(torch.full((3,), float(rank)), "none", key="after")
    return out


def test_allreduce_beside_allreduce_fused_is_named_on_every_rank(tmp_path):
    for r in run_ranks(_mixed_calls, 2, tmp_path):
        assert "different collectives (rank 0: allreduce, rank 1: allreduce_fused)" in r["mixed"], r["mixed"]
        assert torch.equal(r["after"], torch.full((3,), 0.5))
