"""CUDA tensors through the collectives (skipped without a GPU): the result stays on the
tensor's device, one process is the compressor's own round trip on that device, and two gloo
ranks sharing one GPU (gloo stages CUDA tensors through the host) hold the same bits."""
from __future__ import annotations

import pytest
import torch

from ranks import run_ranks
from gradcomp.collectives import ALGORITHMS, allreduce
from gradcomp.compress import ErrorFeedback, available_compressors, get_compressor

pytestmark = pytest.mark.gpu
NAMES = available_compressors()


def _suitable(c):
    return [a for a, cls in ALGORITHMS.items() if cls.unsuitable(c) is None]


def test_cuda_one_process_round_trip():
    for name in NAMES:
        for algo in _suitable(get_compressor(name)):
            if algo in ("rounds", "scatter-reduce"):
                continue  # their one-process forms are checked on the CPU; here: device handling
            t = torch.randn(33, 17, device="cuda")
            out = allreduce(t, get_compressor(name), key="k", algorithm=algo)
            c = get_compressor(name)
            expected = c.decompress(c.compress(t, "k"))
            assert out.device == t.device and out.dtype == t.dtype
            assert torch.equal(out, expected), f"{name}/{algo} on CUDA is not the local round trip"


def _ranks(rank, w):
    torch.cuda.set_device(0)
    out = {}
    for name in NAMES:
        c = ErrorFeedback(get_compressor(name))
        for algo in _suitable(c.compressor):
            t = torch.randn(40, 9, device="cuda", generator=torch.Generator("cuda").manual_seed(rank))
            res = allreduce(t, c, key=f"k/{algo}", algorithm=algo)
            out[(name, algo)] = (str(res.device), res.cpu())
    return out


def test_cuda_tensors_on_two_gloo_ranks_agree(tmp_path):
    r0, r1 = run_ranks(_ranks, 2, tmp_path, timeout_s=120)
    for combo, (device, value) in r0.items():
        assert device.startswith("cuda"), combo
        assert r1[combo][0] == device and torch.equal(value, r1[combo][1]), f"{combo}: ranks differ"
        assert torch.isfinite(value).all(), combo


SLEEP = 200_000_000  # GPU cycles (about 0.1 s): long enough for an unordered read to come first


def _streams(rank, w):
    """Issue 22, item 5: the module-level async path on CUDA tensors, read from a side stream."""
    from gradcomp.collectives import allreduce_buckets, worker

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    side = torch.cuda.Stream()
    out = {}
    with torch.cuda.stream(side):
        # the input is written on the caller's stream after a delay: the worker must wait for it
        t = torch.empty(1 << 14, device=dev)
        torch.cuda._sleep(SLEEP)
        t.fill_(rank + 1.0)
        out["ready"] = allreduce(t, "none", key="ready", async_op=True).wait().clone()
        # the result is written on the worker's stream after a delay: wait() must order this stream
        def late(twin):
            x = torch.empty(1 << 14, device=dev).fill_(-1.0)
            torch.cuda._sleep(SLEEP)
            return x.fill_(7.0)
        out["future"] = worker.submit(late, (None,), True, device=dev).wait().clone()
        out["then"] = worker.submit(late, (None,), True, device=dev).then(lambda f: f.value() * 2).wait().clone()
        # buckets: one event per bucket, the merged future over their device
        u = torch.empty(1 << 12, device=dev)
        torch.cuda._sleep(SLEEP)
        u.fill_(2.0 * rank)
        merged = allreduce_buckets({"a": u, "b": u[:100]}, "none", bucket_mb=0.001, async_op=True).wait()
        out["buckets"] = torch.cat([merged["a"], merged["b"]]).clone()
    torch.cuda.synchronize()
    return {k: (str(v.device), v.cpu()) for k, v in out.items()}


def test_async_results_are_ordered_on_the_callers_stream(tmp_path):
    expected = {"ready": 1.5, "future": 7.0, "then": 14.0, "buckets": 1.0}
    for result in run_ranks(_streams, 2, tmp_path, timeout_s=120):
        for what, value in expected.items():
            device, got = result[what]
            assert device == "cuda:0", (what, device)
            assert torch.equal(got, torch.full_like(got, value)), f"{what}: read before the work it waits for"


def test_cuda_phases_are_timed_by_events_and_read_later():
    """A record on a CUDA device times its phases with CUDA events on the current stream: the
    time is the GPU's (here a loop of products that takes far longer to run than to queue), and
    nothing waits for it until the counters are read."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from gradcomp.collectives import _telemetry as tele

    tele.reset_telemetry()
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    rec = tele.Record("allreduce", "probe", "none", "k", 1, device=torch.device("cuda", 0))
    with rec.timing("compress"):
        for _ in range(20):
            a = a @ a * 1e-3
    tele.commit(rec)
    assert rec.compress_s == 0.0 and rec._pending  # not read yet: no wait on the path
    out = tele.telemetry()["by_op"]["allreduce/probe"]
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a = a @ a * 1e-3
    end.record()
    end.synchronize()
    gpu_s = start.elapsed_time(end) / 1000.0
    assert 0.5 * gpu_s < out["compress_s"] < 2.0 * gpu_s, (out["compress_s"], gpu_s)
    # a job that never reads telemetry keeps only the calls still in flight, not every call
    for _ in range(200):
        r = tele.Record("allreduce", "probe", "none", "k", 1, device=torch.device("cuda", 0))
        with r.timing("compress"):
            a = a * 1.0
        tele.commit(r)
    torch.cuda.synchronize()
    tele.commit(tele.Record("allreduce", "probe", "none", "k", 1, device=torch.device("cuda", 0)))
    assert sum(len(v) for v in tele._unsettled.values()) == 0
    assert tele.telemetry()["by_op"]["allreduce/probe"]["calls"] == 202
