"""Low-rank math used by PowerSGD: orthonormalisation and matrix views of gradients.

Shapes use suffixes: ``m_bnm`` is a batch of ``b`` matrices with ``n`` rows and ``m`` columns, ``p_bnr``
a batch of ``n x r`` left factors, ``q_bmr`` a batch of ``m x r`` right factors.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

__all__ = [
    "add_owed",
    "cholesky_qr",
    "householder_qr",
    "less_low_rank",
    "low_rank",
    "matrix_shape",
    "orthonormalize",
    "settled",
    "stack_settled",
    "unit_scaled",
]

#: The boundary each factor of a kept ``M`` starts on, in bytes, as a fresh tensor does (on a 64-byte boundary on the
#: CPU, 512 on CUDA: its caching allocator's blocks). A BLAS may round ``e - p q^T`` differently by where ``p`` and
#: ``q`` start, not only by their strides (MKL does: docs/notes/compression.md, "Where the kept factors start"), so
#: the product owed back is formed from factors laid out as :func:`settled` lays them.
ALIGN_BYTES = 512


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
    (completed by other directions) instead of the NaN that Gram-Schmidt with a zero epsilon produces. Householder QR
    (LAPACK's blocked QR is fast on the CPU), except on CUDA: :func:`cholesky_qr`, because CUDA's QR of a batch of
    tall, thin matrices runs an unblocked kernel per matrix: on an H100 it was 65% of PowerSGD rank 32's GPU time on
    the 350M GPT (benchmarks/powersgd_profile_h100.txt), where a Cholesky QR is a few batched products.
    """
    if x_bnr.device.type == "cuda" and x_bnr.shape[-1] <= x_bnr.shape[-2]:
        return cholesky_qr(x_bnr)
    return householder_qr(x_bnr)


def householder_qr(x_bnr: torch.Tensor) -> torch.Tensor:
    """:func:`orthonormalize` by torch's Householder QR on any device (the choice everywhere but CUDA). Each matrix is
    scaled to entries <= 1 first (:func:`unit_scaled`: exact, and the span is what counts): LAPACK's QR on the CPU
    does not scale a column's norm, which overflowed for float32 columns of 256 entries of 2.2e37."""
    return torch.linalg.qr(unit_scaled(x_bnr), mode="reduced").Q


#: The shift of cholesky_qr's shifted passes, in units of u64 ||Y||_F^2 per (n r + r (r + 1)): Fukaya et al.'s bound
#: (SIAM J. Sci. Comput. 42(1), 2020, "Shifted Cholesky QR for computing the QR factorization of ill-conditioned
#: matrices") under which Y^T Y + s I stays positive definite in floating point.
_SHIFT = 11.0
_U64 = torch.finfo(torch.float64).eps / 2


@functools.lru_cache(maxsize=16)
def _completion(n: int, r: int, device: torch.device) -> torch.Tensor:
    """``n x r`` orthonormal columns (float64) that fill what a rank-deficient input lacks: column j is 1 on rows j,
    j + r, j + 2r, ... (normalised), so disjoint columns spread over all the rows. Cached per shape and device (a
    handful of shapes per model: a few MB at most on the device)."""
    rows = torch.arange(n, device=device)
    e = (rows[:, None] % r == torch.arange(r, device=device)[None, :]).to(torch.float64)
    return e / e.sum(0, keepdim=True).sqrt()


