"""onebit: positives (x >= 0) decode to their mean, negatives to theirs (two fp32 words)."""
import pytest
import torch

from gradcomp.compress import get_compressor


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_each_side_decodes_to_its_mean(dtype):
    x = (torch.randn(30, 31, dtype=torch.float64) + 0.4).to(dtype)
    c = get_compressor("onebit")
    p = c.compress(x)
    xd = x.double()
    pos_mean, neg_mean = xd[xd >= 0].mean().item(), xd[xd < 0].mean().item()
    assert p.tensors[1].tolist() == pytest.approx([pos_mean, neg_mean], rel=1e-6)
    pos, neg = (torch.tensor(v, dtype=dtype) for v in p.tensors[1].tolist())
    out = c.decompress(p)
    assert torch.equal(out, torch.where(x >= 0, pos, neg))


def test_sum_is_kept():
    x = torch.randn(2000) * torch.rand(2000) + 0.2
    c = get_compressor("onebit")
    out = c.decompress(c.compress(x))
    assert out.double().sum().item() == pytest.approx(x.double().sum().item(), rel=1e-5)


def test_one_sided_input():
    c = get_compressor("onebit")
    x = torch.tensor([0.0, 1.0, 2.0, 3.0])
    p = c.compress(x)
    assert p.tensors[1].tolist() == [1.5, 0.0]
    assert c.decompress(p).tolist() == [1.5] * 4
    assert c.decompress(c.compress(-x - 1)).tolist() == [-2.5] * 4


def test_bits_per_element():
    c = get_compressor("onebit")
    for n in (1, 9, 4096):
        assert c.compress(torch.randn(n)).nbytes == (n + 7) // 8 + 8
    assert c.bits_per_element(1 << 16) == pytest.approx(1 + 64 / (1 << 16))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_input_reaches_the_output(bad):
    x = torch.randn(100)
    x[3] = bad
    c = get_compressor("onebit")
    out = c.decompress(c.compress(x))
    assert not torch.isfinite(out[3])
