"""Selection kernels: topk_indices is the exact top-k set (NaN largest, ties to the lowest
index) on both its paths, whatever sample it is given; threshold_indices is exactly |x| >= tau."""
import numpy as np
import pytest
import torch

from gradcomp.kernels import select
from gradcomp.kernels.select import threshold_indices, topk_indices

SMALL = 5000  # whole-tensor fix-up path
LARGE = select._DIRECT + 12345  # sampled-threshold path


def reference_topk(x_abs: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted indices of the k largest: NaN first, then by magnitude, ties by lower index."""
    a = x_abs.double().numpy()
    nan = np.isnan(a)
    order = np.lexsort((np.arange(a.size), -np.where(nan, 0.0, a), -nan.astype(np.int8)))
    return torch.from_numpy(np.sort(order[:k]))


@pytest.mark.parametrize("n", [SMALL, LARGE])
def test_matches_torch_topk_on_distinct_values(n):
    x = torch.randn(n).abs()
    for k in (1, 7, n // 100, n // 3, n - 1):
        idx = topk_indices(x, k)
        assert idx.dtype == torch.int64 and torch.all(idx[1:] > idx[:-1])
        ref = torch.topk(x, k).indices.sort().values
        assert torch.equal(idx, ref), (n, k)


@pytest.mark.parametrize("n", [SMALL, LARGE])
def test_ties_go_to_the_lowest_indices(n):
    x = torch.randint(0, 40, (n,)).float()  # ~n/40 copies of each value: the k-th is always tied
    for k in (1, n // 100, n // 40 + 3, n // 2):
        assert torch.equal(topk_indices(x, k), reference_topk(x, k)), (n, k)
        # same magnitudes as torch.topk, whose tie order is unspecified
        assert torch.equal(x[topk_indices(x, k)].sort().values, torch.topk(x, k).values.sort().values)


@pytest.mark.parametrize("n", [select._DIRECT - 1, select._DIRECT + 1, 7 * select._DIRECT + 5])
@pytest.mark.parametrize("levels", [3, 1000, None])  # heavy ties, some ties, distinct
def test_exact_set_around_the_path_boundary(n, levels):
    """Sizes on both sides of the direct/sampled switch, k from one element to a quarter, signed
    data ranked by magnitude: always the reference set (ties to the lowest indices)."""
    g = torch.Generator().manual_seed(n + (levels or 0))
    x = torch.randn(n, generator=g)
    if levels:
        x = torch.randint(-levels, levels + 1, (n,), generator=g).float()
    for k in (1, max(1, n // 1000), n // 100, n // 4):
        assert torch.equal(select.topk_abs_indices(x, k), reference_topk(x.abs(), k)), (n, levels, k)


@pytest.mark.parametrize("n", [SMALL, LARGE])
def test_nan_ranks_largest(n):
    x = torch.randn(n).abs()
    x[[3, 500, n - 1]] = float("nan")
    x[10] = float("inf")
    idx = topk_indices(x, 5)
    assert {3, 500, n - 1, 10} <= set(idx.tolist())
    assert torch.equal(idx, reference_topk(x, 5))
    assert torch.equal(topk_indices(x, 2), torch.tensor([3, 500]))  # more NaN than k: lowest first


def test_mostly_nan_still_exact():
    x = torch.full((LARGE,), float("nan"))
    x[::7] = torch.rand(x[::7].shape)
    for k in (10, LARGE // 2, LARGE - LARGE // 7 + 5):
        assert torch.equal(topk_indices(x, k), reference_topk(x, k)), k


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_low_and_high_precision(dtype):
    x = torch.randn(LARGE).abs().to(dtype)  # fp16/bf16 round to many ties
    for k in (1, 2000):
        assert torch.equal(topk_indices(x, k), reference_topk(x, k)), (dtype, k)


@pytest.mark.parametrize("sample", ["zeros", "huge", "tiny", "nan"])
def test_a_bad_sample_changes_speed_not_result(sample):
    """Any sample is allowed: too high a threshold retries lower, too low keeps more candidates."""
    x = torch.randn(LARGE).abs()
    s = {"zeros": torch.zeros(1000), "huge": torch.full((1000,), 1e30), "tiny": x[:3],
         "nan": torch.full((100,), float("nan"))}[sample]
    k = LARGE // 100
    assert torch.equal(topk_indices(x, k, sample=s), reference_topk(x, k))


def test_edge_sizes_and_errors():
    x = torch.rand(100)
    assert topk_indices(x, 0).numel() == 0
    assert torch.equal(topk_indices(x, 100), torch.arange(100))
    assert topk_indices(torch.empty(0), 0).numel() == 0
    with pytest.raises(ValueError, match="k=101"):
        topk_indices(x, 101)
    with pytest.raises(ValueError, match="1-D"):
        topk_indices(x.reshape(10, 10), 3)
    with pytest.raises(ValueError, match="1-D"):
        threshold_indices(x.reshape(10, 10), 0.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_threshold_is_exact_at_the_boundary(dtype):
    tau = 0.1  # not representable in any of these dtypes
    x = torch.randn(4000, dtype=torch.float64).mul_(0.2).to(dtype)
    # plant the dtype's neighbours of tau, on both sides and both signs
    near = torch.tensor(tau, dtype=torch.float64).to(dtype)
    up = torch.nextafter(near, torch.tensor(1.0, dtype=dtype))
    down = torch.nextafter(near, torch.tensor(0.0, dtype=dtype))
    x[:6] = torch.stack([near, up, down, -near, -up, -down])
    x[6], x[7] = float("nan"), float("-inf")
    got = threshold_indices(x, tau)
    want = (~(x.double().abs() < tau)).nonzero().squeeze(1)  # exact in fp64, NaN kept
    assert torch.equal(got, want)
    assert {6, 7} <= set(got.tolist())
    assert torch.equal(threshold_indices(x, 0.0), torch.arange(4000))


@pytest.mark.parametrize("n", [SMALL, LARGE])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_topk_abs_equals_topk_of_magnitudes(n, dtype):
    """topk_abs_indices(x) == topk_indices(|x|): signed zeros, Inf of both signs and NaN of
    both signs included; with and without a sample."""
    x = torch.randn(n, dtype=torch.float64).to(dtype)
    x[[1, 2]] = torch.tensor([0.0, -0.0], dtype=dtype)
    x[[10, 20]] = torch.tensor([float("inf"), float("-inf")], dtype=dtype)
    x[30] = float("nan")
    x[40] = -x[30]  # a NaN with the sign bit set
    for k in (1, 3, 7, n // 100, n // 3):
        want = topk_indices(x.abs(), k)
        assert torch.equal(select.topk_abs_indices(x, k), want), (n, dtype, k)
        assert torch.equal(select.topk_abs_indices(x, k, sample=x[::50].abs()), want), (n, dtype, k)
    y = torch.randint(-20, 20, (n,)).to(dtype)  # heavy ties of equal magnitude and both signs
    assert torch.equal(select.topk_abs_indices(y, n // 100), reference_topk(y.abs(), n // 100))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_whole_tensor_selection_reads_nothing_back(dtype):
    """The selection that tensors off the CPU take at every size (and CPU tensors below the
    sampled path's size): the reference set, ties and NaN included, with no host read."""
    from syncs import HostSyncs

    g = torch.Generator().manual_seed(3)
    n = 3 * select._DIRECT + 11
    x = torch.randint(-30, 31, (n,), generator=g).to(dtype)  # heavy ties
    x[[5, 77, n - 2]] = float("nan")
    for k in (1, 2, 3, 4, n // 61, n // 4, n - 1):
        with HostSyncs() as syncs:
            idx = select._exact(x.abs(), None, k)
        assert syncs.count == 0, syncs.report()
        assert torch.equal(idx, reference_topk(x.abs(), k)), (dtype, k)
        assert torch.equal(idx, select._exact_cpu(x.abs(), None, k)), (dtype, k)  # the CPU's read-back form
    nan = torch.full((40,), float("nan"), dtype=dtype)  # the k-th value NaN: NaN by position
    assert torch.equal(select._exact(nan, None, 3), torch.tensor([0, 1, 2]))
    cand = torch.arange(100, 140)  # candidates' positions carried through
    assert torch.equal(select._exact(x[:40].abs(), cand, 9), cand[reference_topk(x[:40].abs(), 9)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_kth_smallest_cpu_is_torch_kthvalue(dtype):
    """numpy's selection gives torch.kthvalue's value: ties, infinities, -0.0, and NaN ranked last
    (so the k-th largest of a tensor with NaN in its top k is NaN), strided inputs too."""
    g = torch.Generator().manual_seed(5)
    for trial in range(60):
        m = int(torch.randint(1, 4000, (1,), generator=g))
        v = torch.randn(m, generator=g, dtype=torch.float64)
        if trial % 3 == 0:
            v = v.round()  # many ties, and -0.0 beside 0.0
        if trial % 4 == 0:
            v[torch.randint(0, m, (max(1, m // 8),), generator=g)] = float("nan")
        if trial % 5 == 0:
            v[torch.randint(0, m, (max(1, m // 8),), generator=g)] = -float("inf")
        v = v.to(dtype)
        if trial % 2 and m > 2:
            v = v[::2]  # a strided view, as the sampled threshold takes it
        for j in {1, v.numel(), int(torch.randint(1, v.numel() + 1, (1,), generator=g))}:
            want = torch.kthvalue(v, j).values
            got = select.kth_smallest_cpu(v, j)
            assert got.dtype == want.dtype and got.dim() == 0
            assert (torch.isnan(got) and torch.isnan(want)) or got == want, (trial, j, got, want)
