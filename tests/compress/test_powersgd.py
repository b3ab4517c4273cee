"""powersgd: P Q^T by one warm-started power iteration. The multi-round protocol, driven here by
hand for two simulated ranks, gives exactly the PowerSGD math on the average; a rank-r matrix
is reproduced; small tensors go dense; the warm start survives state_dict()."""
import math

import pytest
import torch

from gradcomp.compress import ErrorFeedback, Payload, get_compressor
from gradcomp.kernels.linalg import METHODS, orthonormalize


def _averaged_rounds(compressors, tensors, key, outs=None):
    """Drive ``rounds()`` of every simulated rank, sending back the mean of what they yield."""
    outs = outs or [None] * len(tensors)
    gens = [c.rounds(t, key, out=o) for c, t, o in zip(compressors, tensors, outs)]
    sent = [next(g) for g in gens]
    yielded = []
    while True:
        yielded.append([s.clone() for s in sent])
        avg = torch.stack(sent).mean(0)
        results = []
        for g in gens:
            try:
                results.append(("yield", g.send(avg.clone())))
            except StopIteration as stop:
                results.append(("done", stop.value))
        if all(kind == "done" for kind, _ in results):
            return [v for _, v in results], yielded
        assert all(kind == "yield" for kind, _ in results), "ranks disagree on the number of rounds"
        sent = [v for _, v in results]


def _low_rank(n, m, r, gen, dtype=torch.float32):
    a = torch.randn(n, r, generator=gen, dtype=torch.float64)
    return (a @ torch.randn(r, m, generator=gen, dtype=torch.float64)).to(dtype)


def test_two_ranks_follow_the_powersgd_math():
    gen = torch.Generator().manual_seed(5)
    steps = [[torch.randn(20, 4, 3, generator=gen) for _ in range(2)] for _ in range(3)]
    ranks = [get_compressor("powersgd", rank=3, seed=7) for _ in range(2)]
    start = ranks[0]._draw("w", 12, 3, torch.device("cpu"), torch.float32)  # the seeded first Q
    outputs, saved = [], None
    for i, grads in enumerate(steps):
        results, yielded = _averaged_rounds(ranks, grads, "w")
        assert len(yielded) == 2  # P, then Q
        mats = [g.reshape(20, 12) for g in grads]
        mean = (mats[0] + mats[1]) / 2
        assert torch.allclose(yielded[0][0], mats[0] @ start, atol=1e-5), "P is not M Q with the warm-start Q"
        p = orthonormalize(mean @ start)
        q = mean.T @ p
        for r in results:
            assert torch.equal(results[0], r), "ranks disagree"
            assert torch.allclose(r, (p @ q.T).reshape(20, 4, 3), atol=1e-5)
        # warm start: the averaged Q is kept, identically on both ranks, and starts the next step
        assert torch.allclose(ranks[0]._q["w"], q, atol=1e-5) and torch.equal(ranks[0]._q["w"], ranks[1]._q["w"])
        start = ranks[0]._q["w"]
        outputs.append(results[0])
        if i == 1:
            saved = [c.state_dict() for c in ranks]
    # state_dict round trip: ranks resumed after step 1 redo step 2 bit for bit
    resumed = [get_compressor("powersgd", rank=3, seed=7) for _ in range(2)]
    for c, sd in zip(resumed, saved):
        c.load_state_dict(sd)
    assert torch.equal(_averaged_rounds(resumed, steps[2], "w")[0][0], outputs[2])


def test_rounds_of_a_skipped_tensor_average_it_once():
    ranks = [get_compressor("powersgd") for _ in range(2)]
    grads = [torch.randn(5, 3), torch.randn(5, 3)]  # 15 < 2 * (5+3) * 3: sent dense
    results, yielded = _averaged_rounds(ranks, grads, "b")
    assert len(yielded) == 1
    assert torch.equal(results[0], (grads[0] + grads[1]) / 2) and torch.equal(results[0], results[1])


