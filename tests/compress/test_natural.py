"""natural: one byte per element plus one int32, every value rounded to a neighbouring power
of two without bias, zero kept, and NaN/Inf delivered element by element."""
import math

import pytest
import torch

from gradcomp.compress import Payload, get_compressor

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _neighbours(x):
    """The powers of two below and above |x| (float64), signed like x; equal for a power of two."""
    mag = x.double().abs()
    lo = torch.exp2(torch.floor(torch.log2(mag)))
    hi = torch.where(lo == mag, lo, 2 * lo)
    sign = torch.sign(x.double())
    return sign * lo, sign * hi


@pytest.mark.parametrize("n", [0, 1, 100, 4096])
def test_bits_per_element(n):
    c = get_compressor("natural")
    p = c.compress(torch.randn(n), key="b")
    assert p.nbytes == n + 4 == c._wire_bytes(n)
    assert [t.dtype for t in p.tensors] == [torch.uint8, torch.int32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_values_are_neighbouring_powers_of_two(dtype):
    c = get_compressor("natural")
    x = (torch.randn(300, dtype=torch.float64) * 4).to(dtype)
    x[0], x[1] = 0.0, 0.5  # zero and an exact power of two stay as they are
    out = c.decompress(c.compress(x, key="p"))
    assert out.dtype == dtype and out[0] == 0 and out[1] == 0.5
    lo, hi = _neighbours(x)
    o = out.double()
    assert ((o == lo) | (o == hi)).all()
    assert ((o - x.double()).abs() <= (hi - lo).abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_unbiased(dtype):
    c = get_compressor("natural")
    x = (torch.randn(40, dtype=torch.float64) * 3).to(dtype).double()
    steps = 1500
    draws = torch.stack([c.decompress(c.compress(x.to(dtype), key="u", step=s)).double() for s in range(steps)])
    lo, hi = _neighbours(x)
    var = (hi - x) * (x - lo)  # of the two-point distribution on {lo, hi} with mean x
    se = (var.abs() / steps).sqrt()
    assert ((draws.mean(0) - x).abs() <= 5 * se + 1e-12).all()
    assert (var.abs() <= x ** 2 / 8 + 1e-12).all(), "natural compression's variance bound 1/8"


def test_same_stream_same_payload_and_fresh_streams_differ():
    x = torch.randn(500)
    a, b = get_compressor("natural", seed=5), get_compressor("natural", seed=5)
    pa = a.compress(x, key="w", step=1)
    assert all(torch.equal(s, t) for s, t in zip(pa.tensors, b.compress(x, key="w", step=1).tensors))
    assert not torch.equal(pa.tensors[0], a.compress(x, key="w", step=2).tensors[0])
    assert not torch.equal(pa.tensors[0], get_compressor("natural", seed=6).compress(x, key="w", step=1).tensors[0])


def test_nonfinite_values_arrive_as_sent():
    c = get_compressor("natural")
    x = torch.tensor([1.0, math.nan, -math.inf, math.inf, -3.0, 0.0])
    out = c.decompress(c.compress(x))
    assert math.isnan(out[1]) and out[2] == -math.inf and out[3] == math.inf
    assert out[0] == 1.0 and out[4] in (-2.0, -4.0) and out[5] == 0.0
    only = torch.tensor([math.nan, math.inf])
    out = c.decompress(c.compress(only))
    assert math.isnan(out[0]) and out[1] == math.inf


def test_range_extremes():
    c = get_compressor("natural")
    # fp32's largest values may round up to 2**128: decoded as 2**127, never inf
    big = torch.tensor([3.4e38, -3.0e38])
    assert torch.isfinite(c.decompress(c.compress(big))).all()
    half = torch.tensor([65504.0, 1.0], dtype=torch.float16)
    assert torch.isfinite(c.decompress(c.compress(half))).all()
    tiny = torch.tensor([1e-45, -3e-44, 1e-40])  # subnormal fp32 only
    lo, hi = _neighbours(tiny)
    out = c.decompress(c.compress(tiny)).double()
    assert ((out == lo) | (out == hi)).all()
    wide = torch.tensor([1e300, 1e-300], dtype=torch.float64)  # 2000 binades apart: the small one underflows
    out = c.decompress(c.compress(wide))
    assert out[1] in (0.0, 2.0 ** (math.frexp(1e300)[1] - 124))


def test_malformed_payloads_are_rejected():
    c = get_compressor("natural")
    codes, exp = c.compress(torch.randn(10)).tensors
    for tensors in ([codes, torch.tensor([5000], dtype=torch.int32)], [codes[:-1], exp],
                    [codes, exp.to(torch.int64)], [codes]):
        with pytest.raises(ValueError, match="natural"):
            c.check_payload(Payload("natural", (10,), torch.float32, tensors, {}))
    with pytest.raises(ValueError, match="natural"):
        c.check_payload(Payload("natural", (10,), torch.float32, [codes, exp], {"x": 1}))
    with pytest.raises(ValueError, match="allowed"):
        get_compressor("natural", levels=3)


def test_check_on_device_clamps_and_flags_the_exponent():
    """On an agreed layout the exponent is known only from its value: out of range it is
    clamped (the table stays finite) and flagged on the device; in range it passes as sent."""
    c = get_compressor("natural")
    p = c.compress(torch.randn(64))
    safe, bad = c.check_on_device(p)
    assert not bool(bad) and torch.equal(safe.tensors[1], p.tensors[1])
    assert torch.equal(c.decompress(safe), c.decompress(p))
    for exp in (-2000, 1025, 2**31 - 1):
        wire = Payload(p.compressor, p.shape, p.dtype, [p.tensors[0], torch.tensor([exp], dtype=torch.int32)])
        safe, bad = c.check_on_device(wire)
        assert bool(bad) and -1074 <= int(safe.tensors[1]) <= 1024, exp
        assert torch.isfinite(c.decompress(safe)).all(), exp  # saturated at the dtype's top, never inf
