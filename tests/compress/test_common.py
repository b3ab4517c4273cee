"""Behaviour every compressor must have, checked for every registered name.

Per-compressor properties (bits per element, exactness, unbiasedness) live in the
per-compressor test files; this file holds the contract of DESIGN.md that they all share.
"""
import math

import pytest
import torch

from gradcomp.compress import ErrorFeedback, Payload, available_compressors, get_compressor

DESIGN_NAMES = ("none fp16 bf16 topk randomk threshold dgc qsgd terngrad signsgd efsignsgd "
                "signum onebit natural int8 powersgd").split()
NAMES = available_compressors()
SHAPES = [(), (0,), (1,), (7,), (33, 17), (4, 5, 6), (1000,)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def test_every_design_name_is_registered():
    missing = sorted(set(DESIGN_NAMES) - set(NAMES))
    assert not missing, f"compressors named in DESIGN.md but not registered: {missing}"


@pytest.mark.parametrize("name", NAMES)
def test_bad_option_is_a_clear_error(name):
    with pytest.raises(ValueError, match="allowed"):
        get_compressor(name, no_such_option=1)


def test_unknown_name_lists_choices():
    with pytest.raises(ValueError, match="topk|none"):
        get_compressor("zip")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_keeps_shape_dtype_device_and_input(name, dtype):
    c = get_compressor(name)
    for shape in SHAPES:
        t = torch.randn(shape, dtype=torch.float64).to(dtype)
        before = t.clone()
        p = c.compress(t, key=f"k{shape}")
        out = c.decompress(p)
        assert torch.equal(t, before), "compress modified its input"
        assert out.shape == t.shape and out.dtype == t.dtype and out.device == t.device
        assert torch.isfinite(out).all()
        wire = Payload.from_bytes(p.to_bytes())
        assert torch.equal(c.decompress(wire), out), "wire round trip changed the result"
        assert len(p.to_bytes()) > p.nbytes >= 0


@pytest.mark.parametrize("name", NAMES)
def test_none_like_compressors_are_close(name):
    """Relative error of one round trip is below 1 for every compressor (it keeps signal)."""
    c = get_compressor(name)
    t = torch.randn(64, 64)
    out = c.decompress(c.compress(t, key="w"))
    if c.unbiased and c.stochastic:
        # one draw of an unbiased sparsifier is noisy by design (randomk 1%: error ~10); its signal is its mean
        out = torch.stack([out] + [c.decompress(c.compress(t, key="w")) for _ in range(399)]).mean(0)
    rel = (out - t).norm() / t.norm()
    assert rel < 1.5, f"{name}: relative error {rel:.3f} — the output carries no signal"


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_input_is_never_made_finite(name):
    c = get_compressor(name)
    for bad in (float("nan"), float("inf")):
        t = torch.randn(257)
        t[13] = bad
        try:
            out = c.decompress(c.compress(t, key="nan"))
        except ValueError:
            continue
        assert not torch.isfinite(out).all(), f"{name} turned {bad} into finite output"


@pytest.mark.parametrize("name", NAMES)
def test_no_global_rng(name):
    c = get_compressor(name)
    t = torch.randn(4096)
    state = torch.get_rng_state()
    c.decompress(c.compress(t, key="r"))
    assert torch.equal(state, torch.get_rng_state()), f"{name} used the global RNG"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_error_feedback_invariant(name, dtype):
    """g + old_residual == decompress(payload) + new_residual, at every step."""
    ef = ErrorFeedback(get_compressor(name))
    for step in range(4):
        g = torch.randn(48, 40, dtype=torch.float64).to(dtype)
        old = ef.residual("w").clone()
        p = ef.compress(g, key="w")
        new = ef.residual("w")
        assert new.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        lhs = g.to(new.dtype) + old
        rhs = ef.decompress(p).to(new.dtype) + new
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        assert torch.allclose(lhs, rhs, rtol=tol, atol=tol), f"{name} step {step}: mass lost"


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_resumes_identically(name):
    ef = ErrorFeedback(get_compressor(name))
    data = [torch.randn(40, 30) for _ in range(5)]
    for g in data[:2]:
        ef.compress(g, key="w")
    sd = ef.state_dict()
    rest = [ef.decompress(ef.compress(g, key="w")) for g in data[2:]]
    fresh = ErrorFeedback(get_compressor(name))
    fresh.load_state_dict(sd)
    again = [fresh.decompress(fresh.compress(g, key="w")) for g in data[2:]]
    for a, b in zip(rest, again):
        assert torch.equal(a, b), f"{name}: resumed run differs"


@pytest.mark.parametrize("name", NAMES)
def test_measured_bytes_match_theory(name):
    c = get_compressor(name)
    if not c.fixed_size:
        pytest.skip(f"{name} has a data-dependent size")
    n = 1 << 16
    p = c.compress(torch.randn(256, 256), key="b")
    theory = c.bits_per_element(n)
    measured = 8.0 * p.nbytes / n
    assert math.isclose(measured, theory, rel_tol=0.02, abs_tol=0.01), (name, measured, theory)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_error_feedback_payload_is_the_plain_wire_format(name, dtype):
    """With feedback, a 16-bit gradient still travels in the compressor's own wire format."""
    ef = ErrorFeedback(get_compressor(name))
    g = torch.randn(30, 20).to(dtype)
    p = ef.compress(g, key="w")
    q = Payload.from_bytes(p.to_bytes())
    assert torch.equal(get_compressor(name).decompress(q), ef.decompress(p))
    assert p.nbytes == get_compressor(name).compress(g, key="w").nbytes or not get_compressor(name).fixed_size
