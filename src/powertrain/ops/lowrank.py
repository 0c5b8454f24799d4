"""Low-rank math used by PowerSGD: orthonormalisation and matrix views of gradients.

Shapes use suffixes: ``m_bnm`` is a batch of ``b`` matrices with ``n`` rows and ``m`` columns, ``p_bnr``
a batch of ``n x r`` left factors, ``q_bmr`` a batch of ``m x r`` right factors.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["cholesky_qr", "householder_qr", "low_rank", "matrix_shape", "orthonormalize"]


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

    Always orthonormal columns: a rank-deficient or all-zero input (an exactly low-rank gradient) gives a valid basis
    (completed by other directions) instead of the NaN that Gram-Schmidt with a zero epsilon produces. On the CPU,
    Householder QR (LAPACK's blocked QR is fast there); on other devices :func:`cholesky_qr`, because CUDA's QR of a
    batch of tall, thin matrices runs an unblocked kernel per matrix: on an H100 it was 65% of PowerSGD rank 32's GPU
    time on the 350M GPT (benchmarks/powersgd_profile_h100.txt), where a Cholesky QR is a few batched products.
    """
    if x_bnr.device.type == "cpu" or x_bnr.shape[-1] > x_bnr.shape[-2]:
        return householder_qr(x_bnr)
    return cholesky_qr(x_bnr)


def householder_qr(x_bnr: torch.Tensor) -> torch.Tensor:
    """:func:`orthonormalize` by torch's Householder QR on any device (the CPU's choice)."""
    return torch.linalg.qr(x_bnr, mode="reduced").Q


#: The shift of cholesky_qr's first pass, in units of u ||Y||_F^2 per (n r + r (r + 1)): Fukaya et al.'s bound
#: (SIAM J. Sci. Comput. 42(1), 2020, "Shifted Cholesky QR for computing the QR factorization of ill-conditioned
#: matrices") under which Y^T Y + s I stays positive definite in floating point.
_SHIFT = 11.0


@functools.lru_cache(maxsize=64)
def _completion(n: int, r: int, device: torch.device) -> torch.Tensor:
    """``n x r`` orthonormal columns that fill what a rank-deficient input lacks: column j is 1 on rows j, j + r,
    j + 2r, ... (normalised), so disjoint columns spread over all the rows."""
    rows = torch.arange(n, device=device)
    e = (rows[:, None] % r == torch.arange(r, device=device)[None, :]).to(torch.float64)
    return e / e.sum(0, keepdim=True).sqrt()


def cholesky_qr(x_bnr: torch.Tensor) -> torch.Tensor:
    """:func:`orthonormalize` by a shifted Cholesky QR, three passes in float64 (sCholQR3, Fukaya et al. 2020),
    without a host synchronisation (``cholesky_ex``: no check of the factorisation on the host).

    Each matrix is scaled to unit Frobenius norm and a completion of relative size u (the input dtype's unit
    roundoff) is added, so that an all-zero or rank-deficient input still yields ``r`` orthonormal columns (the
    completion's directions where the input has none) and a full-rank one a basis of its own span perturbed by
    less than its own rounding: ``||F||_F <= sqrt(r) u ||Y||_F``. The first pass shifts the Gram matrix by
    ``11 (n r + r (r + 1)) u64 ||Y||_F^2`` so that its Cholesky factorisation exists for any input (condition
    numbers up to ~1/u64); two unshifted passes then make the columns orthonormal to float64's rounding. The span
    is set by the triangular solves alone (any triangular factor keeps it): each is row-wise backward stable, so
    the basis spans ``Y + F`` with ``||F||_F <= (sqrt(r) + 1 + 3 r^2) u ||Y||_F`` to first order in u (the
    filler, the scaling, and three solves each within ``r u`` of every row's ``||L||``)."""
    n, r = x_bnr.shape[-2:]
    if r > n:
        raise ValueError(f"cholesky_qr needs at most as many columns as rows, got {n} x {r}: use torch.linalg.qr")
    y = x_bnr.to(torch.float64)
    norm = torch.linalg.vector_norm(y, dim=(1, 2), keepdim=True)
    nonzero = norm > 0
    y = y / torch.where(nonzero, norm, 1.0)
    unit = torch.finfo(x_bnr.dtype).eps / 2
    fill = torch.where(nonzero, unit, 1.0)  # an all-zero input: the completion alone
    y = y + fill * _completion(n, r, y.device)
    eye = torch.eye(r, dtype=y.dtype, device=y.device)
    shift = _SHIFT * (n * r + r * (r + 1)) * (torch.finfo(torch.float64).eps / 2)
    for k in range(3):
        gram = y.transpose(1, 2) @ y
        if k == 0:
            gram = gram + (shift * gram.diagonal(dim1=1, dim2=2).sum(-1))[:, None, None] * eye
        lower = torch.linalg.cholesky_ex(gram).L
        y = torch.linalg.solve_triangular(lower.transpose(1, 2), y, upper=True, left=False)
    return y.to(x_bnr.dtype)


def low_rank(p_bnr: torch.Tensor, q_bmr: torch.Tensor) -> torch.Tensor:
    """The batch of rank-``r`` matrices ``P Q^T`` (shape ``b x n x m``)."""
    return torch.bmm(p_bnr, q_bmr.transpose(1, 2))
