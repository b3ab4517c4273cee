"""The guarantees of the compressed collectives, on 2 and 4 real gloo ranks.

One spawn of ranks per world size runs every check (a spawn costs seconds); each rank returns
what it saw and the parent asserts. Invariants protected:

- every rank ends with the same bits, for every compressor, algorithm and error feedback;
- ``allgather`` and ``scatter-reduce`` equal an independent replay of their algorithm in the
  parent, bit for bit; ``native`` and ``rounds`` equal the replay within float rounding
  (the backend's summation order is its own); ``none`` equals a dense ``all_reduce`` mean;
- the input is never written to; empty, 0-d, odd-sized, fp16, bf16 and fp64 tensors work;
  NaN/Inf reach every rank (or every rank raises);
- a mismatched shape, dtype, compressor or key raises ValueError on every rank, and the group
  stays usable; a dead peer raises CommunicationError within the group timeout;
- measured bytes per rank: scatter-reduce bounded as ranks grow, allgather grows;
- async calls back to back equal sync calls; bucketing keeps error feedback per name;
  point-to-point and hierarchical paths deliver the same bits everywhere;
- state belongs to the object passed: two callers of one key with different error feedback
  keep independent residuals (server residuals included), and a compressor passed by name
  keeps nothing from one call to the next (a stochastic one is refused by name).
"""
from __future__ import annotations

import os
import time
import zlib

import pytest
import torch

from ranks import run_ranks
from gradcomp.collectives import ALGORITHMS
from gradcomp.compress import ErrorFeedback, available_compressors, get_compressor
from gradcomp.compress.base import work_dtype

NAMES = available_compressors()
ALGOS = list(ALGORITHMS)
CASES = {  # name: (shape, dtype)
    "odd": ((33, 17), torch.float32),
    "half": ((7, 3), torch.float16),
    "bf16": ((5, 3), torch.bfloat16),
    "scalar": ((), torch.float64),
    "empty": ((0,), torch.float32),
}
WRAPS = ("bare", "ef")


def data(tag: str, rank: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(tag.encode()) + 7919 * rank)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def make(name: str, wrap: str):
    c = get_compressor(name)
    return ErrorFeedback(c) if wrap == "ef" else c


