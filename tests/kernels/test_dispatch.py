"""Dispatch plumbing and the kernels' logic, checked without a GPU.

The kernel-path functions of ``_dispatch`` run here on CPU tensors through the CUDA emulation
(``emu`` fixture): the same kernels, grid sizes and buffers as on a GPU, compared with the
torch references of ``gradcomp.kernels``.
"""
import types

import numpy as np
import pytest
import torch

from gradcomp.compress import ErrorFeedback, get_compressor
from gradcomp.kernels import _cupy, _dispatch, quant, rng, select, sign, sparse
from gradcomp.kernels import bits as bits_ref

from kernel_checks import same  # beside this file (conftest puts it on the path)

FLOATS = [torch.float32, torch.float16, torch.bfloat16]


# ---- plumbing ------------------------------------------------------------------------------

def test_cpu_tensors_take_the_torch_path():
    """Every dispatch entry declines CPU tensors, so the references run (and importing the
    kernels never needs CuPy)."""
    x, b = torch.randn(100), torch.zeros(13, dtype=torch.uint8)
    calls = [
        lambda: _dispatch.cuda_uniform(10, 1, torch.device("cpu")),
        lambda: _dispatch.cuda_sign_pack(x, "abs"),
        lambda: _dispatch.cuda_sign_unpack(b, 100, 1.0, -1.0, x, False),
        lambda: _dispatch.cuda_sign_ef(x, x.clone(), "onebit"),
        lambda: _dispatch.cuda_count_set(b),
        lambda: _dispatch.cuda_topk_indices(x, 5),
        lambda: _dispatch.cuda_threshold_indices(x, torch.tensor(0.5)),
        lambda: _dispatch.cuda_pack_codes(b, 2),
        lambda: _dispatch.cuda_scatter_add_checked(x, torch.arange(3), x[:3]),
        lambda: _dispatch.cuda_block_absmax(x, 8),
        lambda: _dispatch.cuda_quantize_levels(x, torch.ones(13), 8, 7, None),
        lambda: _dispatch.cuda_natural_codes(x, x, None),
    ]
    assert all(call() is None for call in calls)


def test_torch_only_switches_the_kernels_off_and_back():
    assert _dispatch._enabled
    with _dispatch.torch_only():
        assert not _dispatch.kernels_apply(torch.zeros(1))
        with _dispatch.torch_only():
            pass
        assert not _dispatch._enabled
    assert _dispatch._enabled


def test_sources_are_self_contained():
    """What NVRTC compiles: every family, headers inlined once, include guards intact."""
    assert set(_cupy.families()) >= {"rng", "bits", "sign", "select", "sparse", "quant"}
    src = _cupy.source("quant")
    assert "#include" not in src and src.count("#define GRADCOMP_COMMON_CUH") == 1
    with pytest.raises(ValueError, match="no CUDA kernel family"):
        _cupy.source("nope")


def test_dlpack_bridge_is_zero_copy(monkeypatch):
    """The bridge on CPU tensors, with numpy standing in for CuPy as the DLPack consumer:
    views share memory, and bf16 crosses as its 16-bit pattern."""
    monkeypatch.setattr(_cupy, "_cupy", lambda: types.SimpleNamespace(from_dlpack=np.from_dlpack))
    for t in (torch.arange(6.0), torch.ones(4, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.bool)):
        view = _cupy.as_cupy(t)
        assert view.ctypes.data == t.data_ptr() and view.size == t.numel()
    t = torch.arange(4.0)
    assert _cupy.as_torch(t).data_ptr() == t.data_ptr()


def test_launcher_refuses_python_numbers():
    """A Python int or float has no C type: the kernel would read the wrong bytes."""
    k = object.__new__(_cupy.Launcher)
    k.device, k._views, k._keep = torch.device("cpu"), {}, []
    for bad in (3, 2.5, None):
        with pytest.raises(TypeError, match="numpy scalars"):
            k._arg(bad)
    assert k._arg(np.int64(3)) == 3


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 4097])
def test_uniform_kernel_is_numpys_philox_stream(emu, n):
    for key in (0, 1, rng.stream_key(3, "layer.w", 17), 2**128 - 1):
        got = _dispatch.uniform(n, key, torch.device("cpu"))
        ref = np.random.Generator(np.random.Philox(key=key)).random(n, dtype=np.float32)
        assert np.array_equal(got.numpy(), ref), (n, key)
    assert emu.launches.count("philox_uniform") == (4 if n else 0)


