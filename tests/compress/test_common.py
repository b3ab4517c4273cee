"""Behaviour every compressor must have, checked for every registered name.

Per-compressor properties (bits per element, exactness, unbiasedness) live in the
per-compressor test files; this file holds the contract they all share (docs/compressors.md).
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
    assert not missing, f"compressors the docs promise but not registered: {missing}"


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


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().reshape(-1).view(ints[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, signed zeros included; any NaN equals any NaN (their sign bits carry nothing)."""
    nan = torch.isnan(a)
    return a.shape == b.shape and torch.equal(nan, torch.isnan(b)) and torch.equal(_bits(a)[~nan.reshape(-1)],
                                                                                  _bits(b)[~nan.reshape(-1)])


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_decompress_into_adds_exactly_what_decompress_gives(name, dtype):
    """decompress_into(p, out) == out + decompress(p) bit for bit (alpha 1), written or added."""
    c = get_compressor(name)
    wd = torch.float64 if dtype == torch.float64 else torch.float32
    for shape in [(33, 17), (7,), ()]:
        t = torch.randn(shape, dtype=torch.float64).to(dtype)
        if t.numel() > 3:
            t.view(-1)[1] = 0.0
        p = c.compress(t, key=f"d{shape}")
        dec = c.decompress(p).to(wd)
        base = torch.randn(shape, dtype=wd)
        added = c.decompress_into(p, base.clone(), accumulate=True)
        assert torch.equal(_bits(added), _bits(base + dec)), f"{name} {dtype} {shape}: accumulate differs"
        written = c.decompress_into(p, torch.full(shape, 7.0, dtype=wd), accumulate=False)
        assert torch.equal(_bits(written), _bits(dec)), f"{name} {dtype} {shape}: write differs"
        scaled = c.decompress_into(p, base.clone(), alpha=0.25)  # a power of two: exact here too
        assert torch.equal(scaled, base + 0.25 * dec), f"{name}: alpha not applied"
    with pytest.raises(ValueError, match="elements"):
        c.decompress_into(c.compress(torch.randn(10), key="d"), torch.zeros(11))


LONG_CASES = [("int8", {}), ("int8", {"block_size": 1000}), ("qsgd", {}), ("qsgd", {"levels": 7, "bucket_size": 7}),
              ("qsgd", {"levels": 1, "bucket_size": 1000}), ("terngrad", {}), ("terngrad", {"bucket_size": 0}),
              ("terngrad", {"bucket_size": 3}), ("natural", {}), ("onebit", {}), ("topk", {})]


@pytest.mark.parametrize("name, options", LONG_CASES, ids=[f"{n}-{o}" for n, o in LONG_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decompress_into_over_cache_sized_runs(name, options, dtype):
    """Decoders that work in runs of ~2**18 elements on CPU (buckets and packed codes cut at
    run boundaries) give the generic bits over several runs, ragged ends and odd bucket sizes."""
    from gradcomp.compress.base import add_into
    from gradcomp.kernels import quant

    n = 3 * quant._CHUNK + 777
    c = get_compressor(name, **options)
    x = torch.randn(n, dtype=torch.float64).to(dtype)
    p = c.compress(x, key="long")
    base = torch.randn(n)
    for accumulate, alpha in ((True, 1.0), (True, 0.5), (False, 1.0), (False, 0.25)):
        want = base.clone()
        add_into(want, c.decompress(p).reshape(-1), alpha, accumulate)
        got = c.decompress_into(p, base.clone(), alpha=alpha, accumulate=accumulate)
        assert torch.equal(_bits(got), _bits(want)), (accumulate, alpha)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_error_feedback_in_place_equals_the_two_step_protocol(name, dtype):
    """ErrorFeedback.compress (in place where the compressor allows) sends the same payload and
    keeps the same residual bits as accumulate / compress_decoded / update; a step with NaN and
    Inf sends the same payload and keeps nothing (the residual stays as it was)."""
    ef = ErrorFeedback(get_compressor(name))
    ref_c = get_compressor(name)
    wd = torch.float64 if dtype == torch.float64 else torch.float32
    res = torch.zeros(48, 40, dtype=wd)
    for step in range(4):
        g = torch.randn(48, 40, dtype=torch.float64).to(dtype)
        if step == 3:
            g[0, 0], g[5, 7] = float("nan"), float("-inf")
        p = ef.compress(g, key="w")
        acc = g.to(wd) + res
        q, sent = ref_c.compress_decoded(acc.to(dtype), key="w")
        assert p.to_bytes() == q.to_bytes(), f"{name} step {step}: payload differs"
        if step < 3:
            res = acc - sent.to(wd)
        assert _same(ef.residual("w"), res), f"{name} step {step}: residual differs"


@pytest.mark.parametrize("name", NAMES)
def test_compress_residual_leaves_the_error_in_place(name):
    c, ref = get_compressor(name), get_compressor(name)
    for shape in [(33, 17), (5,), (), (0,)]:
        acc = torch.randn(shape)
        left = acc.clone()
        p = c.compress_residual(left, key=f"r{shape}")
        assert p.to_bytes() == ref.compress(acc, key=f"r{shape}").to_bytes()
        assert torch.equal(_bits(left), _bits(acc - c.decompress(p))), f"{name} {shape}"
    with pytest.raises(ValueError, match="contiguous"):
        c.compress_residual(torch.randn(6, 4).t(), key="r")


def test_identity_decoding_is_the_payload_itself():
    # the native allreduce of `none` returns the averaged tensor instead of copying it into a
    # fresh buffer (a 100 MB first touch costs ~0.4 s of page faults on the build machine)
    from gradcomp.compress import get_compressor

    c = get_compressor("none")
    x = torch.randn(6, 5)
    p = c.compress(x, "k")
    view = c.decoding_of(p)
    assert view is not None and view.data_ptr() == p.tensors[0].data_ptr() and torch.equal(view, x)
    assert view.shape == x.shape
    assert get_compressor("fp16").decoding_of(get_compressor("fp16").compress(x, "k")) is None


@pytest.mark.parametrize("name", NAMES)
def test_compress_view_is_compress_without_a_copy_of_the_input(name):
    """``compress_view`` gives ``compress``'s payload and advances the same counters; only the
    identity's shares the input's memory (which its caller frames at once)."""
    x = torch.randn(12, 9, generator=torch.Generator().manual_seed(3))
    a, b = get_compressor(name), get_compressor(name)
    for step in range(2):
        p, q = a.compress(x, key="k"), b.compress_view(x, key="k")
        assert (p.compressor, p.shape, p.dtype, p.meta) == (q.compressor, q.shape, q.dtype, q.meta), name
        assert all(torch.equal(u, v) for u, v in zip(p.tensors, q.tensors)), (name, step)
        shares = [t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in q.tensors]
        assert any(shares) == (name == "none"), (name, shares)
    assert _same_state(a.state_dict(), b.state_dict()), name
    with pytest.raises(ValueError):
        b.compress_view(torch.zeros(3, dtype=torch.int64), key="k")


def _same_state(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return a == b
