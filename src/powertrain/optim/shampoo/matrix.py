"""Matrix functions of Shampoo's factor statistics: pure functions on tensors, no process group.

``inverse_root(A, p)`` computes ``(A + d I)^(-1/p)`` for a symmetric positive semi-definite ``A`` (n x n), with the
damping ``d = max(eps, rel_eps * lambda_max(A))``: ``eps`` in ``A``'s units, ``rel_eps`` relative to
its largest eigenvalue. By default ``rel_eps`` is a round-off floor, ``FLOOR * u`` with ``u`` the unit round-off
of ``A``'s dtype (float32: 1.2e-7): accumulating ``A`` and decomposing it each leave errors of about
``u lambda_max``, of either sign, so eigenvalues below that are not resolved and their eigenvectors are round-off.
An absolute eps far below it (Shampoo's customary 1e-12 is, for any factor whose eigenvalues exceed 1e-5)
would weight those directions by up to ``eps^(-1/p)`` against ``lambda_max^(-1/p)`` for the informative
ones, and the preconditioned direction of a rank-deficient factor (fewer gradients seen than its dimension:
every factor early on, a vector's full-matrix factor for ``n`` steps) would be mostly round-off.

* ``method="eigh"``: symmetric eigendecomposition ``A = Q diag(l) Q^T``, then ``Q diag((l' + d)^(-1/p)) Q^T`` with
  ``l'`` the spectrum shifted so that its smallest value is at least 0 (the reference implementation's rule).
  If the decomposition fails or returns non-finite values in the factor's dtype, it is retried in
  float64 (``retry_float64``; the default floor stays that of ``A``'s own dtype); a failure after that raises
  :class:`RootFailure`, which the optimizer counts and, past its tolerance, answers by falling back to the
  grafting method.
* ``method="newton"``: the coupled Newton iteration (Higham 2008; Guo & Higham 2006) for the inverse
  p-th root of ``B = A + d I`` (``lambda_max`` bounded by ``||A||_F``), matrix products only (fast on
  accelerators): ``X_0 = c^-1 I``, ``M_0 = c^-p B`` with ``c = (2 ||B||_F / (p + 1))^(1/p)``... iterated as
  ``T = ((p + 1) I - M) / p``, ``X <- X T``, ``M <- T^p M`` until ``||M - I||_inf < tol`` or ``max_iters``.
"""

from __future__ import annotations

from typing import Literal

import torch

from powertrain._checks import check_int

__all__ = ["FLOOR", "RootFailure", "eigenvectors", "inverse_root"]

Method = Literal["eigh", "newton"]

#: The default ``rel_eps`` in units of the factor dtype's unit round-off (see the module docstring).
FLOOR = 1.0


class RootFailure(RuntimeError):
    """An inverse root could not be computed (non-finite input, failed decomposition, no convergence)."""


def _finite(a: torch.Tensor) -> bool:
    """Whether every entry of ``a`` is finite: a NaN or infinity makes the sum non-finite, and a float64 sum of
    float32 (or smaller) entries cannot overflow. About a fifth of ``isfinite(a).all()``'s time on a 256 x 256
    matrix (23 against 127 microseconds on one CPU thread)."""
    return bool(torch.isfinite(a.sum(dtype=torch.float64)))


def _eigh_root(a: torch.Tensor, root: float, eps: float, rel_eps: float) -> torch.Tensor:
    vals, vecs = torch.linalg.eigh(a)
    # A is PSD in exact arithmetic. Round-off can make its smallest eigenvalues negative: shift the whole
    # spectrum so the smallest is 0 (as the reference implementation does) rather than clipping each to 0,
    # which would leave round-off-negative directions apart from their round-off-positive twins; the floor then
    # lifts every round-off eigenvalue to the same order (see the module docstring)
    damping = (rel_eps * vals[-1]).clamp(min=eps)
    vals = vals - vals[0].clamp(max=0.0) + damping
    return (vecs * vals.pow(-1.0 / root).unsqueeze(-2)) @ vecs.mT