def bits(t: torch.Tensor) -> torch.Tensor:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().reshape(-1).view(ints[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# ---- the ranks -------------------------------------------------------------------------------
def _matrix(rank, w):
    """Every compressor x algorithm x wrapper x tensor case; returns {combo: result}."""
    from gradcomp.collectives import allreduce

    out = {}
    for name in NAMES:
        for algo in ALGOS:
            for wrap in WRAPS:
                for case, (shape, dtype) in CASES.items():
                    combo = (name, algo, wrap, case)
                    t = data("/".join(combo), rank, shape, dtype)
                    before = t.clone()
                    try:
                        res = allreduce(t, make(name, wrap), key="w", algorithm=algo)
                    except ValueError as exc:
                        out[combo] = ("ValueError", str(exc))
                        continue
                    out[combo] = ("ok", res, same_bits(t, before))
    return out


def _nonfinite(rank, w):
    from gradcomp.collectives import allreduce

    out = {}
    for name in NAMES:
        for algo in (None, "allgather", "scatter-reduce"):
            t = data(f"nan/{name}", rank, (257,), torch.float32)
            if rank == 1:
                t[3], t[200] = float("nan"), float("inf")
            try:
                out[(name, algo)] = ("ok", allreduce(t, name, key=f"nan/{algo}", algorithm=algo))
            except ValueError as exc:
                out[(name, algo)] = ("ValueError", str(exc))
    return out


def _dense_equality(rank, w):
    import torch.distributed as dist
    from gradcomp.collectives import allreduce

    out = {}
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        t = data(f"dense/{dtype}", rank, (1001,), dtype) * 100
        dense = t.clone()
        dist.all_reduce(dense)
        dense /= w
        out[dtype] = (allreduce(t, "none", key="d"), dense, allreduce(t, "fp16", key="d"), allreduce(t, "bf16", key="d"))
    return out


def _mismatches(rank, w):
    from gradcomp.collectives import allreduce

    out = {}
    cases = {
        "shape": lambda: allreduce(torch.ones(4 if rank else 5), "fp16", key="m"),
        "dtype": lambda: allreduce(torch.ones(4, dtype=torch.float64 if rank else torch.float32), "fp16", key="m"),
        "compressor": lambda: allreduce(torch.ones(4), get_compressor("topk", ratio=0.5 if rank else 0.25), key="m"),
        "key": lambda: allreduce(torch.ones(4), "fp16", key=f"m{rank}"),
        "algorithm": lambda: allreduce(torch.ones(4), "fp16", key="m", algorithm="native" if rank else "allgather"),
        "not a tensor": lambda: allreduce(torch.ones(4, dtype=torch.int64) if rank else torch.ones(4), "fp16", key="m"),
        "async shape": lambda: allreduce(torch.ones(3 if rank else 2), "fp16", key="m", async_op=True).wait(),
        "native state": lambda: allreduce(torch.ones(40), _stepped_randomk(rank), key="m2", algorithm="native"),
    }
    for what, call in cases.items():
        try:
            call()
            out[what] = "no error"
        except ValueError as exc:
            out[what] = str(exc)
    out["after"] = allreduce(torch.full((3,), float(rank)), "none", key="after")  # the group still works
    return out


def _stepped_randomk(rank):
    """A shared-seed randomk whose step counter of key "m2" is one ahead on rank 1."""
    c = get_compressor("randomk", ratio=0.5)
    if rank == 1:
        c.compress(torch.ones(40), key="m2")
    return c


def _async_and_buckets(rank, w):
    from gradcomp.collectives import allreduce, allreduce_buckets

    out = {}
    combos = [("fp16", None), ("topk", None), ("powersgd", None), ("int8", "scatter-reduce"), ("randomk", None)]
    ts = [data(f"async/{i}", rank, (20, 9), torch.float32) for i in range(len(combos))]
    sync = [allreduce(t, ErrorFeedback(get_compressor(n)), key=f"a{i}", algorithm=a)
            for i, (t, (n, a)) in enumerate(zip(ts, combos))]
    comps = [ErrorFeedback(get_compressor(n)) for n, _ in combos]
    futs = [allreduce(t, c, key=f"a{i}", algorithm=a, async_op=True).then(lambda f: f.value() * 2)
            for i, (t, c, (_, a)) in enumerate(zip(ts, comps, combos))]
    out["async"] = ([f.wait() / 2 for f in futs], sync)
    out["sync after async"] = allreduce(ts[0], "none", key="s")

    named = [(f"p{i}", data(f"bucket/{i}", rank, shape, torch.float32))
             for i, shape in enumerate([(3, 4), (5,), (), (7, 2), (1,), (0,), (30,)])]
    per_tensor, bucketed = ErrorFeedback("bf16"), ErrorFeedback("bf16")
    steps = []
    for step, mb in enumerate([1e-4, 1e-6, 1.0]):  # three different bucket layouts
        grads = [(n, t * (step + 1)) for n, t in named]
        ref = {n: allreduce(t, per_tensor, key=n, algorithm="allgather") for n, t in grads}
        got = allreduce_buckets(grads, bucketed, bucket_mb=mb, algorithm="allgather")
        steps.append((ref, got, {n: (per_tensor.residual(n), bucketed.residual(n)) for n, _ in named}))
    out["buckets"] = steps
    fut = allreduce_buckets(named, "topk", bucket_mb=1e-4, async_op=True)
    out["buckets async"] = (fut.wait(), allreduce_buckets(named, "topk", bucket_mb=1e-4))
    return out


def _bytes_and_telemetry(rank, w):
    import torch.distributed as dist
    from gradcomp.collectives import allreduce, reset_telemetry, telemetry

    out = {}
    t = data("bytes", rank, (1 << 18,), torch.float32)
    for name in ("fp16", "int8", "onebit"):
        for algo in ("allgather", "scatter-reduce"):
            reset_telemetry()
            allreduce(t, name, key=f"b/{algo}", algorithm=algo)
            out[(name, algo)] = telemetry()["last"]
    reset_telemetry()
    allreduce(t, "none", key="dense", measure_error=True)
    allreduce(t, "topk", key="err", measure_error=True)
    out["telemetry"] = telemetry()
    # a real process group of one rank: a local round trip through the same code
    singles = [dist.new_group([r]) for r in range(w)]
    out["group of one"] = (allreduce(t[:10], "int8", key="one", group=singles[rank], algorithm="scatter-reduce"), t[:10])
    return out


def _p2p(rank, w):
    from gradcomp.collectives import recv, send

    out = {}
    pairs = [(0, 1), (2, 3)] if w == 4 else [(0, 1)]
    for src, dst in pairs:
        for name in NAMES:
            for step in range(2):
                t = data(f"p2p/{name}/{step}/{src}", src, (9, 5), torch.float32)
                if rank == src:
                    send(t, dst, _p2p_comp(name), key="x")
                elif rank == dst:
                    out[(src, name, step)] = recv(src, _p2p_comp(name), key="x")
    # a bound on what the sender may announce: refused before decoding, the channel stays in step
    if rank == 0:
        send(torch.ones(1000), 1, "fp16")
        send(torch.ones(3), 1, "fp16")
    elif rank == 1:
        try:
            recv(0, "fp16", max_numel=100)
            out["bounded"] = "no error"
        except ValueError as exc:
            out["bounded"] = str(exc)
        out["after bound"] = recv(0, "fp16", max_numel=100)
    # a refused input (qsgd: a norm beyond float32) raises at the send, also inside a step's
    # transaction, before anything is sent: the channel stays in step
    if rank == 0:
        from gradcomp.compress.transaction import Transaction

        huge = torch.ones(64)
        huge[:2] = 3e38
        with Transaction().active():
            try:
                send(huge, 1, get_compressor("qsgd"))
                out["refused send"] = "sent"
            except ValueError as exc:
                out["refused send"] = str(exc)
        send(torch.ones(3), 1, "fp16")
    elif rank == 1:
        out["after refused"] = recv(0, "fp16")
    return out


_P2P_COMPS = {}


def _p2p_comp(name):
    if name not in _P2P_COMPS:
        _P2P_COMPS[name] = ErrorFeedback(get_compressor(name))
    return _P2P_COMPS[name]


def _hierarchical(rank, w):
    from gradcomp.collectives import allreduce, make_node_groups

    groups = make_node_groups(2)
    out = {"groups": (groups.local_rank, groups.node)}
    for name in ("none", "fp16", "topk", "onebit", "powersgd", "randomk"):
        for wrap in WRAPS:
            for shape in ((21, 11), (3,), ()):
                t = data(f"h/{name}/{shape}", rank, shape, torch.float32)
                res = allreduce(t, make(name, wrap), key="h", intra_group=groups.intra, inter_group=groups.inter)
                out[(name, wrap, shape)] = res
    t = data("h/async", rank, (40, 3), torch.float32)
    c = ErrorFeedback("int8")
    fut = allreduce(t, c, key="ha", intra_group=groups.intra, inter_group=groups.inter, async_op=True)
    out["async"] = fut.wait()
    try:  # the second node passes one element more: every rank must say so
        allreduce(torch.ones(10 + groups.node), "fp16", key="hm", intra_group=groups.intra, inter_group=groups.inter)
        out["mismatch"] = "no error"
    except ValueError as exc:
        out["mismatch"] = str(exc)
    return out


def _conservation(rank, w):
    """Three steps with error feedback; returns (sum of results, worker residual, server residual)."""
    from gradcomp.collectives import allreduce, allreduce_buckets, server_feedback

    out = {}
    for name in ("topk", "onebit", "int8", "threshold", "randomk", "powersgd"):
        for algo in ALGOS:
            ef = ErrorFeedback(get_compressor(name))
            if ALGORITHMS[algo].unsuitable(ef.compressor):
                continue
            total = sum(allreduce(data(f"cons/{name}/{algo}/{step}", rank, (24, 10), torch.float32), ef, key="c",
                                  algorithm=algo).double() for step in range(3))
            server = server_feedback(ef).residual(f"c/chunk{rank}/server") if algo == "scatter-reduce" else None
            out[(name, algo)] = (total, ef.residual("c"), server)
    ef = ErrorFeedback("topk")  # one bucket of three tensors, scatter-reduce: per-name and server memory
    totals = {}
    for step in range(3):
        named = [(n, data(f"consb/{n}/{step}", rank, s, torch.float32)) for n, s in _CONS_BUCKET]
        for n, t in allreduce_buckets(named, ef, bucket_mb=1.0, algorithm="scatter-reduce").items():
            totals[n] = totals.get(n, 0) + t.double()
    server = server_feedback(ef).state_dict()["state"]
    assert len(server) == 1, "one bucket, one chunk per rank"
    out["bucket"] = (totals, {n: ef.residual(n) for n, _ in _CONS_BUCKET}, next(iter(server.values())))
    return out


_CONS_BUCKET = [("a", (6, 5)), ("b", (7,)), ("c", (2, 2))]


def _independent(rank, w):
    """Two callers of one key: different ErrorFeedback objects, then compressors by name."""
    from gradcomp.collectives import allreduce, server_feedback, server_key

    out = {}
    a, b, c = (ErrorFeedback(get_compressor("topk", ratio=0.1)) for _ in range(3))
    for step in range(2):  # the first caller's steps under key "w"
        allreduce(data(f"ind/a/{step}", rank, (12, 5), torch.float32), a, key="w", algorithm="scatter-reduce")
    gb = data("ind/b", rank, (12, 5), torch.float32)
    # the second caller's step under the same key, beside the first and alone (a fresh one)
    out["ef"] = [(allreduce(gb, fb, key="w", algorithm="scatter-reduce"), fb.residual("w"),
                  server_feedback(fb).residual(server_key("w", rank)), fb.owed("w")) for fb in (b, c)]
    out["ef first"] = (a.residual("w"), server_feedback(a).residual(server_key("w", rank)))
    taken = c.take("w")  # owed, then nothing: residual and server residual zero
    out["take"] = (taken, c.owed("w"), c.residual("w"), server_feedback(c).residual(server_key("w", rank)))
    x, y = data("ind/powersgd/x", rank, (16, 8), torch.float32), data("ind/powersgd/y", rank, (16, 8), torch.float32)
    allreduce(x, "powersgd", key="w")  # no warm start carried to the next call by name
    out["powersgd"] = (allreduce(y, "powersgd", key="w"), allreduce(y, get_compressor("powersgd"), key="w"))
    try:  # a random stream made anew at every call would repeat itself: refused, before any message
        allreduce(y, "randomk", key="w")
        out["randomk"] = None
    except ValueError as exc:
        out["randomk"] = str(exc)
    return out


def _rank_main(rank, w):
    torch.manual_seed(1234 + rank)  # compressors must not depend on it; different per rank on purpose
    started = time.perf_counter()
    parts = {"matrix": _matrix, "nonfinite": _nonfinite, "dense": _dense_equality, "mismatch": _mismatches,
             "async": _async_and_buckets, "bytes": _bytes_and_telemetry, "p2p": _p2p,
             "conservation": _conservation, "independent": _independent}
    if w == 4:
        parts["hierarchical"] = _hierarchical
    out = {k: fn(rank, w) for k, fn in parts.items()}
    out["seconds"] = time.perf_counter() - started
    return out


def _slow_start(seconds: float, marker: str) -> float:
    """Unpickled in each rank before it runs: the first rank to get here goes on at once, the
    others wait ``seconds`` (a machine too loaded to start processes together)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        time.sleep(seconds)
    return seconds


class SlowStart:
    """An argument of ``run_ranks`` that makes all ranks but one start ``seconds`` late."""

    def __init__(self, seconds: float, marker: str) -> None:
        self.seconds, self.marker = seconds, marker

    def __reduce__(self):
        return _slow_start, (self.seconds, self.marker)


def _rank_started(rank, w, delay):
    return rank


def _rank_dead_peer(rank, w):
    from gradcomp.collectives import CommunicationError, allreduce

    if rank == 1:
        return "left"  # exits without joining the collective below
    time.sleep(0.5)
    started = time.perf_counter()
    try:
        allreduce(torch.ones(1000), "topk", key="d")
    except CommunicationError as exc:
        return ("raised", time.perf_counter() - started, str(exc))
    return ("returned", time.perf_counter() - started, "")


# ---- replays in the parent (independent of the implementation) ---------------------------------
def _decoded(c, payload):
    return c.decompress(payload).reshape(-1).to(work_dtype(payload.dtype))


def _mean(parts, w, dtype):
    total = parts[0].to(dtype, copy=True)
    for p in parts[1:]:
        total += p.to(dtype)
    return total / w


def replay(name, algo, wrap, tensors):
    """The expected result of a first call: ``(expected, True)`` when it must match bit for bit,
    else ``(expected, dtype)`` whose precision bounds the difference."""
    w = len(tensors)
    comps = [get_compressor(name) for _ in range(w)]
    # first call: the residual is zero, and error feedback compresses in the input's dtype
    dtype, wd = tensors[0].dtype, work_dtype(tensors[0].dtype)
    accs = tensors
    if algo == "allgather":
        avg = _mean([_decoded(c, c.compress(a, "w")) for c, a in zip(comps, accs)], w, wd)
        return avg, True
    if algo == "scatter-reduce":
        chunks = []
        for j in range(w):
            parts = [_decoded(c, c.compress(a.reshape(-1).tensor_split(w)[j], f"w/chunk{j}")) for c, a in zip(comps, accs)]
            mine = _mean(parts, w, wd).to(dtype)
            chunks.append(_decoded(comps[j], comps[j].compress(mine, f"w/chunk{j}/server")))
        return torch.cat(chunks), True
    if algo == "native":
        payloads = [c.compress(a, "w") for c, a in zip(comps, accs)]
        summed = _mean([p.tensors[0].double() for p in payloads], w, torch.float64).to(payloads[0].tensors[0].dtype)
        p = payloads[0]
        p.tensors[0] = summed
        return comps[0].decompress(p).reshape(-1), summed.dtype
    gens = [c.rounds(a.to(wd) if wrap == "ef" else a, "w") for c, a in zip(comps, accs)]
    ys = [next(g) for g in gens]
    while True:
        avg = _mean([y.double() for y in ys], w, torch.float64).to(ys[0].dtype)
        try:
            ys = [g.send(avg.clone()) for g in gens]
        except StopIteration as stop:
            return stop.value.reshape(-1), avg.dtype


def _tol(*dtypes) -> float:
    return max(TOL[d] for d in dtypes)


TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{world size: [each rank's results]} for 2 and 4 ranks."""
    return {w: run_ranks(_rank_main, w, tmp_path_factory.mktemp(f"w{w}"), timeout_s=240) for w in (2, 4)}


def test_same_bits_on_every_rank_and_matches_replay(runs):
    for w, results in runs.items():
        matrices = [r["matrix"] for r in results]
        for combo in matrices[0]:
            name, algo, wrap, case = combo
            shape, dtype = CASES[case]
            if ALGORITHMS[algo].unsuitable(get_compressor(name)):
                assert all(m[combo][0] == "ValueError" for m in matrices), combo
                continue
            bad = [m[combo][1] for m in matrices if m[combo][0] != "ok"]
            assert not bad, (w, combo, bad)
            outs = [m[combo][1] for m in matrices]
            assert all(m[combo][2] for m in matrices), f"{combo}: the input was written to"
            assert all(o.shape == shape and o.dtype == dtype for o in outs), combo
            assert all(same_bits(outs[0], o) for o in outs[1:]), f"{w} ranks, {combo}: ranks hold different bits"
            if case == "empty":
                continue
            tensors = [data("/".join(combo), r, shape, dtype) for r in range(w)]
            expected, exact = replay(name, algo, wrap, tensors)
            expected = expected.reshape(shape).to(dtype)
            if exact is True:
                assert same_bits(outs[0], expected), f"{w} ranks, {combo}: differs from the replay of the algorithm"
            else:
                scale = float(expected.double().abs().max()) + 1e-30
                err = float((outs[0].double() - expected.double()).abs().max())
                assert err <= 10 * _tol(dtype, exact) * scale, f"{w} ranks, {combo}: off the replay by {err / scale:.2e}"


def test_error_feedback_loses_no_mass_across_steps(runs):
    """sum of results + mean worker residual (+ server residuals) == sum of dense means."""
    for w, results in runs.items():
        totals, _, _ = results[0]["conservation"]["bucket"]
        server = torch.cat([r["conservation"]["bucket"][2].double() for r in results])
        offset = 0
        for n, shape in _CONS_BUCKET:
            numel = torch.Size(shape).numel()
            inputs = sum(data(f"consb/{n}/{step}", r, shape, torch.float32).double()
                         for step in range(3) for r in range(w)) / w
            held = sum(r["conservation"]["bucket"][1][n].double() for r in results) / w
            held = held + server[offset:offset + numel].view(shape)
            offset += numel
            assert torch.allclose(totals[n] + held, inputs, atol=1e-5), f"{w} ranks, bucket {n}: mass lost"
        for (name, algo), (total, _, _) in ((k, v) for k, v in results[0]["conservation"].items() if k != "bucket"):
            inputs = sum(data(f"cons/{name}/{algo}/{step}", r, (24, 10), torch.float32).double()
                         for step in range(3) for r in range(w)) / w
            held = sum(r["conservation"][(name, algo)][1].double() for r in results) / w
            if algo == "scatter-reduce":
                held = held + torch.cat([r["conservation"][(name, algo)][2].double() for r in results]).view(24, 10)
            err = float((total + held - inputs).abs().max())
            assert err < 1e-4 * float(inputs.abs().max()), f"{w} ranks, {name}/{algo}: {err:.2e} of the gradient lost"


def test_callers_of_one_key_keep_independent_state(runs):
    """Two callers of ``key="w"`` with different ErrorFeedback objects: the second's result,
    residual, server residual and what it owes the key (``owed``, ``take``) are those of a
    caller alone; a
    compressor passed by name starts afresh at every call (no warm start carried), and a stochastic
    one is refused by name (its random stream would repeat at every call)."""
    for w, results in runs.items():
        for rank, r in enumerate(results):
            (out_b, res_b, srv_b, owed_b), (out_c, res_c, srv_c, owed_c) = r["independent"]["ef"]
            assert same_bits(out_b, out_c) and same_bits(res_b, res_c) and same_bits(srv_b, srv_c), (w, rank)
            res_a, srv_a = r["independent"]["ef first"]
            assert srv_a.dim() and not torch.equal(res_a, res_b) and not torch.equal(srv_a, srv_b), (w, rank)
            # what the error feedback owes the key: its residual and w times its server residual,
            # at the place of the chunk this rank averaged
            expected = res_b.clone()
            expected.view(-1).tensor_split(w)[rank].add_(srv_b, alpha=w)
            assert same_bits(owed_b, expected) and same_bits(owed_c, owed_b), (w, rank)
            taken, after, res_after, srv_after = r["independent"]["take"]
            assert same_bits(taken, owed_c) and not after.any() and not res_after.any() and not srv_after.any()
            named, fresh = r["independent"]["powersgd"]
            assert same_bits(named, fresh), f"{w} ranks, powersgd: a call by name kept an earlier call's state"
            refused = r["independent"]["randomk"]
            assert refused and "get_compressor('randomk')" in refused, (w, rank, refused)


def test_none_equals_dense_allreduce_mean(runs):
    for w, results in runs.items():
        for dtype, (none, dense, fp16, bf16) in results[0]["dense"].items():
            if dtype in (torch.float32, torch.float64):
                assert same_bits(none, dense), f"none in {dtype} differs from the dense mean"
            scale = float(dense.double().abs().max())
            assert torch.allclose(none.double(), dense.double(), atol=TOL[dtype] * scale, rtol=0)
            assert torch.allclose(fp16.double(), dense.double(), atol=_tol(dtype, torch.float16) * scale, rtol=0)
            assert torch.allclose(bf16.double(), dense.double(), atol=_tol(dtype, torch.bfloat16) * scale, rtol=0)
        for r in results[1:]:
            for dtype, outs in r["dense"].items():
                assert all(same_bits(a, b) for a, b in zip(outs, results[0]["dense"][dtype]))


def test_nan_and_inf_reach_every_rank(runs):
    for w, results in runs.items():
        for combo, first in results[0]["nonfinite"].items():
            statuses = [r["nonfinite"][combo] for r in results]
            if first[0] == "ValueError":
                assert all(s[0] == "ValueError" for s in statuses), combo
                continue
            assert all(s[0] == "ok" and same_bits(s[1], first[1]) for s in statuses), combo
            assert not torch.isfinite(first[1]).all(), f"{combo}: NaN/Inf became finite numbers"


def test_mismatch_raises_on_every_rank_and_says_so(runs):
    expect = {"shape": "shape", "dtype": "dtype", "compressor": "compressor", "key": "key",
              "algorithm": "algorithm", "not a tensor": "dtype", "async shape": "shape", "native state": "native"}
    for w, results in runs.items():
        for r in results:
            for what, word in expect.items():
                assert word in r["mismatch"][what], (what, r["mismatch"][what])
            assert torch.equal(r["mismatch"]["after"], torch.full((3,), (w - 1) / 2))


def test_async_equals_sync_and_buckets_keep_feedback_per_name(runs):
    for w, results in runs.items():
        for r in results:
            got, sync = r["async"]["async"]
            assert all(same_bits(a, b) for a, b in zip(got, sync)), "async results differ from sync ones"
            for ref, bucketed, residuals in r["async"]["buckets"]:
                assert list(ref) == list(bucketed)
                for n in ref:
                    assert same_bits(ref[n], bucketed[n]), f"bucketed {n} differs from the per-tensor result"
                    a, b = residuals[n]
                    assert a.shape == b.shape and torch.equal(a, b), f"residual of {n} depends on the bucket layout"
            fut_result, sync_result = r["async"]["buckets async"]
            assert all(same_bits(fut_result[n], sync_result[n]) for n in sync_result)
        for r in results[1:]:
            assert all(same_bits(a, b) for a, b in zip(r["async"]["async"][0], results[0]["async"]["async"][0]))


def test_measured_bytes_scatter_reduce_bounded_allgather_grows(runs):
    sent = {}
    for w, results in runs.items():
        for r in results:
            for (name, algo), rec in ((k, v) for k, v in r["bytes"].items() if isinstance(k, tuple)):
                assert rec["algorithm"] == algo and rec["world_size"] == w
                payload = rec["payload_bytes"]
                assert rec["bytes_recv"] == pytest.approx(rec["bytes_sent"], rel=0.05)
                if algo == "allgather":  # every other rank gets the whole payload
                    assert rec["bytes_sent"] >= (w - 1) * payload
                else:  # (w-1)/w of a payload in each of two phases, plus framing and headers
                    assert rec["bytes_sent"] <= 2 * (w - 1) / w * payload * 1.05 + 1024
                sent.setdefault((name, algo), {}).setdefault(w, []).append(rec["bytes_sent"])
            tel = r["bytes"]["telemetry"]
            assert tel["by_op"]["allreduce/native"]["rel_error"] == 0.0
            assert tel["by_op"]["allreduce/native"]["cos_sim"] == pytest.approx(1.0)
            assert 0 < tel["last"]["rel_error"] < 1.5 and tel["last"]["compressor"] == "topk"
            assert tel["total"]["calls"] == 2 and tel["total"]["compress_s"] > 0
            one, t = r["bytes"]["group of one"]
            assert one.shape == t.shape and torch.allclose(one, t, atol=0.05 * float(t.abs().max()))
    for (name, algo), per_w in sent.items():
        growth = max(per_w[4]) / max(per_w[2])
        if algo == "scatter-reduce":  # 2(w-1)/w: 1.0 -> 1.5 payloads, never above 2
            assert growth < 1.6, f"{name}: scatter-reduce bytes per rank grew {growth:.2f}x from 2 to 4 ranks"
        else:  # (w-1): 1 -> 3 payloads
            assert growth > 2.8, f"{name}: allgather bytes per rank grew only {growth:.2f}x from 2 to 4 ranks"


def test_p2p_delivers_what_the_sender_compressed(runs):
    for w, results in runs.items():
        for src, dst in ([(0, 1), (2, 3)] if w == 4 else [(0, 1)]):
            for name in NAMES:
                ef = ErrorFeedback(get_compressor(name))
                for step in range(2):
                    t = data(f"p2p/{name}/{step}/{src}", src, (9, 5), torch.float32)
                    expected = ef.decompress(ef.compress(t, key="x")).to(t.dtype)
                    assert same_bits(results[dst]["p2p"][(src, name, step)], expected), (w, name, step)
        assert "more than the limit 100" in results[1]["p2p"]["bounded"]
        assert torch.equal(results[1]["p2p"]["after bound"], torch.ones(3))
        assert "float32 range" in results[0]["p2p"]["refused send"]
        assert torch.equal(results[1]["p2p"]["after refused"], torch.ones(3))


def test_hierarchical_same_bits_everywhere(runs):
    results = runs[4]
    assert [r["hierarchical"]["groups"] for r in results] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert all("shape" in r["hierarchical"]["mismatch"] for r in results)
    for k, v in results[0]["hierarchical"].items():
        if k in ("groups", "mismatch"):
            continue
        assert all(same_bits(v, r["hierarchical"][k]) for r in results[1:]), k
        if isinstance(k, tuple) and k[0] == "none":
            name, wrap, shape = k
            dense = sum(data(f"h/{name}/{shape}", r, shape, torch.float32).double() for r in range(4)) / 4
            assert torch.allclose(v.double(), dense, atol=1e-6), k


def test_rank_time_budget(runs):
    for w, results in runs.items():
        assert max(r["seconds"] for r in results) < 120, f"the {w}-rank checks became too slow"


def test_dead_peer_raises_within_the_timeout(tmp_path):
    # the harness waits for the error as long as it takes to come (it ends when both ranks have
    # reported): a loaded machine slows the run, never cuts it short
    results = run_ranks(_rank_dead_peer, 2, tmp_path, timeout_s=5, deadline_s=300)
    status, seconds, message = results[0]
    assert status == "raised", "allreduce returned although its peer had left"
    assert seconds < 3 * 5, f"took {seconds:.1f} s: beyond the 5 s group timeout, as if it had hung"
    assert "peer" in message and "rank 0" in message


def test_ranks_started_late_by_a_loaded_machine_still_run(tmp_path):
    # a rank starting 5 s after the other: the group's 2 s timeout and the run's 6 s deadline
    # count from when both have started, not from the spawn
    assert run_ranks(_rank_started, 2, tmp_path, SlowStart(5.0, str(tmp_path / "first")), timeout_s=2) == [0, 1]
