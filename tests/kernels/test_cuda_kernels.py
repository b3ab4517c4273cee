"""Every CUDA kernel against the torch path on CUDA tensors (needs a GPU and CuPy).

Each ``launch_<op>`` of ``kernels/_launch_<family>.py`` runs on sizes 0, 1, 7, 1000 and
2**24 + 3 in fp32, fp16 and bf16, and is compared with the torch reference of
``gradcomp.kernels`` run under ``_launch.torch_only()``: bit for bit for packing, selection and codes (the random
draws are the same stream), within float tolerance for sums and scatter-adds. The last tests
check the plumbing only a GPU has: the DLPack bridge, torch's current stream, and that the
public primitives and compressors reach the kernels and agree with the torch path.
"""
import math

import numpy as np
import pytest
import torch

from gradcomp.compress import ErrorFeedback, available_compressors, get_compressor
from gradcomp.kernels import (_cupy, _launch, _launch_bits, _launch_quant, _launch_rng, _launch_select,
                              _launch_sign, _launch_sparse, bits, quant, rng, select, sign, sparse)

from kernel_checks import same  # beside this file (conftest puts it on the path)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _cupy.available(), reason="CuPy cannot see a CUDA device or NVRTC: the kernels cannot run"),
]
DEVICE = torch.device("cuda")
BIG = 2**24 + 3
SIZES = [0, 1, 7, 1000, BIG]
FLOATS = [torch.float32, torch.float16, torch.bfloat16]


def reference(fn, *args, **kwargs):
    with _launch.torch_only():
        return fn(*args, **kwargs)


def gen(seed):
    """A generator on the test device: data is made where it is used (2**24 elements made on
    the CPU and copied would take most of the run)."""
    return torch.Generator(device=DEVICE).manual_seed(seed)


