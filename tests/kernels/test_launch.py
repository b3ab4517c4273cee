"""Launcher plumbing and the kernels' logic, checked without a GPU.

The ``launch_<op>`` functions of ``kernels/_launch_<family>.py`` run here on CPU tensors
through the CUDA emulation (``emu`` fixture): the same kernels, grid sizes and buffers as on a
GPU, compared with the torch references of ``gradcomp.kernels``.
"""
import types

import numpy as np
import pytest
import torch

from gradcomp.kernels import (_cupy, _launch, _launch_bits, _launch_quant, _launch_rng, _launch_select,
                              _launch_sign, _launch_sparse, quant, rng, select, sign, sparse)
from gradcomp.kernels import bits as bits_ref

from kernel_checks import same  # beside this file (conftest puts it on the path)

FLOATS = [torch.float32, torch.float16, torch.bfloat16]


# ---- plumbing ------------------------------------------------------------------------------

def test_cpu_tensors_take_the_torch_path(monkeypatch):
    """No primitive launches a kernel for CPU tensors, so the references run (and importing
    the kernels never needs CuPy), even where CuPy would be available."""
    monkeypatch.setattr(_cupy, "available", lambda: True)

    def refuse(device):
        raise AssertionError(f"a kernel was launched for {device}")

    monkeypatch.setattr(_cupy, "launcher", refuse)
    x, b = torch.randn(100), torch.zeros(13, dtype=torch.uint8)
    assert not _launch.kernels_apply(x) and not _launch.device_applies(torch.device("cpu"))
    rng.uniform(10, 1)
    sign.sign_pack(x, "abs")
    sign.sign_unpack(b, 100, 1.0, -1.0, out=x.clone())
    sign.count_set(b)
    select.topk_indices(x.abs(), 5)
    select.threshold_indices(x, 0.5)
    bits_ref.pack_codes(b % 4, 2)
    bits_ref.unpack_codes(b, 52, 2)
    sparse.scatter_add_checked(x.clone(), torch.arange(3), x[:3])
    quant.block_absmax(x, 8)
    quant.bucket_norms(x, 8)
    quant.quantize_levels(x, torch.ones(13), 8, 7)
    quant.dequantize_levels(torch.zeros(100, dtype=torch.int8), torch.ones(13), 8)
    quant.natural_codes(x * 0.01, torch.rand(100))
    quant.natural_decode(b, 0)


def test_torch_only_switches_the_kernels_off_and_back(monkeypatch):
    monkeypatch.setattr(_cupy, "available", lambda: True)
    meta = torch.zeros(1, device="meta")
    assert _launch.enabled() and not _launch.kernels_apply(meta)  # meta: not a CUDA device
    with _launch.torch_only():
        assert not _launch.kernels_apply(torch.zeros(1))
        assert not _launch.device_applies(torch.device("cuda"))
        with _launch.torch_only():
            pass
        assert not _launch.enabled()
    assert _launch.enabled() and _launch.device_applies(torch.device("cuda"))


