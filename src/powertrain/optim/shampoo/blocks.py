"""How Shampoo cuts a parameter into blocks, each preconditioned by one factor matrix per dimension.

1. Merge adjacent dimensions, from the last, while their product stays <= ``max_dim`` and at least two
   dimensions remain (a conv weight (64, 3, 3, 3) becomes (64, 27) for any max_dim >= 27); dimensions of size 1
   are dropped (a 0-d or all-ones tensor is one 1-element block). A matrix therefore stays a matrix, with one
   factor per side (Kronecker-factored), however small: the reference implementation's default
   (``target_parameter_dimensionality=1``) merges a (16, 32) weight with max_dim 1024 into one 512-vector with a
   single 512 x 512 factor (full-matrix AdaGrad), whose statistics have rank at most the number of steps seen,
   cost 64 times the memory of the two Kronecker factors and an eigendecomposition of 512 x 512 instead of 16 x 16
   and 32 x 32 (``target_parameter_dimensionality=2`` there is this rule).
2. Split every dimension of the merged shape into chunks of at most ``max_dim``: the blocks are the
   grid of those chunks, in row-major order. A 1-D parameter is a vector, cut into pieces of <= max_dim.

Blocks are views of the parameter (or gradient) when it is contiguous: the optimizer writes each block's
update through them, and the same index names the same rows and columns of every tensor of that shape.
"""

from __future__ import annotations

import math

import torch

from powertrain._checks import check_int

__all__ = ["block_cost", "merged_shape", "split"]


def merged_shape(shape: tuple[int, ...] | torch.Size, max_dim: int) -> tuple[int, ...]:
    check_int("max_preconditioner_dim", max_dim, 1)
    dims = [d for d in shape if d != 1]
    if not dims:
        return (1,)
    # from the last dimension backwards, as the reference implementation does: the leading (output) dimension
    # of a conv weight keeps its own factor
    out = [dims[-1]]
    for left, d in enumerate(reversed(dims[:-1])):
        # ``len(dims) - 1 - left`` dimensions are still to place, d included: merging d leaves at least two only
        # if out has two already or more are to come
        if out[-1] * d <= max_dim and len(out) + len(dims) - 2 - left >= 2:
            out[-1] *= d
        else:
            out.append(d)
    return tuple(reversed(out))


def _chunks(n: int, max_dim: int) -> list[int]:
    k = math.ceil(n / max_dim)
    return [max_dim] * (k - 1) + [n - max_dim * (k - 1)]


def split(t: torch.Tensor, max_dim: int) -> list[torch.Tensor]:
    """The blocks of ``t`` (views when ``t`` is contiguous), row-major over the chunk grid."""
    merged = t.reshape(merged_shape(t.shape, max_dim))
    parts = [merged]
    for dim, n in enumerate(merged.shape):
        sizes = _chunks(n, max_dim)
        parts = [q for p in parts for q in torch.split(p, sizes, dim=dim)]
    return parts


# Balancing model: a block's time per step in multiply-adds of a large matrix product: an eigendecomposition of a
# d x d factor costs about 10 d^3, the step's elementwise passes about 140 per entry (about 15 passes), and each
# block a fixed cost of dispatch and Python worth about 5e6. Only the balance depends on them: any deterministic
# assignment keeps the distributed optimizer bitwise the single-process one.
_ROOT_COST, _PASS_COST, _BLOCK_COST = 10, 140, 5e6


def block_cost(shape: tuple[int, ...], preconditioned: bool, products: int, frequency: int) -> float:
    """Estimated time of one step of a block, what :func:`powertrain.optim.distributor.assign` balances: fixed and
    elementwise work, plus for a preconditioned block its ``products`` mode products per step (each ``numel * d_i``
    multiply-adds per dimension ``i``; 2 for Shampoo: the factor update and the preconditioning; 4
    eigenvalue-corrected: the factor update and three rotations) and its eigendecompositions amortised over
    ``frequency`` steps."""
    n = math.prod(shape)
    cost = _BLOCK_COST + _PASS_COST * n
    if preconditioned:
        cost += products * n * sum(shape) + _ROOT_COST * sum(d**3 for d in shape) / frequency
    return cost
