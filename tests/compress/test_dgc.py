"""dgc: the sampled threshold still yields the exact top-k; DGCMomentum keeps
v_old + u_new == decompress(payload) + v_new, masks the velocity where it sent, clips locally
and resumes bit-identically from its state_dict."""
import pytest
import torch

from gradcomp.compress import DGCMomentum, ErrorFeedback, get_compressor


def _u_new(u_old, g, m, clip=None):
    """DGC's velocity before masking, computed independently of the class."""
    g = g.to(u_old.dtype)
    if clip is not None and float(g.norm()) > clip:
        g = g * (clip / float(g.norm()))
    return m * u_old + g


@pytest.mark.parametrize("sample_ratio", [0.0001, 0.01, 1.0])
def test_selection_is_the_exact_top_k(sample_ratio):
    x = torch.randint(-30, 30, (400_000,)).float()  # ties at the k-th magnitude
    x[1234] = float("nan")
    c = get_compressor("dgc", ratio=0.01, sample_ratio=sample_ratio)
    p = c.compress(x, key="w")
    assert torch.equal(p.tensors[1], get_compressor("topk", ratio=0.01).compress(x).tensors[1])
    kept = p.tensors[1].long()
    assert kept.numel() == 4000 and 1234 in kept.tolist()
    # quality: no element left out is larger than one sent
    dropped = torch.ones(x.numel(), dtype=torch.bool)
    dropped[kept] = False
    sent = x[kept].abs()
    assert float(x[dropped].abs().max()) <= float(sent[~sent.isnan()].min())


