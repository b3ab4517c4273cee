"""Finite in, finite out: for every compressor, dtype and magnitude a finite tensor decodes to
a finite tensor of sane error, or compressing or decoding it raises a ``ValueError`` that names
the compressor, the dtype and the limit. The one documented exception: the 16-bit casts
(``fp16``, ``bf16``) send a value beyond the wire's own range as inf, as PyTorch's compression
hooks do. Then one test per defect that this rule once caught.
"""
import math
import re

import pytest
import torch

from gradcomp.compress import available_compressors, get_compressor

NAMES = available_compressors()
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SHAPES = [(7,), (1000,), (64, 48)]  # odd, several buckets, a matrix that powersgd compresses
MAGNITUDES = [1e-40, 1e-30, 1e-20, 1e-10, 1.0, 1e10, 1e20, 1e30, 3e38]
FLT_MAX = torch.finfo(torch.float32).max
WIRE_OVERFLOW = {"fp16": 65520.0, "bf16": 3.3961e38}  # IEEE round-to-nearest gives inf from here on


def magnitudes(dtype):
    """The grid clipped to the finite range of ``dtype``, plus its smallest subnormal, its
    smallest normal and its largest value."""
    fi = torch.finfo(dtype)
    sub = fi.tiny * fi.eps
    return sorted({min(max(m, sub), fi.max) for m in MAGNITUDES} | {sub, fi.tiny, fi.max})


def sample(shape, mag, dtype, seed=1):
    """Random signs times ``mag * U[0.5, 1]``, rounded to ``dtype``, with ``mag`` itself as the
    first element (the dtype's max, where that is the magnitude): finite by construction."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(shape, generator=g, dtype=torch.float64) * 0.5 + 0.5
    u.view(-1)[0] = 1.0
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).double()
    t = (u * sign * mag).to(dtype)
    assert torch.isfinite(t).all()
    return t


def rel_error(out, t):
    """||out - t|| / ||t||, both divided by max |t| first so that no norm overflows."""
    top = t.double().abs().max()
    a, b = out.double() / top, t.double() / top
    return float((a - b).norm() / b.norm())


def error_bound(name, numel):
    """The largest sane one-draw relative error: 1.5 (barely worse than sending zeros), as in
    test_common; randomk's rescaled draw has sqrt(n/k - 1) by design."""
    if name == "randomk":
        return 3.0 * math.sqrt(numel / max(1, round(0.01 * numel)))
    return 1.5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_finite_input_gives_finite_output_or_a_clear_error(name, dtype):
    """Every finite tensor from the smallest subnormal to the dtype's max decodes to a finite
    tensor of sane error; a ValueError is allowed only near the top of the range (the wire or
    the dtype cannot hold the result) and must name the compressor, the dtype and a limit."""
    dname = str(dtype).replace("torch.", "")
    for mag in magnitudes(dtype):
        for shape in SHAPES:
            t = sample(shape, mag, dtype)
            c = get_compressor(name)
            case = f"{name} {dname} |x|~{mag:.3g} {shape}"
            try:
                out = c.decompress(c.compress(t, key="k"))
            except ValueError as exc:
                msg = str(exc)
                assert mag >= min(torch.finfo(dtype).max, FLT_MAX) / 2**10, f"{case}: raised far from the top: {msg}"
                assert name in msg and dname in msg and any(ch.isdigit() for ch in msg), f"{case}: unclear: {msg}"
                continue
            assert out.dtype == dtype and out.shape == t.shape
            if name in WIRE_OVERFLOW and not (name == "bf16" and dtype == torch.float16):
                beyond = t.double().abs() >= WIRE_OVERFLOW[name]  # documented: the wire's own overflow
                assert torch.isinf(out[beyond]).all() and torch.isfinite(out[~beyond]).all(), case
                continue
            assert torch.isfinite(out).all(), f"{case}: finite input decoded to inf/NaN"
            if name == "signsgd":
                assert torch.equal(out, torch.where(t >= 0, 1.0, -1.0).to(dtype)), case
            elif name != "signum":  # signum's +-1 follow the momentum, not t
                rel = rel_error(out, t)
                assert rel <= error_bound(name, t.numel()), f"{case}: relative error {rel:.3g}"


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_input_at_extreme_magnitudes_stays_nonfinite(name):
    """A NaN or Inf among values near the top or the bottom of fp32's range still decodes to a
    non-finite tensor and never raises: the loss scaler must see it."""
    for mag in (1e-40, 1e30):
        for bad in (math.nan, math.inf):
            t = sample((33, 17), mag, torch.float32)
            t[3, 4] = bad
            c = get_compressor(name)
            out = c.decompress(c.compress(t, key="n"))
            assert not torch.isfinite(out).all(), f"{name}: {bad} among |x|~{mag} made finite"


