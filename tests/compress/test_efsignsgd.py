"""efsignsgd: decoded as +/- ||x||_1 / d (one fp32 scale), 1 bit per element plus 32 bits."""
import pytest
import torch

from gradcomp.compress import ErrorFeedback, get_compressor


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_decode_is_sign_times_mean_abs(dtype):
    x = torch.randn(40, 25, dtype=torch.float64).to(dtype)
    c = get_compressor("efsignsgd")
    p = c.compress(x)
    scale = x.double().abs().mean()
    assert p.tensors[1].item() == pytest.approx(scale.item(), rel=1e-6)
    s = torch.tensor(p.tensors[1].item(), dtype=dtype)  # the fp32 wire scale, rounded once
    out = c.decompress(p)
    assert out.dtype == dtype
    assert torch.equal(out, torch.where(x >= 0, s, -s))


def test_l1_norm_is_kept():
    x = torch.randn(1000)
    c = get_compressor("efsignsgd")
    out = c.decompress(c.compress(x))
    assert out.abs().sum().item() == pytest.approx(x.abs().sum().item(), rel=1e-5)


def test_bits_per_element():
    c = get_compressor("efsignsgd")
    for n in (1, 9, 4096):
        assert c.compress(torch.randn(n)).nbytes == (n + 7) // 8 + 4
    assert c.bits_per_element(1 << 16) == pytest.approx(1 + 32 / (1 << 16))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_scale_makes_every_output_nonfinite(bad):
    x = torch.randn(100)
    x[3] = bad
    c = get_compressor("efsignsgd")
    assert not torch.isfinite(c.decompress(c.compress(x))).any()


def test_error_feedback_tracks_the_gradient_sum():
    """With EF, the sum of what was sent follows the sum of the gradients: the residual (their
    difference) stays bounded instead of growing with the number of steps."""
    gen = torch.Generator().manual_seed(1)
    ef = ErrorFeedback(get_compressor("efsignsgd"))
    sent, total = torch.zeros(500), torch.zeros(500)
    for _ in range(60):
        g = torch.randn(500, generator=gen) + 0.3
        total += g
        sent += ef.decompress(ef.compress(g, key="w"))
    assert torch.allclose(total, sent + ef.residual("w"), atol=1e-3)
    assert ef.residual("w").norm() < 0.2 * total.norm()
