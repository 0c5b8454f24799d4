"""Packing many tensors into one flat buffer so that one collective serves them all."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["flat_views", "pack"]


def pack(tensors: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Copy ``tensors`` (any shapes, any floating dtypes) into one new 1-D buffer of ``dtype``."""
    if not tensors:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def flat_views(buffer: torch.Tensor, shapes: Sequence[torch.Size | tuple[int, ...]]) -> list[torch.Tensor]:
    """Views of ``shapes`` laid out one after the other in the 1-D ``buffer`` (no copies)."""
    views = []
    offset = 0
    for shape in shapes:
        numel = 1
        for d in shape:
            numel *= d
        views.append(buffer[offset : offset + numel].view(shape))
        offset += numel
    assert offset == buffer.numel(), f"buffer holds {buffer.numel()} elements, shapes need {offset}"
    return views
