"""int8: 8 bits per element plus an fp32 scale per block; rounding to nearest is within half a
step (scale = absmax / 127), stochastic rounding within a step and unbiased."""
import math

import pytest
import torch

from gradcomp.compress import Payload, get_compressor

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("block_size", [1, 64, 256])
@pytest.mark.parametrize("n", [1, 300, 4096])
def test_bits_per_element(block_size, n):
    c = get_compressor("int8", block_size=block_size)
    p = c.compress(torch.randn(n), key="b")
    assert p.nbytes == n + 4 * math.ceil(n / block_size) == c._wire_bytes(n)
    assert p.tensors[1].dtype == torch.int8 and p.tensors[1].abs().max() <= 127


def _scale(p):
    return p.tensors[0].double().repeat_interleave(p.meta["block_size"])[:p.numel]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("stochastic", [False, True])
def test_error_bounds(dtype, stochastic):
    c = get_compressor("int8", block_size=16, stochastic=stochastic)
    x = torch.randn(50, dtype=torch.float64).to(dtype)  # a ragged last block of 2
    p = c.compress(x, key="e")
    out = c.decompress(p)
    assert out.dtype == dtype
    absmax = torch.stack([b.double().abs().max() for b in x.split(16)])
    assert torch.allclose(p.tensors[0].double(), absmax / 127, rtol=1e-6)
    scale = _scale(p)
    err = (out.double() - x.double()).abs()
    slack = 0 if dtype == torch.float64 else torch.finfo(dtype).eps * x.double().abs()
    bound = scale * (1.0 if stochastic else 0.5) * (1 + 1e-5) + slack
    assert (err <= bound).all()
    # the largest element of a block is level 127: exact up to the rounding of absmax / 127
    assert math.isclose(float(out.abs().max()), float(x.abs().max()), rel_tol=2.0 ** -22)


def test_nearest_rounding_is_deterministic_and_biased_flag():
    c = get_compressor("int8")
    x = torch.randn(1000)
    assert torch.equal(c.compress(x, key="a", step=0).tensors[1], c.compress(x, key="b", step=5).tensors[1])
    assert not c.unbiased and not c.stochastic
    s = get_compressor("int8", stochastic=True)
    assert s.unbiased and s.stochastic


def test_stochastic_unbiased():
    c = get_compressor("int8", block_size=16, stochastic=True)
    x = torch.randn(40, dtype=torch.float64)
    steps = 1500
    draws = torch.stack([c.decompress(c.compress(x, key="u", step=s)) for s in range(steps)])
    scale = _scale(c.compress(x, key="u"))
    frac = torch.frac(x.abs() / scale)
    se = (scale ** 2 * frac * (1 - frac) / steps).sqrt()
    assert ((draws.mean(0) - x).abs() <= 5 * se + 1e-12).all()


def test_stochastic_streams():
    x = torch.randn(500)
    a, b = get_compressor("int8", stochastic=True, seed=2), get_compressor("int8", stochastic=True, seed=2)
    pa = a.compress(x, key="w", step=4)
    assert all(torch.equal(s, t) for s, t in zip(pa.tensors, b.compress(x, key="w", step=4).tensors))
    assert not torch.equal(pa.tensors[1], a.compress(x, key="w", step=5).tensors[1])


def test_edge_cases_and_nonfinite():
    c = get_compressor("int8", block_size=4)
    assert torch.equal(c.decompress(c.compress(torch.zeros(7))), torch.zeros(7))
    one = torch.tensor([-0.3])
    assert torch.equal(c.decompress(c.compress(one)), one)
    assert c.decompress(c.compress(torch.empty(0))).numel() == 0
    x = torch.randn(10)
    x[6] = -math.inf
    out = c.decompress(c.compress(x))
    assert not torch.isfinite(out[4:8]).any() and torch.isfinite(out[:4]).all() and torch.isfinite(out[8:]).all()
    with pytest.raises(ValueError, match="float32 range"):
        c.compress(torch.tensor([1e300], dtype=torch.float64))


def test_bad_options_and_malformed_payloads():
    for kw in ({"block_size": 0}, {"stochastic": 1}, {"block_size": 2.5}):
        with pytest.raises(ValueError, match="must be"):
            get_compressor("int8", **kw)
    good = get_compressor("int8", block_size=8).compress(torch.randn(20))
    scale, q = good.tensors
    for tensors, meta in [([scale, q], {"block_size": 16}), ([scale, q.view(torch.uint8)], good.meta),
                          ([scale, q[:-1]], good.meta), ([scale, q], {"block_size": 0})]:
        with pytest.raises(ValueError, match="int8"):
            get_compressor("int8").check_payload(Payload("int8", (20,), torch.float32, tensors, meta))


def _bits(t):
    return t.reshape(-1).view({4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("block_size", [256, 1000, (1 << 18) + 5])  # runs of whole blocks; one block > a run
def test_cache_sized_runs_give_the_bits_of_the_whole_tensor_forms(dtype, stochastic, block_size):
    """compress_residual and decompress_into work in runs of ~2**18 elements on CPU: over
    several runs, ragged last block, NaN and inf blocks, the same payload and bits as
    compress + decompress on the whole tensor."""
    from gradcomp.kernels import quant

    n = 3 * quant._CHUNK + 777
    x = torch.randn(n, dtype=torch.float64).to(dtype)
    x[5], x[quant._CHUNK + 3] = float("nan"), float("inf")
    c, ref = (get_compressor("int8", block_size=block_size, stochastic=stochastic) for _ in range(2))
    left = x.clone()
    p = c.compress_residual(left, key="w")
    q = ref.compress(x, key="w")
    assert p.to_bytes() == q.to_bytes()
    want = x - ref.decompress(q)
    assert torch.equal(left.isnan(), want.isnan())
    assert torch.equal(_bits(left.nan_to_num()), _bits(want.nan_to_num()))
    base = torch.randn(n, dtype=dtype)
    for acc, alpha in ((True, 1.0), (True, 0.5), (False, 1.0), (False, 0.25)):
        got = c.decompress_into(q, base.clone(), alpha=alpha, accumulate=acc)
        dec = ref.decompress(q)
        exp = base + alpha * dec if acc else alpha * dec
        assert torch.equal(got.isnan(), exp.isnan()) and torch.equal(got.nan_to_num(), exp.nan_to_num()), (acc, alpha)


def test_fp64_scale_overflow_changes_nothing():
    c = get_compressor("int8")
    acc = torch.randn(1 << 19, dtype=torch.float64)
    acc[(1 << 18) + 9] = 1e300  # in the second run: found before the first is touched
    before = acc.clone()
    with pytest.raises(ValueError, match="float32 range"):
        c.compress_residual(acc, key="w")
    assert torch.equal(acc, before)
