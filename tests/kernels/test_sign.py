"""Sign primitives: the chunked CPU path equals the torch reference bit for bit (sums up to
rounding), decode values are exact in every dtype, and NaN/Inf always reach the sums."""
import math

import numpy as np
import pytest
import torch

from gradcomp.kernels import sign
from gradcomp.kernels.sign import (STATS, count_set, sign_pack, sign_pack_reference, sign_unpack,
                                   sign_unpack_reference)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 16 elements, so small tensors cross many chunk boundaries."""
    monkeypatch.setattr(sign, "_CHUNK", 16)


def _reference_sums(x, stats):
    xd = x.double()
    return {"none": [], "sum": [xd.sum()], "abs": [xd.abs().sum()],
            "split": [xd.clamp(min=0).sum(), xd.clamp(max=0).sum()]}[stats]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 7, 16, 17, 203])
def test_pack_matches_reference(small_chunks, dtype, n):
    x = torch.randn(n, dtype=torch.float64).to(dtype)
    for stats in STATS:
        bits, sums = sign_pack(x, stats)
        ref_bits, ref_sums = sign_pack_reference(x, stats)
        assert bits.dtype == torch.uint8 and bits.numel() == (n + 7) // 8
        assert torch.equal(bits, ref_bits)
        expected = torch.tensor([float(s) for s in _reference_sums(x, stats)], dtype=torch.float64)
        assert sums.dtype == torch.float64
        assert torch.allclose(sums, expected, rtol=1e-6, atol=1e-9), (stats, sums, expected)
        assert torch.allclose(ref_sums, expected, rtol=1e-12, atol=1e-12)


def test_bit_semantics():
    x = torch.tensor([1.5, -2.0, 0.0, -0.0, float("nan"), float("inf"), float("-inf"), -1e-30, 3.0])
    bits, _ = sign_pack(x)
    got = np.unpackbits(bits.numpy(), count=x.numel(), bitorder="little").tolist()
    assert got == [1, 0, 1, 1, 0, 1, 0, 0, 1]  # x >= 0: zeros positive, NaN negative
    assert count_set(bits) == 5


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nonfinite_reaches_every_sum(small_chunks, bad, dtype):
    x = torch.randn(100).to(dtype)
    x[37] = bad
    for stats in ("sum", "abs"):
        assert not math.isfinite(sign_pack(x, stats)[1][0])
    pos, neg = sign_pack(x, "split")[1].tolist()
    assert not (math.isfinite(pos) and math.isfinite(neg))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unpack_is_exact_and_matches_reference(small_chunks, dtype):
    n = 203
    bits, _ = sign_pack(torch.randn(n))
    mask = torch.from_numpy(np.unpackbits(bits.numpy(), count=n, bitorder="little").astype(bool))
    # values whose bit patterns differ in sign and exponent: the integer difference wraps
    for pos, neg in [(0.1, -0.3), (1.0, -1.0), (-5e-3, 7e4), (0.0, -0.0), (float("nan"), 2.0)]:
        want = torch.where(mask, torch.tensor(pos, dtype=dtype), torch.tensor(neg, dtype=dtype))
        got = sign_unpack(bits, n, pos, neg, dtype=dtype)
        ref = sign_unpack_reference(bits, n, pos, neg, out=torch.empty(n, dtype=dtype))
        assert got.dtype == dtype and got.shape == (n,)
        # compare bit patterns: exact, and -0.0 / NaN included
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (pos, neg)
        assert torch.equal(ref.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unpack_into_out_and_accumulate(small_chunks, dtype):
    n = 77
    bits, _ = sign_pack(torch.randn(n))
    base = torch.randn(n).to(dtype)
    decoded = sign_unpack(bits, n, 0.25, -0.75, dtype=dtype)
    out = torch.empty(n, dtype=dtype)
    assert sign_unpack(bits, n, 0.25, -0.75, out=out) is out and torch.equal(out, decoded)
    acc = sign_unpack(bits, n, 0.25, -0.75, out=base.clone(), accumulate=True)
    assert torch.equal(acc, base + decoded)
    ref = sign_unpack_reference(bits, n, 0.25, -0.75, out=base.clone(), accumulate=True)
    assert torch.equal(acc, ref)


def test_empty():
    bits, sums = sign_pack(torch.empty(0), "split")
    assert bits.numel() == 0 and sums.tolist() == [0.0, 0.0]
    assert sign_unpack(bits, 0, 1.0, -1.0).numel() == 0


def test_bad_arguments_are_clear_errors():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="stats"):
        sign_pack(x, "mean")
    with pytest.raises(ValueError, match="1-D contiguous"):
        sign_pack(torch.randn(4, 4))
    bits, _ = sign_pack(x)
    with pytest.raises(ValueError, match="2 bytes"):
        sign_unpack(bits[:1], 10, 1.0, -1.0)
    with pytest.raises(ValueError, match="out"):
        sign_unpack(bits, 10, 1.0, -1.0, out=torch.empty(9))
    with pytest.raises(ValueError, match="accumulate"):
        sign_unpack(bits, 10, 1.0, -1.0, accumulate=True)


def test_default_chunk_keeps_bytes_aligned():
    """Each chunk must start on a byte of the packed output."""
    assert sign._CHUNK % 8 == 0
    x = torch.randn(sign._CHUNK + 13)
    assert torch.equal(sign_pack(x)[0], sign_pack_reference(x)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_matches_cpu(dtype):
    x = torch.randn(100_003, dtype=torch.float64).to(dtype)
    x[:3] = torch.tensor([0.0, -0.0, float("nan")], dtype=dtype)
    xc = x.cuda()
    for stats in STATS:
        bits, sums = sign_pack(x, stats)
        bits_c, sums_c = sign_pack(xc, stats)
        assert bits_c.is_cuda and torch.equal(bits_c.cpu(), bits)
        assert torch.allclose(sums_c.cpu(), sums, rtol=1e-5, equal_nan=True)
    assert count_set(bits_c) == count_set(bits)
    base = torch.randn(x.numel()).to(dtype)
    for pos, neg in [(0.1, -0.3), (-5e-3, 7e4)]:
        got = sign_unpack(bits_c, x.numel(), pos, neg, dtype=dtype)
        assert got.is_cuda and torch.equal(got.cpu(), sign_unpack(bits, x.numel(), pos, neg, dtype=dtype))
        acc = sign_unpack(bits_c, x.numel(), pos, neg, out=base.cuda(), accumulate=True)
        assert torch.equal(acc.cpu(), sign_unpack(bits, x.numel(), pos, neg, out=base.clone(), accumulate=True))
