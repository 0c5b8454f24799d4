"""DeMo's math: chunked orthonormal DCT-II of 1-D and 2-D tensors, and top-k per chunk.

A tensor is seen as a matrix ``(m, n)``: a vector of ``n`` values as ``(1, n)``, a matrix as itself, a tensor
of more dimensions (conv weights) as ``(shape[0], prod(shape[1:]))``. Each dimension is cut into chunks of
the largest divisor of its size that is at most the target chunk (as the reference DeMo picks them), so a
matrix becomes a grid of ``Y x X`` chunks of ``c1 x c2`` values. Every chunk goes through the 2-D DCT-II
``C1 @ chunk @ C2^T`` with orthonormal bases, so the transform is exactly invertible (``C^T C = I``) and
preserves energy; its ``c1 * c2`` coefficients are laid out row-major in one row of a
``(chunks, c1 * c2)`` tensor, the layout top-k selection, transmission and decoding work on.

Shapes use suffixes: ``coeff_rk`` is ``r`` chunks of ``k`` coefficients, ``x_mn`` an ``m x n`` matrix.
Nothing here communicates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = [
    "ChunkLayout",
    "chunk_layout",
    "chunk_size",
    "dct_basis",
    "decode",
    "encode",
    "mean_over_senders",
    "scatter_chunks",
    "topk_per_chunk",
]

#: ``basis(n)`` returns the ``n x n`` orthonormal DCT-II matrix in the dtype and on the device wanted.
BasisFn = Callable[[int], torch.Tensor]


def chunk_size(n: int, target: int) -> int:
    """The largest divisor of ``n`` that is at most ``target`` (1 for a prime ``n > target``)."""
    assert n >= 1 and target >= 1, f"chunk_size needs n >= 1 and target >= 1, got {n=}, {target=}"
    if n <= target:
        return n
    best = 1
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            for c in (d, n // d):
                if best < c <= target:
                    best = c
    return best


class ChunkLayout(NamedTuple):
    """How one tensor is cut: its matrix view ``(rows, cols)`` and the chunk ``(c1, c2)`` (dividing each)."""

    rows: int
    cols: int
    c1: int
    c2: int

    @property
    def num_chunks(self) -> int:
        """How many ``c1 x c2`` chunks tile the ``rows x cols`` matrix."""
        return (self.rows // self.c1) * (self.cols // self.c2)

    @property
    def chunk_numel(self) -> int:
        """Values per chunk: ``c1 * c2``."""
        return self.c1 * self.c2


def chunk_layout(shape: torch.Size | tuple[int, ...], target: int) -> ChunkLayout:
    """The matrix view of a tensor of ``shape`` and its chunk, for a target chunk size per dimension.

    Args:
        shape: the tensor's shape (any number of dimensions, no zero sizes).
        target: the wanted chunk size per dimension (DeMo's ``compression_chunk``).
    """
    if len(shape) <= 1:
        rows, cols = 1, int(shape[0]) if len(shape) == 1 else 1
    else:
        rows, cols = int(shape[0]), math.prod(int(d) for d in shape[1:])
    assert rows * cols > 0, f"chunk_layout needs a non-empty tensor, got shape {tuple(shape)}"
    return ChunkLayout(rows, cols, chunk_size(rows, target), chunk_size(cols, target))


def dct_basis(n: int, *, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> torch.Tensor:
    """The orthonormal DCT-II matrix ``C`` (``n x n``): ``coeff = C @ x``, ``x = C^T @ coeff``.

    ``C[k, i] = s_k cos(pi (2 i + 1) k / (2 n))`` with ``s_0 = sqrt(1/n)`` and ``s_k = sqrt(2/n)``: the
    ``norm="ortho"`` DCT-II of scipy. Computed in float64 and rounded once to ``dtype``.
    """
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    c = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    c[0] = math.sqrt(1.0 / n)
    return c.to(dtype=dtype, device=device)


def encode(x: torch.Tensor, layout: ChunkLayout, basis: BasisFn) -> torch.Tensor:
    """The DCT coefficients of every chunk of ``x``: ``(num_chunks, chunk_numel)``, chunks row-major.

    Args:
        x: the tensor (its matrix view is ``layout``); the result has the dtype of ``basis``'s matrices.
        layout: from :func:`chunk_layout` for ``x.shape``.
        basis: returns the DCT matrix of a given size (cached by the caller).
    """
    rows, cols, c1, c2 = layout
    x_yhxw = x.reshape(rows // c1, c1, cols // c2, c2)
    b1, b2 = basis(c1), basis(c2)
    chunks = x_yhxw.transpose(1, 2).to(b1.dtype)  # (Y, X, c1, c2)
    coeff = b1 @ chunks @ b2.T
    return coeff.reshape(layout.num_chunks, layout.chunk_numel)


def decode(
    coeff_rk: torch.Tensor, layout: ChunkLayout, shape: torch.Size | tuple[int, ...], basis: BasisFn
) -> torch.Tensor:
    """Inverse of :func:`encode`: the tensor of ``shape`` whose chunks have the DCT coefficients ``coeff_rk``."""
    rows, cols, c1, c2 = layout
    b1, b2 = basis(c1), basis(c2)
    coeff = coeff_rk.reshape(rows // c1, cols // c2, c1, c2).to(b1.dtype)
    chunks = b1.T @ coeff @ b2  # (Y, X, c1, c2)
    return chunks.transpose(1, 2).reshape(shape)


def topk_per_chunk(coeff_rk: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest-magnitude coefficients of every chunk: ``(values, indices)``, each ``(chunks, k)``.

    ``k`` is clamped to ``[1, chunk_numel]``; indices are positions within the chunk (int64), unsorted.
    """
    k = max(1, min(k, coeff_rk.shape[-1]))
    indices = coeff_rk.abs().topk(k, dim=-1, largest=True, sorted=False).indices
    return coeff_rk.gather(-1, indices), indices


def scatter_chunks(values_rk: torch.Tensor, indices_rk: torch.Tensor, chunk_numel: int) -> torch.Tensor:
    """Dense coefficients ``(chunks, chunk_numel)``: ``values`` at ``indices`` (distinct per chunk), zeros elsewhere."""
    out = torch.zeros(values_rk.shape[0], chunk_numel, dtype=values_rk.dtype, device=values_rk.device)
    return out.scatter_(-1, indices_rk.long(), values_rk)


def mean_over_senders(values_wrk: torch.Tensor, indices_wrk: torch.Tensor, chunk_numel: int) -> torch.Tensor:
    """Dense coefficients ``(chunks, chunk_numel)`` from every sender's top-k: at each position the mean of the
    values of the senders that chose it, zero where none did (the reference DeMo's ``scatter_reduce(mean)``).

    Args:
        values_wrk: ``(senders, chunks, k)`` values, summed in sender order (deterministic on every rank).
        indices_wrk: their positions within the chunk, same shape, any integer dtype.
        chunk_numel: coefficients per chunk.
    """
    chunks = values_wrk.shape[1]
    base = torch.arange(chunks, device=values_wrk.device)[None, :, None] * chunk_numel
    flat = (indices_wrk.long() + base).reshape(-1)
    total = torch.zeros(chunks * chunk_numel, dtype=values_wrk.dtype, device=values_wrk.device)
    total.index_add_(0, flat, values_wrk.reshape(-1))
    count = torch.zeros_like(total).index_add_(0, flat, torch.ones_like(values_wrk).reshape(-1))
    return (total / count.clamp_min(1)).reshape(chunks, chunk_numel)