def test_primitives_route_to_their_launchers(emu, monkeypatch):
    """With the kernels taken to apply (as they do for a CUDA tensor), each primitive that has
    no CPU fast path in front launches its family's kernels and returns what its torch code
    returns: the guard conditions and arguments of the dispatch, without a GPU."""
    x = torch.randn(5000)
    x[7] = float("nan")
    mult, u = torch.rand(20) * 200, rng.uniform(5000, 3)
    q, scale = torch.randint(-127, 128, (5000,), dtype=torch.int8), torch.rand(20)
    idx, vals = torch.randint(0, 5000, (300,)), torch.randn(300)
    y = (torch.randn(5000) * 0.05).clamp(-0.24, 0.24)
    calls = {
        "philox_uniform": lambda: rng.uniform(1000, 7),
        "topk_write": lambda: select.topk_indices(x.abs(), 50),
        "threshold_mark_f32": lambda: select.threshold_indices(x, 1.0),
        "scatter_add_f32_i64": lambda: sparse.scatter_add_checked(torch.zeros(5000), idx, vals),
        "block_absmax_f32": lambda: quant.block_absmax(x, 256),
        "block_sumsq_f32": lambda: quant.bucket_norms(x, 256),
        "quantize_levels": lambda: quant.quantize_levels(x.nan_to_num(), mult, 256, 127, u),
        "dequantize_sum_f32": lambda: quant.dequantize_levels(q, scale, 256),
        "natural_codes": lambda: quant.natural_codes(y, u),
    }
    expected = {name: call() for name, call in calls.items()}
    monkeypatch.setattr(rng, "device_applies", lambda device: True)
    for module in (select, sparse, quant):
        monkeypatch.setattr(module, "kernels_apply", lambda *tensors: True)
    for name, call in calls.items():
        emu.launches.clear()
        got = call()
        assert name in emu.launches, f"{name} was not launched"
        if name in ("scatter_add_f32_i64", "block_sumsq_f32"):  # sums: any order
            assert torch.allclose(got, expected[name], rtol=1e-5, atol=1e-6, equal_nan=True), name
        else:
            assert same(got, expected[name], zero_sign=False) if got.is_floating_point() else \
                torch.equal(got, expected[name]), name


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
        got = _launch_rng.launch_uniform(n, key, torch.device("cpu"))
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
        bits, sums = _launch_sign.launch_sign_pack(x, stats)
        rbits, rsums = sign.sign_pack_reference(x, stats)
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
        got = _launch_sign.launch_sign_unpack(bits, n, pos, neg, base.clone(), acc)
        ref = sign.sign_unpack_reference(bits, n, pos, neg, out=base.clone(), accumulate=acc)
        assert same(got, ref), (pos, neg, acc)
        unaligned = torch.cat([base[:1], base])[1:]  # a view one element off: scalar stores
        assert same(_launch_sign.launch_sign_unpack(bits, n, pos, neg, unaligned, acc), ref)


def test_count_set_kernel(emu):
    for n in (0, 1, 1001):
        bits = torch.randint(0, 256, (n,), dtype=torch.uint8)
        assert _launch_sign.launch_count_set(bits) == sign.count_set(bits)


# ---- select --------------------------------------------------------------------------------
SAMPLED_N = _launch_select.FULL_N + 7001  # above the whole-tensor size: sample, window, candidates


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
        got = _launch_select.launch_topk_indices(x, k)
        ref = select.topk_indices(x, k)
        assert got.dtype == torch.int64 and torch.equal(got, ref), (kind, n, k)


def test_topk_kernel_takes_the_window_path(emu):
    """With a usable sample window no kernel reads the whole tensor after the first pass."""
    x = torch.randn(SAMPLED_N)
    k = SAMPLED_N // 100
    got = _launch_select.launch_topk_indices(x, k)
    assert torch.equal(got, select.topk_indices(x, k))
    assert "topk_pass_f32" in emu.launches


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n", [0, 1, 1000, 70_001])
def test_threshold_kernel(emu, dtype, n):
    x = _magnitudes(n, dtype, "special") if n else torch.empty(0, dtype=dtype)
    for tau in (0.0, 0.5, 1.7, 1e6):
        t = select._round_up(tau, dtype, "cpu")
        assert torch.equal(_launch_select.launch_threshold_indices(x, float(t)), select.threshold_indices(x, tau)), tau


# ---- bits, sparse --------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("n", [0, 1, 7, 9, 1001, 70_001])
def test_pack_and_unpack_codes_kernels(emu, bits, n):
    codes = torch.randint(0, 1 << bits, (n + 1,), dtype=torch.uint8)
    for c in (codes[:n], codes[1:]):  # aligned, and a view one byte off
        packed = _launch_bits.launch_pack_codes(c, bits)
        assert torch.equal(packed, bits_ref.pack_codes_reference(c, bits) if bits > 1 else bits_ref.pack_bits(c))
        assert torch.equal(_launch_bits.launch_unpack_codes(packed, n, bits), c)