def _newton_root(a: torch.Tensor, root: int, eps: float, rel_eps: float, max_iters: int, tol: float) -> torch.Tensor:
    n = a.shape[-1]
    eye = torch.eye(n, dtype=a.dtype, device=a.device)
    # ||A||_F bounds lambda_max from above; the floor also makes a factor with round-off-negative eigenvalues
    # (which the iteration cannot take) positive definite
    a = a + (rel_eps * torch.linalg.matrix_norm(a)).clamp(min=eps) * eye
    z = (1 + root) / (2 * torch.linalg.matrix_norm(a))  # scales the spectrum into the iteration's basin
    x = eye * z.pow(1.0 / root)
    m = a * z
    for _ in range(max_iters):
        t = ((root + 1) * eye - m) / root
        x = x @ t
        m = torch.linalg.matrix_power(t, root) @ m
        if torch.linalg.matrix_norm(m - eye, ord=float("inf")) < tol:
            return x
    raise RootFailure(f"coupled Newton did not converge in {max_iters} iterations (tolerance {tol})")


def inverse_root(
    a: torch.Tensor,
    root: int,
    *,
    eps: float = 1e-12,
    rel_eps: float | None = None,
    method: Method = "eigh",
    retry_float64: bool = True,
    max_iters: int = 100,
    tol: float = 1e-6,
) -> torch.Tensor:
    """``(a + max(eps, rel_eps lambda_max(a)) I)^(-1/root)`` of a symmetric PSD matrix ``a`` (n x n), in
    ``a``'s dtype.

    Args:
        eps: absolute damping, in ``a``'s units.
        rel_eps: damping relative to ``a``'s largest eigenvalue (``newton``: to ``||a||_F``, an upper bound);
            None: :data:`FLOOR` times the unit round-off of ``a``'s dtype (see the module docstring); 0: none.

    Raises:
        ValueError: bad arguments (not square, root < 1, eps < 0, rel_eps < 0, unknown method).
        RootFailure: non-finite input, or the computation failed (also after the float64 retry).
    """
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"inverse_root needs a square matrix, got shape {tuple(a.shape)}")
    check_int("root", root, 1)
    if not eps >= 0:
        raise ValueError(f"Invalid eps={eps!r}: must be >= 0")
    if rel_eps is None:
        rel_eps = FLOOR * torch.finfo(a.dtype).eps
    elif not rel_eps >= 0:
        raise ValueError(f"Invalid rel_eps={rel_eps!r}: must be >= 0 (None: the dtype's round-off floor)")
    if method not in ("eigh", "newton"):
        raise ValueError(f"Invalid method={method!r}: choose eigh or newton")
    if not _finite(a):
        raise RootFailure("the factor matrix has non-finite entries")
    attempts = [a.dtype] + ([torch.float64] if retry_float64 and a.dtype != torch.float64 else [])
    for dtype in attempts:
        x = a.to(dtype)
        try:
            if method == "eigh":
                out = _eigh_root(x, root, eps, rel_eps)
            else:
                out = _newton_root(x, root, eps, rel_eps, max_iters, tol)
        except (torch.linalg.LinAlgError, RootFailure):
            continue
        if _finite(out):
            return out.to(a.dtype)
    raise RootFailure(f"inverse {root}-th root failed ({method}, tried {', '.join(str(d) for d in attempts)})")


def eigenvectors(a: torch.Tensor, *, retry_float64: bool = True) -> torch.Tensor:
    """The eigenvectors (columns, ascending eigenvalues) of a symmetric matrix ``a``, in ``a``'s dtype: the
    eigenbasis of eigenvalue-corrected Shampoo (SOAP). Retried in float64 like :func:`inverse_root`.

    Raises:
        RootFailure: non-finite input, or the decomposition failed (also after the float64 retry).
    """
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"eigenvectors needs a square matrix, got shape {tuple(a.shape)}")
    if not _finite(a):
        raise RootFailure("the factor matrix has non-finite entries")
    attempts = [a.dtype] + ([torch.float64] if retry_float64 and a.dtype != torch.float64 else [])
    for dtype in attempts:
        try:
            vecs = torch.linalg.eigh(a.to(dtype)).eigenvectors
        except torch.linalg.LinAlgError:
            continue
        if _finite(vecs):
            return vecs.to(a.dtype)
    raise RootFailure(f"eigendecomposition failed (tried {', '.join(str(d) for d in attempts)})")
