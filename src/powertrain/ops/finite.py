"""Finiteness checks without full-size temporaries, and the host's reading of a device flag.

:func:`finite_flag` stays on the tensors' device (no host synchronisation on CUDA). :func:`read_flag` is where a
device value becomes a Python bool: on CUDA the host waits there for everything queued before it. Compressors
read a flag at most once per collective (PowerSGD once per call), to decide together whether to raise
(:func:`powertrain.compress.base.guard_nonfinite`); keeping every such read here lets the sync-debug test
(tests/test_device.py) allow exactly these and refuse any other.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["all_finite", "bounded_flag", "finite_flag", "read_flag"]


def finite_flag(tensors: Iterable[torch.Tensor]) -> torch.Tensor | bool:
    """Whether no tensor holds NaN or Inf, as a 0-dim bool tensor on their device (True, a bool, when there are none).

    Min and max propagate both NaN and Inf: one pass, no full-size temporary, and nothing waits for the device."""
    tensors = list(tensors)
    extrema = [torch.stack(torch.aminmax(t)).float() for t in tensors if t.numel()]
    if extrema:
        return torch.isfinite(torch.cat(extrema)).all()
    return torch.ones((), dtype=torch.bool, device=tensors[0].device) if tensors else True


def bounded_flag(tensors: Iterable[torch.Tensor], bounds: Iterable[float]) -> torch.Tensor | bool:
    """Whether every entry of each tensor is finite and at most its bound in magnitude (``bounds``: one finite number
    per tensor), as :func:`finite_flag` gives it: a 0-dim bool tensor on their device, read by nothing. NaN fails every
    comparison and Inf exceeds any finite bound, so this is also a finiteness check."""
    pairs = list(zip(tensors, bounds, strict=True))
    scaled = [(torch.stack(torch.aminmax(t)).abs() / bound).float() for t, bound in pairs if t.numel()]
    if scaled:
        return (torch.cat(scaled) <= 1).all()
    return torch.ones((), dtype=torch.bool, device=pairs[0][0].device) if pairs else True


def read_flag(flag: torch.Tensor | bool) -> bool:
    """``flag`` as a Python bool. On CUDA this is a host synchronisation (it waits for the device): call it only
    where the host must branch on a device value."""
    return bool(flag)


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True if no tensor holds NaN or Inf (:func:`finite_flag`, read on the host: a synchronisation on CUDA)."""
    return read_flag(finite_flag(tensors))
