"""threshold: sends exactly the elements with |x| >= tau (and NaN/Inf), 64 bits per kept fp32
element, a size that follows the data, indices validated on arrival."""
import pytest
import torch

from gradcomp.compress import ErrorFeedback, Payload, get_compressor


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_keeps_exactly_the_large_elements(dtype):
    tau = 0.7
    x = torch.randn(3000, dtype=torch.float64).to(dtype)
    x[0], x[1], x[2] = 0.7, -0.7, 0.6999  # equality is kept (0.7 rounds below 0.7 in fp32)
    c = get_compressor("threshold", tau=tau)
    p = c.compress(x)
    out = c.decompress(p)
    keep = x.double().abs() >= tau
    assert torch.equal(out, torch.where(keep, x, torch.zeros_like(x)))
    assert torch.equal(p.tensors[1].long(), keep.nonzero().squeeze(1))
    assert p.tensors[0].dtype == dtype and p.tensors[1].dtype == torch.int32
    assert out[2] == 0


def test_size_follows_the_data():
    c = get_compressor("threshold", tau=1.0)
    assert not c.fixed_size
    x = torch.randn(10_000)
    p = c.compress(x)
    m = int((x.abs() >= 1.0).sum())
    assert p.nbytes == 8 * m
    assert c.compress(x * 0.01).nbytes == 0
    assert c.compress(x.sign() + x).nbytes == 8 * 10_000  # every |x| >= 1
    # bits_per_element is the worst case: every element kept
    assert c.bits_per_element(10_000) == 64.0


def test_tau_zero_keeps_everything_and_huge_tau_nothing():
    x = torch.randn(100)
    assert torch.equal(get_compressor("threshold", tau=0.0).decompress(get_compressor("threshold", tau=0.0).compress(x)), x)
    c = get_compressor("threshold", tau=1e300)  # above every float16 too: only Inf passes
    h = torch.randn(100, dtype=torch.float16)
    h[5] = float("inf")
    assert c.compress(h).tensors[1].tolist() == [5]


def test_nonfinite_is_kept():
    x = torch.zeros(50)
    x[3], x[30] = float("nan"), -float("inf")
    c = get_compressor("threshold", tau=10.0)
    out = c.decompress(c.compress(x))
    assert torch.isnan(out[3]) and out[30] == -float("inf") and int((out != 0).sum()) == 2


def test_error_feedback_sends_small_elements_once_they_add_up():
    ef = ErrorFeedback(get_compressor("threshold", tau=1.0))
    g = torch.full((4,), 0.3)
    sent = [ef.decompress(ef.compress(g, key="w")) for _ in range(4)]
    assert [float(s[0]) for s in sent] == pytest.approx([0.0, 0.0, 0.0, 1.2])
    assert torch.allclose(ef.residual("w"), torch.zeros(4), atol=1e-6)


def test_hostile_payloads_are_rejected():
    p = get_compressor("threshold", tau=0.5).compress(torch.randn(64))
    values, indices = p.tensors

    def raw(tensors):
        return Payload(p.compressor, p.shape, p.dtype, tensors, p.meta).to_bytes()

    with pytest.raises(ValueError, match=r"\[0, 64\)"):
        Payload.from_bytes(raw([values, indices.clone().index_fill_(0, torch.tensor([0]), 64)]))
    with pytest.raises(ValueError, match="strictly increasing"):
        Payload.from_bytes(raw([values, indices.flip(0)]))
    too_many = torch.arange(65, dtype=torch.int32)
    with pytest.raises(ValueError, match="at most 64"):
        Payload.from_bytes(raw([torch.zeros(65), too_many]))
    assert torch.equal(get_compressor("threshold").decompress(Payload.from_bytes(p.to_bytes())),
                       get_compressor("threshold").decompress(p))


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), "1"])
def test_bad_tau(bad):
    with pytest.raises(ValueError, match="tau"):
        get_compressor("threshold", tau=bad)


