"""The bucket exchange on 2 and 3 real gloo ranks: compressors that are not summable share one
fused exchange per bucket (allgather on 2 ranks, scatter-reduce on 3), and give the same bits
as sending each parameter on its own.

Invariant protected: over several steps (so residuals and compressor state carry over), a
bucket mixing dense, native (fp16), variable-size (threshold) and fixed-size (topk with error
feedback, onebit) routes gives, for every gradient, exactly ``allreduce(grad, codec, key)``
of that gradient alone, on every rank; and the non-summable ones cost one recorded call.
"""
from __future__ import annotations

import pytest
import torch

from ranks import run_ranks
from gradcomp.compress import ErrorFeedback, get_compressor

STEPS = 3
SHAPES = {"l1.weight": (24, 16), "l1.bias": (24,), "l2.weight": (10, 24), "l2.bias": (10,), "l3.weight": (5, 10)}


def _codecs():
    return {"l1.weight": ErrorFeedback(get_compressor("topk", ratio=0.1)), "l1.bias": None,
            "l2.weight": get_compressor("onebit"), "l2.bias": get_compressor("fp16"),
            "l3.weight": ErrorFeedback(get_compressor("threshold"))}


def _rank(rank, world):
    from gradcomp.collectives import allreduce, reset_telemetry, telemetry
    from gradcomp.collectives.bucket import exchange_bucket as exchange

    bucket, single = _codecs(), _codecs()
    op = "allreduce/allgather" if world == 2 else "allreduce/scatter-reduce"
    out, calls = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        grads = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
        reset_telemetry()
        got = exchange([(n, grads[n], bucket[n]) for n in SHAPES], None, world)
        calls.append(telemetry()["by_op"][op]["calls"])
        want = [grads[n].clone() if single[n] is None else allreduce(grads[n], single[n], key=n) for n in SHAPES]
        for i, n in enumerate(SHAPES):
            if single[n] is None:  # dense: the plain mean, as DDP's reducer computes it
                torch.distributed.all_reduce(want[i].mul_(1.0 / world))
        out.append((got, want))
    return out, calls


@pytest.mark.parametrize("world", [2, 3])
def test_bucket_exchange_equals_per_parameter_allreduce(tmp_path, world):
    results = run_ranks(_rank, world, tmp_path, timeout_s=120)
    for out, calls in results:
        assert calls == [1] * STEPS  # topk, onebit and threshold in one exchange per step
        for step, (got, want) in enumerate(out):
            for n, g, x in zip(SHAPES, got, want):
                assert torch.equal(g, x), (step, n)
                assert torch.equal(g, results[0][0][step][0][list(SHAPES).index(n)]), (step, n)


def _ahead_rank(rank, world):
    """Two bucket exchanges queued on the worker behind a held job: the second's local phase
    runs while the first is on the wire, and both give what ``exchange_bucket`` gives."""
    import threading

    from gradcomp.collectives import BucketExchange, exchange_bucket, worker
    from gradcomp.compress import ErrorFeedback, get_compressor

    def codecs(prefix):
        return {f"{prefix}.w": ErrorFeedback(get_compressor("onebit")), f"{prefix}.b": None,
                f"{prefix}.v": ErrorFeedback(get_compressor("topk", ratio=0.1))}

    g = torch.Generator().manual_seed(rank)
    shapes = {"w": (256, 256), "b": (256,), "v": (64, 32)}  # onebit's payload over the 4 KB the wire time needs
    grads = {p: {f"{p}.{n}": torch.randn(s, generator=g) for n, s in shapes.items()} for p in ("a", "b")}
    calls = []

    class Watched(BucketExchange):
        def prepare(self, *, ahead=False):
            calls.append((self.label, first.on_wire))
            super().prepare(ahead=ahead)

    w = worker.worker_for((None,))
    twin = w.twin(None)
    mine = {p: codecs(p) for p in ("a", "b")}
    first, second = (Watched([(n, t, mine[p][n]) for n, t in grads[p].items()], twin, world, label=p)
                     for p in ("a", "b"))
    gate = threading.Event()
    w.submit(lambda _: gate.wait(60), device="cpu")  # holds the worker until both are queued
    futures = [w.submit(lambda _, beside, x=x: x.finish(x.start(beside)), device="cpu", exchange=x, beside=True)
               for x in (first, second)]
    gate.set()
    got = [f.wait() for f in futures]
    plain = {p: codecs(p) for p in ("a", "b")}
    want = [exchange_bucket([(n, t, plain[p][n]) for n, t in grads[p].items()], None, world) for p in ("a", "b")]
    return calls, first.ahead, second.ahead, got, want


def test_the_next_bucket_prepares_while_one_is_on_the_wire(tmp_path):
    for calls, first_ahead, second_ahead, got, want in run_ranks(_ahead_rank, 2, tmp_path, timeout_s=120):
        # a prepares in its own start(); b's prepare() runs inside a's start(), while a's payload
        # is on the wire, and again (a no-op) in b's own start()
        assert calls == [("a", False), ("b", True), ("b", False)], calls
        assert (first_ahead, second_ahead) == (False, True)
        for g_bucket, w_bucket in zip(got, want):
            for g, x in zip(g_bucket, w_bucket):
                assert torch.equal(g, x)
