"""How Shampoo cuts a parameter into blocks, each preconditioned by one factor matrix per dimension.

1. Merge adjacent dimensions, from the last, while their product stays <= ``max_dim`` (a conv weight
   (64, 3, 3, 3) becomes (64, 27) for any max_dim in [27, 1728)); dimensions of size 1 are dropped (a 0-d or
   all-ones tensor is one 1-element block).
2. Split every dimension of the merged shape into chunks of at most ``max_dim``: the blocks are the
   grid of those chunks, in row-major order. A 1-D parameter is a vector, cut into pieces of <= max_dim.

Blocks are views of the parameter (or gradient) when it is contiguous: the optimizer writes each block's
update through them, and the same index names the same rows and columns of every tensor of that shape.
"""

from __future__ import annotations

import math

import torch

__all__ = ["merged_shape", "split"]


def merged_shape(shape: tuple[int, ...] | torch.Size, max_dim: int) -> tuple[int, ...]:
    if isinstance(max_dim, bool) or not isinstance(max_dim, int) or max_dim < 1:
        raise ValueError(f"Invalid max_preconditioner_dim={max_dim!r}: must be an integer >= 1")
    dims = [d for d in shape if d != 1]
    if not dims:
        return (1,)
    # from the last dimension backwards, as the reference implementation does: the leading (output) dimension
    # of a conv weight keeps its own factor
    out = [dims[-1]]
    for d in reversed(dims[:-1]):
        if out[-1] * d <= max_dim:
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
