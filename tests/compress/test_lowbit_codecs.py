"""int4, int2 and fp4: block-scaled (32 elements per scale) codes packed 2 or 4 per byte, the scale
as fp32, fp16 or e8m0. Rounding to nearest is within half a grid step per block, a block's
largest element is never clipped, the payload size follows from numel alone, a received payload
is checked (scales, codes, padding), finite input never decodes to inf or NaN, and int4/int2's
default payload is the one they sent before the scale option."""
import hashlib
import math

import pytest
import torch

from gradcomp.compress import ErrorFeedback, Payload, get_compressor
from gradcomp.kernels.minifloat import E2M1, e8m0_values

TOP = {"int4": 7, "int2": 1, "fp4": 6}
PER_BYTE = {"int4": 2, "int2": 4, "fp4": 2}
SCALES = {"fp32": 4, "fp16": 2, "e8m0": 1}  # bytes per scale
CASES = [(name, scale) for name in sorted(TOP) for scale in SCALES]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def decoded_scales(payload):
    wire = payload.tensors[0]
    return e8m0_values(wire, torch.float64) if wire.dtype == torch.uint8 else wire.double()


@pytest.mark.parametrize("name, scale", CASES)
@pytest.mark.parametrize("n", [0, 1, 3, 31, 32, 33, 100, 4096])
def test_fixed_size(name, scale, n):
    c = get_compressor(name, scale=scale)
    p = c.compress(torch.randn(n), key="s")
    assert p.nbytes == SCALES[scale] * math.ceil(n / 32) + math.ceil(n / PER_BYTE[name]) == c._wire_bytes(n)
    assert c.decompress(p).shape == (n,)


@pytest.mark.parametrize("name, scale, bits", [("int4", "fp32", 5), ("int4", "fp16", 4.5), ("int4", "e8m0", 4.25),
                                               ("int2", "fp32", 3), ("int2", "fp16", 2.5), ("int2", "e8m0", 2.25),
                                               ("fp4", "fp32", 5), ("fp4", "fp16", 4.5), ("fp4", "e8m0", 4.25)])
def test_bits_per_element(name, scale, bits):
    c = get_compressor(name, scale=scale)
    n = 1 << 20
    assert c.bits_per_element(n) == bits == 8 * c.compress(torch.randn(n)).nbytes / n


def test_defaults_and_options():
    assert get_compressor("int4").config.scale == get_compressor("int2").config.scale == "fp32"
    assert get_compressor("fp4").config.scale == "e8m0"
    assert repr(get_compressor("fp4", scale="fp16")) == "get_compressor('fp4', scale='fp16')"
    for name in TOP:
        assert get_compressor(name).options["scale"].choices == ("fp32", "fp16", "e8m0")
        for bad in ("bf16", "E8M0", 8, None):
            with pytest.raises(ValueError, match=rf"{name}: option scale=.* must be one of"):
                get_compressor(name, scale=bad)
        assert not get_compressor(name).unbiased and not get_compressor(name).stochastic


@pytest.mark.parametrize("name", ["int4", "int2"])
def test_default_payload_is_the_one_before_the_scale_option(name):
    """sha256 of the payload bytes that int4/int2 sent before scales had a format."""
    x = ((torch.arange(1000, dtype=torch.float64) * 7919) % 1000 - 500) / 37
    x[100:132] *= 1e-3
    want = {("int4", torch.float32): "26ffeb81275917cec00cd1a6", ("int4", torch.float16): "d531d0244a85b943a3dd472f",
            ("int2", torch.float32): "46ec3f481fe0682230aed703", ("int2", torch.float16): "4320c2739ca6e0f2f68bf626"}
    for dtype in (torch.float32, torch.float16):
        for c in (get_compressor(name), get_compressor(name, scale="fp32")):
            p = c.compress(x.to(dtype))
            assert not p.meta and p.tensors[0].dtype == torch.float32
            assert hashlib.sha256(p.to_bytes()).hexdigest()[:24] == want[name, dtype]


def _half_step(name, x, s):
    """The most that rounding to nearest may move ``x`` on the grid of scale ``s``: half a level
    (ints); half the gap of the e2m1 grid around ``|x| / s``, at most ``max(s / 4, |x| / 4)``."""
    if name == "fp4":
        return torch.maximum(s / 4, x.abs() / 4)
    return s / 2


