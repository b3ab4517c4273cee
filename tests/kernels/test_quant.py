"""Quantisation primitives: each equals a plain formula exactly (they are the oracle of the CUDA
kernels), ragged blocks and CPU chunks change nothing, and NaN/Inf are never lost."""
import math

import pytest
import torch

from gradcomp.kernels import quant
from gradcomp.kernels.bits import pack_codes, pack_codes_reference, unpack_codes, unpack_codes_reference

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.fixture
def small_chunks(monkeypatch):
    """CPU chunks of 64 elements, so small tensors cross many chunk boundaries."""
    monkeypatch.setattr(quant, "_CHUNK", 64)


def _blocks(x, bs):
    return [x[i:i + bs] for i in range(0, x.numel(), bs)]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n,bs", [(0, 4), (1, 4), (10, 4), (12, 4), (7, 100), (300, 1)])
def test_block_absmax_and_norms_match_per_block_loop(n, bs, dtype):
    x = torch.randn(n, dtype=torch.float64).to(dtype)
    amax = quant.block_absmax(x, bs)
    norms = quant.bucket_norms(x, bs)
    assert amax.dtype == dtype and amax.numel() == quant.num_blocks(n, bs)
    for i, b in enumerate(_blocks(x, bs)):
        assert amax[i] == b.abs().max()
        assert math.isclose(float(norms[i]), float(b.double().norm()), rel_tol=1e-2 if dtype.itemsize == 2 else 1e-6)


def test_block_absmax_propagates_nan_and_inf():
    x = torch.ones(12)
    x[1], x[6] = math.nan, -math.inf
    amax = quant.block_absmax(x, 4)
    assert math.isnan(amax[0]) and amax[1] == math.inf and amax[2] == 1
    norms = quant.bucket_norms(x, 4)
    assert math.isnan(norms[0]) and norms[1] == math.inf and norms[2] == 2


def test_bucket_norms_neither_overflow_nor_underflow():
    """A sum of squares in fp32 overflows at 1e19 and underflows at 1e-19; the norms do not."""
    x = torch.tensor([1e20, -1e20, 3e-30, 4e-30, 0.0, 0.0, 5e-40, 0.0, 3e38, 3e38])
    norms = quant.bucket_norms(x, 2)
    expected = [math.sqrt(2) * 1e20, 5e-30, 0.0, 5e-40, math.inf]  # the last exceeds fp32
    for got, want in zip(norms.tolist(), expected):
        assert got == want or math.isclose(got, want, rel_tol=1e-6), (got, want)


def test_bucket_norms_second_look_off_the_cpu_is_the_same():
    """Tensors off the CPU take the second look on every bucket (``_norms_again``, nothing read
    back); it keeps what the CPU's read-back branch computes, for tiny, huge, zero, inf and NaN
    buckets and a ragged tail."""
    x = torch.tensor([1e20, -1e20, 3e-30, 4e-30, 0.0, 0.0, 5e-40, 0.0, 3e38, 3e38, math.inf, 1.0, math.nan, 2.0,
                      1e-30])
    for bs in (2, 3, 4):
        first = quant._per_block(lambda b: torch.linalg.vector_norm(b, dim=1), bs, x)
        suspect = (first == 0) | torch.isinf(first)
        again = quant._norms_again(x, first.clone(), suspect, bs)
        assert torch.allclose(again, quant.bucket_norms(x, bs), rtol=1e-6, equal_nan=True), bs


def test_fp32_ceil_never_rounds_down():
    t = torch.tensor([1 / 3, 1e-50, 1.0, 3.5e38, math.nan], dtype=torch.float64)
    c = quant.fp32_ceil(t)
    assert c.dtype == torch.float32
    assert (c[:3].double() >= t[:3]).all() and c[2] == 1.0
    assert c[3] == math.inf and math.isnan(c[4])


def test_stochastic_round_is_floor_of_sum():
    x = torch.tensor([-2.25, -0.5, 0.0, 0.75, 3.0])
    assert torch.equal(quant.stochastic_round(x, torch.full((5,), 0.5)), torch.tensor([-2.0, 0.0, 0.0, 1.0, 3.0]))
    assert torch.equal(quant.stochastic_round(x, torch.zeros(5)), torch.floor(x))


