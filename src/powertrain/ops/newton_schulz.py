"""Muon's orthogonalisation: a few Newton-Schulz iterations that push a matrix's singular values towards 1.

Shapes use suffixes as in :mod:`powertrain.ops.lowrank`: ``g_nm`` is an ``n x m`` matrix.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

__all__ = ["NS_COEFFICIENTS", "AdjustLR", "adjusted_lr", "newton_schulz", "ns_dtype", "ns_flops"]

#: The quintic's coefficients ``(a, b, c)`` of Keller Jordan's Muon, as torch.optim.Muon has them.
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)

AdjustLR = Literal["original", "match_rms_adamw"]


def ns_dtype(device: torch.device) -> torch.dtype:
    """The dtype the iteration runs in by default: bfloat16 on CUDA (what torch.optim.Muon always uses: tensor cores),
    float32 elsewhere: a CPU without bf16 units emulates bfloat16, slower than it runs float32."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(
    g_nm: torch.Tensor,
    *,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``g_nm`` orthogonalised: ``U S' V^T`` for ``g = U S V^T``, with ``S'`` near 1 (within about 0.7-1.2 for the
    default coefficients, which trade convergence for slope at 0), as a new tensor of ``dtype``.

    The operations of ``torch.optim.Muon`` in the same order (so bitwise its result in the same dtype): cast, the
    wide orientation (``n <= m``; transposed back at the end), division by the Frobenius norm (at least ``eps``: an
    all-zero matrix stays zero), then ``steps`` times ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``.

    Args:
        g_nm: a 2-D matrix (a momentum); not modified.
        coefficients: ``(a, b, c)``.
        steps: iterations (>= 1).
        eps: the smallest norm divided by.
        dtype: what the iteration runs in (default: :func:`ns_dtype` of the device).
    """
    if g_nm.ndim != 2:
        raise ValueError(f"newton_schulz orthogonalises a matrix, got shape {tuple(g_nm.shape)}")
    a, b, c = coefficients
    x = g_nm.to(dtype or ns_dtype(g_nm.device))
    tall = g_nm.shape[0] > g_nm.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # not in place: without a cast, x is the caller's tensor
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def ns_flops(n: int, m: int, steps: int) -> float:
    """Multiply-adds of :func:`newton_schulz` on an ``n x m`` matrix: per step ``A = X X^T`` (``k^2 K``), ``A^2``
    (``k^3``) and the product with ``X`` (``k^2 K``), with ``k = min(n, m)`` and ``K = max(n, m)``: what balances the
    matrices over ranks."""
    k, big = min(n, m), max(n, m)
    return steps * (2.0 * k * k * big + k**3)


def adjusted_lr(lr: float, fn: AdjustLR | None, shape: tuple[int, ...] | torch.Size) -> float:
    """Muon's per-matrix learning rate, as torch.optim.Muon's ``adjust_lr_fn``: ``"original"`` (and None) scales by
    ``sqrt(max(1, A / B))`` for an ``A x B`` matrix (Keller Jordan's), ``"match_rms_adamw"`` by ``0.2 sqrt(max(A,
    B))`` (Moonlight's: an update of AdamW's RMS, so AdamW's learning rate and weight decay carry over)."""
    rows, cols = int(shape[0]), int(shape[1])
    if fn is None or fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"Invalid adjust_lr_fn={fn!r}: choose 'original', 'match_rms_adamw' or None")