def signal(n, dtype, special=True, seed=0):
    x = torch.randn(n, generator=gen(seed), device=DEVICE)
    if special and n > 8:
        x[1], x[3] = 0.0, -0.0
        x[2], x[4] = -1e-40, -3e-6  # negative subnormals of fp32/bf16 and of fp16: sign bit clear
        x[n // 2] = float("nan") if n % 2 else float("-inf")
    return x.to(dtype)


# ---- rng ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES)
def test_uniform_is_numpys_stream(n):
    key = rng.stream_key(5, "layer.w", 11)
    got = _launch_rng.launch_uniform(n, key, DEVICE)
    ref = np.random.Generator(np.random.Philox(key=key)).random(n, dtype=np.float32)
    assert np.array_equal(got.cpu().numpy(), ref)


# ---- sign --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_sign_pack(dtype, n):
    x = signal(n, dtype)
    for stats in sign.STATS:
        got_bits, got_sums = _launch_sign.launch_sign_pack(x, stats)
        ref_bits, ref_sums = sign.sign_pack_reference(x, stats)  # what sign_pack runs on CUDA without kernels
        assert torch.equal(got_bits, ref_bits), stats
        assert torch.allclose(got_sums, ref_sums, rtol=1e-10, atol=1e-6, equal_nan=True), (stats, got_sums, ref_sums)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_sign_unpack(dtype, n):
    packed = torch.randint(0, 256, ((n + 7) // 8,), generator=gen(1), dtype=torch.uint8, device=DEVICE)
    for pos, neg, acc in ((0.1, -0.3, False), (1.0, -1.0, True), (3e38, float("nan"), True), (1e-40, -2e-40, True)):
        base = signal(n, dtype, special=False, seed=2)
        if pos < 1e-30:  # subnormal sums: kept, not flushed to zero
            base = (base * 1e-39).to(dtype)
        got = _launch_sign.launch_sign_unpack(packed, n, pos, neg, base.clone(), acc)
        ref = sign.sign_unpack_reference(packed, n, pos, neg, out=base.clone(), accumulate=acc)
        assert same(got, ref), (pos, neg, acc)


@pytest.mark.parametrize("n", SIZES)
def test_count_set(n):
    packed = torch.randint(0, 256, (n,), generator=gen(9), dtype=torch.uint8, device=DEVICE)
    assert _launch_sign.launch_count_set(packed) == reference(sign.count_set, packed)


# ---- select ------------------------------------------------------------------------------
def magnitudes(n, dtype, kind):
    g = gen(6)
    if kind == "normal":
        x = torch.randn(n, generator=g, device=DEVICE).abs()
    elif kind == "ties":
        x = torch.randint(0, 40, (n,), generator=g, device=DEVICE).float()
    else:  # NaN, inf, signed zeros, negative values
        x = torch.randn(n, generator=g, device=DEVICE)
        if n > 100:
            x[torch.randperm(n, generator=g, device=DEVICE)[: n // 50]] = float("nan")
            x[::97] = float("inf")
            x[1::89] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("kind", ["normal", "ties", "special"])
@pytest.mark.parametrize("n", SIZES)
def test_topk_indices(dtype, kind, n):
    x = magnitudes(n, dtype, kind)
    for k in sorted({min(n, k) for k in (0, 1, max(1, n // 1000), max(1, n // 100), n // 3, n)}):
        got = _launch_select.launch_topk_indices(x, k)
        ref = reference(select.topk_indices, x, k)
        assert got.dtype == torch.int64 and torch.equal(got, ref), (kind, n, k)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_threshold_indices(dtype, n):
    x = magnitudes(n, dtype, "special")
    for tau in (0.0, 0.5, 2.5, 1e6):
        t = select._round_up(tau, dtype, "cpu")
        got = _launch_select.launch_threshold_indices(x, float(t))
        assert torch.equal(got, reference(select.threshold_indices, x, tau))


# ---- bits, sparse ------------------------------------------------------------------------
@pytest.mark.parametrize("nbits", [1, 2, 4])
@pytest.mark.parametrize("n", SIZES)
def test_pack_unpack_codes(nbits, n):
    codes = torch.randint(0, 1 << nbits, (n + 1,), generator=gen(10), dtype=torch.uint8, device=DEVICE)
    for c in (codes[:n], codes[1:]):  # aligned, and one byte off
        packed = _launch_bits.launch_pack_codes(c, nbits)
        assert torch.equal(packed, reference(bits.pack_codes, c, nbits))
        assert torch.equal(_launch_bits.launch_unpack_codes(packed, n, nbits), c)


@pytest.mark.parametrize("dtype", FLOATS + [torch.float64], ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("n", [1, 7, 1000, BIG])
def test_scatter_add(dtype, index_dtype, n):
    m = 3 * n
    g = gen(7)
    idx = torch.randint(0, n, (m,), generator=g, dtype=index_dtype, device=DEVICE)
    idx[0], idx[-1] = 0, n - 1
    vals = torch.randn(m, generator=g, device=DEVICE).to(dtype)
    got = _launch_sparse.launch_scatter_add_checked(torch.zeros(n, dtype=dtype, device=DEVICE), idx, vals)
    ref = reference(sparse.scatter_add_checked, torch.zeros(n, dtype=dtype, device=DEVICE), idx, vals)
    tol = {torch.float32: 1e-4, torch.float64: 1e-9, torch.float16: 5e-2}.get(dtype, 1e-1)  # atomics: any order
    assert torch.allclose(got.double(), ref.double(), rtol=tol, atol=tol)


def test_scatter_add_rejects_bad_indices_and_writes_nothing():
    out = torch.zeros(1000, device=DEVICE)
    for bad in (-1, 1000):
        idx = torch.tensor([3, bad, 5], device=DEVICE)
        with pytest.raises(ValueError, match=r"indices must lie in \[0, 1000\)"):
            _launch_sparse.launch_scatter_add_checked(out, idx, torch.ones(3, device=DEVICE))
    assert not out.any()


# ---- quant -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n", SIZES[1:])
def test_block_absmax_and_bucket_norms(dtype, n):
    x = signal(n, dtype)
    for block in (1, 256, 5000, n):
        # max |x| of a block of zeros is a zero of either sign
        got = _launch_quant.launch_block_absmax(x, block)
        assert same(got, reference(quant.block_absmax, x, block), zero_sign=False), block
        y = signal(n, dtype, special=False)
        got, ref = _launch_quant.launch_bucket_norms(y, block), reference(quant.bucket_norms, y, block)
        rtol = 1e-5 if dtype == torch.float32 else 1e-2
        assert got.dtype == ref.dtype and torch.allclose(got.double(), ref.double(), rtol=rtol), block


def _level_mismatch(got, ref):
    """Elements whose level differs (only ever by one, from the rounding of fma vs mul+add)."""
    diff = (got.int() - ref.int()).abs()
    assert int(diff.max()) <= 1 if diff.numel() else True
    return int((diff != 0).sum())


@pytest.mark.parametrize("levels", [1, 7, 127])
@pytest.mark.parametrize("n", SIZES[1:])
def test_quantize(levels, n):
    block = 512
    x = signal(n, torch.float32, special=False)
    mult = torch.rand(-(-n // block), generator=gen(11), device=DEVICE) * levels * 2
    key = rng.stream_key(3, "q", 8)
    u = reference(rng.uniform, n, key, DEVICE)
    got = _launch_quant.launch_quantize_levels(x, mult, block, levels, u)
    assert _level_mismatch(got, reference(quant.quantize_levels, x, mult, block, levels, u)) <= n * 1e-6
    assert torch.equal(_launch_quant.launch_quantize_levels(x, mult, block, levels, None),
                       reference(quant.quantize_levels, x, mult, block, levels))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("nbits,offset", [(8, 0), (2, 1), (4, 7)])
@pytest.mark.parametrize("n", [1, 1000, BIG])
def test_dequantize_sum(dtype, nbits, offset, n):
    ranks, block = 4, 512
    g = gen(8)
    if nbits == 8:
        codes = torch.randint(-127, 128, (ranks, n), generator=g, dtype=torch.int8, device=DEVICE)
    else:
        codes = torch.randint(0, 256, (ranks, (n * nbits + 7) // 8), generator=g, dtype=torch.uint8, device=DEVICE)
    scales = torch.rand(ranks, -(-n // block), generator=g, device=DEVICE) * 10
    base = signal(n, dtype, special=False)
    got = _launch_quant.launch_dequantize_sum(codes, nbits, offset, scales, block, base.clone(), 1.0 / ranks, True)
    ref = quant.dequantize_sum_reference(codes, nbits, offset, scales, block, base.clone(), 1.0 / ranks, True)
    assert same(got, ref)
    if nbits == 8:
        one = _launch_quant.launch_dequantize_sum(codes[:1], 8, 0, scales[:1], block,
                                                  torch.empty(n, dtype=dtype, device=DEVICE))
        assert same(one, reference(quant.dequantize_levels, codes[0], scales[0], block, dtype))


@pytest.mark.parametrize("n", SIZES[1:])
def test_natural(n):
    y = (signal(n, torch.float32, special=False) * 0.05).clamp(-0.24, 0.24)
    key = rng.stream_key(1, "nat", 2)
    u = reference(rng.uniform, n, key, DEVICE)
    ref = reference(quant.natural_codes, y, u)
    assert torch.equal(_launch_quant.launch_natural_codes(y, u), ref)
    assert torch.equal(_launch_quant.launch_natural_codes(y, None, key), ref)
    codes = torch.randint(0, 256, (n,), generator=gen(12), dtype=torch.uint8, device=DEVICE)
    table = quant.natural_table(-7, torch.float32).reshape(1, 256).to(DEVICE)
    got = _launch_quant.launch_natural_decode_sum(codes.reshape(1, -1), table, torch.empty(n, device=DEVICE))
    assert same(got, reference(quant.natural_decode, codes, -7, torch.float32))


# ---- plumbing only a GPU has -------------------------------------------------------------
def test_bridge_is_zero_copy():
    for dtype in (torch.float32, torch.bfloat16, torch.uint8, torch.int64):
        t = torch.arange(10, device=DEVICE).to(dtype)
        a = _cupy.as_cupy(t)
        assert a.data.ptr == t.data_ptr() and a.size == t.numel()
        assert _cupy.as_torch(a).data_ptr() == t.data_ptr()


def test_kernels_run_on_torchs_current_stream():
    """Work queued on a side stream waits for nothing else and is ordered on that stream."""
    x = torch.randn(BIG, device=DEVICE)
    ref_idx = reference(select.topk_indices, x.abs(), BIG // 100)
    ref_bits, _ = reference(sign.sign_pack, x, "abs")
    side = torch.cuda.Stream(device=DEVICE)
    side.wait_stream(torch.cuda.current_stream(DEVICE))
    with torch.cuda.stream(side):
        with _cupy.launcher(DEVICE) as k:
            assert k.stream.ptr == side.cuda_stream
        y = x.abs()  # made on the side stream: the kernels must see it complete
        idx = _launch_select.launch_topk_indices(y, BIG // 100)
        packed, _ = _launch_sign.launch_sign_pack(x, "abs")
    torch.cuda.current_stream(DEVICE).wait_stream(side)
    assert torch.equal(idx, ref_idx) and torch.equal(packed, ref_bits)


class _Recorder:
    def __init__(self, monkeypatch):
        self.names = []
        real = _cupy.Launcher.__call__

        def call(launcher, family, kernel, *args):
            self.names.append(kernel)
            return real(launcher, family, kernel, *args)

        monkeypatch.setattr(_cupy.Launcher, "__call__", call)


def test_public_primitives_reach_the_kernels(monkeypatch):
    rec = _Recorder(monkeypatch)
    x = torch.randn(100_000, device=DEVICE)
    checks = [
        (lambda: rng.uniform(1000, 7, DEVICE), "philox_uniform"),
        (lambda: sign.sign_pack(x, "abs"), "sign_pack_f32"),
        (lambda: sign.sign_unpack(torch.zeros(125, dtype=torch.uint8, device=DEVICE), 1000, 1.0, -1.0),
         "sign_unpack_f32"),
        (lambda: select.topk_indices(x.abs(), 1000), "topk_write"),
        (lambda: select.threshold_indices(x, 1.0), "threshold_mark_f32"),
        (lambda: sparse.densify(torch.arange(10, device=DEVICE), torch.ones(10, device=DEVICE), 100, torch.float32),
         "scatter_add_f32_i64"),
        (lambda: bits.pack_codes(torch.ones(100, dtype=torch.uint8, device=DEVICE), 2), "pack_codes"),
        (lambda: quant.block_absmax(x, 256), "block_absmax_f32"),
        (lambda: quant.bucket_norms(x, 256), "block_sumsq_f32"),
        (lambda: quant.quantize_levels(x, torch.ones(391, device=DEVICE), 256, 127), "quantize_levels"),
    ]
    missing = []
    for call, name in checks:
        rec.names.clear()
        call()
        if name not in rec.names:
            missing.append(name)
    assert not missing, f"these primitives did not launch their kernels on CUDA: {missing}"


@pytest.mark.parametrize("name", available_compressors())
def test_compressors_agree_with_the_torch_path(name):
    """End to end through the dispatch hooks: same payload (up to rounding of sums and norms)."""
    x = torch.randn(100_003, device=DEVICE)
    for ef in (False, True):
        make = (lambda: ErrorFeedback(get_compressor(name))) if ef else (lambda: get_compressor(name))
        c_kernel, c_torch = make(), make()
        for step in range(2):
            t = x * (step + 1)
            out_k = c_kernel.decompress(c_kernel.compress(t, key="w"))
            with _launch.torch_only():
                out_t = c_torch.decompress(c_torch.compress(t, key="w"))
            assert out_k.shape == out_t.shape and out_k.dtype == out_t.dtype
            scale = float(out_t.abs().max()) or 1.0
            bad = ((out_k - out_t).abs() > 1e-3 * scale).float().mean().item()
            assert bad <= 1e-3 and math.isfinite(bad), f"{name} ef={ef} step {step}: {bad:.2%} of elements differ"