# ---- sign ----------------------------------------------------------------------------------
# sizes around the 32-element words and 128-element warp steps, and one that makes the
# emulated grid (3 SMs) loop more than once
SIGN_SIZES = [0, 1, 7, 31, 32, 33, 129, 1000, 200_003]


def _signal(n, dtype, special=True):
    x = torch.randn(n, dtype=torch.float64)
    if special and n > 8:
        x[1], x[3], x[5] = 0.0, -0.0, 1e30  # signed zeros; fp16 overflows to inf
        x[2], x[4] = -1e-40, -3e-6  # negative subnormals of fp32/bf16 and of fp16: sign bit clear
        x[n // 2] = float("nan") if n % 2 else float("-inf")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n", SIGN_SIZES)
def test_sign_pack_kernel(emu, dtype, n):
    x = _signal(n, dtype)
    for stats in sign.STATS:
        bits, sums = _dispatch.sign_pack(x, stats)
        rbits, rsums = sign.sign_pack_torch(x, stats)
        assert torch.equal(bits, rbits), stats
        assert torch.allclose(sums, rsums, rtol=1e-12, atol=1e-9, equal_nan=True), (stats, sums, rsums)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n", [0, 1, 9, 1000, 70_001])
def test_sign_unpack_kernel(emu, dtype, n):
    bits = torch.randint(0, 256, ((n + 7) // 8,), dtype=torch.uint8)
    for pos, neg, acc in ((0.1, -0.3, False), (1.0, -1.0, True), (3e38, float("nan"), True), (1e-40, -2e-40, True)):
        base = torch.randn(n).to(dtype)
        if pos < 1e-30:  # subnormal sums: kept, not flushed to zero
            base = (base * 1e-39).to(dtype)
        got = _dispatch.sign_unpack(bits, n, pos, neg, base.clone(), acc)
        ref = sign.sign_unpack_torch(bits, n, pos, neg, out=base.clone(), accumulate=acc)
        assert same(got, ref), (pos, neg, acc)
        unaligned = torch.cat([base[:1], base])[1:]  # a view one element off: scalar stores
        assert same(_dispatch.sign_unpack(bits, n, pos, neg, unaligned, acc), ref)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("nvalues", [1, 2])
def test_sign_unpack_sum_kernel_matches_its_reference(emu, dtype, nvalues):
    n, ranks = 3001, 3
    bits = torch.randint(0, 256, (ranks, (n + 7) // 8), dtype=torch.uint8)
    values = torch.randn(ranks, nvalues)
    for acc, weight in ((False, 1.0 / ranks), (True, 0.5)):
        base = torch.randn(n).to(dtype)
        got = _dispatch.sign_unpack_sum(bits, values, n, base.clone(), weight, acc)
        ref = _dispatch.sign_unpack_sum_torch(bits, values, n, base.clone(), weight, acc)
        assert torch.equal(got, ref)


@pytest.mark.parametrize("mode", ["signsgd", "efsignsgd", "onebit"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_sign_ef_kernel_is_error_feedback_of_the_compressor(emu, mode, dtype):
    """Two steps of the fused kernel against ErrorFeedback(get_compressor(mode)) on CPU."""
    n = 5000
    ef = ErrorFeedback(get_compressor(mode))
    residual = torch.zeros(n)
    for step in range(2):
        x = _signal(n, dtype, special=False)
        p = ef.compress(x, key="w")
        bits, values = _dispatch.sign_ef(x, residual, mode)
        assert torch.equal(bits, p.tensors[0]), step
        # the CPU path of sign_pack sums chunks in fp32: agreement to ~1e-6, not bit for bit
        assert torch.allclose(values, p.tensors[1], rtol=1e-5), (values, p.tensors[1])
        assert torch.allclose(residual, ef.residual("w"), rtol=1e-5, atol=1e-6)
    # the torch composition used as the GPU oracle (float64 sums), with NaN/Inf in x
    x = _signal(n, dtype)
    res_a, res_b = residual.clone(), residual.clone()
    bits_a, vals_a = _dispatch.sign_ef(x, res_a, mode)
    bits_b, vals_b = _dispatch.sign_ef_torch(x, res_b, mode)
    assert torch.equal(bits_a, bits_b)
    assert torch.allclose(vals_a, vals_b, rtol=1e-6, equal_nan=True)
    assert torch.allclose(res_a, res_b, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_count_set_kernel(emu):
    for n in (0, 1, 1001):
        bits = torch.randint(0, 256, (n,), dtype=torch.uint8)
        assert _dispatch.count_set(bits) == sign.count_set(bits)


# ---- select --------------------------------------------------------------------------------
SAMPLED_N = _dispatch._FULL_N + 7001  # above the whole-tensor size: sample, window, candidates


def _magnitudes(n, dtype, kind):
    if kind == "normal":
        x = torch.randn(n).abs()
    elif kind == "ties":  # 40 distinct values: the k-th is always tied
        x = torch.randint(0, 40, (n,)).float()
    elif kind == "special":  # NaN, inf, signed zeros and negative values
        x = torch.randn(n)
        x[torch.randperm(n)[: max(1, n // 50)]] = float("nan")
        x[:: 97] = float("inf")
        x[1:: 89] = -0.0
        x[2:: 83] = 0.0
    else:  # "sorted": the sample's strata see a monotone ramp
        x = torch.linspace(0, 1, n)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("kind", ["normal", "ties", "special", "sorted"])
@pytest.mark.parametrize("n", [1, 7, 1000, SAMPLED_N])
def test_topk_kernel_is_the_reference_set(emu, dtype, kind, n):
    """Small sizes select on the whole tensor; SAMPLED_N goes through the sample window, or
    (40 distinct values: the tie group overflows the window) the exact fallback."""
    if n == SAMPLED_N and dtype != torch.float32 and kind != "special":
        pytest.skip("16-bit inputs differ only in the load: one kind suffices at this size")
    x = _magnitudes(n, dtype, kind)
    ks = (0, 1, max(1, n // 100), n // 3, n - 1, n) if n < SAMPLED_N else (1, n // 100)
    for k in sorted(set(ks)):
        got = _dispatch.topk_indices(x, k)
        ref = select.topk_indices(x, k)
        assert got.dtype == torch.int64 and torch.equal(got, ref), (kind, n, k)


def test_topk_kernel_takes_the_window_path(emu):
    """With a usable sample window no kernel reads the whole tensor after the first pass."""
    x = torch.randn(SAMPLED_N)
    k = SAMPLED_N // 100
    got = _dispatch.topk_indices(x, k)
    assert torch.equal(got, select.topk_indices(x, k))
    assert "topk_pass_f32" in emu.launches


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n", [0, 1, 1000, 70_001])
def test_threshold_kernel(emu, dtype, n):
    x = _magnitudes(n, dtype, "special") if n else torch.empty(0, dtype=dtype)
    for tau in (0.0, 0.5, 1.7, 1e6):
        t = select._round_up(tau, dtype, "cpu")
        assert torch.equal(_dispatch.threshold_indices(x, float(t)), select.threshold_indices(x, tau)), tau


# ---- bits, sparse --------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("n", [0, 1, 7, 9, 1001, 70_001])
def test_pack_and_unpack_codes_kernels(emu, bits, n):
    codes = torch.randint(0, 1 << bits, (n + 1,), dtype=torch.uint8)
    for c in (codes[:n], codes[1:]):  # aligned, and a view one byte off
        packed = _dispatch.pack_codes(c, bits)
        assert torch.equal(packed, bits_ref._pack_torch(c, bits) if bits > 1 else bits_ref.pack_bits(c))
        assert torch.equal(_dispatch.unpack_codes(packed, n, bits), c)


@pytest.mark.parametrize("dtype", FLOATS + [torch.float64], ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_scatter_add_kernel(emu, dtype, index_dtype):
    n, m = 1001, 3000  # many repeats: atomic adds of the same element
    idx = torch.randint(0, n, (m,), dtype=index_dtype)
    idx[:3] = torch.tensor([0, n - 1, n - 1])  # first and last element (16-bit: both word halves)
    vals = torch.randn(m).to(dtype)
    got = _dispatch.scatter_add_checked(torch.zeros(n, dtype=dtype), idx, vals)
    ref = sparse.scatter_add_checked(torch.zeros(n, dtype=dtype), idx, vals)
    tol = 1e-5 if dtype in (torch.float32, torch.float64) else 3e-2
    assert torch.allclose(got.double(), ref.double(), rtol=tol, atol=tol)
    assert torch.equal(_dispatch.scatter_add_checked(torch.ones(n, dtype=dtype), idx[:0], vals[:0]),
                       torch.ones(n, dtype=dtype))


@pytest.mark.parametrize("bad", [-1, 1001, 2**40])
def test_scatter_add_kernel_rejects_bad_indices_and_writes_nothing(emu, bad):
    n = 1001
    idx = torch.tensor([3, bad, 5], dtype=torch.int64)
    out = torch.zeros(n)
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 1001\)"):
        _dispatch.scatter_add_checked(out, idx, torch.ones(3))
    assert not out.any()


# ---- quant -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n,block", [(1, 1), (7, 3), (1000, 256), (5000, 5000), (70_001, 2500)])
def test_block_absmax_and_norm_kernels(emu, dtype, n, block):
    x = (torch.randn(n) * 3).to(dtype)
    if n > 10:
        x[5] = float("nan")
        x[n - 2] = float("-inf")
    assert same(_dispatch.block_absmax(x, block), quant.block_absmax(x, block), zero_sign=False)
    y = (torch.randn(n) * 1e20).to(torch.float32) if dtype == torch.float32 else torch.randn(n).to(dtype)
    got, ref = _dispatch.bucket_norms(y, block), quant.bucket_norms(y, block)
    rtol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == ref.dtype and torch.allclose(got.double(), ref.double(), rtol=rtol)


@pytest.mark.parametrize("levels,bits", [(1, 2), (7, 4), (127, 8), (3, 8)])
@pytest.mark.parametrize("n,block", [(1, 1), (9, 4), (20_003, 512)])
@pytest.mark.parametrize("offset", [0, 1])  # 1: x is a view off the 32-byte alignment
def test_quantize_kernels_match_the_reference_bit_for_bit(emu, levels, bits, n, block, offset):
    x = torch.randn(n + offset)[offset:]
    mult = torch.rand(-(-n // block)) * levels * 2  # some products beyond +-levels saturate
    key = rng.stream_key(7, "w", 3)
    u = rng.uniform(n, key)
    assert torch.equal(_dispatch.quantize_levels(x, mult, block, levels, u),
                       quant.quantize_levels(x, mult, block, levels, u))
    assert torch.equal(_dispatch.quantize_levels(x, mult, block, levels, None),
                       quant.quantize_levels(x, mult, block, levels))
    for k in (key, None):
        assert torch.equal(_dispatch.quantize_codes(x, mult, block, levels, k, bits),
                           _dispatch.quantize_codes_torch(x, mult, block, levels, k, bits)), k


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bits,offset", [(8, 0), (2, 1), (4, 7)])
@pytest.mark.parametrize("n", [3001, 4096])  # rows of 4096 codes start aligned: vector loads
def test_dequantize_sum_kernel(emu, dtype, bits, offset, n):
    block, ranks = 256, 3
    nb = -(-n // block)
    if bits == 8:
        codes = torch.randint(-127, 128, (ranks, n), dtype=torch.int8)
    else:
        codes = torch.randint(0, 256, (ranks, (n * bits + 7) // 8), dtype=torch.uint8)
    scales = torch.rand(ranks, nb) * 10
    for acc, weight in ((False, 1.0), (True, 1.0 / ranks)):
        base = torch.randn(n).to(dtype)
        got = _dispatch.dequantize_sum(codes, bits, offset, scales, block, base.clone(), weight, acc)
        ref = _dispatch.dequantize_sum_torch(codes, bits, offset, scales, block, base.clone(), weight, acc)
        assert torch.equal(got, ref)
    q = codes[0] if bits == 8 else torch.randint(-127, 128, (n,), dtype=torch.int8)
    one = _dispatch.dequantize_sum(q.reshape(1, -1), 8, 0, scales[:1], block, torch.empty(n, dtype=dtype))
    assert torch.equal(one, quant.dequantize_levels(q, scales[0], block, dtype))


@pytest.mark.parametrize("n", [1, 8, 9, 20_003])
def test_natural_kernels(emu, n):
    y = (torch.randn(n) * 0.05).clamp(-0.24, 0.24)
    y[0] = 0.0
    if n > 2:
        y[1], y[2] = -0.0, 1e-40  # signed zero, a subnormal
    key = rng.stream_key(1, "nat", 9)
    u = rng.uniform(n, key)
    ref = quant.natural_codes(y, u)
    assert torch.equal(_dispatch.natural_codes(y, u), ref)
    assert torch.equal(_dispatch.natural_codes(y, None, key), ref)
    codes = torch.randint(0, 256, (2, n), dtype=torch.uint8)
    for dtype in FLOATS:
        table = quant.natural_table(-3, dtype)
        got = _dispatch.natural_decode_sum(codes[:1], table.float().reshape(1, 256), torch.empty(n, dtype=dtype))
        ref = table[codes[0].long()]  # natural_decode itself makes fp32/fp64 only
        if dtype == torch.float32:
            assert same(ref, quant.natural_decode(codes[0], -3, dtype))
        assert same(got, ref)