# ---- one test per defect -----------------------------------------------------------------------

def test_randomk_rescale_beyond_fp16_is_a_clear_error():
    """randomk's n/k rescale of fp16 |x| > 65504 * k/n has no fp16 value: a ValueError saying
    the limit, never inf; just below the limit the decoding is finite and exact."""
    c = get_compressor("randomk", ratio=0.01)
    over = torch.full((1000,), 700.0, dtype=torch.float16)  # 700 * 100 > 65504
    with pytest.raises(ValueError, match=r"randomk.*float16.*65504.*655"):
        c.decompress(c.compress(over, key="w"))
    under = torch.full((1000,), 640.0, dtype=torch.float16)
    out = c.decompress(c.compress(under, key="w"))
    assert torch.isfinite(out).all() and set(out.unique().tolist()) == {0.0, 64000.0}


def test_bf16_never_decodes_finite_fp16_to_inf():
    """fp16's 65408..65504 round to bf16's 65536, beyond fp16: they are sent as 65280 (the
    largest bf16 value that fp16 holds); inf and NaN pass as they are."""
    c = get_compressor("bf16")
    t = torch.tensor([65504.0, -65504.0, 65408.0, 65280.0, 1.0, math.inf, -math.inf, math.nan], dtype=torch.float16)
    out = c.decompress(c.compress(t))
    assert out[:5].tolist() == [65280.0, -65280.0, 65280.0, 65280.0, 1.0]
    assert out[5] == math.inf and out[6] == -math.inf and torch.isnan(out[7])


@pytest.mark.parametrize("name", ["efsignsgd", "onebit"])
def test_sign_sums_that_overflow_fp32_stay_finite(name):
    """The per-chunk sums of 1e35 over 2**19 elements (two CPU chunks) exceed fp32; they are
    taken in fp64, so the decode value is the mean, 1e35, not inf."""
    t = torch.full((1 << 19,), 1e35)
    t[::2] = -1e35
    out = get_compressor(name).decompress(get_compressor(name).compress(t))
    assert torch.isfinite(out).all()
    assert torch.allclose(out.double(), t.double(), rtol=1e-6)


def test_sign_value_beyond_the_fp32_wire_is_a_clear_error():
    """An fp64 tensor whose decode value exceeds the fp32 wire raises; NaN input does not."""
    with pytest.raises(ValueError, match=r"efsignsgd.*float64.*float32 range"):
        get_compressor("efsignsgd").compress(torch.full((10,), 1e300, dtype=torch.float64))
    t = torch.full((10,), 1e300, dtype=torch.float64)
    t[2] = math.nan
    assert not torch.isfinite(get_compressor("efsignsgd").decompress(get_compressor("efsignsgd").compress(t))).all()


@pytest.mark.parametrize("dtype, mag", [(torch.float32, 1e-40), (torch.float32, 1e-43), (torch.bfloat16, 1e-40)],
                         ids=str)
@pytest.mark.parametrize("name, options", [("int8", {}), ("int8", {"stochastic": True}), ("qsgd", {}),
                                           ("qsgd", {"levels": 1}), ("terngrad", {})])
def test_subnormal_scales_decode_within_one_step(name, options, dtype, mag):
    """A block whose scale (int8, terngrad) or step norm/s (qsgd) is a float32 subnormal used
    to get an infinite reciprocal and decode to +-max|x|: now every element is within one step
    of its value."""
    t = sample((512,), mag, dtype)
    c = get_compressor(name, **options)
    p = c.compress(t, key="s")
    out = c.decompress(p).double()
    scale = p.tensors[0].double()
    per_block = scale / c.config.levels if name == "qsgd" else scale
    step = per_block.repeat_interleave(p.meta.get("block_size") or p.meta["bucket_size"])
    slack = torch.finfo(torch.float32).tiny * torch.finfo(torch.float32).eps  # one subnormal ulp
    assert ((out - t.double()).abs() <= step * (1 + 1e-6) + slack).all(), (out[:4], t[:4])


@pytest.mark.parametrize("name, options", [("qsgd", {}), ("qsgd", {"levels": 7}), ("terngrad", {}),
                                           ("int8", {"stochastic": True}), ("natural", {})])