def _reference_levels(x, mult, bs, levels, u):
    """floor(fma(x, m, u)) via float64 (exact product) rounded once to x's dtype, or round()."""
    m = torch.cat([mi.expand(b.numel()) for mi, b in zip(mult, _blocks(x, bs))]) if x.numel() else mult[:0]
    if u is None:
        t = torch.round(x * m)
    else:
        t = torch.floor((x.double() * m.double() + u.double()).to(x.dtype))
    return t.clamp(-levels, levels).to(torch.int8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("n,bs", [(0, 8), (5, 8), (700, 64), (701, 64), (500, 300)])
@pytest.mark.parametrize("stochastic", [False, True])
def test_quantize_levels_matches_formula(small_chunks, dtype, n, bs, stochastic):
    x = torch.randn(n, dtype=dtype) * 3
    mult = torch.rand(quant.num_blocks(n, bs), dtype=dtype) * 40
    u = torch.rand(n) if stochastic else None
    u_before = None if u is None else u.clone()
    q = quant.quantize_levels(x, mult, bs, 100, u)
    assert q.dtype == torch.int8 and q.shape == x.shape
    assert torch.equal(q, _reference_levels(x, mult, bs, 100, u))
    if u is not None:
        assert torch.equal(u, u_before), "u changed without overwrite_u"
        assert torch.equal(quant.quantize_levels(x, mult, bs, 100, u.clone(), overwrite_u=True), q)


def test_quantize_levels_saturates_and_survives_nan():
    x = torch.tensor([1e30, -1e30, math.nan, math.inf, 0.4])
    for u in (None, torch.full((5,), 0.99)):
        q = quant.quantize_levels(x, torch.ones(1), 8, 3, u)
        assert q[0] == 3 and q[1] == -3 and q.abs().max() <= 3
    with pytest.raises(ValueError, match="levels"):
        quant.quantize_levels(x, torch.ones(1), 8, 128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_dequantize_levels_is_one_product(dtype):
    q = torch.randint(-127, 128, (37,), dtype=torch.int8)
    scale = torch.rand(quant.num_blocks(37, 8))
    out = quant.dequantize_levels(q, scale, 8, dtype)
    expected = torch.cat([b.to(dtype) * s.to(dtype) for b, s in zip(_blocks(q, 8), scale)])
    assert out.dtype == dtype and torch.equal(out, expected)


def test_mul_pow2_is_exact_beyond_the_factor_range():
    t = torch.tensor([1.5 * 2.0 ** -140, 3.0 * 2.0 ** -149])
    assert torch.equal(quant.mul_pow2_(t.clone(), 260), torch.tensor([1.5 * 2.0 ** 120, 3.0 * 2.0 ** 111]))
    big = torch.tensor([1.25 * 2.0 ** 127])
    assert quant.mul_pow2_(big, -130) == 1.25 * 2.0 ** -3


def _natural_reference(y, u):
    """Exponent field after rounding y up with probability f (|y| = 2**e (1 + f)), and the sign."""
    bits = y.view(torch.int32).long()
    field, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    r = torch.floor(u.double() * 2 ** 23).long()
    up = (r >= (1 << 23) - mant) & (y != 0)  # also right for subnormals (field 0)
    return field + up.long(), (bits < 0)


def test_natural_codes_match_the_rounding_rule(small_chunks):
    y = torch.cat([torch.randn(500) * 2.0 ** -5, torch.tensor([0.0, -0.0, 2.0 ** -3, 1e-40, -3e-39, 0.2499])])
    u = torch.rand(y.numel())
    codes = quant.natural_codes(y, u)
    field, neg = _natural_reference(y, u)
    assert torch.equal(codes.long() & 0x7F, field) and torch.equal(codes >= 128, neg)
    assert int(field.max()) <= quant.NATURAL_TOP


def test_natural_rounding_picks_a_neighbouring_power_with_the_right_odds():
    x = torch.tensor([1.0, 1.25, -1.75, 3.0, 0.0, -0.0])
    reps = 4000
    xs = x.repeat(reps)
    codes, exp = quant.natural_encode(xs, torch.rand(xs.numel()))
    out = quant.natural_decode(codes, exp).view(reps, -1)
    lo = torch.tensor([1.0, 1.0, -1.0, 2.0, 0.0, -0.0])
    assert ((out == lo) | (out == 2 * lo)).all()
    assert torch.equal(torch.signbit(out[:, 5]), torch.ones(reps, dtype=torch.bool)), "-0.0 keeps its sign"
    p_up = (out == 2 * lo).double().mean(0)[:4]
    expected = torch.tensor([0.0, 0.25, 0.75, 0.5], dtype=torch.float64)
    se = (expected * (1 - expected) / reps).sqrt()
    assert ((p_up - expected).abs() <= 5 * se + 1e-12).all(), p_up


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_natural_encode_window_and_special_values(small_chunks, dtype):
    top = 1000.0 if dtype == torch.float16 else 1e38
    x = torch.tensor([top, -1.5, 0.0, math.nan, math.inf, -math.inf] + [0.1] * 70, dtype=torch.float64).to(dtype)
    codes, exp = quant.natural_encode(x, torch.rand(x.numel()))
    assert 2.0 ** (exp - 1) <= float(x[0]) < 2.0 ** exp
    out = quant.natural_decode(codes, exp, torch.float64)
    assert out[0] in (2.0 ** (exp - 1), 2.0 ** exp) and out[2] == 0
    assert math.isnan(out[3]) and out[4] == math.inf and out[5] == -math.inf
    small = 2.0 ** (exp - 124)  # -1.5 lies below the window for top=1e38: it rounds to 0 or -small
    assert out[1] in ((-1.0, -2.0) if dtype == torch.float16 else (0.0, -small))


def test_natural_underflow_is_unbiased():
    """Values below the 124 binades kept under the largest round to 0 or 2**(E-124), unbiasedly."""
    reps = 20000
    x = torch.tensor([2.0 ** 60] + [0.3 * 2.0 ** -64] * reps)
    codes, exp = quant.natural_encode(x, torch.rand(x.numel()))
    out = quant.natural_decode(codes, exp)[1:].double()
    small = 2.0 ** (exp - 124)
    assert set(out.unique().tolist()) <= {0.0, small}
    p = 0.3 * 2.0 ** -64 / small
    assert abs(float(out.mean()) / small - p) <= 5 * math.sqrt(p * (1 - p) / reps)


def test_natural_table_saturates_below_inf():
    table = quant.natural_table(20, torch.float32, torch.float16)
    assert table[quant.NATURAL_TOP] == 2.0 ** 15 and table[quant.NATURAL_TOP + 128] == -(2.0 ** 15)
    assert table[quant.NATURAL_INF] == math.inf and math.isnan(table[quant.NATURAL_NAN])
    assert table[0] == 0 and torch.signbit(table[128])


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 8, 9, 1001])
def test_packed_codes_cpu_path_equals_torch_reference(bits, n):
    codes = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    if n:
        assert torch.equal(packed, pack_codes_reference(codes, bits))
        assert torch.equal(unpack_codes_reference(packed, n, bits), codes)
    assert torch.equal(unpack_codes(packed, n, bits), codes)
    assert packed.numel() == (n * bits + 7) // 8