# ---- bounded payloads (compress/sparse.py payload_bounds): a fixed size, fillers, the rest kept in the residual


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_a_bound_above_the_count_gives_the_same_bits(dtype):
    """With room for every kept element: the same decoding, residual and leading values and
    indices as without a bound, then fillers (value 0 at the last position); NaN, Inf, an
    element kept at the last position itself among them."""
    from gradcomp.compress.sparse import payload_bounds
    x = torch.randn(3000, dtype=torch.float64).to(dtype)
    x[5], x[9], x[-1] = float("nan"), float("-inf"), 2.5
    c = get_compressor("threshold", tau=0.9)
    free, bound = x.clone(), x.clone()
    exact = c.compress_residual(free, key="k")
    m = exact.tensors[0].numel()
    with payload_bounds({"k": m + 100}):
        padded = c.compress_residual(bound, key="k")
        decoded_payload, decoded = c.compress_decoded(x.clone(), key="k")
    assert padded.tensors[0].shape == (m + 100,) and padded.tensors[1].dtype == torch.int32
    assert torch.equal(padded.tensors[0][:m].nan_to_num(7.0), exact.tensors[0].nan_to_num(7.0))
    assert torch.equal(padded.tensors[1][:m], exact.tensors[1])
    assert (padded.tensors[1][m:] == 2999).all() and (padded.tensors[0][m:] == 0).all()
    assert torch.equal(free.nan_to_num(7.0), bound.nan_to_num(7.0))  # the residuals: x - x at every sent place
    assert torch.equal(c.decompress(padded).nan_to_num(7.0), c.decompress(exact).nan_to_num(7.0))
    assert torch.equal(decoded.reshape(-1).nan_to_num(7.0), c.decompress(exact).nan_to_num(7.0))
    safe, bad = type(c).check_on_device(padded)
    assert not bool(bad) and torch.equal(safe.tensors[1], padded.tensors[1])


def test_what_does_not_fit_stays_in_the_residual():
    """A bound below the count: the first kept elements go, the others stay whole in the
    residual (sent + residual == input, exactly); the next step sends them."""
    from gradcomp.compress.sparse import payload_bounds
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5000, generator=g)
    c = get_compressor("threshold", tau=0.5)
    count = int((x.abs() >= 0.5).sum())
    res = x.clone()
    with payload_bounds({"k": count // 3}):
        p = c.compress_residual(res, key="k")
    assert p.tensors[0].numel() == count // 3
    assert torch.equal(c.decompress(p) + res, x)
    assert int((res.abs() >= 0.5).sum()) == count - count // 3
    assert res[: int(p.tensors[1][-1]) + 1].abs().max() < 0.5  # the lowest positions went first
    ef = ErrorFeedback(c)
    sent = torch.zeros(5000)
    for _ in range(3):  # error feedback drains it: everything above tau arrives within three steps
        with payload_bounds({"k": count // 3 + 1}):
            sent += c.decompress(ef.compress(x if not sent.any() else torch.zeros(5000), key="k"))
    assert torch.equal(sent.abs() >= 0.5, x.abs() >= 0.5)


def test_fillers_are_checked():
    """Fillers pass the checks only as value 0 at the last position, after the real entries;
    top-k's payloads, which nobody pads, stay strictly increasing."""
    from gradcomp.compress.sparse import check_sparse, sparse_on_device
    c = get_compressor("threshold", tau=0.0)

    def payload(values, indices, n=10):
        return Payload("threshold", (n,), torch.float32,
                       [torch.tensor(values), torch.tensor(indices, dtype=torch.int32)], {})
    good = payload([1.0, 2.0, 0.0, 0.0], [3, 9, 9, 9])
    type(c).check_payload(good)  # the host check: accepted
    assert not bool(type(c).check_on_device(good)[1])
    for bad in (payload([1.0, 2.0, 5.0], [3, 9, 9]),  # a filler with a value
                payload([1.0, 0.0, 2.0], [3, 3, 9]),  # a repeat that is not the last position
                payload([0.0, 0.0, 1.0], [9, 9, 3])):  # order
        with pytest.raises(ValueError, match="strictly increasing"):
            type(c).check_payload(bad)
        assert bool(type(c).check_on_device(bad)[1])
    with pytest.raises(ValueError, match="strictly increasing"):
        check_sparse(payload([1.0, 0.0], [9, 9]), "topk")
    assert bool(sparse_on_device(payload([1.0, 0.0], [9, 9]))[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("n", [0, 1, 7, 4099])
def test_bounded_selection_on_the_host_is_the_device_form(dtype, n):
    """``threshold_bounded``'s CPU branch (the integer compare, then the first ``size``
    positions) gives the bits of its device form (``nonzero_static``, filled and clamped) for
    every size from none to all, NaN, Inf and a kept last element included."""
    from gradcomp.kernels.select import _host_threshold, threshold_bounded
    x = (3 * torch.randn(n, dtype=torch.float64)).to(dtype)
    if n > 10:
        x[3], x[5], x[-1] = float("nan"), float("-inf"), 2.5
    keep = torch.logical_not(torch.lt(x.abs(), _host_threshold(2.5, dtype)))
    for size in sorted({0, n // 50, n // 10, int(keep.sum()), n}):
        device_idx = torch.nonzero_static(keep, size=size, fill_value=n).squeeze(1)
        idx, filler = threshold_bounded(x, 2.5, size)
        assert torch.equal(filler, device_idx.eq(n))
        assert torch.equal(idx, device_idx.clamp(max=max(n - 1, 0)))
