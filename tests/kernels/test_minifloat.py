"""The minifloats of the low-bit codecs, against their rules written out in Python floats: e2m1
rounding to nearest with ties to the even code, OCP's e8m0 block scale and its values, float16
scales rounded up."""
import math

import pytest
import torch

from gradcomp.kernels.minifloat import (E2M1, E8M0_NAN, e2m1_codes, e2m1_decode, e2m1_table, e8m0_codes, e8m0_values,
                                        fp16_ceil)


def _e2m1_reference(v: float) -> float:
    """The nearest e2m1 value of ``v``, ties to the one whose code is even, saturating at 6."""
    m = min(abs(v), 6.0)
    best = min(range(8), key=lambda i: (abs(E2M1[i] - m), i % 2))
    return math.copysign(E2M1[best], v) + 0.0  # a decoded zero is +0 (the code of -0 decodes to +0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_e2m1_rounding_matches_the_rule(dtype):
    grid = sorted({g / 4 for g in range(-30, 31)} | {g + d for g in E2M1 for d in (-1e-6, 1e-6)} | {7.0, 100.0})
    x = torch.tensor(grid + [-v for v in grid], dtype=dtype)
    codes = e2m1_codes(x, torch.ones(1, dtype=dtype), x.numel())
    got = e2m1_decode(codes, torch.ones(1, dtype=dtype), x.numel(), dtype)
    want = torch.tensor([_e2m1_reference(float(v)) for v in x], dtype=dtype)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


def test_e2m1_codes_are_ocp_encoding_and_blocks_scale():
    x = torch.tensor(E2M1 + tuple(-v for v in E2M1))
    assert e2m1_codes(x, torch.ones(1), 16).tolist() == list(range(16))
    assert torch.equal(e2m1_table(torch.float32, x.device), x)
    # two blocks of 4, multipliers 1/2 and 4: the codes of x * mult, decoded with the steps 2 and 1/4
    y = torch.tensor([12.0, 1.0, -3.0, 4.0, 1.5, 0.25, -0.125, 0.0])
    codes = e2m1_codes(y, torch.tensor([0.5, 4.0]), 4)
    assert torch.equal(e2m1_decode(codes, torch.tensor([2.0, 0.25]), 4, torch.float32), y)


def test_e8m0_codes_are_ocp_shared_scales():
    amax = torch.tensor([1.0, 6.0, 7.99, 8.0, 0.0, 2.0 ** -140, 3e38, math.nan, math.inf], dtype=torch.float64)
    codes = e8m0_codes(amax, emax=2)
    # floor(log2 amax) - 2, biased by 127; 0 for zero, clamped at 0 below 2**-127; NaN for NaN and inf
    assert codes.tolist() == [125, 127, 127, 128, 0, 0, 127 + 127 - 2, E8M0_NAN, E8M0_NAN]
    assert e8m0_codes(torch.tensor([3e38]), emax=0, top_code=200).tolist() == [200]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_e8m0_values_are_exact_powers_of_two(dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = e8m0_values(codes, dtype)
    assert torch.isnan(values[255]) and torch.isfinite(values[:255]).all()
    assert [float(v) for v in values[:255]] == [math.ldexp(1.0, c - 127) for c in range(255)]


def test_fp16_ceil_rounds_up_and_never_to_zero():
    s = torch.tensor([0.0, 1.0, 1.0 + 2 ** -12, 1e-9, 2.0 ** -24, 65504.0, 1000.3, math.inf, math.nan],
                     dtype=torch.float64)
    got = fp16_ceil(s)
    assert got.dtype == torch.float16
    assert got[:7].double().tolist() == [0.0, 1.0, 1.0 + 2 ** -10, 2.0 ** -24, 2.0 ** -24, 65504.0, 1000.5]
    assert math.isinf(got[7]) and math.isnan(got[8])
    r = torch.rand(1000, dtype=torch.float64) * 60000
    up = fp16_ceil(r).double()
    below = (fp16_ceil(r).view(torch.int16) - 1).view(torch.float16).double()
    assert (up >= r).all() and (below < r).all()
