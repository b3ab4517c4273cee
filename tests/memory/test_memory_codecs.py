"""The activation codecs: lossless is bit-exact, lossy ones stay within their error bound and
are unbiased, randomness is keyed, sizes are what they claim, non-finite values survive."""
import math

import pytest
import torch

from gradcomp.kernels import rng
from gradcomp.memory.codecs import ActivationCodec, BlockQuant, Packed, available_codecs, get_codec

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
QUANT = ["int8", "int4", "int2"]


def bits_of(t):
    return t.contiguous().view(INTS[t.element_size()])


def special_values(dtype):
    """-0.0, +-inf, NaNs with payloads and sign, subnormals, the extremes, as a flat tensor."""
    fi = torch.finfo(dtype)
    plain = torch.tensor([0.0, -0.0, math.inf, -math.inf, fi.max, -fi.max, fi.tiny, -fi.tiny,
                          fi.tiny * fi.eps, -fi.tiny * fi.eps, fi.tiny * fi.eps * 3, 1.0, -1.0],
                         dtype=torch.float64).to(dtype)
    nan_bits = {torch.float32: [0x7FC00001, 0x7F800123, -0x003EDCBA], torch.float64: [0x7FF8000000000ABC, -0x7FFFFFFF],
                torch.float16: [0x7E01, 0x7C05, -0x0123], torch.bfloat16: [0x7FC1, 0x7F81, -0x0045]}[dtype]
    nans = torch.tensor(nan_bits, dtype=INTS[dtype.itemsize]).view(dtype)
    assert torch.isnan(nans).all()
    return torch.cat([plain, nans])