def test_yielded_tensors_are_fresh_and_error_feedback_rounds():
    """The caller may average in place; ErrorFeedback.rounds keeps acc - result."""
    ef = ErrorFeedback(get_compressor("powersgd", rank=2))
    g = torch.randn(16, 16)
    gen = ef.rounds(g, "w")
    p = next(gen)
    p.mul_(1.0)  # an in-place "average" over one rank
    q = gen.send(p)
    try:
        gen.send(q)
    except StopIteration as stop:
        result = stop.value
    assert torch.allclose(g, result + ef.residual("w"), atol=1e-6)
    dense = ErrorFeedback(get_compressor("powersgd")).rounds(g[0], "b")
    sent = next(dense)
    sent.zero_()  # must not be the accumulator itself
    with pytest.raises(StopIteration):
        dense.send(sent)


@pytest.mark.parametrize("ef", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(40, 3, 3), (7,), (2, 2)])  # compressed, dense (1-D), dense (too small)
def test_out_receives_the_same_bits_even_when_it_is_the_input(ef, dtype, shape):
    """``out=tensor`` (how the DDP hook calls it): the result lands in the gradient's memory,
    with the bits, residuals and warm start of the call without ``out``, over several steps."""
    def make():
        return [ErrorFeedback(get_compressor("powersgd", rank=2)) if ef else get_compressor("powersgd", rank=2)
                for _ in range(2)]

    plain, into = make(), make()
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        grads = [torch.randn(shape, generator=gen).to(dtype) for _ in range(2)]
        want, _ = _averaged_rounds(plain, [g.clone() for g in grads], "w")
        got, _ = _averaged_rounds(into, grads, "w", outs=grads)
        for w, g, mem in zip(want, got, grads):
            assert g.data_ptr() == mem.data_ptr() and g.dtype == dtype and g.shape == torch.Size(shape)
            assert torch.equal(g, w), (step, dtype)
        if ef:
            assert all(torch.equal(a.residual("w"), b.residual("w")) for a, b in zip(plain, into))


def test_bad_out_is_refused_before_anything_changes():
    c = get_compressor("powersgd")
    g = torch.randn(8, 8)
    for out in (torch.zeros(64), torch.zeros(8, 8, dtype=torch.float64), torch.zeros(8, 16)[:, ::2]):
        with pytest.raises(ValueError, match="out must be a contiguous tensor"):
            next(c.rounds(g, "w", out=out))
    assert "w" not in c.state_dict().get("q", {})


def test_average_of_the_wrong_shape_is_a_clear_error():
    gen = get_compressor("powersgd").rounds(torch.randn(16, 16), "w")
    next(gen)
    with pytest.raises(ValueError, match="shape"):
        gen.send(torch.zeros(3, 3))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)], ids=str)
def test_rank_r_matrix_is_reproduced(method, dtype, tol):
    gen = torch.Generator().manual_seed(6)
    m = _low_rank(40, 30, 3, gen, dtype)
    c = get_compressor("powersgd", rank=3, orthogonalize=method)
    for _ in range(2):
        out = c.decompress(c.compress(m, key="w"))
    assert out.dtype == dtype
    assert (out - m).norm() / m.norm() < tol


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_works_in_fp32(dtype):
    gen = torch.Generator().manual_seed(8)
    m = _low_rank(32, 24, 2, gen, dtype)
    c = get_compressor("powersgd", rank=2)
    p = c.compress(m, key="w")
    assert [t.dtype for t in p.tensors] == [torch.float32, torch.float32]
    out = c.decompress(p)
    assert out.dtype == dtype
    eps = torch.finfo(dtype).eps  # the input is rank 2 only up to its own rounding
    assert (out.float() - m.float()).norm() / m.float().norm() < 8 * eps