def test_fp32_scales_reject_overflow_but_keep_inf():
    x = torch.tensor([1e300, 1.0, math.inf, 2.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="float32 range"):
        quant.fp32_scales(x, quant.block_absmax(x, 2), 2)
    ok = torch.tensor([1.0, 2.0, math.inf, 3.0], dtype=torch.float64)
    assert torch.equal(quant.fp32_scales(ok, quant.block_absmax(ok, 2), 2), torch.tensor([2.0, math.inf]))


def test_div_scalar_rounds_once():
    t = torch.rand(1000) * 100
    assert torch.equal(quant.div_scalar(t, 127), t / torch.full_like(t, 127.0))
    assert torch.equal(quant.div_scalar(t.double(), 7), t.double() / 7.0)


def test_pow2_is_exact_over_float64s_range():
    for dtype, (lo, hi) in ((torch.float32, (-149, 127)), (torch.float64, (-1074, 1023))):
        k = torch.arange(lo, hi + 1)
        ref = torch.tensor([math.ldexp(1.0, int(i)) for i in k], dtype=torch.float64).to(dtype)
        assert torch.equal(quant.pow2(k, dtype), ref), dtype


def _natural_inputs():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for scale in (1.0, 1e-30, 1e30, 1e-6 if dtype == torch.float16 else 1e-40):
            yield (torch.randn(1000, generator=g, dtype=torch.float64) * scale).to(dtype)
        x = torch.randn(1000, generator=g).to(dtype)
        x[3], x[5], x[9] = math.nan, math.inf, -math.inf
        yield x
        yield torch.zeros(50, dtype=dtype)
        yield torch.full((7,), math.nan, dtype=dtype)
    yield torch.randn(500, generator=g, dtype=torch.float64) * 1e300
    yield torch.randn(500, generator=g, dtype=torch.float64) * 1e-310
    yield torch.tensor([5e-324, -5e-324, 0.0], dtype=torch.float64)
    yield torch.tensor([3e38, -1e-45, 1e-45, 0.0])


def test_natural_on_the_device_is_the_cpu_form():
    """Off the CPU, natural's exponent stays on the device (the scaling built from its bits, the
    decode table there too): the same codes, exponent and table as the CPU's host form."""
    for x in _natural_inputs():
        u = torch.rand(x.numel(), generator=torch.Generator().manual_seed(x.numel()))
        codes, exp = quant.natural_encode(x, u.clone())
        dcodes, dexp = quant._natural_encode_on_device(x, u.clone(), False)
        assert dexp.dtype == torch.int32 and int(dexp) == exp and torch.equal(dcodes, codes), (x.dtype, exp)
        for dtype in (torch.float32, torch.float64):
            limit = None if x.dtype == torch.float64 else x.dtype
            a, b = quant.natural_table(exp, dtype, limit), quant.natural_table(dexp, dtype, limit)
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), (exp, dtype)
    for exp in (-1074, -1000, 0, 1000, 1024):  # the table's whole range, underflow to 0 included
        a, b = quant.natural_table(exp, torch.float64), quant.natural_table(torch.tensor(exp), torch.float64)
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), exp
