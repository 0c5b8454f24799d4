"""Elementwise work fused into one kernel by ``torch.compile`` (C++ on the CPU, Triton on CUDA), where it pays.

A compressor's elementwise steps in eager mode each pass over the gradients (a read and a write per operation);
fused, a chain of them reads its inputs once and writes its outputs once (tools/compressor_traffic.py counts both).
Each fused function has an eager twin of the same operations in the same order, which runs where fusion is off or
unavailable (tests/test_fused.py: the same results).

``POWERTRAIN_FUSED`` chooses: ``auto`` (the default: fused on CUDA, eager on the CPU, where a first compilation costs
seconds for little gain), ``1`` (fused wherever torch.compile works), ``0`` (eager). A function that fails to compile
warns once and runs eager from then on.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["enabled", "fused_or_eager"]

_SETTINGS = ("auto", "1", "0")
_COMPILED: dict[str, Callable[..., Any]] = {}
_FAILED: set[str] = set()


def enabled(device: torch.device) -> bool:
    """Whether work on ``device`` runs fused (``POWERTRAIN_FUSED``; see the module)."""
    setting = os.environ.get("POWERTRAIN_FUSED", "auto")
    if setting not in _SETTINGS:
        raise ValueError(f"POWERTRAIN_FUSED={setting!r}: choose auto, 1 or 0")
    return setting == "1" or (setting == "auto" and device.type == "cuda")


def fused_or_eager(
    name: str, fused: Callable[..., Any], eager: Callable[..., Any], device: torch.device
) -> Callable[..., Any]:
    """What to call for work on ``device``: ``fused`` compiled (shapes symbolic, so one compilation serves every
    bucket), falling back to ``eager`` (warned once) if it cannot compile; ``eager`` where fusion is off."""
    if name in _FAILED or not enabled(device):
        return eager
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fused, dynamic=True)
    compiled = _COMPILED[name]

    def call(*args: Any) -> Any:
        try:
            return compiled(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # no C++ compiler, no Triton: the eager twin (which raises a real error itself)
            _FAILED.add(name)
            warnings.warn(f"powertrain: fused {name} did not run ({type(e).__name__}: {e}); eager now", stacklevel=2)
            return eager(*args)

    return call
