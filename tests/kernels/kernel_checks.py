"""Comparisons shared by the kernel tests (emulated and on a GPU)."""
import torch


def same(a, b, zero_sign=True):
    """Equal dtypes and values, NaN where the other has NaN (any payload), and (unless
    ``zero_sign`` is false) the same signs of zero."""
    nan = a.isnan()
    return (a.dtype == b.dtype and torch.equal(nan, b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
            and (not zero_sign or torch.equal(a.signbit() & ~nan, b.signbit() & ~nan)))
