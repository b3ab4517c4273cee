"""Orthonormalisation of the thin factor matrices of low-rank compression (PowerSGD).

Both methods return a matrix with orthonormal columns spanning the columns of ``p``
(``n x r``, ``n >= r``). A rank-deficient ``p`` never yields NaN, while NaN/Inf in ``p`` always
yield a non-finite result:

- ``"qr"``: Householder QR (``torch.linalg.qr``); dependent or zero columns are completed to
  an orthonormal basis, so the result always has rank ``r``.
- ``"gram_schmidt"``: classical Gram-Schmidt with one re-orthogonalisation ("twice is
  enough"), a loop over the ``r`` columns only; cheaper than QR on GPUs for small ``r``. A
  zero column, or one numerically dependent on the columns before it, becomes zero (the
  result then has fewer than ``r`` non-zero columns, all orthonormal).
"""
from __future__ import annotations

import torch

METHODS = ("qr", "gram_schmidt")


def orthonormalize(p: torch.Tensor, method: str = "qr") -> torch.Tensor:
    """Orthonormal columns spanning those of ``p`` (a new contiguous tensor; ``p`` is not changed)."""
    if method not in METHODS:
        raise ValueError(f"orthonormalize: method={method!r} is not allowed; use one of {METHODS}")
    if p.dim() != 2 or p.shape[0] < p.shape[1]:
        raise ValueError(f"orthonormalize expects an n x r matrix with n >= r, got shape {tuple(p.shape)}")
    if p.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"orthonormalize works in float32 or float64, got {p.dtype}")
    if method == "qr":
        return torch.linalg.qr(p, mode="reduced")[0].contiguous()  # LAPACK returns column-major
    return gram_schmidt(p)


def gram_schmidt(p: torch.Tensor) -> torch.Tensor:
    """Classical Gram-Schmidt, each column projected twice; see the module docstring."""
    q = p.clone()
    for j in range(q.shape[1]):
        col = q[:, j]
        keep = None
        if j:
            done = q[:, :j]
            col -= done @ (done.T @ col)
            first = torch.linalg.vector_norm(col)
            col -= done @ (done.T @ col)  # removes what rounding left of the first projection
            # Kahan's test: if the second pass cancels most of what the first left, the column
            # was dependent and what remains is rounding noise, not a direction
            keep = torch.linalg.vector_norm(col) > 0.5 * first
        norm = torch.linalg.vector_norm(col)
        # divide only by a positive norm and zero by multiplying: NaN stays NaN, never 0 or inf
        col /= torch.where(norm > 0, norm, torch.ones_like(norm))
        if keep is not None:
            col *= keep.to(col.dtype)
    return q
