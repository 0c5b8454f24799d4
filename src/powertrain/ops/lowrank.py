"""Low-rank math used by PowerSGD: orthonormalisation and matrix views of gradients.

Shapes use suffixes: ``m_bnm`` is a batch of ``b`` matrices with ``n`` rows and ``m`` columns, ``p_bnr``
a batch of ``n x r`` left factors, ``q_bmr`` a batch of ``m x r`` right factors.
"""

from __future__ import annotations

import torch

__all__ = ["low_rank", "matrix_shape", "orthonormalize"]


def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """The matrix a tensor of ``shape`` is compressed as: ``(shape[0], prod(shape[1:]))``.

    A conv weight ``(out, in, kh, kw)`` becomes ``(out, in * kh * kw)``. Only defined for ``ndim >= 2``.
    """
    assert len(shape) >= 2, f"matrix_shape needs at least 2 dims, got {tuple(shape)}"
    cols = 1
    for d in shape[1:]:
        cols *= d
    return int(shape[0]), cols


def orthonormalize(x_bnr: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of the column span of each matrix in a batch, as a new tensor.

    Uses Householder QR, which always returns orthonormal columns: a rank-deficient or all-zero input
    (an exactly low-rank gradient) gives a valid basis instead of the NaN that Gram-Schmidt with a zero
    epsilon produces.
    """
    return torch.linalg.qr(x_bnr, mode="reduced").Q


def low_rank(p_bnr: torch.Tensor, q_bmr: torch.Tensor) -> torch.Tensor:
    """The batch of rank-``r`` matrices ``P Q^T`` (shape ``b x n x m``)."""
    return torch.bmm(p_bnr, q_bmr.transpose(1, 2))
