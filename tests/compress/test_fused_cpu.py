"""The fused CPU loops (gradcomp.kernels.cpu) against the torch/numpy reference paths.

The loops run from ``FUSED_MIN`` elements on; here ``cpu.threshold(1)`` forces them on small
tensors of awkward sizes (word and byte tails), and ``cpu.threshold(NEVER)`` forces the
reference. Bits, decodings, residuals and indices must be identical; the sign sums are float64
in another order than the reference's, so they agree to float64 rounding and the wire values
(rounded to fp32) are compared exactly on these seeds.
"""
import dataclasses

import pytest
import torch

from gradcomp.compress import ErrorFeedback, available_compressors, get_compressor, transaction
from gradcomp.compress import sign as sign_compressor
from gradcomp.compress.sign import mean_into
from gradcomp.kernels import cpu, select, sign
from gradcomp.kernels.sign import sign_pack_reference

NEVER = 1 << 62
SIZES = [1, 7, 8, 63, 64, 65, 1000, 4099]
SIGN_FAMILY = ["onebit", "efsignsgd", "signsgd", "signum"]

if not cpu.warm():
    pytest.skip("numba is not importable here: the fused loops do not run (the reference paths do)",
                allow_module_level=True)


def _data(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    if n >= 8:  # zeros of both signs and repeats: the edges of x >= 0 and of the tie rule
        x[1], x[3], x[5:7] = 0.0, -0.0, x[4]
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_sign_pack_and_decode_match_the_reference(dtype):
    for n in SIZES:
        x = _data(n, dtype, n)
        for stats in sign.STATS:
            bits, sums = cpu.sign_pack(x, stats)
            rbits, rsums = sign_pack_reference(x, stats)
            assert torch.equal(bits, rbits), (n, stats)
            torch.testing.assert_close(sums, rsums, rtol=1e-13, atol=1e-13)
        values = torch.tensor([0.7, -1.3], dtype=torch.float64)
        for accumulate in (False, True):
            out, ref = x.clone(), x.clone()
            cpu.sign_decode(bits, values, out, accumulate)
            sign.sign_unpack_values(bits, n, values, out=ref, accumulate=accumulate)
            assert torch.equal(out, ref), (n, accumulate)


def test_nan_and_inf_reach_every_sum_the_reference_makes_non_finite():
    x = torch.randn(130)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[77] = bad
        for stats in ("sum", "abs", "split"):
            sums, rsums = cpu.sign_pack(y, stats)[1], sign_pack_reference(y, stats)[1]
            assert torch.equal(torch.isfinite(sums), torch.isfinite(rsums)), (bad, stats)
            assert torch.equal(torch.isnan(sums), torch.isnan(rsums)), (bad, stats)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_topk_selection_is_the_exact_topk(dtype):
    for n, k in [(4099, 1), (4099, 40), (100_000, 1000), (65, 16)]:
        x = _data(n, dtype, k)
        x[::7] = x[2]  # many ties at one magnitude
        assert torch.equal(cpu.topk_abs_indices(x, k), select.topk_abs_indices(x, k)), (n, k)
    x = _data(50_000, dtype)
    x[10], x[20_000] = float("nan"), float("inf")
    assert torch.equal(cpu.topk_abs_indices(x, 30), select.topk_abs_indices(x, 30))
    # a constant tensor: every element ties, and an estimate too low to find them at once
    assert torch.equal(cpu.topk_abs_indices(torch.ones(40_000, dtype=dtype), 900), torch.arange(900))


def test_candidate_pass_grows_its_buffer():
    x = _data(10_000, torch.float32)
    ref = select._at_least(x, torch.tensor(0.5), True)
    assert torch.equal(cpu._at_least(x, 0.5, expect=0), ref)  # room for 1024, ~6000 found
    assert torch.equal(cpu._at_least(x, 0.0, expect=0), torch.arange(10_000))


def _run(name, x):
    """What a step gives on ``x``: payload tensors, decoding, decompress_into both ways, the
    in-place residual and an error-feedback step's residual (a fresh compressor each time)."""
    c = get_compressor(name)
    payload, decoded = c.compress_decoded(x, "k")
    into = torch.ones(x.numel(), dtype=torch.float32)
    c.decompress_into(payload, into, alpha=0.5)
    res = [] if not c.compresses_in_place or x.dtype not in (torch.float32, torch.float64) else [x.clone(memory_format=torch.contiguous_format)]
    if res:
        res += c.compress_residual(res[0], "r").tensors
    fb = ErrorFeedback(get_compressor(name))
    sent = fb.compress(x, "e")
    fb.compress(x.flip(0), "e")
    return [*payload.tensors, decoded, into, *res, *sent.tensors, fb.residual("e")], payload


@pytest.mark.parametrize("name", SIGN_FAMILY + ["topk"])
def test_compressors_fused_and_reference_agree(name, monkeypatch):
    # the oracle: the torch reference with float64 sums (the numpy path below the threshold
    # sums chunks in their own dtype, so its decode values may differ in the last fp32 bit)
    monkeypatch.setattr(sign_compressor, "sign_pack", sign_pack_reference)
    shapes = [(4099,), (65, 63), (1,), (0,), (64, 130)]
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for shape in shapes:
            x = _data(int(torch.Size(shape).numel()), dtype, len(shape)).reshape(shape)
            if len(shape) == 2:
                x = x.t()  # non-contiguous input
            with cpu.threshold(1):
                fused, payload = _run(name, x)
                # the reference decode of the fused payload: the fused decode's bits
                with cpu.threshold(NEVER):
                    assert torch.equal(get_compressor(name).decompress(payload), fused[2])
            with cpu.threshold(NEVER):
                ref, _ = _run(name, x)
            assert len(fused) == len(ref)
            for i, (a, b) in enumerate(zip(fused, ref)):
                assert torch.equal(a, b), (name, dtype, shape, i)


def test_the_rule_of_use():
    x = torch.randn(16)
    with cpu.threshold(16):
        assert cpu.applies(16, x) and not cpu.applies(15, x)
        assert not cpu.applies(16, x.half()) and not cpu.applies(16, x.bfloat16())
        assert not cpu.applies(16, torch.empty(16, device="meta"))
        assert cpu.applies(16, x, torch.zeros(2, dtype=torch.uint8))
    assert cpu.FUSED_MIN == 1 << 14 and not cpu.applies((1 << 14) - 1, x)


@pytest.mark.parametrize("name", ["onebit", "signsgd", "topk"])
def test_mean_of_payloads_matches_decoding_each_in_turn(name):
    c = get_compressor(name, **({"ratio": 0.3} if name == "topk" else {}))
    for n in (1, 13, 64, 4099):
        xs = [_data(n, torch.float32, seed) for seed in range(3)]
        xs[1][: n // 2] = xs[0][: n // 2]  # shared positions: their values add in rank order
        payloads = [c.compress(x) for x in xs]
        for ranks in (1, 2, 3):
            for dtype in (torch.float32, torch.float64):
                ref = mean_into(c, payloads[:ranks], torch.full((n,), 7.0, dtype=dtype))
                with cpu.threshold(1):
                    out = c.decompress_mean_into(payloads[:ranks], torch.full((n,), 7.0, dtype=dtype))
                assert torch.equal(out, ref), (n, ranks, dtype)
    if name == "topk":  # an index out of range, in a payload from outside (not built here), is refused on the
        # fused path too
        bad = dataclasses.replace(c.compress(xs[0]), checked=False)
        bad.tensors[1][-1] = 4099 + 5
        with cpu.threshold(1), pytest.raises(ValueError, match="indices must lie"):
            c.decompress_mean_into([payloads[0], bad], torch.zeros(4099))


def _same(a, b):
    """Equal bits, NaNs equal wherever both are NaN (their sign and payload may differ)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_pack_with_the_sum_in_its_pass_is_add_then_pack(dtype):
    for n in SIZES:
        a, b = _data(n, dtype, n), _data(n, dtype, n + 1)
        if n > 100:
            a[40], b[41], a[42], b[42] = float("nan"), float("inf"), -0.0, 0.0
        for stats in sign.STATS:
            for alias in (False, True):  # out may be one of the operands (error feedback outside a transaction)
                aa = a.clone()
                out = aa if alias else torch.empty(n, dtype=dtype)
                bits, sums = cpu.sign_pack_sum(aa, b, out, stats)
                ref = a + b
                rbits, rsums = cpu.sign_pack(ref, stats)
                assert _same(out, ref) and torch.equal(bits, rbits) and _same(sums, rsums), (n, stats, alias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_candidate_pass_with_the_sum_selects_the_topk_of_the_sum(dtype):
    for n, k in [(4099, 1), (4099, 40), (100_000, 1000), (65, 16)]:
        a, b = _data(n, dtype, k), _data(n, dtype, k + 7)
        b[::7] = -a[::7] + a[2]  # many ties at one magnitude
        out = torch.empty(n, dtype=dtype)
        idx = cpu.topk_abs_indices(out, k, sum_of=(a, b))
        assert torch.equal(out, a + b) and torch.equal(idx, select.topk_abs_indices(a + b, k)), (n, k)
    # a constant sum (every element ties; the estimate is too low, so the pass runs again on x)
    ones = torch.ones(40_000, dtype=dtype)
    out = torch.empty_like(ones)
    assert torch.equal(cpu.topk_abs_indices(out, 900, sum_of=(ones, ones)), torch.arange(900))
    assert torch.equal(out, ones + ones)


def _in_place_names():
    return [n for n in available_compressors() if get_compressor(n).compresses_in_place]


@pytest.mark.parametrize("name", _in_place_names())
def test_compress_residual_of_a_sum_is_adding_first(name):
    """``compress_residual(acc, sum_of=(a, b))``, fused or not, deferred or not: the payload and
    residual of ``torch.add(a, b, out=acc)`` and then ``compress_residual(acc)``."""
    for threshold in (1, NEVER):
        for n in (9, 65, 4099):
            for dtype in (torch.float32, torch.float64):
                a, b = _data(n, dtype, n), _data(n, dtype, 2 * n)
                if n > 100:
                    a[7], a[9] = float("nan"), float("inf")
                with cpu.threshold(threshold):
                    ref_acc = torch.add(a, b)
                    ref = get_compressor(name).compress_residual(ref_acc, "k")
                    for alias in (False, True):
                        for deferred in (False, True):
                            aa = a.clone()
                            acc = aa if alias else torch.empty(n, dtype=dtype)
                            later: list = []
                            p = get_compressor(name).compress_residual(acc, "k", sum_of=(aa, b),
                                                                       defer=later if deferred else None)
                            for run in later:
                                run()
                            where = (name, threshold, n, dtype, alias, deferred)
                            assert all(_same(x, y) for x, y in zip(p.tensors, ref.tensors)), where
                            assert _same(acc, ref_acc), where
    with pytest.raises(ValueError, match="sum_of must match"):
        get_compressor(name).compress_residual(torch.zeros(8), sum_of=(torch.zeros(8), torch.zeros(9)))


def test_combines_vouch_for_their_finite_means_only():
    """The two-payload sign mean and the sparse mean tell the open transaction their result is
    finite when it is (no pass of its own over the result); a non-finite mean is not vouched
    for, and an in-place change of the result voids what was."""
    n = 4099
    with cpu.threshold(1):
        for name in ("onebit", "topk"):
            c = get_compressor(name)
            payloads = [c.compress(_data(n, torch.float32, s)) for s in (1, 2)]
            for poison in (None, "nan", "inf"):
                ps = list(payloads)
                if poison is not None:
                    bad = ps[1].tensors[1 if name == "onebit" else 0].clone()
                    bad[0] = float(poison)
                    ps[1] = dataclasses.replace(ps[1], tensors=[ps[1].tensors[0], bad] if name == "onebit"
                                                else [bad, ps[1].tensors[1]])
                txn = transaction.Transaction()
                with txn.active():
                    out = c.decompress_mean_into(ps, torch.zeros(n), zeroed=True)
                    assert bool(txn._vouched) == (poison is None), (name, poison)
                    txn.observe(out.view(1, n))  # a view over the same memory: the vouched witness
                    assert txn.finite == bool(torch.isfinite(out).all()), (name, poison)
                    if poison is None:
                        out[5] = float("inf")  # an in-place change: the witness no longer holds
                        txn.observe(out)
                        assert not txn.finite
                txn.rollback()


def test_a_sign_payload_decodes_finite_when_its_values_do_in_the_target_dtype():
    c = get_compressor("onebit")
    big = c.compress(_data(4099, torch.float32) * 1e5)  # decode values ~8e4: beyond fp16's range
    assert c.decodes_finite(big) and c.decodes_finite(big, torch.float64)
    assert not c.decodes_finite(big, torch.float16)
    values = big.tensors[1].clone()
    values[0] = float("nan")
    assert not c.decodes_finite(dataclasses.replace(big, tensors=[big.tensors[0], values]))
    assert not get_compressor("topk").decodes_finite(get_compressor("topk").compress(_data(100, torch.float32)))
    if torch.cuda.is_available():  # known only by reading: not said for a device payload
        assert not c.decodes_finite(big.to("cuda"))