def test_same_size_as_topk_and_different_default():
    c = get_compressor("dgc")
    assert c.config.ratio == 0.001 and c.fixed_size and c.stochastic
    n = 1 << 16
    assert 8 * c.compress(torch.randn(n)).nbytes == pytest.approx(c.bits_per_element(n) * n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("name", ["dgc", "topk", "randomk", "fp16"])
def test_momentum_invariant(name, dtype):
    """v_old + u_new == decompress(payload) + v_new at every step, for any compressor."""
    m, clip = 0.9, 3.0
    dgc = DGCMomentum(get_compressor(name, **({"ratio": 0.05} if name != "fp16" else {})), momentum=m, clip_norm=clip)
    wd = torch.float64 if dtype == torch.float64 else torch.float32
    u = torch.zeros(30, 20, dtype=wd)
    for step in range(5):
        g = torch.randn(30, 20, dtype=torch.float64).to(dtype)
        v_old = dgc.residual("w").clone()
        u_new = _u_new(u, g, m, clip)
        p = dgc.compress(g, key="w")
        v_new = dgc.residual("w")
        assert v_new.dtype == wd
        out = dgc.decompress(p)
        assert out.dtype == dtype
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        assert torch.allclose(v_old + u_new, out.to(wd) + v_new, rtol=tol, atol=tol), (name, step)
        sent = out != 0
        # momentum factor masking: the velocity is cleared exactly where an element was sent
        vel = dgc.velocity("w")
        assert torch.all(vel[sent] == 0) and torch.allclose(vel[~sent], u_new[~sent], rtol=tol, atol=tol)
        if name in ("dgc", "topk") and dtype != torch.bfloat16:  # bf16 output keeps its rounding in v
            assert torch.all(v_new[sent] == 0), "a sparsifier leaves no accumulation where it sent"
        u = dgc.velocity("w")


def test_two_step_protocol_for_collectives():
    """accumulate/update, used to compress pieces separately, keeps the invariant and masking;
    on the whole tensor it is exactly compress."""
    whole, parts, split = (DGCMomentum(get_compressor("topk", ratio=0.1)) for _ in range(3))
    for _ in range(3):
        g = torch.randn(8, 25)
        whole.compress(g, key="w")
        acc = parts.accumulate(g, key="w")
        parts.update("w", acc, parts.compressor.compress_decoded(acc, key="w")[1])
        assert torch.equal(whole.residual("w"), parts.residual("w"))
        assert torch.equal(whole.velocity("w"), parts.velocity("w"))
        acc = split.accumulate(g, key="w")
        pieces = [split.compressor.compress_decoded(p, key=f"w{i}")[1] for i, p in enumerate(acc.reshape(-1).chunk(2))]
        sent = torch.cat(pieces)
        split.update("w", acc, sent)  # a flat decoding is accepted
        assert torch.equal(split.residual("w").reshape(-1) + sent, acc.reshape(-1))
        assert torch.all(split.velocity("w").reshape(-1)[sent != 0] == 0)


def test_masking_off_keeps_the_velocity():
    dgc = DGCMomentum(get_compressor("dgc", ratio=0.1), momentum=0.5, masking=False)
    g = torch.randn(100)
    dgc.compress(g, key="w")
    dgc.compress(g, key="w")
    assert torch.allclose(dgc.velocity("w"), 1.5 * g)


def test_momentum_zero_is_plain_error_feedback():
    dgc = DGCMomentum(get_compressor("topk", ratio=0.05), momentum=0.0)
    ef = ErrorFeedback(get_compressor("topk", ratio=0.05))
    for _ in range(4):
        g = torch.randn(500)
        a, b = dgc.compress(g, key="w"), ef.compress(g, key="w")
        assert all(torch.equal(s, t) for s, t in zip(a.tensors, b.tensors))
        assert torch.equal(dgc.residual("w"), ef.residual("w"))


def test_clipping_is_local_and_skips_nonfinite():
    """First step: u_new is the clipped gradient, and it equals what was sent plus v_new."""
    def first_step(g):
        dgc = DGCMomentum(get_compressor("dgc", ratio=0.1), clip_norm=1.0)
        out = dgc.decompress(dgc.compress(g, key="w"))
        return out, out + dgc.residual("w")

    g = torch.randn(200) * 10
    _, u_new = first_step(g)
    assert torch.allclose(u_new, g / g.norm(), atol=1e-6)
    small = torch.full((200,), 1e-3)  # norm below clip_norm: untouched
    assert torch.equal(first_step(small)[1], small)
    bad = torch.randn(200)
    bad[5] = float("nan")
    out, _ = first_step(bad)
    assert torch.isnan(out[5])


def test_state_dict_resumes_identically():
    make = lambda: DGCMomentum(get_compressor("dgc", ratio=0.05), momentum=0.8, clip_norm=5.0)  # noqa: E731
    data = [torch.randn(40, 30) for _ in range(5)]
    a = make()
    for g in data[:2]:
        a.compress(g, key="w")
    sd = a.state_dict()
    rest = [a.decompress(a.compress(g, key="w")) for g in data[2:]]
    b = make()
    b.load_state_dict(sd)
    again = [b.decompress(b.compress(g, key="w")) for g in data[2:]]
    assert all(torch.equal(x, y) for x, y in zip(rest, again))
    assert torch.equal(a.velocity("w"), b.velocity("w")) and torch.equal(a.residual("w"), b.residual("w"))
    with pytest.raises(ValueError, match="config"):
        DGCMomentum(get_compressor("dgc", ratio=0.05), momentum=0.5, clip_norm=5.0).load_state_dict(sd)


def test_bad_arguments():
    with pytest.raises(ValueError, match="momentum"):
        DGCMomentum("dgc", momentum=1.0)
    with pytest.raises(ValueError, match="clip_norm"):
        DGCMomentum("dgc", clip_norm=0.0)
    with pytest.raises(ValueError, match="masking"):
        DGCMomentum("dgc", masking=1)
    with pytest.raises(ValueError, match="once"):
        DGCMomentum(ErrorFeedback("dgc"))
    with pytest.raises(ValueError, match="without a preceding accumulate"):
        DGCMomentum("dgc").update("w", torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="sample_ratio"):
        get_compressor("dgc", sample_ratio=0.0)
    assert DGCMomentum("dgc").residual("never").shape == ()