def cholesky_qr(x_bnr: torch.Tensor) -> torch.Tensor:
    """:func:`orthonormalize` by Cholesky QR in float64, four passes, the first two shifted (Fukaya et al. 2020's
    shifted Cholesky QR), without a host synchronisation (``cholesky_ex`` does not check on the host).

    Each matrix (the last two dimensions; ``n >= r``) is scaled to unit Frobenius norm (by its largest entry first, so
    that no float64 input overflows or underflows) and the completion is added at u64 of it, so that an all-zero or
    rank-deficient input still yields ``r`` orthonormal columns (the completion's directions where the input has
    none), and a full-rank one a basis of its own span perturbed by ``||F||_F <= sqrt(r) u64 ||Y||_F``. A shifted
    pass (Gram matrix + ``11 (n r + r (r + 1)) u64 ||Y||_F^2 I``) has a Cholesky factor for any input and divides
    the condition number by about ``1 / sqrt(shift)``: two of them take the ~1e16 of a rank-deficient input into
    the range where two plain passes (CholQR2) end orthonormal to float64's rounding. The span is set by the
    triangular solves alone (any triangular factor keeps it), each row-wise backward stable: the basis spans ``Y + F``
    with ``||F||_F <= (sqrt(r) + 2 + 4 r^2) u64 ||Y||_F`` to first order (the completion, the two scalings, four
    solves each within ``r u64`` of every row's ``||L||``), before the cast back to the input's dtype. A pass whose
    Cholesky factorisation fails (possible only for an input that exactly cancels the completion, which no
    gradient does) leaves that matrix as the previous pass made it: finite, not NaN."""
    n, r = x_bnr.shape[-2:]
    if r > n:
        raise ValueError(f"cholesky_qr needs at most as many columns as rows, got {n} x {r}: use householder_qr")
    y = x_bnr.to(torch.float64)
    amax = y.abs().amax(dim=(-2, -1), keepdim=True)
    y = y / torch.where(amax > 0, amax, 1.0)
    norm = torch.linalg.vector_norm(y, dim=(-2, -1), keepdim=True)
    nonzero = norm > 0
    y = y / torch.where(nonzero, norm, 1.0)
    fill = torch.where(nonzero, _U64, 1.0)  # an all-zero input: the completion alone
    y = y + fill * _completion(n, r, y.device)
    eye = torch.eye(r, dtype=y.dtype, device=y.device)
    for k in range(4):
        gram = y.mT @ y
        if k < 2:
            trace = gram.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]
            gram = gram + (_SHIFT * (n * r + r * (r + 1)) * _U64) * trace * eye
        lower, info = torch.linalg.cholesky_ex(gram)
        solved = torch.linalg.solve_triangular(lower.mT, y, upper=True, left=False)
        y = torch.where((info == 0)[..., None, None], solved, y)
    return y.to(x_bnr.dtype)


def unit_scaled(x: torch.Tensor) -> torch.Tensor:
    """Each matrix of ``x`` (the last two dimensions) divided by the power of two at or just above its largest
    magnitude, so that no entry exceeds 1, without a host synchronisation. Scaling by a power of two is exact in
    floating point (short of underflow), so a product with the result is the product with ``x``, scaled: the span
    PowerSGD's paper variant takes from ``P = M Q`` is unchanged, and ``P`` cannot overflow because the previous step's
    ``Q`` was large. An all-zero matrix stays zero; NaN and Inf stay non-finite."""
    _, exponent = torch.frexp(x.abs().amax(dim=(-2, -1), keepdim=True))
    return torch.ldexp(x, -exponent)


def add_owed(
    owed: torch.Tensor, g: torch.Tensor, e: torch.Tensor, p: torch.Tensor | None = None, q: torch.Tensor | None = None
) -> None:
    """``owed <- g + (e - p q^T)`` (gradient + residual; without ``p``, ``e`` is the residual itself), a gradient
    wider than ``owed`` rounded to its dtype first, as a stack of them would be. ``p`` (``n x r``) and ``q``
    (``m x r``) are the factors of the approximation last sent, which PowerSGD's paper variant subtracts here, from
    the ``e`` it kept whole, rather than writing the residual out a step earlier."""
    if p is not None:
        assert q is not None, "the residual's factors come in pairs"
        e = less_low_rank(e, p, q, out=owed)
    torch.add(g if g.dtype == owed.dtype else g.to(owed.dtype), e, out=owed)


def settled(t: torch.Tensor) -> torch.Tensor:
    """A fresh copy of ``t`` in rows (starting on the allocator's boundary, which :data:`ALIGN_BYTES` is a multiple of):
    how a factor is laid out wherever a product of it is owed back (:func:`less_low_rank`), so that the product does
    not depend on how it was kept."""
    return t.clone(memory_format=torch.contiguous_format)


def stack_settled(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(tensors)`` (same shapes and dtype) with each ``[k]`` laid out as :func:`settled` lays out a
    tensor: in rows, each starting :data:`ALIGN_BYTES` apart (a gap after each where its size is not a multiple)."""
    first = tensors[0]
    per = max(1, ALIGN_BYTES // first.element_size())
    slot = -(-first.numel() // per) * per
    stacked = torch.stack(list(tensors))
    if slot == first.numel():
        return stacked
    out = first.new_empty(len(tensors) * slot).as_strided(stacked.shape, (slot, *stacked.stride()[1:]))
    return out.copy_(stacked)


def less_low_rank(e: torch.Tensor, p: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``e - p q^T`` (``n x m``, ``p`` ``n x r``, ``q`` ``m x r``) in one addmm, into ``out`` if given: the residual
    PowerSGD's paper variant owes from the ``M`` it kept and the factors it sent, formed the same way wherever it is."""
    return torch.addmm(e, p, q.mT, alpha=-1, out=out)


def low_rank(p_bnr: torch.Tensor, q_bmr: torch.Tensor) -> torch.Tensor:
    """The batch of rank-``r`` matrices ``P Q^T`` (shape ``b x n x m``)."""
    return torch.bmm(p_bnr, q_bmr.transpose(1, 2))
