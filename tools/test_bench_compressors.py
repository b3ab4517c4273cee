"""CPU throughput of compress + decompress for every compressor (pytest-benchmark).

Not part of the unit-test run. Run with::

    python -m pytest -n 0 tools/test_bench_compressors.py --benchmark-only --benchmark-columns=median,iqr,rounds

(``-n 0``: the project's pytest options start two xdist workers, under which pytest-benchmark
switches itself off; the calls then run once each, a smoke test with nothing timed.)

Each benchmark compresses and decompresses one 25M-element fp32 tensor (100 MB, a ResNet-50
sized gradient); ``extra_info["gbps"]`` is fp32 input GB/s at the median. Set ``GRADCOMP_BENCH_NUMEL``
to change the size.
"""
import os

import pytest
import torch

from gradcomp.compress import ErrorFeedback, available_compressors, get_compressor

NUMEL = int(os.environ.get("GRADCOMP_BENCH_NUMEL", 25_000_000))


@pytest.fixture(scope="module")
def grad():
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    # a matrix shape, so PowerSGD compresses it as a layer would be (5000 x 5000)
    side = int(NUMEL ** 0.5)
    return torch.randn(side, NUMEL // side, generator=gen)


def _record(benchmark, grad):
    if benchmark.stats is None:  # benchmarks switched off (xdist, --benchmark-disable): nothing was timed
        return
    median = benchmark.stats.stats.median
    benchmark.extra_info["gbps"] = round(grad.numel() * 4 / median / 1e9, 3)


@pytest.mark.parametrize("name", available_compressors())
def test_compress_decompress(benchmark, grad, name):
    c = get_compressor(name)
    benchmark.pedantic(lambda: c.decompress(c.compress(grad, key="g")), rounds=5, warmup_rounds=1)
    _record(benchmark, grad)


@pytest.mark.parametrize("name", ["topk", "efsignsgd", "onebit", "int8", "powersgd"])
def test_error_feedback_compress(benchmark, grad, name):
    ef = ErrorFeedback(get_compressor(name))
    benchmark.pedantic(lambda: ef.compress(grad, key="g"), rounds=5, warmup_rounds=1)
    _record(benchmark, grad)