def test_warm_start_converges_to_the_best_rank_r_approximation():
    gen = torch.Generator().manual_seed(9)
    u, _ = torch.linalg.qr(torch.randn(60, 60, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(50, 50, generator=gen, dtype=torch.float64))
    s = 0.5 ** torch.arange(50, dtype=torch.float64)
    m = (u[:, :50] * s) @ v.T
    best = torch.linalg.vector_norm(s[2:]).item()
    c = get_compressor("powersgd", rank=2)
    errors = [(c.decompress(c.compress(m, key="w")) - m).norm().item() for _ in range(8)]
    assert errors[-1] < 1.01 * best < errors[0]


def test_skip_rule_and_matrix_view():
    c = get_compressor("powersgd", rank=4, min_compression_rate=2)
    assert c.plan((10,)) is None and c.plan(()) is None and c.plan((0, 7)) is None
    assert c.plan((16, 16)) == (16, 16, 4)  # 256 / (32 * 4) = 2: compressed
    assert c.plan((15, 16)) is None  # 240 / (31 * 4) < 2: dense
    assert c.plan((16, 2, 3, 4)) == (16, 24, 4)
    assert c.plan((8, 2, 3, 4)) is None  # 192 / (32 * 4) < 2
    assert c.plan((3, 500)) is None  # rank capped at 3: 1500 / (503 * 3) < 2
    assert get_compressor("powersgd", rank=1).plan((3, 500)) == (3, 500, 1)
    x = torch.randn(15, 16)
    p = c.compress(x)
    assert p.meta == {"dense": True} and torch.equal(c.decompress(p), x)
    p = c.compress(torch.randn(16, 2, 3, 4))
    assert p.meta == {"dense": False}
    assert [tuple(t.shape) for t in p.tensors] == [(16, 4), (24, 4)]
    assert p.nbytes == 4 * (16 + 24) * 4
    assert c.bits_per_element(1 << 16) == pytest.approx(32 * 2 * 256 * 4 / (1 << 16))


@pytest.mark.parametrize("method", METHODS)
def test_zero_gradient_does_not_kill_the_warm_start(method):
    c = get_compressor("powersgd", rank=2, orthogonalize=method)
    assert torch.equal(c.decompress(c.compress(torch.zeros(20, 20), key="w")), torch.zeros(20, 20))
    gen = torch.Generator().manual_seed(10)
    m = _low_rank(20, 20, 2, gen)
    out = c.decompress(c.compress(m, key="w"))
    assert (out - m).norm() / m.norm() < 1e-5


def test_nonfinite_gradient_propagates_and_spares_the_warm_start():
    c = get_compressor("powersgd", rank=2)
    c.compress(torch.randn(20, 20), key="w")
    kept = c._q["w"].clone()
    bad = torch.randn(20, 20)
    bad[3, 4] = float("nan")
    assert not torch.isfinite(c.decompress(c.compress(bad, key="w"))).all()
    assert torch.equal(c._q["w"], kept)
    assert torch.isfinite(c.decompress(c.compress(torch.randn(20, 20), key="w"))).all()


def test_seed_and_key_choose_the_start_and_nothing_else_does():
    x = torch.randn(30, 30)
    pairs = [(0, "a"), (0, "a"), (1, "a"), (0, "b")]
    first = [get_compressor("powersgd", seed=s).compress(x, key=k).tensors[0] for s, k in pairs]
    assert torch.equal(first[0], first[1])
    assert not torch.allclose(first[0], first[2]) and not torch.allclose(first[0], first[3])


def test_payload_checks():
    c = get_compressor("powersgd")
    p = c.compress(torch.randn(30, 30), key="w")
    assert Payload.from_bytes(p.to_bytes()).meta == {"dense": False}
    p.tensors[1] = p.tensors[1][:-1]
    with pytest.raises(ValueError, match="powersgd"):
        Payload.from_bytes(p.to_bytes())
    p = c.compress(torch.randn(30, 30), key="w")
    p.meta["dense"] = True
    with pytest.raises(ValueError, match="powersgd"):
        Payload.from_bytes(p.to_bytes())


def test_options_and_key_errors():
    for bad in [{"rank": 0}, {"min_compression_rate": 0.5}, {"min_compression_rate": math.inf},
                {"orthogonalize": "svd"}]:
        with pytest.raises(ValueError, match="allowed|must be"):
            get_compressor("powersgd", **bad)
    c = get_compressor("powersgd")
    c.compress(torch.randn(20, 20), key="w")
    with pytest.raises(ValueError, match="distinct key"):
        c.compress(torch.randn(20, 30), key="w")


@pytest.mark.parametrize("method", METHODS)
def test_orthonormalize_rank_deficient_and_nonfinite(method):
    gen = torch.Generator().manual_seed(11)
    for p in (torch.randn(30, 4, generator=gen), torch.randn(30, 1, generator=gen) @ torch.randn(1, 4, generator=gen),
              torch.zeros(30, 4)):
        q = orthonormalize(p, method)
        assert torch.isfinite(q).all()
        gram = q.T @ q
        assert torch.allclose(gram, torch.diag(gram.diagonal()), atol=1e-5)  # orthogonal columns
        assert torch.all(((gram.diagonal() - 1).abs() < 1e-5) | (gram.diagonal() == 0))  # unit or zero
        assert torch.allclose(q @ (q.T @ p), p, atol=1e-5)  # spans the columns of p
    for bad in (float("nan"), float("inf")):
        p = torch.randn(30, 4, generator=gen)
        p[2, 1] = bad
        assert not torch.isfinite(orthonormalize(p, method)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
def test_cuda_matches_cpu(method):
    gen = torch.Generator().manual_seed(12)
    grads = [torch.randn(64, 8, 4, generator=gen) for _ in range(2)]
    cpu = [get_compressor("powersgd", rank=3, orthogonalize=method) for _ in range(2)]
    gpu = [get_compressor("powersgd", rank=3, orthogonalize=method) for _ in range(2)]
    for _ in range(2):
        want, _ = _averaged_rounds(cpu, grads, "w")
        got, _ = _averaged_rounds(gpu, [g.cuda() for g in grads], "w")
        assert got[0].is_cuda and torch.equal(got[0], got[1])
        assert torch.allclose(got[0].cpu(), want[0], atol=1e-4)
    c = gpu[0]
    m = _low_rank(40, 30, 3, gen).cuda()
    for _ in range(2):
        out = c.decompress(c.compress(m, key="m"))
    assert out.is_cuda and (out - m).norm() / m.norm() < 1e-5


# ---- the device form (two rounds always, nothing read), run here on CPU tensors -------------------

def _device_form(monkeypatch):
    from gradcomp.compress import powersgd

    monkeypatch.setattr(powersgd, "_on_device", lambda t: True)


def _steps(x_of_step, method="qr", ef=False, steps=3):
    """Decodings of ``steps`` steps of one compressor (error feedback's rounds when ``ef``)."""
    c = get_compressor("powersgd", rank=2, orthogonalize=method)
    codec = ErrorFeedback(c) if ef else c
    outs = []
    for step in range(steps):
        x = x_of_step(step)
        if ef:
            outs.append(_averaged_rounds([codec], [x], "k", [torch.empty_like(x)])[0][0])
        else:
            outs.append(c.decompress(c.compress(x, key="k")))
    return outs, c


def _ordinary(dtype, shape=(40, 3, 11)):
    def x_of_step(step):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(shape, generator=g).to(dtype)
        if step == 1:
            x.view(shape[0], -1)[:, 4] = 0.0  # a column the warm start loses, drawn anew next step
        if step == 2:
            x.view(shape[0], -1)[5, :] *= 1e3  # a row that dominates
        return x
    return x_of_step


@pytest.mark.parametrize("ef", [False, True])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_device_form_gives_the_cpu_bits_on_ordinary_data(dtype, method, ef, monkeypatch):
    """Off the CPU the factors are scaled by powers of two before each product and the rounds
    are never repeated; on data of ordinary magnitude that changes no bit of any decoding, over
    warm-started steps, a dead column and error feedback's residual."""
    reference, _ = _steps(_ordinary(dtype), method, ef)
    _device_form(monkeypatch)
    got, c = _steps(_ordinary(dtype), method, ef)
    for step, (a, b) in enumerate(zip(reference, got)):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b), (step, float((a.double() - b.double()).abs().max()))
    assert torch.isfinite(c._q["k"]).all()


MAGNITUDES = [1e-40, 1e-30, 1e-20, 1e-10, 1.0, 1e10, 1e20, 1e30, 3e38]


@pytest.mark.parametrize("form", ["cpu", "device"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_both_forms_are_finite_at_every_magnitude(dtype, form, monkeypatch):
    """As tests/compress/test_finite.py asks of every compressor, over warm-started steps
    (where the CPU form repeats rounds): finite input decodes to a finite tensor of sane error
    at every magnitude, up to the dtype's largest value; NaN and Inf stay non-finite and leave
    the warm start as it was."""
    if form == "device":
        _device_form(monkeypatch)
    fi = torch.finfo(dtype)
    for mag in sorted({min(max(m, fi.tiny * fi.eps), fi.max) for m in MAGNITUDES} | {fi.tiny, fi.max}):
        def x_of_step(step):
            g = torch.Generator().manual_seed(step)
            u = torch.rand(64, 48, generator=g, dtype=torch.float64) * 0.5 + 0.5
            u[0, 0] = 1.0
            sign = torch.where(torch.rand(64, 48, generator=g) < 0.5, -1.0, 1.0).double()
            return (u * sign * mag).to(dtype)
        outs, c = _steps(x_of_step)
        for step, out in enumerate(outs):
            x = x_of_step(step)
            assert torch.isfinite(out).all(), (mag, step)
            top = x.double().abs().max()
            rel = float((out.double() / top - x.double() / top).norm() / (x.double() / top).norm())
            assert rel <= 1.5, (mag, step, rel)
        kept = c._q["k"].clone()
        for bad in (math.nan, math.inf):
            x = x_of_step(5)
            x[3, 4] = bad
            assert not torch.isfinite(c.decompress(c.compress(x, key="k"))).all(), (mag, bad)
            assert torch.equal(c._q["k"], kept), (mag, bad)


def test_device_form_product_saturates_where_the_plain_product_overflows(monkeypatch):
    """P Q^T near fp32's top: the device bound scales the factors down, so the sum cannot
    overflow to inf - inf = NaN, and entries beyond the dtype saturate to its largest value,
    as the CPU form's float64 product does; fp16 output saturates at 65504."""
    from gradcomp.compress.powersgd import _product_cpu, _product_on_device

    p = torch.tensor([[1.0, 1.0], [1.0, -1.0], [0.5, 0.25]])
    q = torch.tensor([[3e38, -3e38], [3e38, 3e38], [1.0, 2.0]])
    plain = torch.mm(p, q.T)
    assert not torch.isfinite(plain).all()
    want = _product_cpu(p, q, torch.float32)
    got = _product_on_device(p, q, torch.float32)
    assert torch.isfinite(got).all() and torch.equal(got, want), (got, want)
    small = torch.tensor([[300.0, 1.0], [-300.0, 2.0]])
    assert torch.equal(_product_on_device(small, small, torch.float16), _product_cpu(small, small, torch.float16))
    assert _product_on_device(small, small, torch.float16).abs().max() == 65504.0
    nan = p.clone()
    nan[0, 0] = math.nan
    assert torch.isnan(_product_on_device(nan, q, torch.float32)[0]).all()


def test_device_form_reads_nothing_back(monkeypatch):
    """What the hook calls on every step (rounds, with error feedback) makes no host read in
    the device form: the counter of tests/training/test_host_syncs.py sees none."""
    from syncs import HostSyncs

    _device_form(monkeypatch)
    codec = ErrorFeedback(get_compressor("powersgd", rank=2))
    x_of_step = _ordinary(torch.float32)
    _averaged_rounds([codec], [x_of_step(0)], "k", [torch.empty(40, 3, 11)])
    with HostSyncs() as syncs:
        for step in (1, 2):
            _averaged_rounds([codec], [x_of_step(step)], "k", [torch.empty(40, 3, 11)])
    assert syncs.count == 0, syncs.report()