def relu_data(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.relu(torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)


def block_steps(packed, codec):
    """The stored step of each element's block."""
    return packed.tensors[1][1].repeat_interleave(codec.block_size)[:packed.numel].double()


# ---- lossless -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
def test_lossless_is_bit_exact_with_special_values(dtype):
    codec = get_codec("lossless")
    x = relu_data(5000, dtype)
    sp = special_values(dtype)
    x[17:17 + sp.numel()] = sp
    x[-sp.numel():] = sp
    for t in [x, x.view(50, 100).t(), x.view(50, 100)[::3, 1::2], x[7:8].view(()), x[:0]]:
        packed = codec.encode(t, key=0)
        y = packed.decode()
        assert y.shape == t.shape and y.dtype == t.dtype and y.device == t.device and y.is_contiguous()
        assert torch.equal(bits_of(y), bits_of(t))
        if t.numel():
            assert y.data_ptr() != t.data_ptr()


def test_lossless_takes_any_dtype_and_sizes_exactly():
    codec = get_codec("lossless")
    assert codec.lossless and not codec.stochastic and codec.predicted_nbytes(100, torch.float32) is None
    for t in [torch.randint(-5, 5, (999,)), torch.rand(999) > 0.7, torch.randint(0, 3, (999,), dtype=torch.uint8),
              torch.randn(99, dtype=torch.complex64), torch.randn(99, dtype=torch.complex128)]:
        assert torch.equal(codec.encode(t, 0).decode(), t)
    x = relu_data(10_000)
    nnz = int((bits_of(x) != 0).sum())
    packed = codec.encode(x, 0)
    assert packed.nbytes == math.ceil(x.numel() / 8) + 4 * nnz
    print(f"lossless on post-ReLU fp32: {packed.raw_nbytes / packed.nbytes:.2f}x")
    assert packed.raw_nbytes / packed.nbytes > 1.7
    dense = torch.randn(10_000)
    assert codec.encode_if_smaller(dense, 0, limit=dense.numel() * 4) is None  # would not shrink
    assert codec.encode_if_smaller(x, 0, limit=x.numel() * 4).nbytes == packed.nbytes


# ---- casts ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,wire", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_casts_round_and_saturate(name, wire):
    codec = get_codec(name)
    assert not codec.lossless and not codec.stochastic
    top = torch.finfo(wire).max
    for dtype in FLOATS:
        x = torch.randn(3000, dtype=torch.float64).to(dtype)
        packed = codec.encode(x.view(30, 100).t(), 0)
        y = packed.decode()
        assert y.dtype == dtype and y.shape == (100, 30) and y.is_contiguous()
        assert packed.nbytes == codec.predicted_nbytes(3000, dtype) == 6000
        eps = max(torch.finfo(wire).eps, torch.finfo(dtype).eps)
        assert ((y.t().double() - x.view(30, 100).double()).abs() <= x.view(30, 100).double().abs() * eps).all()
        if dtype == wire:  # nothing to cast: still a copy, never an alias
            assert torch.equal(y, x.view(30, 100).t()) and packed.tensors[0].data_ptr() != x.data_ptr()
        # beyond the wire's range: saturates; inf and NaN stay
        big = torch.finfo(dtype).max
        if big > top:
            z = torch.tensor([big, -big, top * 4 if top * 4 < big else big, math.inf, -math.inf, math.nan], dtype=dtype)
            d = codec.encode(z, 0).decode().double()
            top_here = float(torch.tensor(top, dtype=torch.float64).to(dtype))  # bfloat16 has no 65504
            assert d[:3].abs().eq(top_here).all() and d[0] > 0 > d[1]
            assert d[3] == math.inf and d[4] == -math.inf and math.isnan(d[5])


# ---- block quantization ---------------------------------------------------------------------

@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("dtype", FLOATS)
def test_quant_error_within_one_step(name, dtype):
    codec = get_codec(name)
    assert codec.stochastic and not codec.lossless
    g = torch.Generator().manual_seed(1)
    for x in [torch.randn(10_000, generator=g, dtype=torch.float64).mul(3).add(1).to(dtype), relu_data(10_001, dtype),
              torch.full((700,), 2.5, dtype=dtype), torch.zeros(300, dtype=dtype),
              relu_data(2**18 + 1031, dtype).sub(0.1)]:  # several CPU runs of blocks, a ragged tail
        packed = codec.encode(x, key=3)
        y = packed.decode()
        assert y.dtype == dtype and y.shape == x.shape
        step = block_steps(packed, codec)
        # the step is the block's range over its levels (one level less where the block's min is 0)
        lo, hi = x.double()[:x.numel() // 256 * 256].view(-1, 256).aminmax(dim=1)
        nb = lo.numel()
        bound = (hi - lo) / torch.where(lo == 0, codec.levels - 1, codec.levels)
        assert torch.allclose(packed.tensors[1][1][:nb].double(), bound, rtol=1e-6, atol=0)
        err = (y.double() - x.double()).abs()
        rounding = y.double().abs() * torch.finfo(dtype).eps  # the decoded value's own rounding
        assert (err <= step * (1 + 1e-6) + rounding).all(), (name, dtype, (err - step).max())
        if (x == x.flatten()[0]).all():  # a constant block decodes exactly
            assert torch.equal(y, x)


def test_quant_keeps_zero_exact_and_positive_values_positive():
    """ReLU's backward reads its saved output's > 0 mask: it must survive every int codec."""
    x = relu_data((64, 1000))
    x[3, :10] = torch.finfo(torch.float32).tiny  # far below one step
    for name in QUANT:
        for dtype in (torch.float32, torch.bfloat16):
            y = get_codec(name).encode(x.to(dtype), 11).decode()
            assert torch.equal(y > 0, x > 0), name


@pytest.mark.parametrize("name", QUANT)
def test_quant_rounding_is_unbiased(name):
    codec = get_codec(name, block_size=128)
    keys = 256
    for x in [torch.randn(4096, dtype=torch.float64).float(), relu_data(4096)]:
        total = torch.zeros(4096, dtype=torch.float64)
        for k in range(keys):
            total += codec.encode(x, key=k).decode().double()
        mean = total / keys
        packed = codec.encode(x, key=0)
        step = block_steps(packed, codec)
        zero = packed.tensors[1][0].repeat_interleave(128) == 0
        # one draw errs by at most a step, so the mean of 256 has sd <= step / 32; values below
        # step / 16 in a zero-preserving block are rounded up to it (the mask's price)
        allowance = 5 * step / (2 * math.sqrt(keys)) + torch.where(zero, step / 16, 0.0)
        dev = (mean - x.double()).abs()
        assert (dev <= allowance + 1e-7).all(), (dev - allowance).max()
        assert abs(float(((mean - x.double()) / step.clamp(min=1e-30)).mean())) < 0.01  # no drift overall


def test_quant_rounding_is_stochastic():
    """A value halfway between two grid points takes both, about equally often (rounding to
    nearest would always take the same one)."""
    x = torch.tensor([-1.0, 0.0, 1.0] * 100)  # int2 grid of each block: -1, -1/3, 1/3, 1
    y = get_codec("int2", block_size=150).encode(x, 0).decode()[1::3]
    assert torch.allclose(y.abs(), torch.full_like(y, 1 / 3))
    assert 30 < int((y > 0).sum()) < 70


def test_quant_codes_follow_the_keyed_stream():
    """The stochastic rounding of a block without zero is floor((x - lo) / step + u) with u the
    stream of (key, numel): a reference computation gives the same codes."""
    x = torch.randn(1000, dtype=torch.float64).float() + 0.5
    x[0::256] = -3.0  # no block has min 0
    codec = get_codec("int8", block_size=256)
    packed = codec.encode(x, key=42)
    u = rng.uniform(1000, rng.stream_key(42, "activations", 1000))
    lo, step = packed.tensors[1]
    b = torch.arange(1000) // 256
    ref = torch.floor((x - lo[b]) / step[b] + u).clamp(0, 255).to(torch.uint8)
    assert torch.equal(packed.tensors[0], ref)


@pytest.mark.parametrize("name", QUANT)
def test_quant_is_keyed_and_leaves_the_global_rng_alone(name):
    codec = get_codec(name)
    x = torch.randn(3, 1000)
    state = torch.get_rng_state()
    a = codec.encode(x, key=5)
    torch.manual_seed(123)  # the global RNG plays no part
    b = codec.encode(x, key=5)
    torch.set_rng_state(state)
    c = codec.encode(x, key=6)
    assert all(torch.equal(p, q) for p, q in zip(a.tensors, b.tensors))
    assert torch.equal(a.decode(), b.decode())
    assert not torch.equal(a.tensors[0], c.tensors[0])
    before = torch.get_rng_state()
    codec.encode(x, key=7)
    assert torch.equal(torch.get_rng_state(), before)
    # a non-contiguous input encodes like its contiguous copy
    t = torch.randn(100, 90).t()
    assert torch.equal(codec.encode(t, 9).decode(), codec.encode(t.contiguous(), 9).decode())


def test_quant_ratios():
    x = torch.randn(64, 4096)
    lines = []
    for name, block, least in [("int8", 256, 3.5), ("int4", 256, 7.0), ("int2", 256, 13.0),
                               ("int8", 64, 3.5), ("int8", 1024, 3.9), ("int2", 64, 10.0)]:
        codec = get_codec(name, block_size=block)
        packed = codec.encode(x, 0)
        assert packed.nbytes == codec.predicted_nbytes(x.numel(), x.dtype)
        ratio = packed.raw_nbytes / packed.nbytes
        lines.append(f"{name}/{block}: {ratio:.2f}x")
        assert ratio >= least, (name, block, ratio)
    print("fp32 ratios incl. scales:", ", ".join(lines))
    assert get_codec("int8").encode(x.half(), 0).raw_nbytes / get_codec("int8").encode(x.half(), 0).nbytes > 1.9


@pytest.mark.parametrize("dtype", FLOATS)
def test_quant_non_finite_blocks_are_stored_raw(dtype):
    codec = get_codec("int4", block_size=64)
    x = torch.randn(640, dtype=torch.float64).to(dtype)
    sp = special_values(dtype)
    x[70] = math.nan
    x[200] = math.inf
    x[330] = -math.inf
    x[400:400 + sp.numel()] = sp  # block 6 (400..463) holds everything special
    x[639] = math.nan  # the last block
    if dtype == torch.float32:
        x[512] = -3e38  # block 8: finite, but its range overflows
        x[513] = 3e38
    packed = codec.encode(x, 1)
    y = packed.decode()
    bad = {1, 3, 5, 6, 9} | ({8} if dtype == torch.float32 else set())
    for b in range(10):
        xs, ys = x[b * 64:(b + 1) * 64], y[b * 64:(b + 1) * 64]
        if b in bad:
            assert torch.equal(bits_of(ys), bits_of(xs)), b  # exact, NaN payloads included
        else:
            assert torch.isfinite(ys).all()
    extra = len(bad) * 64 * x.element_size() + len(bad) * 8
    assert packed.nbytes == codec.predicted_nbytes(640, dtype) + extra


@pytest.mark.parametrize("dtype", FLOATS)
def test_quant_near_the_top_of_the_range_stays_finite(dtype):
    top = torch.finfo(dtype).max
    x = torch.linspace(0.5, 1.0, 512, dtype=torch.float64).mul(top).to(dtype)
    x[::7] = top
    for name in QUANT:
        for key in range(4):
            y = get_codec(name).encode(x, key).decode()
            assert torch.isfinite(y).all() and (y.double() <= top).all(), name


# ---- the contract -----------------------------------------------------------------------------

def test_empty_and_scalar_tensors():
    for name in available_codecs():
        codec = get_codec(name)
        for t in [torch.empty(0, 5), torch.tensor(2.5), torch.empty(0, dtype=torch.float16)]:
            y = codec.encode(t, 0).decode()
            assert y.shape == t.shape and y.dtype == t.dtype
            if t.numel():
                assert float(y) == pytest.approx(2.5, rel=0.01)


def test_decode_is_a_fresh_tensor_every_time():
    for name in available_codecs():
        x = relu_data((40, 300))
        packed = get_codec(name).encode(x, 0)
        y = packed.decode()
        ref = y.clone()
        y.fill_(-7.0)  # the payload is untouched
        assert torch.equal(packed.decode(), ref)


def test_to_moves_the_payload():
    for name in available_codecs():
        packed = get_codec(name).encode(relu_data((30, 500)), 4)
        moved = packed.to("cpu")
        assert isinstance(moved, Packed) and moved.nbytes == packed.nbytes and moved.device.type == "cpu"
        assert torch.equal(moved.decode(), packed.decode())


@pytest.mark.gpu
def test_to_round_trip_through_cuda_and_pinned_host():
    for name in available_codecs():
        x = relu_data((64, 1000)).cuda()
        packed = get_codec(name).encode(x, 4)
        host = packed.to("cpu", non_blocking=True)
        torch.cuda.synchronize()
        assert all(t.is_pinned() for t in host.tensors)
        back = host.to(x.device)
        y = back.decode()
        assert y.device == x.device and torch.equal(y, packed.decode())
        cpu = get_codec(name).encode(x.cpu(), 4).decode()  # the same stream on either device
        if get_codec(name).stochastic:  # float rounding may move a code on a boundary, rarely
            assert float((y.cpu() != cpu).float().mean()) < 1e-3
        else:
            assert torch.equal(y.cpu(), cpu)


def test_bad_names_options_and_dtypes_raise_value_error():
    assert available_codecs() == ["lossless", "fp16", "bf16", "int8", "int4", "int2"]
    with pytest.raises(ValueError, match="available: lossless.*did you mean 'int8'"):
        get_codec("int9")
    with pytest.raises(ValueError, match="unknown activation codec"):
        get_codec("zstd")
    with pytest.raises(ValueError, match="block_size"):
        get_codec("int8", blocksize=64)
    with pytest.raises(ValueError, match="takes no options"):
        get_codec("fp16", block_size=64)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        get_codec("int4", block_size=0)
    codec = get_codec("INT8", block_size=64)
    assert isinstance(codec, BlockQuant) and codec.block_size == 64 and get_codec(codec) is codec
    for name in ["fp16", "bf16", "int8", "int4", "int2"]:
        for t in [torch.arange(10), torch.ones(10, dtype=torch.bool), torch.ones(10, dtype=torch.complex64)]:
            with pytest.raises(ValueError, match="encodes floating tensors"):
                get_codec(name).encode(t, 0)
        with pytest.raises(ValueError, match="floating"):
            get_codec(name).predicted_nbytes(10, torch.int32)
    with pytest.raises(ValueError, match="dense"):
        get_codec("int8").encode(torch.randn(4, 4).to_sparse(), 0)
    assert isinstance(get_codec("lossless"), ActivationCodec)
