"""Every private or version-dependent torch API powertrain uses, in one place."""

from __future__ import annotations

import torch

# Fused in-place list ops (what torch.optim's foreach implementations use); stable since torch 2.0.
foreach_add_ = torch._foreach_add_
foreach_copy_ = torch._foreach_copy_

__all__ = ["foreach_add_", "foreach_copy_"]