@pytest.mark.parametrize("name, scale", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_error_bound_per_block(name, scale, dtype):
    c = get_compressor(name, scale=scale)
    x = torch.randn(77, dtype=torch.float64).to(dtype)  # a ragged last block
    p = c.compress(x, key="e")
    out = c.decompress(p)
    assert out.dtype == dtype
    s = decoded_scales(p)
    absmax = torch.stack([b.double().abs().max() for b in x.split(32)])
    per = s.repeat_interleave(32)[:77]
    bound = _half_step(name, x.double(), per)
    if scale == "e8m0":  # OCP's scale: the largest element in [2**emax, 2**(emax+1)) units, clipped at the top
        emax = math.frexp(TOP[name])[1] - 1
        assert ((2.0 ** emax * s <= absmax) & (absmax < 2.0 ** (emax + 1) * s)).all()
        bound = torch.maximum(bound, x.double().abs() - TOP[name] * per)
    else:  # max |x| / top, rounded once, up to float16 (or to float32's nearest: an ulp)
        assert (absmax <= TOP[name] * s * (1 + 2.0 ** -23)).all()
    if scale == "fp16":
        below = (s.half().view(torch.int16) - 1).view(torch.float16).double()  # the float16 below each scale
        assert (s.half().double() == s).all() and (absmax / TOP[name] > below).all()
    slack = 0 if dtype == torch.float64 else torch.finfo(dtype).eps * x.double().abs()
    err = (out.double() - x.double()).abs()
    assert (err <= bound * (1 + 1e-5) + slack).all()


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp4_grid_values_decode_exactly(scale, dtype):
    """Every e2m1 value times a power of two, in every block, comes back bit for bit."""
    grid = torch.tensor(E2M1, dtype=torch.float64)
    blocks = [torch.cat([grid, -grid, grid.flip(0), -grid.flip(0)]) * 2.0 ** k for k in (-20, -3, 0, 5)]
    x = torch.cat(blocks).to(dtype)
    c = get_compressor("fp4", scale=scale)
    assert torch.equal(c.decompress(c.compress(x)), x)


@pytest.mark.parametrize("name", ["int4", "int2"])
@pytest.mark.parametrize("scale", SCALES)
def test_int_levels_decode_exactly(name, scale):
    """Levels times a power of two, each block holding its top level (so its scale is that
    power of two in every format), come back bit for bit."""
    top = TOP[name]
    levels = torch.arange(-top, top + 1, dtype=torch.float64).repeat(32)[:64]
    levels[0] = levels[32] = top
    x = torch.cat([levels[:32] * 2.0 ** -4, levels[32:] * 2.0 ** 6])
    c = get_compressor(name, scale=scale)
    assert torch.equal(c.decompress(c.compress(x)), x)


@pytest.mark.parametrize("scale", SCALES)
def test_fp4_rounds_to_nearest_ties_to_even(scale):
    """Ties go to the even code as IEEE's rounding sends them; a zero decodes to +0 whatever its
    input's sign (so a sum's zeros do not depend on the order it adds in); the block's 6 makes
    its scale 1 in every format."""
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 2.6, 5.1, -0.25, -0.75, -5.0, -0.1, 5.9, 6.0]
                     + [0.0] * 16)
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 3.0, 6.0, -0.0, -1.0, -4.0, -0.0, 6.0, 6.0]
    c = get_compressor("fp4", scale=scale)
    out = c.decompress(c.compress(x))
    assert out[:16].tolist() == want and not torch.signbit(out[13]) and not torch.signbit(out[10])
    assert torch.equal(out[16:], x[16:])


@pytest.mark.parametrize("name, scale", CASES)
def test_zeros_and_deterministic(name, scale):
    c = get_compressor(name, scale=scale)
    assert torch.equal(c.decompress(c.compress(torch.zeros(70))), torch.zeros(70))
    x = torch.randn(500)
    a, b = c.compress(x, key="a", step=0), c.compress(x, key="b", step=3)
    assert all(torch.equal(s, t) for s, t in zip(a.tensors, b.tensors))


