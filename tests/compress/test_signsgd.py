"""signsgd: decoded as +1 / -1 (zero counts as +1), 1 bit per element plus one fp32 word that
carries NaN when the input held NaN/Inf."""
import pytest
import torch

from gradcomp.compress import ErrorFeedback, Payload, get_compressor


def test_decodes_to_plus_minus_one():
    x = torch.tensor([0.3, -2.0, 0.0, -0.0, 1e-30, -1e-30, 5.0])
    c = get_compressor("signsgd")
    out = c.decompress(c.compress(x))
    assert out.tolist() == [1.0, -1.0, 1.0, 1.0, 1.0, -1.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_sign_in_every_dtype(dtype):
    x = torch.randn(1001, dtype=torch.float64).to(dtype)
    c = get_compressor("signsgd")
    out = c.decompress(c.compress(x))
    assert out.dtype == dtype
    assert torch.equal(out, torch.where(x >= 0, 1.0, -1.0).to(dtype))


@pytest.mark.parametrize("n", [1, 8, 1000, 1 << 16])
def test_one_bit_per_element(n):
    c = get_compressor("signsgd")
    p = c.compress(torch.randn(n))
    assert p.nbytes == (n + 7) // 8 + 4 == c._wire_bytes(n)
    assert [t.dtype for t in p.tensors] == [torch.uint8, torch.float32]
    assert c.bits_per_element(1 << 20) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_input_decodes_to_nan(bad):
    x = torch.randn(300)
    x[123] = bad
    c = get_compressor("signsgd")
    assert torch.isnan(c.decompress(c.compress(x))).all()


def test_finite_input_whose_sum_overflows_stays_finite():
    x = torch.full((8,), 3e38)
    x[2] = -3e38
    c = get_compressor("signsgd")
    assert c.decompress(c.compress(x)).tolist() == [1, 1, -1, 1, 1, 1, 1, 1]


def test_fused_decode_equals_decompress():
    c = get_compressor("signsgd")
    x = torch.randn(33, 17)
    p, decoded = c.compress_decoded(x, key="w")
    assert torch.equal(decoded, c.decompress(p))
    assert torch.equal(decoded, c.decompress(Payload.from_bytes(p.to_bytes())))


def test_error_feedback_keeps_what_the_sign_dropped():
    ef = ErrorFeedback(get_compressor("signsgd"))
    g = torch.tensor([0.25, -3.0, 0.0])
    out = ef.decompress(ef.compress(g, key="w"))
    assert out.tolist() == [1.0, -1.0, 1.0]
    assert ef.residual("w").tolist() == [-0.75, -2.0, -1.0]


def test_malformed_payload_rejected():
    p = get_compressor("signsgd").compress(torch.randn(20))
    p.tensors[0] = p.tensors[0][:2]
    with pytest.raises(ValueError, match="signsgd"):
        Payload.from_bytes(p.to_bytes())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["signsgd", "efsignsgd", "signum", "onebit"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_cuda_round_trip_matches_cpu(name, dtype):
    """Every sign compressor on a CUDA tensor: same bits, same decode up to the fp32 rounding of
    its scale (GPU sums differ from CPU sums in the last bits), result on the same device."""
    x = torch.randn(257, 33, dtype=torch.float64).to(dtype)
    cpu, gpu = get_compressor(name), get_compressor(name)
    for _ in range(2):  # signum: a second step uses the momentum
        p, pc = cpu.compress(x, key="w"), gpu.compress(x.cuda(), key="w")
        assert all(t.is_cuda for t in pc.tensors) and torch.equal(pc.tensors[0].cpu(), p.tensors[0])
        out, out_c = cpu.decompress(p), gpu.decompress(pc)
        assert out_c.is_cuda and out_c.dtype == dtype
        assert torch.allclose(out_c.cpu().double(), out.double(), rtol=1e-5)
        assert torch.equal(gpu.decompress(Payload.from_bytes(pc.to_bytes()).to("cuda")), out_c)
    ef = ErrorFeedback(get_compressor(name))
    g = x.cuda()
    p = ef.compress(g, key="w")
    assert torch.allclose(g.to(ef.residual("w").dtype), ef.decompress(p).to(ef.residual("w").dtype) + ef.residual("w"),
                          atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("n", [7, 1 << 15])  # the torch path, and the fused CPU loops from FUSED_MIN on
def test_an_all_zero_tensor_decodes_to_zeros(dtype, n):
    """sign(0) = 0: a gradient of zeros (a layer that got none) moves nothing, alone, under
    error feedback (its one-pass form) and in a collective's combine."""
    z = torch.zeros(n, dtype=dtype)
    c = get_compressor("signsgd")
    p = c.compress(z)
    assert torch.equal(c.decompress(p), z)
    ef = ErrorFeedback(get_compressor("signsgd"))
    acc = ef.accumulate(z, "z")
    q = ef.compressor.compress_residual(acc, "z")
    assert torch.equal(c.decompress(q), z) and torch.equal(acc, torch.zeros_like(acc))
    out = torch.full((n,), 7.0, dtype=dtype)
    c.decompress_mean_into([p, q], out)
    assert torch.equal(out, z)


def test_zeros_beside_other_values_decode_as_plus_one():
    # one bit per element has no room for a third value: only a tensor that is zero everywhere
    # decodes to zeros; a zero among non-zero elements is sent as +1 (as the sign bit x >= 0 says)
    c = get_compressor("signsgd")
    out = c.decompress(c.compress(torch.tensor([0.0, -1.0, 0.0, 2.0])))
    assert out.tolist() == [1.0, -1.0, 1.0, 1.0]
