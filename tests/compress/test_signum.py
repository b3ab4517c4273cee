"""signum: the sign of a per-key momentum m = beta*m + (1-beta)*g, decoded as +1 / -1; the
momentum survives state_dict() and is not touched by a non-finite gradient."""
import pytest
import torch

from gradcomp.compress import ErrorFeedback, get_compressor


def _sign(t):
    return torch.where(t >= 0, 1.0, -1.0)


def test_sign_of_momentum_across_steps():
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(64, 8, generator=gen, dtype=torch.float64) for _ in range(5)]
    c = get_compressor("signum", momentum=0.8)
    m = torch.zeros(64, 8, dtype=torch.float64)
    for g in grads:
        m = 0.8 * m + 0.2 * g
        out = c.decompress(c.compress(g.float(), key="w"))
        clear = m.abs() > 1e-5  # fp32 rounding may flip a sign only next to zero
        assert torch.equal(out[clear], _sign(m)[clear].float())
        assert torch.allclose(c.momentum_buffer("w").double(), m.reshape(-1), atol=1e-6)


def test_first_step_is_the_sign_of_the_gradient_and_keys_are_separate():
    c = get_compressor("signum")
    a, b = torch.randn(50), torch.randn(50)
    assert torch.equal(c.decompress(c.compress(a, key="a")), _sign(a))
    assert torch.equal(c.decompress(c.compress(b, key="b")), _sign(b))
    assert torch.allclose(c.momentum_buffer("a"), 0.1 * a) and torch.allclose(c.momentum_buffer("b"), 0.1 * b)


def test_zero_momentum_is_signsgd():
    x = torch.randn(100)
    s, ref = get_compressor("signum", momentum=0.0), get_compressor("signsgd")
    s.compress(torch.randn(100), key="w")
    assert torch.equal(s.decompress(s.compress(x, key="w")), ref.decompress(ref.compress(x)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_momentum_dtype(dtype):
    c = get_compressor("signum")
    out = c.decompress(c.compress(torch.randn(30).to(dtype), key="w"))
    assert out.dtype == dtype
    assert c.momentum_buffer("w").dtype == (torch.float64 if dtype == torch.float64 else torch.float32)


def test_state_dict_round_trip():
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(200, generator=gen) for _ in range(6)]
    c = get_compressor("signum", momentum=0.5)
    for g in grads[:3]:
        c.compress(g, key="w")
    sd = c.state_dict()
    assert torch.equal(sd["momentum"]["w"], c.momentum_buffer("w"))
    rest = [c.decompress(c.compress(g, key="w")) for g in grads[3:]]
    fresh = get_compressor("signum", momentum=0.5)
    fresh.load_state_dict(sd)
    assert [torch.equal(a, fresh.decompress(fresh.compress(g, key="w"))) for a, g in zip(rest, grads[3:])] == [True] * 3
    with pytest.raises(ValueError, match="config"):
        get_compressor("signum", momentum=0.7).load_state_dict(sd)


def test_nonfinite_gradient_leaves_momentum_untouched():
    c = get_compressor("signum")
    c.compress(torch.randn(40), key="w")
    before = c.momentum_buffer("w")
    bad = torch.randn(40)
    bad[7] = float("nan")
    assert torch.isnan(c.decompress(c.compress(bad, key="w"))).all()
    assert torch.equal(c.momentum_buffer("w"), before)


def test_error_feedback_invariant_holds_with_momentum():
    ef = ErrorFeedback(get_compressor("signum"))
    for _ in range(3):
        g = torch.randn(25)
        old = ef.residual("w").clone()
        out = ef.decompress(ef.compress(g, key="w"))
        assert torch.allclose(g + old, out + ef.residual("w"), atol=1e-6)


def test_bad_options_and_keys():
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="momentum"):
            get_compressor("signum", momentum=bad)
    c = get_compressor("signum")
    c.compress(torch.randn(10), key="w")
    with pytest.raises(ValueError, match="distinct key"):
        c.compress(torch.randn(11), key="w")
    assert c.bits_per_element(1 << 16) == pytest.approx(1 + 32 / (1 << 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_the_device_form_matches_the_cpu_form(dtype, monkeypatch):
    """Off the CPU the finiteness is decided on the device (``_signal_on_device``, nothing read
    back); run here on CPU tensors it gives the CPU form's payloads, decodings and momenta,
    finite steps and NaN/Inf steps alike, inside a transaction and outside one."""
    from gradcomp.compress.signum import Signum
    from gradcomp.compress.transaction import Transaction

    g = torch.Generator().manual_seed(1)
    steps = [torch.randn(300, generator=g).to(dtype) for _ in range(4)]
    steps[2][7] = float("nan")
    steps[3][0] = float("inf")
    ref, dev = get_compressor("signum"), get_compressor("signum")
    monkeypatch.setattr(dev, "_signal", dev._signal_on_device)
    for i, x in enumerate(steps):
        for c in (ref, dev):
            txn = Transaction()
            with txn.active():
                c.payload = c.compress(x, key="w")
            txn.commit()
        a, b = ref.payload, dev.payload
        assert torch.equal(a.tensors[1], b.tensors[1]) or (a.tensors[1].isnan().all() and b.tensors[1].isnan().all())
        if not a.tensors[1].isnan().any():
            assert torch.equal(a.tensors[0], b.tensors[0]), i
        assert torch.equal(ref.momentum_buffer("w"), dev.momentum_buffer("w")), i
        out_a, out_b = ref.decompress(a), dev.decompress(b)
        assert torch.equal(out_a.isnan(), out_b.isnan()) and torch.equal(out_a.nan_to_num(), out_b.nan_to_num()), i
    assert isinstance(Signum._signal_on_device(dev, steps[0], "w")[1], torch.Tensor)


@pytest.mark.parametrize("form", ["cpu", "device"])  # the host-read form, and the one other devices take
@pytest.mark.parametrize("n", [7, 1 << 15])
def test_an_all_zero_momentum_decodes_to_zeros(form, n):
    """sign(0) = 0: a zero gradient into a fresh (zero) momentum moves nothing; once the
    momentum holds a past gradient, a zero gradient sends the momentum's signs."""
    c = get_compressor("signum")
    if form == "device":
        c._signal = c._signal_on_device
    z = torch.zeros(n)
    assert torch.equal(c.decompress(c.compress(z, key="w")), z)
    g = torch.randn(n)
    c.compress(g, key="w")
    assert torch.equal(c.decompress(c.compress(z, key="w")), _sign(g))