@pytest.mark.parametrize("dtype", FLOATS + [torch.float64], ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_scatter_add_kernel(emu, dtype, index_dtype):
    n, m = 1001, 3000  # many repeats: atomic adds of the same element
    idx = torch.randint(0, n, (m,), dtype=index_dtype)
    idx[:3] = torch.tensor([0, n - 1, n - 1])  # first and last element (16-bit: both word halves)
    vals = torch.randn(m).to(dtype)
    got = _launch_sparse.launch_scatter_add_checked(torch.zeros(n, dtype=dtype), idx, vals)
    ref = sparse.scatter_add_checked(torch.zeros(n, dtype=dtype), idx, vals)
    tol = 1e-5 if dtype in (torch.float32, torch.float64) else 3e-2
    assert torch.allclose(got.double(), ref.double(), rtol=tol, atol=tol)
    assert torch.equal(_launch_sparse.launch_scatter_add_checked(torch.ones(n, dtype=dtype), idx[:0], vals[:0]),
                       torch.ones(n, dtype=dtype))


@pytest.mark.parametrize("bad", [-1, 1001, 2**40])
def test_scatter_add_kernel_rejects_bad_indices_and_writes_nothing(emu, bad):
    n = 1001
    idx = torch.tensor([3, bad, 5], dtype=torch.int64)
    out = torch.zeros(n)
    with pytest.raises(ValueError, match=r"indices must lie in \[0, 1001\)"):
        _launch_sparse.launch_scatter_add_checked(out, idx, torch.ones(3))
    assert not out.any()


# ---- quant -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n,block", [(1, 1), (7, 3), (1000, 256), (5000, 5000), (70_001, 2500)])
def test_block_absmax_and_norm_kernels(emu, dtype, n, block):
    x = (torch.randn(n) * 3).to(dtype)
    if n > 10:
        x[5] = float("nan")
        x[n - 2] = float("-inf")
    assert same(_launch_quant.launch_block_absmax(x, block), quant.block_absmax(x, block), zero_sign=False)
    y = (torch.randn(n) * 1e20).to(torch.float32) if dtype == torch.float32 else torch.randn(n).to(dtype)
    got, ref = _launch_quant.launch_bucket_norms(y, block), quant.bucket_norms(y, block)
    rtol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == ref.dtype and torch.allclose(got.double(), ref.double(), rtol=rtol)


@pytest.mark.parametrize("levels", [1, 3, 7, 127])
@pytest.mark.parametrize("n,block", [(1, 1), (9, 4), (20_003, 512)])
@pytest.mark.parametrize("offset", [0, 1])  # 1: x is a view off the 32-byte alignment
def test_quantize_kernel_matches_the_reference_bit_for_bit(emu, levels, n, block, offset):
    x = torch.randn(n + offset)[offset:]
    mult = torch.rand(-(-n // block)) * levels * 2  # some products beyond +-levels saturate
    key = rng.stream_key(7, "w", 3)
    u = rng.uniform(n, key)
    assert torch.equal(_launch_quant.launch_quantize_levels(x, mult, block, levels, u),
                       quant.quantize_levels(x, mult, block, levels, u))
    assert torch.equal(_launch_quant.launch_quantize_levels(x, mult, block, levels, None),
                       quant.quantize_levels(x, mult, block, levels))


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
        got = _launch_quant.launch_dequantize_sum(codes, bits, offset, scales, block, base.clone(), weight, acc)
        ref = quant.dequantize_sum_reference(codes, bits, offset, scales, block, base.clone(), weight, acc)
        assert torch.equal(got, ref)
    q = codes[0] if bits == 8 else torch.randint(-127, 128, (n,), dtype=torch.int8)
    one = _launch_quant.launch_dequantize_sum(q.reshape(1, -1), 8, 0, scales[:1], block, torch.empty(n, dtype=dtype))
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
    assert torch.equal(_launch_quant.launch_natural_codes(y, u), ref)
    assert torch.equal(_launch_quant.launch_natural_codes(y, None, key), ref)
    codes = torch.randint(0, 256, (2, n), dtype=torch.uint8)
    for dtype in FLOATS:
        table = quant.natural_table(-3, dtype)
        got = _launch_quant.launch_natural_decode_sum(codes[:1], table.float().reshape(1, 256),
                                                      torch.empty(n, dtype=dtype))
        ref = table[codes[0].long()]  # natural_decode itself makes fp32/fp64 only
        if dtype == torch.float32:
            assert same(ref, quant.natural_decode(codes[0], -3, dtype))
        assert same(got, ref)
