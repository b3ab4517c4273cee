"""Sparse kernels: densify/scatter_add_checked agree with a dense reference, sum repeats, and
reject a bad index with ValueError before writing anything."""
import pytest
import torch

from gradcomp.kernels.sparse import check_indices, densify, index_dtype, scatter_add_checked


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_densify_matches_reference(idx_dtype, dtype):
    idx = torch.randperm(1000)[:137]
    vals = torch.randn(137)
    out = densify(idx.to(idx_dtype), vals, 1000, dtype)
    ref = torch.zeros(1000, dtype=torch.float64)
    ref[idx] = vals.double()
    assert out.dtype == dtype and out.shape == (1000,)
    assert torch.equal(out, ref.to(dtype))


def test_repeats_are_summed_in_place():
    out = torch.ones(5)
    res = scatter_add_checked(out, torch.tensor([1, 3, 1], dtype=torch.int32), torch.tensor([2.0, 5.0, 4.0]))
    assert res is out
    assert torch.equal(out, torch.tensor([1.0, 7.0, 1.0, 6.0, 1.0]))


def test_empty():
    assert torch.equal(densify(torch.empty(0, dtype=torch.int64), torch.empty(0), 4, torch.float32), torch.zeros(4))
    assert densify(torch.empty(0, dtype=torch.int32), torch.empty(0), 0, torch.float32).numel() == 0


@pytest.mark.parametrize("bad", [[0, 10], [-1, 2], [2**31 - 1]])
def test_out_of_range_index_is_rejected_before_writing(bad):
    out = torch.zeros(10)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        scatter_add_checked(out, torch.tensor(bad, dtype=torch.int64), torch.ones(len(bad)))
    assert torch.equal(out, torch.zeros(10)), "a rejected scatter wrote into its output"
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        densify(torch.tensor(bad), torch.ones(len(bad)), 10, torch.float32)


def test_bad_arguments():
    with pytest.raises(ValueError, match="int32 or int64"):
        check_indices(torch.tensor([1.0]), 4)
    with pytest.raises(ValueError, match="int32 or int64"):
        check_indices(torch.tensor([[1]]), 4)
    with pytest.raises(ValueError, match="one value per index"):
        densify(torch.tensor([1, 2]), torch.ones(3), 4, torch.float32)
    with pytest.raises(ValueError, match="floating"):
        scatter_add_checked(torch.zeros(4, dtype=torch.int64), torch.tensor([1]), torch.ones(1))
    with pytest.raises(ValueError, match="numel"):
        densify(torch.tensor([1]), torch.ones(1), -3, torch.float32)


def test_index_dtype():
    assert index_dtype(0) == torch.int32
    assert index_dtype(2**31 - 1) == torch.int32
    assert index_dtype(2**31) == torch.int64
