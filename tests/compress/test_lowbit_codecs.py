"""int4 and int2: block-scaled (32 elements per fp32 scale) levels packed 2 or 4 per byte; rounding
to nearest is within half a step per block, the payload size follows from numel alone."""
import math

import pytest
import torch

from gradcomp.compress import ErrorFeedback, get_compressor

LEVELS = {"int4": 7, "int2": 1}
PER_BYTE = {"int4": 2, "int2": 4}
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("name", sorted(LEVELS))
@pytest.mark.parametrize("n", [0, 1, 3, 31, 32, 33, 100, 4096])
def test_fixed_size(name, n):
    c = get_compressor(name)
    p = c.compress(torch.randn(n), key="s")
    assert p.nbytes == 4 * math.ceil(n / 32) + math.ceil(n / PER_BYTE[name]) == c._wire_bytes(n)
    assert c.decompress(p).shape == (n,)


@pytest.mark.parametrize("name", sorted(LEVELS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_error_bound_per_block(name, dtype):
    c = get_compressor(name)
    x = torch.randn(77, dtype=torch.float64).to(dtype)  # a ragged last block
    out = c.decompress(c.compress(x, key="e"))
    assert out.dtype == dtype
    absmax = torch.stack([b.double().abs().max() for b in x.split(32)])
    step = (absmax / LEVELS[name]).repeat_interleave(32)[:77]
    slack = 0 if dtype == torch.float64 else torch.finfo(dtype).eps * x.double().abs()
    assert ((out.double() - x.double()).abs() <= step * 0.5 * (1 + 1e-5) + slack).all()


@pytest.mark.parametrize("name", sorted(LEVELS))
def test_zeros_and_deterministic(name):
    c = get_compressor(name)
    assert torch.equal(c.decompress(c.compress(torch.zeros(70))), torch.zeros(70))
    x = torch.randn(500)
    assert torch.equal(c.compress(x, key="a", step=0).tensors[1], c.compress(x, key="b", step=3).tensors[1])
    assert not c.unbiased and not c.stochastic


@pytest.mark.parametrize("name", sorted(LEVELS))
def test_error_feedback_converges_on_a_quadratic(name):
    torch.manual_seed(0)
    target = torch.randn(200, dtype=torch.float64)
    w = torch.zeros(200, dtype=torch.float64)
    ef = ErrorFeedback(get_compressor(name))
    for step in range(400):
        g = w - target
        w -= 0.1 * ef.decompress(ef.compress(g, key="q", step=step))
    assert (w - target).norm() < 1e-3 * target.norm()
