"""Shampoo's per-block math: factor statistics, their inverse roots, and the preconditioned direction.

For a block ``G`` of order ``k`` (a matrix: k = 2) there is one factor per dimension ``i``:
``L_i <- beta2 L_i + (1 - beta2) G_(i) G_(i)^T`` (``beta2 = 1``: AdaGrad's running sum), where ``G_(i)`` is
``G`` unfolded along dimension ``i`` (that dimension's rows, all others flattened). Every
``precondition_frequency`` steps ``R_i = (L_i + delta_i I)^(-1/(2k))`` is recomputed (``delta_i``: eps, or the
round-off floor relative to ``L_i``'s largest eigenvalue where that is larger, see :mod:`.matrix`), and the
direction is ``G x_1 R_1 x_2 ... x_k R_k`` (mode-i products; for a matrix ``R_1 G R_2``).

Eigenvalue-corrected Shampoo (SOAP; George et al. 2018, Vyas et al. 2024) keeps the same factors but uses only
their eigenvectors ``Q_i``: the gradient is rotated into that basis, ``G' = G x_1 Q_1^T ... x_k Q_k^T``, an
Adam-style second moment ``D <- beta2 D + (1 - beta2) G'^2`` is kept *in the rotated basis* (every step), and
the direction is ``(G' / (sqrt(D / (1 - beta2^t)) + eps))`` rotated back. The bases start as identities
and are recomputed every ``precondition_frequency`` steps.

Pure functions on tensors; the optimizer owns state and decides when to recompute.
"""

from __future__ import annotations

from typing import Literal

import torch

from powertrain.optim.shampoo.matrix import Method, eigenvectors, inverse_root

Preconditioner = Literal["shampoo", "eigenvalue_corrected"]  # the optimizer's two kinds
Grafting = Literal["adam", "rmsprop", "adagrad", "none"]  # where the step size comes from

__all__ = [
    "Grafting",
    "Preconditioner",
    "eigenbases",
    "init_factors",
    "inverse_roots",
    "precondition",
    "rotate",
    "update_factors",
]


def init_factors(block: torch.Tensor) -> list[torch.Tensor]:
    """Zero factor statistics, one (d_i x d_i) per dimension of ``block`` (float32 or wider)."""
    dtype = torch.promote_types(block.dtype, torch.float32)
    return [torch.zeros(d, d, dtype=dtype, device=block.device) for d in block.shape]


def _unfold(g: torch.Tensor, dim: int) -> torch.Tensor:
    return g.movedim(dim, 0).reshape(g.shape[dim], -1)


def _add_gram(f: torch.Tensor, u: torch.Tensor, beta: float, alpha: float) -> None:
    """``f <- beta f + alpha u u^T`` for a symmetric ``f``. Large factors compute the lower half's three
    quarter-size products and mirror the off-diagonal one, a quarter fewer multiply-adds than the full product,
    and ``f`` stays exactly symmetric off the diagonal blocks; small ones, or few columns (a vector's rank-1
    update), take one product."""
    n = f.shape[0]
    if n < 128 or u.shape[1] < 32:
        f.addmm_(u, u.T, beta=beta, alpha=alpha)
        return
    h = n // 2
    top, bottom = u[:h], u[h:]
    f[:h, :h].addmm_(top, top.T, beta=beta, alpha=alpha)
    f[h:, :h].addmm_(bottom, top.T, beta=beta, alpha=alpha)
    f[h:, h:].addmm_(bottom, bottom.T, beta=beta, alpha=alpha)
    f[:h, h:].copy_(f[h:, :h].T)


def update_factors(factors: list[torch.Tensor], g: torch.Tensor, beta2: float) -> None:
    """In place: ``L_i <- beta2 L_i + (1 - beta2) G_(i) G_(i)^T`` (``beta2 == 1``: ``L_i += G_(i) G_(i)^T``)."""
    g = g.to(factors[0].dtype)
    for i, f in enumerate(factors):
        u = _unfold(g, i)
        if beta2 == 1.0:
            _add_gram(f, u, 1.0, 1.0)
        else:
            _add_gram(f, u, beta2, 1.0 - beta2)


def inverse_roots(
    factors: list[torch.Tensor],
    *,
    eps: float,
    rel_eps: float | None = None,
    method: Method = "eigh",
    exponent_multiplier: float = 1.0,
) -> list[torch.Tensor]:
    """``(L_i + delta_i I)^(-1/(2k))`` for each of the ``k`` factors, with ``delta_i = max(eps, rel_eps
    lambda_max(L_i))`` (:func:`.matrix.inverse_root`; ``exponent_multiplier`` scales the root's exponent, as in the
    reference implementation; 1: Shampoo's own). May raise RootFailure."""
    k = len(factors)
    root = 2 * k
    if exponent_multiplier != 1.0:
        # (-1 / root) * multiplier = -1 / (root / multiplier): only integer roots are supported
        scaled = root / exponent_multiplier
        if abs(scaled - round(scaled)) > 1e-9:
            raise ValueError(f"exponent_multiplier={exponent_multiplier} gives a non-integer root {scaled}")
        root = round(scaled)
    return [inverse_root(f, root, eps=eps, rel_eps=rel_eps, method=method) for f in factors]


def _mode_products(g: torch.Tensor, mats: list[torch.Tensor], *, transpose: bool) -> torch.Tensor:
    out = g.to(mats[0].dtype)
    for m in mats:
        # contract the leading dim with M's rows (M^T x) or columns (M x), which moves the new dim to the
        # back: after k steps the dimensions are back in order
        out = torch.tensordot(out, m, dims=([0], [1 if transpose else 0]))
    return out


def precondition(g: torch.Tensor, roots: list[torch.Tensor]) -> torch.Tensor:
    """``G x_1 R_1 ... x_k R_k`` in the roots' dtype (the caller casts back)."""
    if len(roots) == 2:
        # a matrix, the common case: R_1 G R_2 as two plain products (no transposes or copies, unlike the mode
        # products' tensordot)
        return roots[0] @ g.to(roots[0].dtype) @ roots[1]
    return _mode_products(g, roots, transpose=False)  # the roots are symmetric


def eigenbases(factors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The eigenvectors ``Q_i`` of each factor. May raise RootFailure."""
    return [eigenvectors(f) for f in factors]


def rotate(g: torch.Tensor, bases: list[torch.Tensor], *, back: bool = False) -> torch.Tensor:
    """``G x_1 Q_1^T ... x_k Q_k^T`` (into the eigenbasis), or with ``back`` ``G x_1 Q_1 ... x_k Q_k``."""
    return _mode_products(g, bases, transpose=back)