def test_unbiased_compressors_stay_unbiased_at_subnormal_magnitudes(name, options):
    """The qsgd case: 512 values of ~1e-40 averaged 22x too large. The mean of 64 draws must be
    within 2% of the input's mean (one draw's standard error is below 1% here)."""
    t = sample((512,), 1e-40, torch.float32).abs()
    c = get_compressor(name, **options)
    draws = torch.stack([c.decompress(c.compress(t, key="u", step=s)).double() for s in range(64)])
    ratio = float(draws.mean() / t.double().mean())
    assert abs(ratio - 1) < 0.02, f"{name}: mean decodes to {ratio:.3f} x the input"


def test_qsgd_fp16_near_its_max_saturates_instead_of_inf():
    """qsgd rounds a value within one step of fp16's 65504 up past it: that decodes to 65504."""
    t = sample((1000,), 65504.0, torch.float16)
    c = get_compressor("qsgd")
    for step in range(8):
        out = c.decompress(c.compress(t, key="h", step=step))
        assert torch.isfinite(out).all() and out.abs().max() <= 65504


def test_quantizer_scale_beyond_fp32_names_compressor_and_dtype():
    """A scale the fp32 wire cannot hold is a ValueError that says who, for which dtype, and the limit."""
    for name in ("qsgd", "int8", "terngrad"):
        with pytest.raises(ValueError, match=rf"{name}: .*float64.*float32 range of the wire \(3.4e38\)"):
            get_compressor(name).compress(torch.tensor([1e300, 1.0], dtype=torch.float64))


def _rounds(compressors, tensors, key):
    """Drive ``rounds()`` of simulated ranks, sending back the mean of what they yield; the
    ranks must agree on the number of rounds."""
    gens = [c.rounds(t, key) for c, t in zip(compressors, tensors)]
    sent = [next(g) for g in gens]
    while True:
        avg = torch.stack(sent).mean(0)
        done, sent = [], []
        for g in gens:
            try:
                sent.append(g.send(avg.clone()))
            except StopIteration as stop:
                done.append(stop.value)
        if done:
            assert not sent, "ranks disagree on the number of rounds"
            return done


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_powersgd_near_the_float32_max_stays_finite(dtype):
    """P = M Q overflowed (then NaN) for finite M near 1e38: the round is repeated with Q scaled
    down, so the result is finite and as accurate as for the same matrix scaled to 1."""
    g = torch.Generator().manual_seed(4)
    base = torch.randn(64, 48, generator=g, dtype=torch.float64).clamp(-3, 3)
    big, unit = (base * 1e38).to(dtype), (base * 1.0).to(dtype)
    out = get_compressor("powersgd").decompress(get_compressor("powersgd").compress(big, key="w"))
    ref = get_compressor("powersgd").decompress(get_compressor("powersgd").compress(unit, key="w"))
    assert torch.isfinite(out).all()
    assert rel_error(out, big) == pytest.approx(rel_error(ref, unit), rel=1e-3)
    # two ranks through the multi-round protocol: the repeat happens on both, results agree
    ranks = [get_compressor("powersgd") for _ in range(2)]
    results = _rounds(ranks, [big, (base.flip(0) * 1e38).to(dtype)], "w")
    assert torch.isfinite(results[0]).all() and torch.equal(results[0], results[1])


def test_powersgd_fp16_near_its_max_saturates():
    """A rank-r approximation of an fp16 matrix near 65504 may exceed it: it saturates."""
    t = sample((64, 48), 65504.0, torch.float16)
    out = get_compressor("powersgd").decompress(get_compressor("powersgd").compress(t, key="w"))
    assert torch.isfinite(out).all() and out.abs().max() <= 65504


def test_randomk_rescale_beyond_fp16_is_flagged_in_a_transaction():
    """Inside a step (a collective's or the training runtime's transaction) the same overflow
    is not read back at the decode: it is a flag read with the step's finiteness, whose problem
    is the same sentence (the runtime raises it and keeps nothing)."""
    from gradcomp.compress.transaction import Transaction

    c = get_compressor("randomk", ratio=0.01)
    over = torch.full((1000,), 700.0, dtype=torch.float16)
    payload = c.compress(over, key="w")
    txn = Transaction()
    with txn.active():
        c.decompress(payload)
    assert len(txn.problems) == 1 and re.search(r"randomk.*float16.*65504.*655", txn.problems[0])
    txn = Transaction()
    with txn.active():
        c.decompress(c.compress(torch.full((1000,), 640.0, dtype=torch.float16), key="w"))
    assert txn.problems == []
