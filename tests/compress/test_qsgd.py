"""qsgd: code widths on the wire, one level step of error, unbiasedness within 5 standard
errors, reproducible draws, and payloads checked before decoding."""
import math

import pytest
import torch

from gradcomp.compress import Payload, get_compressor
from gradcomp.compress.qsgd import code_bits


@pytest.mark.parametrize("levels,bits", [(1, 2), (2, 4), (7, 4), (8, 8), (127, 8)])
@pytest.mark.parametrize("n", [1, 33, 4096])
def test_bits_per_element(levels, bits, n):
    c = get_compressor("qsgd", levels=levels, bucket_size=32)
    p = c.compress(torch.randn(n), key="b")
    assert code_bits(levels) == bits
    assert p.nbytes == 4 * math.ceil(n / 32) + math.ceil(n * bits / 8) == c._wire_bytes(n)
    assert math.isclose(c.bits_per_element(1 << 20), bits + 32 / 32)


def _step(p):
    """Per-element level step norm/s (float64) of a payload."""
    norms, s, bs = p.tensors[0].double(), p.meta["levels"], p.meta["bucket_size"]
    return (norms / s).repeat_interleave(bs)[:p.numel]


@pytest.mark.parametrize("levels", [1, 5, 127])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_error_is_within_one_level(levels, dtype):
    c = get_compressor("qsgd", levels=levels, bucket_size=16)
    x = torch.randn(50, dtype=torch.float64).to(dtype)  # 3 buckets and a ragged one of 2
    p = c.compress(x, key="e")
    out = c.decompress(p)
    assert out.dtype == dtype
    slack = 0 if dtype == torch.float64 else torch.finfo(dtype).eps * x.double().abs()
    assert ((out.double() - x.double()).abs() <= _step(p) * (1 + 1e-6) + slack).all()
    norms = torch.stack([b.double().norm() for b in x.split(16)]).float()
    assert torch.allclose(p.tensors[0], norms, rtol=1e-6)


@pytest.mark.parametrize("levels", [1, 127])
def test_unbiased(levels):
    """The mean of many draws (a fresh stream per step) converges to x: within 5 standard
    errors per element, the variance taken from the two-point distribution of each level."""
    c = get_compressor("qsgd", levels=levels, bucket_size=16)
    x = torch.randn(40, dtype=torch.float64)
    steps = 1500
    draws = torch.stack([c.decompress(c.compress(x, key="u", step=s)) for s in range(steps)])
    step = _step(c.compress(x, key="u"))
    frac = torch.frac(x.abs() / step)
    se = (step ** 2 * frac * (1 - frac) / steps).sqrt()
    assert ((draws.mean(0) - x).abs() <= 5 * se + 1e-12).all()
    assert (draws.var(0) > 0).any(), "no randomness at all"


def test_same_stream_same_payload_and_fresh_streams_differ():
    x = torch.randn(300)
    a, b = get_compressor("qsgd", seed=3), get_compressor("qsgd", seed=3)
    pa, pb = a.compress(x, key="w", step=7), b.compress(x, key="w", step=7)
    assert all(torch.equal(s, t) for s, t in zip(pa.tensors, pb.tensors))
    codes = pa.tensors[1]
    assert not torch.equal(codes, a.compress(x, key="w", step=8).tensors[1])
    assert not torch.equal(codes, a.compress(x, key="v", step=7).tensors[1])
    assert not torch.equal(codes, get_compressor("qsgd", seed=4).compress(x, key="w", step=7).tensors[1])
    # without an explicit step the counter advances per key
    assert not torch.equal(a.compress(x, key="k").tensors[1], a.compress(x, key="k").tensors[1])


def test_edge_cases():
    c = get_compressor("qsgd", levels=7, bucket_size=4)
    assert torch.equal(c.decompress(c.compress(torch.zeros(9))), torch.zeros(9))
    one = torch.tensor([-2.5])
    assert torch.equal(c.decompress(c.compress(one)), one), "a lone element is its own norm"
    p = c.compress(torch.empty(0))
    assert p.nbytes == 0 and c.decompress(p).numel() == 0


def test_nonfinite_spreads_over_its_bucket():
    c = get_compressor("qsgd", bucket_size=4)
    x = torch.randn(12)
    x[5] = math.nan
    out = c.decompress(c.compress(x))
    assert torch.isnan(out[4:8]).all() and torch.isfinite(out[:4]).all() and torch.isfinite(out[8:]).all()
    x[5] = math.inf
    assert not torch.isfinite(c.decompress(c.compress(x))[4:8]).any()


def test_norm_beyond_fp32_is_an_error():
    with pytest.raises(ValueError, match="float32 range"):
        get_compressor("qsgd").compress(torch.tensor([1e300, 1.0], dtype=torch.float64))


def test_bad_options():
    for kw in ({"levels": 0}, {"levels": 128}, {"bucket_size": 0}, {"seed": -1}):
        with pytest.raises(ValueError, match="must be"):
            get_compressor("qsgd", **kw)


def test_malformed_payloads_are_rejected():
    c = get_compressor("qsgd", levels=7, bucket_size=8)
    good = c.compress(torch.randn(20))
    norms, codes = good.tensors
    bad = [
        {"levels": 200, "bucket_size": 8},  # out of range
        {"levels": 127, "bucket_size": 8},  # 8-bit codes expected
        {"levels": 7, "bucket_size": 4},  # norms count mismatch
        {"levels": 7},
        {"levels": 7, "bucket_size": 8, "extra": 1},
    ]
    for meta in bad:
        with pytest.raises(ValueError, match="qsgd"):
            type(c).check_payload(Payload("qsgd", (20,), torch.float32, [norms, codes], meta))
    with pytest.raises(ValueError, match="qsgd"):
        type(c).check_payload(Payload("qsgd", (20,), torch.float32, [norms, codes[:-1]], good.meta))
    wire = Payload.from_bytes(good.to_bytes())
    assert torch.equal(get_compressor("qsgd").decompress(wire), c.decompress(good)), "decoding needs no config"
