"""terngrad: 2 bits per element plus a scale per bucket, values in {-1, 0, 1} * scale,
unbiased without clipping, and clipping that bounds the scale by clip * std."""
import math

import pytest
import torch

from gradcomp.compress import Payload, get_compressor


@pytest.mark.parametrize("bucket_size", [0, 1, 16, 512])
@pytest.mark.parametrize("n", [1, 7, 4096])
def test_bits_per_element(bucket_size, n):
    c = get_compressor("terngrad", bucket_size=bucket_size)
    p = c.compress(torch.randn(n), key="b")
    scales = 1 if bucket_size == 0 else math.ceil(n / bucket_size)
    assert p.nbytes == 4 * scales + math.ceil(n / 4) == c._wire_bytes(n)
    assert p.tensors[1].dtype == torch.uint8  # the ternary codes, packed 4 to a byte


def _scale(p):
    bs = p.meta["bucket_size"] or p.numel
    return p.tensors[0].double().repeat_interleave(bs)[:p.numel]


@pytest.mark.parametrize("bucket_size", [0, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_values_are_ternary_times_the_bucket_absmax(bucket_size, dtype):
    c = get_compressor("terngrad", bucket_size=bucket_size)
    x = torch.randn(50, dtype=torch.float64).to(dtype)
    p = c.compress(x, key="t")
    out = c.decompress(p).double()
    scale = _scale(p)
    absmax = torch.stack([b.double().abs().max() for b in x.split(bucket_size or 50)])
    sent = p.tensors[0].double()
    # exact below fp64; fp64 maxima are rounded up to the next float32, never down
    assert (sent >= absmax).all() and (sent - absmax <= absmax * 2.0 ** -23).all()
    level = out / scale.to(dtype).double()
    assert ((level == -1) | (level == 0) | (level == 1)).all()
    assert ((level == 0) | (torch.sign(level) == torch.sign(x.double()))).all(), "a sign flipped"


@pytest.mark.parametrize("bucket_size", [0, 16])
def test_unbiased(bucket_size):
    c = get_compressor("terngrad", bucket_size=bucket_size)
    x = torch.randn(40, dtype=torch.float64)
    steps = 1500
    draws = torch.stack([c.decompress(c.compress(x, key="u", step=s)) for s in range(steps)])
    scale = _scale(c.compress(x, key="u"))
    p = x.abs() / scale
    se = (scale ** 2 * p * (1 - p) / steps).sqrt()
    assert ((draws.mean(0) - x).abs() <= 5 * se + 1e-12).all()
    assert c.unbiased and not get_compressor("terngrad", clip=2.5).unbiased


def test_clip_bounds_the_scale_by_std():
    x = torch.randn(4000, dtype=torch.float64)
    x[17] = 50.0  # an outlier that would otherwise set the scale of its bucket
    c = get_compressor("terngrad", bucket_size=0, clip=2.5)
    p = c.compress(x, key="c")
    limit = 2.5 * float(x.std())
    assert math.isclose(float(p.tensors[0][0]), limit, rel_tol=1e-6)
    out = c.decompress(p)
    assert out[17] == float(p.tensors[0][0]), "a clipped element is sent at full scale"
    const = torch.full((10,), 3.0)  # std 0: no clipping to zero
    assert torch.equal(c.decompress(c.compress(const)), const)


def test_same_stream_same_payload_and_fresh_streams_differ():
    x = torch.randn(400)
    a, b = get_compressor("terngrad", seed=9), get_compressor("terngrad", seed=9)
    pa = a.compress(x, key="w", step=2)
    assert all(torch.equal(s, t) for s, t in zip(pa.tensors, b.compress(x, key="w", step=2).tensors))
    assert not torch.equal(pa.tensors[1], a.compress(x, key="w", step=3).tensors[1])
    assert not torch.equal(pa.tensors[1], get_compressor("terngrad", seed=1).compress(x, key="w", step=2).tensors[1])


def test_edge_cases_and_nonfinite():
    c = get_compressor("terngrad", bucket_size=4)
    assert torch.equal(c.decompress(c.compress(torch.zeros(6))), torch.zeros(6))
    one = torch.tensor([0.75])
    assert torch.equal(c.decompress(c.compress(one)), one), "|x| == scale is sent exactly"
    assert c.decompress(c.compress(torch.empty(0))).numel() == 0
    x = torch.randn(10)
    x[1] = math.nan
    out = c.decompress(c.compress(x))
    assert torch.isnan(out[:4]).all() and torch.isfinite(out[4:]).all()
    with pytest.raises(ValueError, match="float32 range"):
        c.compress(torch.tensor([1e40], dtype=torch.float64))


def test_bad_options_and_malformed_payloads():
    for kw in ({"bucket_size": -1}, {"clip": -1.0}, {"clip": math.inf}):
        with pytest.raises(ValueError, match="must be"):
            get_compressor("terngrad", **kw)
    good = get_compressor("terngrad", bucket_size=8).compress(torch.randn(20))
    scale, codes = good.tensors
    for tensors, meta in [([scale, codes], {"bucket_size": 4}), ([scale, codes[:-1]], good.meta),
                          ([scale.double(), codes], good.meta), ([scale, codes], {})]:
        with pytest.raises(ValueError, match="terngrad"):
            get_compressor("terngrad").check_payload(Payload("terngrad", (20,), torch.float32, tensors, meta))
