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
