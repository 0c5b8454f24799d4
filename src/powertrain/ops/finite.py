"""Finiteness checks without full-size temporaries."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["all_finite"]


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True if no tensor holds NaN or Inf (min and max propagate both; one pass, no temporary)."""
    extrema = [torch.stack(torch.aminmax(t)).float() for t in tensors if t.numel()]
    return not extrema or bool(torch.isfinite(torch.cat(extrema)).all())