@pytest.mark.parametrize("name, scale", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_finite_input_at_the_ends_of_the_range_decodes_finite(name, scale, dtype):
    """A block at the dtype's largest value saturates at the largest decodable value rather than
    decoding to inf (the scale is lowered to the largest whose top multiple is finite); a
    block far below a format's least scale decodes within |x| (to zero, at worst), never inf or
    NaN. fp64 blocks beyond fp32's range are refused with fp32 scales, saturated with the others."""
    fi = torch.finfo(dtype)
    c = get_compressor(name, scale=scale)
    for mag in (fi.max, fi.max / 3, 1e30, 6e4, 1e-30, fi.tiny, fi.tiny * fi.eps, 1e-300):
        if not fi.tiny * fi.eps <= mag <= fi.max:
            continue
        x = (torch.linspace(-1, 1, 70, dtype=torch.float64) * mag).to(dtype)
        x[0] = mag
        try:
            out = c.decompress(c.compress(x))
        except ValueError as exc:
            assert scale == "fp32" and dtype == torch.float64 and mag > 3.4e38, exc
            assert f"{name}: " in str(exc) and "float64" in str(exc) and "float32 range" in str(exc)
            continue
        assert torch.isfinite(out).all(), (mag, out)
        # 0 is on every grid: rounding or saturating moves no element farther than |x| (+ the dtype's rounding)
        assert ((out.double() - x.double()).abs() <= x.double().abs() * (1 + 2 * fi.eps)).all(), mag


@pytest.mark.parametrize("name, scale", CASES)
def test_non_finite_blocks_stay_non_finite_and_alone(name, scale):
    """A block holding NaN or inf decodes non-finite (the scale carries it: NaN or inf for
    fp32/fp16, the NaN code for e8m0); the other blocks decode as without it."""
    x = torch.randn(96)
    clean = get_compressor(name, scale=scale).decompress(get_compressor(name, scale=scale).compress(x))
    for bad in (math.nan, math.inf, -math.inf):
        y = x.clone()
        y[40] = bad
        c = get_compressor(name, scale=scale)
        out = c.decompress(c.compress(y))
        assert not torch.isfinite(out[32:64]).all()
        assert torch.equal(out[:32], clean[:32]) and torch.equal(out[64:], clean[64:])


def _corrupt(payload, i, fn):
    tensors = list(payload.tensors)
    tensors[i] = fn(tensors[i].clone())
    return Payload(payload.compressor, payload.shape, payload.dtype, tensors, dict(payload.meta))


@pytest.mark.parametrize("name, scale", CASES)
def test_corrupted_payloads_are_refused(name, scale):
    """From bytes (``check_payload``) a ValueError naming the codec; on an agreed layout
    (``check_on_device``) a device flag, the payload still decodable."""
    c = get_compressor(name, scale=scale)
    good = c.compress(torch.randn(101), key="v")  # 101: the last byte holds padding
    assert Payload.from_bytes(good.to_bytes()).compressor == name
    assert not bool(c.check_on_device(good)[1])
    bad = []
    if scale != "e8m0":
        bad.append(_corrupt(good, 0, lambda s: s.index_fill_(0, torch.tensor([2]), -1.0)))
        bad.append(_corrupt(good, 0, lambda s: s.index_fill_(0, torch.tensor([0]), -math.inf)))
    if name != "fp4":  # every 4-bit field is an e2m1 value; int4's 15 and int2's 3 are beyond +-L
        bad.append(_corrupt(good, 1, lambda p: p.index_fill_(0, torch.tensor([5]), 0xFF)))
    bad.append(_corrupt(good, 1, lambda p: p.index_fill_(0, torch.tensor([p.numel() - 1]), 0x80 | int(p[-1]))))
    for p in bad:
        with pytest.raises(ValueError, match=rf"{name}: malformed payload"):
            Payload.from_bytes(p.to_bytes())
        safe, flag = c.check_on_device(p)
        assert bool(flag) and c.decompress(safe).shape == (101,)
    shapes = [
        _corrupt(good, 0, lambda s: s.to(torch.int32 if s.dtype != torch.int32 else torch.float32)),  # no scale dtype
        _corrupt(good, 0, lambda s: s[:-1]),  # a scale short
        _corrupt(good, 1, lambda p: torch.cat([p, p[:1]])),  # a byte too many
        Payload(name, good.shape, good.dtype, list(good.tensors), {"block_size": 32}),
        Payload(name, good.shape, good.dtype, list(good.tensors[:1]), {}),
    ]
    for p in shapes:
        with pytest.raises(ValueError, match=rf"{name}: malformed payload"):
            c.check_payload(p)


def test_a_payload_decodes_by_its_own_scale_format():
    """The scales' dtype says their format: any int4 decodes what another int4 sent."""
    x = torch.randn(300)
    for scale in SCALES:
        p = get_compressor("int4", scale=scale).compress(x)
        assert torch.equal(get_compressor("int4").decompress(p), get_compressor("int4", scale=scale).decompress(p))


@pytest.mark.parametrize("name, scale", CASES)
def test_error_feedback_carries_the_residual(name, scale):
    """Every step sends ``g + old residual`` and keeps exactly what the payload left out."""
    torch.manual_seed(1)
    ef = ErrorFeedback(get_compressor(name, scale=scale))
    old = torch.zeros(130)
    for step in range(3):
        g = torch.randn(130)
        p = ef.compress(g, key="r", step=step)
        new = ef.residual("r")
        assert torch.allclose(g + old, ef.base.decompress(p) + new, atol=1e-6)
        assert new.abs().max() > 0
        old = new.clone()


@pytest.mark.parametrize("name, scale", CASES)
def test_error_feedback_converges_on_a_quadratic(name, scale):
    torch.manual_seed(0)
    target = torch.randn(200, dtype=torch.float64)
    w = torch.zeros(200, dtype=torch.float64)
    ef = ErrorFeedback(get_compressor(name, scale=scale))
    for step in range(400):
        g = w - target
        w -= 0.1 * ef.decompress(ef.compress(g, key="q", step=step))
    assert (w - target).norm() < 1e-3 * target.norm()


@pytest.mark.parametrize("name, scale, rel", [("int4", "fp32", 0.0971), ("int4", "fp16", 0.0971), ("int4", "e8m0", 0.1325),
                                              ("int2", "fp32", 0.6579), ("int2", "fp16", 0.6581), ("int2", "e8m0", 0.5353),
                                              ("fp4", "fp32", 0.1012), ("fp4", "fp16", 0.1012), ("fp4", "e8m0", 0.1149)])
def test_relative_error_on_gaussian_data(name, scale, rel):
    """The figures of compress/lowbit.py's docstring: ||x - decoded|| / ||x|| for 2**20 Gaussian elements."""
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    c = get_compressor(name, scale=scale)
    got = float((c.decompress(c.compress(x)) - x).norm() / x.norm())
    assert abs(got - rel) < 0.002, got
